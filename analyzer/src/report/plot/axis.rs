//! Axes: where values sit on a chart and which ticks label them. Pure
//! arithmetic, so that what a plot shows can be checked without drawing it,
//! and the plotters coordinate that draws exactly those ticks.

use std::ops::Range;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::coord::types::RangedCoordf64;

/// Most tick labels on a value axis, and on a layer or token axis.
const MAX_TICKS: usize = 10;
const MAX_INDEX_TICKS: usize = 16;
/// Smallest span of a fitted value axis, in decades: a range this wide holds
/// at least two of the 1-2-5 ticks.
const MIN_SPAN: f64 = 0.8;
/// Room left above and below the data, as a share of the span.
const PAD: f64 = 0.05;
/// Distance from 1 below which an agreement is drawn at `1 - AGREEMENT_FLOOR`
/// (the axis cannot reach 1): under one key in ten thousand.
pub(crate) const AGREEMENT_FLOOR: f64 = 1e-4;

/// How values map onto a chart's vertical axis (its "u" coordinate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scale {
    /// Positive values by their decimal logarithm: errors spanning decades.
    Log,
    /// Agreement in [0, 1] (a Jaccard) by the decimal logarithm of its
    /// distance from 1, upwards: 0.9, 0.99 and 0.999 are equally spaced, so
    /// healthy values near 1 stay apart while a collapse to 0.3 still fits.
    Agreement,
}

/// Where a value lands on a [`Scale`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Placed {
    /// At this coordinate.
    At(f64),
    /// Beyond the axis's end (an agreement above `1 - AGREEMENT_FLOOR`),
    /// drawn at the end.
    Clamped(f64),
    /// Not drawable: non-finite, or outside the scale's domain (an error of
    /// 0 on a log axis).
    Outside,
}

/// A tick: its coordinate and its label.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Tick {
    pub(crate) at: f64,
    pub(crate) label: String,
}

impl Scale {
    /// The coordinate of `v`.
    pub(crate) fn place(self, v: f64) -> Placed {
        match self {
            Scale::Log if v.is_finite() && v > 0.0 => Placed::At(v.log10()),
            Scale::Agreement if (0.0..=1.0).contains(&v) => {
                let d = 1.0 - v;
                if d < AGREEMENT_FLOOR {
                    Placed::Clamped(-AGREEMENT_FLOOR.log10())
                } else {
                    Placed::At(-d.log10())
                }
            }
            _ => Placed::Outside,
        }
    }

    /// The coordinate of `v` if it can be drawn, clamped or not.
    pub(crate) fn coordinate(self, v: f64) -> Option<f64> {
        match self.place(v) {
            Placed::At(u) | Placed::Clamped(u) => Some(u),
            Placed::Outside => None,
        }
    }

    /// The coordinates the axis can hold at all.
    fn domain(self) -> (f64, f64) {
        match self {
            Scale::Log => (f64::NEG_INFINITY, f64::INFINITY),
            Scale::Agreement => (0.0, -AGREEMENT_FLOOR.log10()),
        }
    }

    /// The axis range for coordinates `us`: their extent, widened to
    /// [`MIN_SPAN`] within the domain, with [`PAD`] either side.
    pub(crate) fn fit(self, us: impl IntoIterator<Item = f64>) -> (f64, f64) {
        let (mut lo, mut hi) = us
            .into_iter()
            .filter(|u| u.is_finite())
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), u| {
                (lo.min(u), hi.max(u))
            });
        let (d0, d1) = self.domain();
        if !lo.is_finite() {
            (lo, hi) = match self {
                Scale::Log => (-3.0, 0.0),
                Scale::Agreement => (0.0, 2.0),
            };
        }
        if hi - lo < MIN_SPAN {
            let grow = (MIN_SPAN - (hi - lo)) / 2.0;
            (lo, hi) = (lo - grow, hi + grow);
            // Slide the window back inside the domain where it left it.
            if lo < d0 {
                (lo, hi) = (d0, (d0 + MIN_SPAN).min(d1));
            } else if hi > d1 {
                (lo, hi) = ((d1 - MIN_SPAN).max(d0), d1);
            }
        }
        let pad = (hi - lo) * PAD;
        (lo - pad, hi + pad)
    }

    /// Ticks at 1, 2 and 5 times a power of ten inside `[lo, hi]` (for
    /// [`Scale::Agreement`], of the distance from 1, labelled as the
    /// agreement: 0.8, 0.9, 0.95, ...), thinned to at most [`MAX_TICKS`].
    pub(crate) fn ticks(self, lo: f64, hi: f64) -> Vec<Tick> {
        for mantissas in [&[1, 2, 5][..], &[1, 5], &[1]] {
            let ticks = self.candidates(lo, hi, mantissas);
            if ticks.len() <= MAX_TICKS {
                return ticks;
            }
        }
        let all = self.candidates(lo, hi, &[1]);
        let every = all.len().div_ceil(MAX_TICKS);
        all.into_iter().step_by(every).collect()
    }

    fn candidates(self, lo: f64, hi: f64, mantissas: &[i32]) -> Vec<Tick> {
        let (d0, d1) = self.domain();
        let (lo, hi) = (lo.max(d0), hi.min(d1));
        if !(lo.is_finite() && hi.is_finite()) || lo > hi {
            return Vec::new();
        }
        // Exponents whose ticks can fall inside; the casts hold: |lo|, |hi|
        // are a few decades at most.
        let (first, last) = match self {
            Scale::Log => (lo.floor() as i32 - 1, hi.ceil() as i32 + 1),
            Scale::Agreement => (-(hi.ceil() as i32) - 1, 0),
        };
        let mut ticks: Vec<Tick> = (first..=last)
            .flat_map(|e| mantissas.iter().map(move |&m| (m, e)))
            .filter_map(|(m, e)| {
                let magnitude = f64::from(m) * 10f64.powi(e);
                let (at, label) = match self {
                    Scale::Log => (magnitude.log10(), log_label(m, e)),
                    Scale::Agreement if magnitude <= 1.0 => {
                        (-magnitude.log10(), agreement_label(magnitude, e))
                    }
                    Scale::Agreement => return None,
                };
                (lo - 1e-9..=hi + 1e-9)
                    .contains(&at)
                    .then_some(Tick { at, label })
            })
            .collect();
        ticks.sort_by(|a, b| a.at.total_cmp(&b.at));
        ticks
    }
}

/// `m x 10^e` as a person writes it: plain decimals near 1, else `2e-5`.
fn log_label(m: i32, e: i32) -> String {
    if (-3..=3).contains(&e) {
        let decimals = usize::try_from(-e).unwrap_or(0);
        format!("{:.decimals$}", f64::from(m) * 10f64.powi(e))
    } else {
        format!("{m}e{e}")
    }
}

/// `1 - d` with the decimals `d = m x 10^e` needs: 0.8, 0.95, 0.999; 0 for d = 1.
fn agreement_label(d: f64, e: i32) -> String {
    let decimals = usize::try_from(-e).unwrap_or(0);
    format!("{:.decimals$}", 1.0 - d)
}

/// Integer ticks over `first..=last` (layers, tokens) at a 1-2-5 step,
/// at most [`MAX_INDEX_TICKS`], each a multiple of the step.
pub(crate) fn index_ticks(first: i64, last: i64) -> Vec<i64> {
    let span = (last - first).max(0);
    let step = (0..)
        .flat_map(|e| [1, 2, 5].map(|m| m * 10i64.pow(e)))
        .find(|s| span / s < i64::try_from(MAX_INDEX_TICKS).unwrap_or(i64::MAX))
        .unwrap_or(1);
    let start = first.div_euclid(step) * step + if first.rem_euclid(step) == 0 { 0 } else { step };
    (0..)
        .map(|i| start + i * step)
        .take_while(|&t| t <= last)
        .collect()
}

/// A linear axis over `range` whose ticks are exactly `ticks`: plotters'
/// `with_key_points` over `f64` cannot take a label formatter, and its own
/// tick choice over floats can repeat a label once rounded (0, 1, 2, 2, 3).
#[derive(Debug, Clone)]
pub(crate) struct Ticked {
    pub(crate) range: Range<f64>,
    pub(crate) ticks: Vec<f64>,
}

impl Ranged for Ticked {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        RangedCoordf64::from(self.range.clone()).map(value, limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        // Bold points only: no light grid lines between ticks.
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> Range<f64> {
        self.range.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(ticks: &[Tick]) -> Vec<&str> {
        ticks.iter().map(|t| t.label.as_str()).collect()
    }

    #[test]
    fn agreement_axis_spaces_healthy_values_apart_and_keeps_a_collapse() {
        let s = Scale::Agreement;
        let at = |v| s.coordinate(v).unwrap();
        // 0.95 and 0.98 sit 0.4 decades apart whatever else is plotted.
        assert!((at(0.98) - at(0.95) - (0.05f64 / 0.02).log10()).abs() < 1e-12);
        let (lo, hi) = s.fit([at(0.3), at(0.95), at(0.98), at(0.8)]);
        assert!(lo <= at(0.3) && hi >= at(0.98));
        assert!(
            (at(0.98) - at(0.95)) / (hi - lo) > 0.2,
            "0.95 to 0.98 spans more than a fifth of the axis"
        );
        assert_eq!(
            labels(&s.ticks(lo, hi)),
            ["0.5", "0.8", "0.9", "0.95", "0.98"]
        );
    }

    #[test]
    fn agreement_at_one_is_clamped_and_said_so() {
        assert_eq!(
            Scale::Agreement.place(1.0),
            Placed::Clamped(4.0),
            "drawn at 0.9999"
        );
        assert_eq!(Scale::Agreement.place(f64::NAN), Placed::Outside);
        assert_eq!(Scale::Agreement.place(1.5), Placed::Outside);
        assert_eq!(Scale::Log.place(0.0), Placed::Outside);
        assert_eq!(Scale::Log.place(f64::INFINITY), Placed::Outside);
    }

    #[test]
    fn a_narrow_range_widens_inside_the_domain() {
        let s = Scale::Agreement;
        let (lo, hi) = s.fit([s.coordinate(1.0).unwrap()]);
        assert!(hi > 4.0 && lo < 4.0 - MIN_SPAN + 1e-9, "{lo}..{hi}");
        assert!(s.ticks(lo, hi).len() >= 2);
        let (lo, hi) = Scale::Log.fit([-2.8, -2.7]);
        assert!(hi - lo >= MIN_SPAN);
        assert_eq!(labels(&Scale::Log.ticks(lo, hi)), ["0.001", "0.002"]);
    }

    #[test]
    fn log_ticks_thin_out_over_many_decades() {
        let ticks = Scale::Log.ticks(-12.0, 1.0);
        assert!(ticks.len() <= MAX_TICKS, "{ticks:?}");
        assert!(ticks.windows(2).all(|w| w[0].at < w[1].at));
        assert_eq!(Scale::Log.ticks(-6.0, -5.0)[0].label, "1e-6");
        assert_eq!(
            labels(&Scale::Log.ticks(-1.1, 0.4)),
            ["0.1", "0.2", "0.5", "1", "2"]
        );
    }

    #[test]
    fn index_ticks_are_unique_sorted_multiples_of_a_step() {
        assert_eq!(index_ticks(0, 3), [0, 1, 2, 3]);
        assert_eq!(index_ticks(0, 0), [0]);
        let glm = index_ticks(0, 77);
        assert_eq!(glm.first(), Some(&0));
        assert!(glm.len() <= MAX_INDEX_TICKS);
        assert!(glm.windows(2).all(|w| w[1] - w[0] == 5));
        assert_eq!(index_ticks(2049, 6143)[0], 2500);
        assert_eq!(index_ticks(-3, 3), [-3, -2, -1, 0, 1, 2, 3]);
    }
}
