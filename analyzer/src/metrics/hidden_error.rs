//! Hidden-state error between prod and shadow, per layer and site.
//!
//! ## What it measures
//! How far the production residual stream (or a block output) is from the
//! shadow's at the same capture, token by token, and how that error is
//! distributed over the tokens of a layer.
//!
//! ## Definition
//! The producer records per (step, layer, site, token): relative L2 error
//! ‖p − s‖₂ / ‖s‖₂, cosine similarity and max |p − s| (NaN where either
//! vector holds a non-finite value). Per (layer, site, shadow mode), over
//! tokens and steps: the [`Summary`] of relative L2 error and of cosine
//! similarity, and the largest max |p − s|. Tokens whose prod vector is
//! non-finite are counted, not summarised; so are tokens whose shadow vector
//! alone is non-finite (the shadow broke where production did not: its error
//! is undefined there, and a count that vanished would hide it). Against an
//! all-zero shadow the producers record a relative error of 0 when prod is
//! zero too and +inf otherwise; +inf is part of the distribution (see
//! [`Summary`] for quantiles over infinities).
//!
//! ## Why it matters
//! In `local` mode the error is what that layer itself introduces (find the
//! culprit op); in `free` mode it is the accumulated divergence (see its
//! consequence). The first-divergence verdict reads the 95th percentile of
//! relative L2 error at one site.

use std::collections::BTreeMap;

use polars::prelude::DataFrame;
use serde::Serialize;
use shadowtrace_schemas::columns::hidden as c;

use super::summary::Summary;
use crate::AnalyzeError;
use crate::frame::{i32s, i64s, opt_f32s, opt_i64s, opt_strs};
use crate::verdict::Thresholds;

/// Columns this metric reads.
pub const COLUMNS: [&str; 14] = [
    c::STEP,
    c::TOKEN,
    c::LAYER,
    c::SITE,
    c::SHADOW_MODE,
    c::PROD_NAN,
    c::PROD_POS_INF,
    c::PROD_NEG_INF,
    c::SHADOW_NAN,
    c::SHADOW_POS_INF,
    c::SHADOW_NEG_INF,
    c::REL_L2_ERR,
    c::COSINE,
    c::MAX_ABS_DIFF,
];

/// Hidden-state error at one (layer, site, shadow mode).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SiteError {
    /// Layer.
    pub layer: i32,
    /// Capture site.
    pub site: String,
    /// `local`, `free`, or `none` for captures without a shadow.
    pub shadow_mode: String,
    /// Captures (tokens × steps).
    pub tokens: usize,
    /// Captures whose prod vector held NaN or ±Inf.
    pub nonfinite_tokens: usize,
    /// Captures whose shadow vector held NaN or ±Inf while prod's was finite.
    pub shadow_nonfinite_tokens: usize,
    /// Relative L2 error over finite captures.
    pub rel_l2_err: Option<Summary>,
    /// Cosine similarity over finite captures.
    pub cosine: Option<Summary>,
    /// Largest max |prod − shadow|.
    pub max_abs_diff: Option<f64>,
}

/// Per (layer, site, shadow mode) error of one run's `hidden` frame
/// ([`COLUMNS`]), sorted by layer, then site in the vocabulary's execution
/// order.
///
/// # Errors
/// When a column is missing or of another type.
pub fn by_site(frame: &DataFrame) -> Result<Vec<SiteError>, AnalyzeError> {
    let layer = i32s(frame, c::LAYER)?;
    let site = opt_strs(frame, c::SITE)?;
    let mode = opt_strs(frame, c::SHADOW_MODE)?;
    let nan = i64s(frame, c::PROD_NAN)?;
    let pos_inf = i64s(frame, c::PROD_POS_INF)?;
    let neg_inf = i64s(frame, c::PROD_NEG_INF)?;
    let shadow_counts = [
        opt_i64s(frame, c::SHADOW_NAN)?,
        opt_i64s(frame, c::SHADOW_POS_INF)?,
        opt_i64s(frame, c::SHADOW_NEG_INF)?,
    ];
    let rel = opt_f32s(frame, c::REL_L2_ERR)?;
    let cos = opt_f32s(frame, c::COSINE)?;
    let diff = opt_f32s(frame, c::MAX_ABS_DIFF)?;

    #[derive(Default)]
    struct Acc {
        tokens: usize,
        nonfinite: usize,
        shadow_nonfinite: usize,
        rel: Vec<f64>,
        cos: Vec<f64>,
        diff: Option<f64>,
    }
    let vocabulary = shadowtrace_schemas::vocabulary();
    let mut groups: BTreeMap<(i32, usize, String, String), Acc> = BTreeMap::new();
    for i in 0..frame.height() {
        let site_name = site[i].clone().unwrap_or_default();
        let rank = vocabulary.site_rank(&site_name).unwrap_or(usize::MAX);
        let key = (
            layer[i],
            rank,
            site_name,
            mode[i].clone().unwrap_or_else(|| "none".to_owned()),
        );
        let acc = groups.entry(key).or_default();
        acc.tokens += 1;
        if nan[i] + pos_inf[i] + neg_inf[i] > 0 {
            acc.nonfinite += 1;
            continue;
        }
        if shadow_counts
            .iter()
            .any(|counts| counts[i].is_some_and(|n| n > 0))
        {
            acc.shadow_nonfinite += 1;
            continue;
        }
        if let Some(v) = rel[i] {
            acc.rel.push(f64::from(v));
        }
        if let Some(v) = cos[i] {
            acc.cos.push(f64::from(v));
        }
        if let Some(v) = diff[i].filter(|v| !v.is_nan()) {
            acc.diff = Some(acc.diff.map_or(f64::from(v), |m: f64| m.max(f64::from(v))));
        }
    }
    Ok(groups
        .into_iter()
        .map(|((layer, _, site, shadow_mode), acc)| SiteError {
            layer,
            site,
            shadow_mode,
            tokens: acc.tokens,
            nonfinite_tokens: acc.nonfinite,
            shadow_nonfinite_tokens: acc.shadow_nonfinite,
            rel_l2_err: Summary::of(acc.rel),
            cosine: Summary::of(acc.cos),
            max_abs_diff: acc.diff,
        })
        .collect())
}

/// One capture's error at the verdict's site: the heatmap's cells.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TokenError {
    /// Forward step.
    pub step: i32,
    /// Layer.
    pub layer: i32,
    /// Token.
    pub token: i32,
    /// Relative L2 error (NaN where a vector was non-finite).
    pub rel_l2_err: Option<f32>,
    /// Cosine similarity.
    pub cosine: Option<f32>,
}

/// Per-token error at the site and shadow mode the hidden verdict reads
/// (see [`crate::verdict::hidden_series`]), from a `hidden` frame ([`COLUMNS`]).
///
/// # Errors
/// When a column is missing or of another type.
pub fn tokens_at_verdict_site(
    frame: &DataFrame,
    sites: &[SiteError],
    t: &Thresholds,
) -> Result<Vec<TokenError>, AnalyzeError> {
    let mode = crate::verdict::deciding_mode(sites, t);
    let step = i32s(frame, c::STEP)?;
    let layer = i32s(frame, c::LAYER)?;
    let token = i32s(frame, c::TOKEN)?;
    let site = opt_strs(frame, c::SITE)?;
    let shadow_mode = opt_strs(frame, c::SHADOW_MODE)?;
    let rel = opt_f32s(frame, c::REL_L2_ERR)?;
    let cos = opt_f32s(frame, c::COSINE)?;
    Ok((0..frame.height())
        .filter(|&i| {
            site[i].as_deref() == Some(t.hidden_site.as_str())
                && shadow_mode[i].as_deref() == Some(mode.as_str())
        })
        .map(|i| TokenError {
            step: step[i],
            layer: layer[i],
            token: token[i],
            rel_l2_err: rel[i],
            cosine: cos[i],
        })
        .collect())
}
