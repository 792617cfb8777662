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
//! non-finite are counted, not summarised.
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
use crate::frame::{i32s, i64s, opt_f32s, opt_strs};

/// Columns this metric reads.
pub const COLUMNS: [&str; 9] = [
    c::LAYER,
    c::SITE,
    c::SHADOW_MODE,
    c::PROD_NAN,
    c::PROD_POS_INF,
    c::PROD_NEG_INF,
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
    let rel = opt_f32s(frame, c::REL_L2_ERR)?;
    let cos = opt_f32s(frame, c::COSINE)?;
    let diff = opt_f32s(frame, c::MAX_ABS_DIFF)?;

    #[derive(Default)]
    struct Acc {
        tokens: usize,
        nonfinite: usize,
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
            rel_l2_err: Summary::of(acc.rel),
            cosine: Summary::of(acc.cos),
            max_abs_diff: acc.diff,
        })
        .collect())
}
