//! Non-finite onset.
//!
//! ## What it measures
//! Where in execution order the production path first holds NaN or ±Inf,
//! and whether the shadow was still finite there.
//!
//! ## Definition
//! Candidates: `hidden` rows with a prod NaN, +Inf or −Inf count above zero,
//! and `events` rows of kind nan, pos_inf or neg_inf on the prod path. The
//! onset is the candidate with the smallest capture sequence number `seq`
//! (ties: the events row, then the lower token). At one capture the events
//! row is the truth: the producer found its first token in the whole
//! tensor, while hidden rows may be a sample of the tokens
//! (`SHADOWTRACE_TOKENS=every:N` or `last:N`), whose first non-finite one can
//! come later. The shadow was finite there when the event says so, or the
//! hidden row's shadow counts are zero.
//! Failed sentinel checks are listed beside it.
//!
//! ## Why it matters
//! A NaN that the shadow does not have was made by the production path at
//! or before that site; one the shadow has too came from the inputs.

use polars::prelude::DataFrame;
use serde::Serialize;
use shadowtrace_schemas::columns::{events as e, hidden as h};

use crate::AnalyzeError;
use crate::frame::{i32s, i64s, opt_bools, opt_i32s, opt_i64s, opt_strs};

/// Columns read from `hidden`.
pub const HIDDEN_COLUMNS: [&str; 11] = [
    h::SEQ,
    h::STEP,
    h::LAYER,
    h::SITE,
    h::TOKEN,
    h::PROD_NAN,
    h::PROD_POS_INF,
    h::PROD_NEG_INF,
    h::SHADOW_NAN,
    h::SHADOW_POS_INF,
    h::SHADOW_NEG_INF,
];

/// Columns read from `events`.
pub const EVENT_COLUMNS: [&str; 11] = [
    e::SEQ,
    e::STEP,
    e::LAYER,
    e::SITE,
    e::PATH,
    e::KIND,
    e::TOKEN,
    e::SHADOW_FINITE,
    e::CHECK,
    e::PASSED,
    e::DETAIL,
];

/// The first non-finite value of the production path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Onset {
    /// Capture sequence number.
    pub seq: i64,
    /// Forward step.
    pub step: i32,
    /// Layer.
    pub layer: i32,
    /// Capture site.
    pub site: String,
    /// Token, where known.
    pub token: Option<i32>,
    /// What was found: nan, pos_inf, neg_inf.
    pub kind: String,
    /// Whether the shadow was finite at the same place; `None` if unknown.
    pub shadow_finite: Option<bool>,
}

/// A sentinel check that failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FailedSentinel {
    /// Forward step.
    pub step: i32,
    /// Layer.
    pub layer: i32,
    /// Check name.
    pub check: String,
    /// What it watched.
    pub detail: Option<String>,
}

/// The onset over a run's `hidden` ([`HIDDEN_COLUMNS`]) and `events`
/// ([`EVENT_COLUMNS`]) frames, and the failed sentinel checks.
///
/// # Errors
/// When a column is missing or of another type.
pub fn onset(
    hidden: &DataFrame,
    events: &DataFrame,
) -> Result<(Option<Onset>, Vec<FailedSentinel>), AnalyzeError> {
    let mut best: Option<(i64, u8, i32, Onset)> = None;
    let mut consider = |candidate: Onset, source_rank: u8| {
        let key = (
            candidate.seq,
            source_rank,
            candidate.token.unwrap_or(i32::MAX),
        );
        if best.as_ref().is_none_or(|(s, r, t, _)| key < (*s, *r, *t)) {
            best = Some((key.0, key.1, key.2, candidate));
        }
    };

    let seq = i64s(hidden, h::SEQ)?;
    let step = i32s(hidden, h::STEP)?;
    let layer = i32s(hidden, h::LAYER)?;
    let token = i32s(hidden, h::TOKEN)?;
    let site = opt_strs(hidden, h::SITE)?;
    let (nan, pinf, ninf) = (
        i64s(hidden, h::PROD_NAN)?,
        i64s(hidden, h::PROD_POS_INF)?,
        i64s(hidden, h::PROD_NEG_INF)?,
    );
    let (snan, spinf, sninf) = (
        opt_i64s(hidden, h::SHADOW_NAN)?,
        opt_i64s(hidden, h::SHADOW_POS_INF)?,
        opt_i64s(hidden, h::SHADOW_NEG_INF)?,
    );
    for i in 0..hidden.height() {
        if nan[i] + pinf[i] + ninf[i] == 0 {
            continue;
        }
        let kind = if nan[i] > 0 {
            "nan"
        } else if pinf[i] > 0 {
            "pos_inf"
        } else {
            "neg_inf"
        };
        let shadow_finite = match (snan[i], spinf[i], sninf[i]) {
            (Some(a), Some(b), Some(c)) => Some(a + b + c == 0),
            _ => None,
        };
        consider(
            Onset {
                seq: seq[i],
                step: step[i],
                layer: layer[i],
                site: site[i].clone().unwrap_or_default(),
                token: Some(token[i]),
                kind: kind.to_owned(),
                shadow_finite,
            },
            // After an events row of the same capture (see the module docs).
            1,
        );
    }

    let seq = i64s(events, e::SEQ)?;
    let step = i32s(events, e::STEP)?;
    let layer = i32s(events, e::LAYER)?;
    let site = opt_strs(events, e::SITE)?;
    let path = opt_strs(events, e::PATH)?;
    let kind = opt_strs(events, e::KIND)?;
    let token = opt_i32s(events, e::TOKEN)?;
    let shadow_finite = opt_bools(events, e::SHADOW_FINITE)?;
    let check = opt_strs(events, e::CHECK)?;
    let passed = opt_bools(events, e::PASSED)?;
    let detail = opt_strs(events, e::DETAIL)?;
    let mut sentinels = Vec::new();
    for i in 0..events.height() {
        let kind_i = kind[i].as_deref().unwrap_or_default();
        if kind_i == "sentinel" {
            if passed[i] == Some(false) {
                sentinels.push(FailedSentinel {
                    step: step[i],
                    layer: layer[i],
                    check: check[i].clone().unwrap_or_default(),
                    detail: detail[i].clone(),
                });
            }
            continue;
        }
        if path[i].as_deref() != Some("prod") || !matches!(kind_i, "nan" | "pos_inf" | "neg_inf") {
            continue;
        }
        consider(
            Onset {
                seq: seq[i],
                step: step[i],
                layer: layer[i],
                site: site[i].clone().unwrap_or_default(),
                token: token[i],
                kind: kind_i.to_owned(),
                shadow_finite: shadow_finite[i],
            },
            0,
        );
    }
    Ok((best.map(|b| b.3), sentinels))
}
