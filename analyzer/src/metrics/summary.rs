//! Summary of a distribution over tokens or rows.
//!
//! ## Definition
//! Quantiles interpolate linearly between order statistics (numpy's
//! default): the q-quantile of n sorted values sits at rank q·(n−1). NaN
//! values are not part of a distribution; they are counted by the metrics
//! that can produce them. Infinities are (a relative error against an
//! all-zero shadow is +inf): an interpolation with an infinite neighbour is
//! its limit, that infinity, unless the infinity has no weight there; between
//! −inf and +inf, which has no limit, it is the nearer one (+inf on a tie).
//! The mean is infinite with an infinity among the values, NaN with both.

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
        values.sort_by(f64::total_cmp);
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
}
