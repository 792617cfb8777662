//! Logits agreement: prod against shadow, and a path against itself across
//! two runs (determinism).
//!
//! ## What it measures
//! Whether the production path still predicts the same next token, and how
//! far its next-token distribution has moved, from what the run recorded:
//! the top-N token ids and log-probabilities of each path.
//!
//! ## Definition
//! Argmax agreement: the share of positions whose best prod id equals the
//! best shadow id, over the positions whose log-probabilities are finite on
//! both sides; positions with a NaN or infinite one are counted apart, and
//! when none is left (every matched position non-finite: the worst case)
//! there is no share, only that count. Jensen–Shannon divergence, in bits (0 to 1), between the
//! two top-N distributions, each renormalised to sum to one over its own N
//! ids; an id one path lists and the other does not has probability zero on
//! the other side. Positions are matched on (step, token).
//!
//! ## Why it matters
//! It is the user-visible end of everything upstream: degenerate output
//! first shows as argmax flips and a growing divergence.

use polars::prelude::DataFrame;
use shadowtrace_schemas::columns::logits as c;

use crate::AnalyzeError;
use crate::frame::{i32s, list};

/// Columns this metric reads.
pub const COLUMNS: [&str; 6] = [
    c::STEP,
    c::TOKEN,
    c::PROD_TOP_IDS,
    c::PROD_TOP_LOGPROBS,
    c::SHADOW_TOP_IDS,
    c::SHADOW_TOP_LOGPROBS,
];

pub use shadowtrace_schemas::stats::{Agreement, TopN, agreement, js_divergence};

/// The prod and shadow top-N of a `logits` frame ([`COLUMNS`]).
///
/// # Errors
/// When a column is missing or has an unexpected layout.
pub fn top_n(frame: &DataFrame) -> Result<(TopN, TopN), AnalyzeError> {
    let step = i32s(frame, c::STEP)?;
    let token = i32s(frame, c::TOKEN)?;
    let (pi, pl) = (
        list::<i32>(frame, c::PROD_TOP_IDS)?,
        list::<f32>(frame, c::PROD_TOP_LOGPROBS)?,
    );
    let (si, sl) = (
        list::<i32>(frame, c::SHADOW_TOP_IDS)?,
        list::<f32>(frame, c::SHADOW_TOP_LOGPROBS)?,
    );
    let (mut prod, mut shadow) = (TopN::new(), TopN::new());
    for i in 0..frame.height() {
        let key = (step[i], token[i]);
        if let (Some(ids), Some(lp)) = (pi.get(i), pl.get(i)) {
            prod.insert(key, (ids.to_vec(), lp.to_vec()));
        }
        if let (Some(ids), Some(lp)) = (si.get(i), sl.get(i)) {
            shadow.insert(key, (ids.to_vec(), lp.to_vec()));
        }
    }
    Ok((prod, shadow))
}
