//! Summaries and logits agreement, defined once for every consumer: the
//! analyzer's verdicts over runs on disk and the suspects sweep over tensors
//! in memory compute the same numbers with these functions.
//!
//! ## Summary
//! Quantiles interpolate linearly between order statistics (numpy's
//! default): the q-quantile of n sorted values sits at rank q·(n−1). NaN
//! values are not part of a distribution; they are counted by the metrics
//! that can produce them. Infinities are (a relative error against an
//! all-zero shadow is +inf): an interpolation with an infinite neighbour is
//! its limit, that infinity, unless the infinity has no weight there; between
//! −inf and +inf, which has no limit, it is the nearer one (+inf on a tie).
//! The mean is infinite with an infinity among the values, NaN with both.
//!
//! ## Logits agreement
//! Argmax agreement: the share of positions whose best id is the same on both
//! sides, over the positions whose log-probabilities are finite on both
//! sides; positions with a NaN or infinite one are counted apart, and when
//! none is left there is no share, only that count. Jensen–Shannon divergence,
//! in bits (0 to 1), between the two top-N distributions, each renormalised
//! to sum to one over its own N ids; an id one side lists and the other does
//! not has probability zero on the other side. Positions are matched on
//! (step, token).

use std::collections::BTreeMap;

use serde::Serialize;

/// Mean, extremes and the quantiles the reports use.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    /// Values summarised.
    pub n: usize,
    /// Arithmetic mean.
    pub mean: f64,
    /// Smallest value.
    pub min: f64,
    /// 5th percentile.
    pub p5: f64,
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// Largest value.
    pub max: f64,
}

impl Summary {
    /// Summarises `values`, ignoring NaN; `None` when nothing is left.
    #[must_use]
    pub fn of(mut values: Vec<f64>) -> Option<Summary> {
        values.retain(|v| !v.is_nan());
        if values.is_empty() {
            return None;
        }
        // Unstable is exact here: values total_cmp calls equal are the same bits.
        values.sort_unstable_by(f64::total_cmp);
        let n = values.len();
        let mean = values.iter().sum::<f64>() / n as f64;
        Some(Summary {
            n,
            mean,
            min: values[0],
            p5: quantile(&values, 0.05),
            p50: quantile(&values, 0.5),
            p95: quantile(&values, 0.95),
            max: values[n - 1],
        })
    }
}

/// The q-quantile of sorted values, interpolating linearly (infinities as
/// the module docs say: never inf − inf).
#[must_use]
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    let (a, b, weight) = (sorted[lo], sorted[hi], rank - lo as f64);
    if weight == 0.0 || a == b {
        return a;
    }
    // Sorted, so an infinite `a` is −inf and an infinite `b` is +inf.
    match (a.is_infinite(), b.is_infinite()) {
        (false, false) => a + (b - a) * weight,
        (true, false) => a,
        (false, true) => b,
        (true, true) => {
            if weight < 0.5 {
                a
            } else {
                b
            }
        }
    }
}

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
    fn quantiles_interpolate_like_numpy() {
        // numpy.quantile([1, 2, 3, 4, 5], [0.05, 0.5, 0.95]) = [1.2, 3.0, 4.8]
        let s = Summary::of(vec![5.0, 1.0, 4.0, 2.0, 3.0]).unwrap();
        assert!(
            (s.p5 - 1.2).abs() < 1e-12
                && (s.p50 - 3.0).abs() < 1e-12
                && (s.p95 - 4.8).abs() < 1e-12
        );
        assert_eq!((s.n, s.mean, s.min, s.max), (5, 3.0, 1.0, 5.0));
    }

    #[test]
    fn quantiles_of_values_with_infinities_are_defined() {
        let inf = f64::INFINITY;
        let s = Summary::of(vec![1.0, 2.0, inf, inf]).unwrap();
        assert_eq!((s.p50, s.p95, s.max, s.mean), (inf, inf, inf, inf), "{s:?}");
        assert!((s.p5 - 1.15).abs() < 1e-12, "{s:?}");
        // No weight on an infinity leaves the other value; between two equal
        // infinities sits that infinity.
        assert_eq!(quantile(&[1.0, inf], 0.0), 1.0);
        assert_eq!(quantile(&[-inf, 0.0], 1.0), 0.0);
        assert_eq!(quantile(&[-inf, -inf, 0.0], 0.25), -inf);
        // Opposite infinities: the nearer one (the upper on a tie).
        assert_eq!(quantile(&[-inf, inf], 0.25), -inf);
        assert_eq!(quantile(&[-inf, inf], 0.5), inf);
    }

    #[test]
    fn nan_is_not_part_of_the_distribution() {
        let s = Summary::of(vec![f64::NAN, 2.0]).unwrap();
        assert_eq!((s.n, s.mean), (1, 2.0));
        assert!(Summary::of(vec![f64::NAN]).is_none());
    }

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
