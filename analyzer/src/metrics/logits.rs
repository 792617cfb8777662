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

use std::collections::BTreeMap;

use polars::prelude::DataFrame;
use serde::Serialize;
use shadowtrace_schemas::columns::logits as c;

use super::summary::Summary;
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

/// Agreement between two top-N sequences over matched positions.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Agreement {
    /// Positions compared: matched, and finite on both sides.
    pub positions: usize,
    /// Positions left out because a log-probability of either side was
    /// NaN or infinite (a NaN run's logits agree with nothing).
    pub nonfinite_positions: usize,
    /// Share of compared positions with the same best token; `None` (JSON
    /// null) when every matched position was non-finite.
    pub argmax_agreement: Option<f64>,
    /// Jensen–Shannon divergence in bits over the positions.
    pub js_divergence: Option<Summary>,
}

/// One path's top-N at each (step, token): ids and log-probabilities.
pub type TopN = BTreeMap<(i32, i32), (Vec<i32>, Vec<f32>)>;

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

/// Agreement of `a` with `b` over the positions both hold; `None` only
/// when they share none (all of them non-finite is an agreement with no
/// share and every position counted).
#[must_use]
pub fn agreement(a: &TopN, b: &TopN) -> Option<Agreement> {
    let mut same = 0;
    let mut nonfinite_positions = 0;
    let mut js = Vec::new();
    for (key, (ids_a, lp_a)) in a {
        let Some((ids_b, lp_b)) = b.get(key) else {
            continue;
        };
        if lp_a.iter().chain(lp_b).any(|l| !l.is_finite()) {
            nonfinite_positions += 1;
            continue;
        }
        if !ids_a.is_empty() && ids_a.first() == ids_b.first() {
            same += 1;
        }
        js.push(js_divergence(ids_a, lp_a, ids_b, lp_b));
    }
    let positions = js.len();
    (positions + nonfinite_positions > 0).then(|| Agreement {
        positions,
        nonfinite_positions,
        argmax_agreement: (positions > 0).then(|| same as f64 / positions as f64),
        js_divergence: Summary::of(js),
    })
}

/// Jensen–Shannon divergence in bits between two top-N distributions, each
/// renormalised over its own ids.
#[must_use]
pub fn js_divergence(ids_a: &[i32], lp_a: &[f32], ids_b: &[i32], lp_b: &[f32]) -> f64 {
    let normalise = |ids: &[i32], lp: &[f32]| -> BTreeMap<i32, f64> {
        let total: f64 = lp.iter().map(|l| f64::from(*l).exp()).sum();
        ids.iter()
            .zip(lp)
            .map(|(&id, &l)| (id, f64::from(l).exp() / total))
            .collect()
    };
    let (p, q) = (normalise(ids_a, lp_a), normalise(ids_b, lp_b));
    let mut ids: Vec<i32> = p.keys().chain(q.keys()).copied().collect();
    ids.sort_unstable();
    ids.dedup();
    let term = |x: f64, m: f64| if x > 0.0 { x * (x / m).log2() } else { 0.0 };
    ids.iter()
        .map(|id| {
            let (x, y) = (
                p.get(id).copied().unwrap_or(0.0),
                q.get(id).copied().unwrap_or(0.0),
            );
            let m = (x + y) / 2.0;
            0.5 * term(x, m) + 0.5 * term(y, m)
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_distributions_diverge_by_zero() {
        let lp = [-0.1_f32, -2.5, -4.0];
        assert!(js_divergence(&[1, 2, 3], &lp, &[1, 2, 3], &lp).abs() < 1e-12);
    }

    #[test]
    fn disjoint_supports_diverge_by_one_bit() {
        assert!((js_divergence(&[1], &[0.0], &[2], &[0.0]) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn a_known_pair_has_its_known_divergence() {
        // p = (1/2, 1/2), q = (1, 0): m = (3/4, 1/4);
        // JS = 1/2 [1/2 log2(2/3) + 1/2 log2(2)] + 1/2 [log2(4/3)] = 0.311278...
        let half = (0.5_f32).ln();
        let got = js_divergence(&[1, 2], &[half, half], &[1], &[0.0]);
        let want = 0.5 * (0.5 * (2.0_f64 / 3.0).log2() + 0.5) + 0.5 * (4.0_f64 / 3.0).log2();
        assert!((got - want).abs() < 1e-7, "{got} vs {want}");
    }

    #[test]
    fn positions_with_non_finite_log_probabilities_are_left_out_and_counted() {
        let mut a = TopN::new();
        let mut b = TopN::new();
        a.insert((0, 0), (vec![5, 6], vec![f32::NAN, f32::NAN]));
        b.insert((0, 0), (vec![5, 6], vec![f32::NAN, f32::NAN]));
        let all_nan = agreement(&a, &b).expect("a matched position");
        assert_eq!(
            (
                all_nan.positions,
                all_nan.nonfinite_positions,
                all_nan.argmax_agreement
            ),
            (0, 1, None),
            "NaN logits agree with nothing, and are counted"
        );
        a.insert((0, 1), (vec![5, 6], vec![-0.1, -3.0]));
        b.insert((0, 1), (vec![6, 5], vec![-0.2, -2.0]));
        let got = agreement(&a, &b).unwrap();
        assert_eq!((got.positions, got.nonfinite_positions), (1, 1));
        assert_eq!(got.argmax_agreement, Some(0.0));
    }

    #[test]
    fn agreement_counts_matching_best_tokens_over_shared_positions() {
        let mut a = TopN::new();
        let mut b = TopN::new();
        a.insert((0, 1), (vec![5, 6], vec![-0.1, -3.0]));
        b.insert((0, 1), (vec![5, 6], vec![-0.1, -3.0]));
        a.insert((0, 2), (vec![7, 8], vec![-0.1, -3.0]));
        b.insert((0, 2), (vec![8, 7], vec![-0.1, -3.0]));
        a.insert((0, 3), (vec![9], vec![0.0]));
        let g = agreement(&a, &b).unwrap();
        assert_eq!((g.positions, g.argmax_agreement), (2, Some(0.5)));
        assert!(agreement(&a, &TopN::new()).is_none(), "no shared position");
    }
}
