//! Top-k overlap between the production and shadow selections.
//!
//! ## What it measures
//! Whether the FP8 indexer still picks the keys the shadow (reference)
//! indexer picks, per query row, and how that is distributed over a layer.
//!
//! ## Definition
//! Per `topk` row with a shadow: Jaccard |P ∩ S| / |P ∪ S| and recall
//! |P ∩ S| / |S| over the stored selections (padding excluded; see
//! `shadowtrace_schemas::selection`). The same again with boundary churn
//! removed from both: keys of either path's boundary list whose score lies
//! within the churn margin of that path's k-th score. The margin is the
//! row's recorded `boundary_band` (the run's relative band times the row's
//! score scale, `shadowtrace_schemas::selection::BAND_SCALE`), or that times
//! `--churn-band` over the recorded relative band.
//!
//! What a margin can do: churn is found only among the keys a producer listed
//! in its boundary lists, which hold the keys within `settings.boundary_stored`
//! over `settings.boundary_band` times the band of the k-th score (twice, by
//! default), with their scores. A margin can narrow the band or widen it that
//! far, no further (the caller refuses a wider one); and a row without
//! boundary lists (no band recorded, or a path's list null) has no score of
//! any differing key to measure, so no margin can find its churn. Such rows
//! are counted as churn unknown ([`RowOverlap::churn_unknown`],
//! [`LayerOverlap::churn_unknown_rows`]) and reported beside the verdict;
//! what churn is known there (one path's list) is removed, and every other
//! difference counts, so their churn-free Jaccard is a lower bound.
//!
//! Rows with at most k visible keys (`visible <= k`) select every key and
//! carry no information: they are counted as dense and kept out of every
//! average. Per (run, layer) over the informative rows: mean, 5th
//! percentile and minimum of each, the share of rows below the verdict's
//! Jaccard threshold, and the churn share: of all keys the two paths
//! disagree on, the fraction that was churn.
//!
//! Rows whose shadow scored the dequantized FP8 operands (`shadow_input`
//! `dequant`) measure the production kernel's own error, not the distance
//! to the reference: they are kept apart ([`RowOverlap::dequant`],
//! [`Skipped::dequant`]), with their own dense counts, and never drive a
//! verdict.
//!
//! ## Why it matters
//! A selection that loses keys the reference needs changes attention
//! itself; churn among near-tied scores does not, which is why both are
//! reported and only the churn-free one drives a verdict.
//!
//! ## References
//! DeepSeek-V3.2 lightning indexer (index_topk = 2048);
//! `../shared/reference/dsa_numerics.md` sections 1 and 3.

use std::collections::BTreeMap;

use polars::prelude::DataFrame;
use rayon::prelude::*;
use serde::Serialize;
use shadowtrace_schemas::columns::topk_v1 as c;
use shadowtrace_schemas::selection::{churn, overlap_with_and_without};

use super::selection_unit::SelectionUnit;
use super::summary::Summary;
use crate::AnalyzeError;
use crate::frame::{i32s, list, opt_f32s, str_equals};

/// Columns this metric reads from a trace format v1 `topk` table (both full
/// selections per row). A v2 table: [`super::topk_v2`].
pub const COLUMNS_V1: [&str; 15] = [
    c::SHADOW_INPUT,
    c::STEP,
    c::LAYER,
    c::TOKEN,
    c::K,
    c::VISIBLE,
    c::PROD_INDICES,
    c::SHADOW_INDICES,
    c::PROD_KTH_SCORE,
    c::SHADOW_KTH_SCORE,
    c::PROD_BOUNDARY_INDICES,
    c::PROD_BOUNDARY_SCORES,
    c::SHADOW_BOUNDARY_INDICES,
    c::SHADOW_BOUNDARY_SCORES,
    c::BOUNDARY_BAND,
];

/// Per layer, rows left out of the averages: (dense rows, rows without a shadow).
pub type Uninformative = BTreeMap<i32, (usize, usize)>;

/// Rows left out of the averages, for the reference shadow (or none) and
/// for the dequant shadow apart: the same query rows appear once per shadow.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Skipped {
    /// Rows whose shadow (if any) is the reference recompute.
    pub reference: Uninformative,
    /// Rows whose shadow scored the dequantized FP8 operands.
    pub dequant: Uninformative,
    /// The same rows by key, so that ranks whose rows together make one
    /// request (vLLM's ShardQ) count each row once ([`crate::ranks`]).
    pub rows: Vec<SkippedRow>,
}

/// A row left out of the averages, by key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SkippedRow {
    /// Forward step.
    pub step: i32,
    /// Layer.
    pub layer: i32,
    /// Query token.
    pub token: i32,
    /// The shadow input is dequant.
    pub dequant: bool,
    /// Dense (at most k visible keys); otherwise without a shadow.
    pub dense: bool,
}

impl Skipped {
    /// The counts of `rows`, by shadow input and layer.
    #[must_use]
    pub fn of(rows: Vec<SkippedRow>) -> Skipped {
        let mut out = Skipped::default();
        for row in &rows {
            let counts = if row.dequant {
                &mut out.dequant
            } else {
                &mut out.reference
            };
            let entry = counts.entry(row.layer).or_default();
            if row.dense {
                entry.0 += 1;
            } else {
                entry.1 += 1;
            }
        }
        out.rows = rows;
        out
    }

    /// Adds another chunk's counts.
    pub fn add(&mut self, other: &Skipped) {
        self.rows.extend_from_slice(&other.rows);
        for (mine, theirs) in [
            (&mut self.reference, &other.reference),
            (&mut self.dequant, &other.dequant),
        ] {
            for (layer, (dense, no_shadow)) in theirs {
                let entry = mine.entry(*layer).or_default();
                entry.0 += dense;
                entry.1 += no_shadow;
            }
        }
    }
}

/// Overlap of one informative row.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RowOverlap {
    /// Forward step.
    pub step: i32,
    /// Layer.
    pub layer: i32,
    /// Query token.
    pub token: i32,
    /// The shadow scored the dequantized FP8 operands (`shadow_input` dequant).
    pub dequant: bool,
    /// Jaccard, churn included.
    pub jaccard: f64,
    /// Recall of the shadow's keys, churn included.
    pub recall: f64,
    /// Jaccard with boundary churn removed.
    pub jaccard_no_churn: f64,
    /// Recall with boundary churn removed.
    pub recall_no_churn: f64,
    /// Keys removed as churn.
    pub churn_keys: usize,
    /// Keys one path selected and the other did not.
    pub differing_keys: usize,
    /// Of those, the keys that were churn.
    pub differing_churn: usize,
    /// The row lacks the band or a path's boundary list: its churn could
    /// not be (fully) computed, and its churn-free values are lower bounds.
    pub churn_unknown: bool,
}

/// What a layer's rows amount to.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerOverlap {
    /// Layer.
    pub layer: i32,
    /// Rows with more than k visible keys and a shadow.
    pub informative_rows: usize,
    /// Rows with at most k visible keys (not averaged in).
    pub dense_rows: usize,
    /// Rows without a shadow selection (not averaged in).
    pub rows_without_shadow: usize,
    /// Informative rows whose churn could not be computed (no boundary
    /// lists): averaged in with every difference counted.
    pub churn_unknown_rows: usize,
    /// Jaccard, churn included.
    pub jaccard: Option<Summary>,
    /// Recall, churn included.
    pub recall: Option<Summary>,
    /// Jaccard with churn removed.
    pub jaccard_no_churn: Option<Summary>,
    /// Recall with churn removed.
    pub recall_no_churn: Option<Summary>,
    /// Share of informative rows whose churn-free Jaccard is below the threshold.
    pub share_below: f64,
    /// Mean keys removed as churn per informative row.
    pub churn_keys_mean: f64,
    /// Of all keys the two paths disagree on in this layer, the share that
    /// was churn; `None` when they agree everywhere.
    pub churn_share: Option<f64>,
    /// What this layer's keys are, and so what k, the visible keys and the
    /// Jaccard count: tokens, pool entries or compressed entries
    /// ([`super::selection_unit`]); `None` until the run's units are read.
    pub unit: Option<SelectionUnit>,
}

/// Per-row overlap of a `topk` frame of trace format `version`: v1 here, v2
/// in [`super::topk_v2::row_overlaps`]. `band_factor` scales each row's
/// recorded band. Also returns the dense and shadow-less row counts per layer.
///
/// # Errors
/// When a column is missing or has an unexpected layout.
pub fn row_overlaps(
    frame: &DataFrame,
    version: u32,
    band_factor: Option<f32>,
) -> Result<(Vec<RowOverlap>, Skipped), AnalyzeError> {
    if version >= 2 {
        super::topk_v2::row_overlaps(frame, band_factor)
    } else {
        row_overlaps_v1(frame, band_factor)
    }
}

/// Per-row overlap of a v1 `topk` frame ([`COLUMNS_V1`]; one chunk per
/// column, see [`crate::frame::list`]), in parallel over rows, with no
/// allocation per row.
fn row_overlaps_v1(
    frame: &DataFrame,
    band_factor: Option<f32>,
) -> Result<(Vec<RowOverlap>, Skipped), AnalyzeError> {
    let step = i32s(frame, c::STEP)?;
    let layer = i32s(frame, c::LAYER)?;
    let token = i32s(frame, c::TOKEN)?;
    let k = i32s(frame, c::K)?;
    let visible = i32s(frame, c::VISIBLE)?;
    let prod = list::<i32>(frame, c::PROD_INDICES)?;
    let shadow = list::<i32>(frame, c::SHADOW_INDICES)?;
    let prod_kth = opt_f32s(frame, c::PROD_KTH_SCORE)?;
    let shadow_kth = opt_f32s(frame, c::SHADOW_KTH_SCORE)?;
    let prod_bi = list::<i32>(frame, c::PROD_BOUNDARY_INDICES)?;
    let prod_bs = list::<f32>(frame, c::PROD_BOUNDARY_SCORES)?;
    let shadow_bi = list::<i32>(frame, c::SHADOW_BOUNDARY_INDICES)?;
    let shadow_bs = list::<f32>(frame, c::SHADOW_BOUNDARY_SCORES)?;
    let band = opt_f32s(frame, c::BOUNDARY_BAND)?;
    let dequant = str_equals(frame, c::SHADOW_INPUT, "dequant")?;

    let mut left_out = Vec::new();
    for i in 0..frame.height() {
        let dense = visible[i] <= k[i];
        if dense || shadow.get(i).is_none() {
            left_out.push(SkippedRow {
                step: step[i],
                layer: layer[i],
                token: token[i],
                dequant: dequant[i],
                dense,
            });
        }
    }
    let skipped = Skipped::of(left_out);
    // One scratch buffer per worker thread for the row's churn keys: no
    // allocation per row.
    let rows: Vec<RowOverlap> = (0..frame.height())
        .into_par_iter()
        .filter(|&i| visible[i] > k[i])
        .map_init(Vec::new, |excluded: &mut Vec<i32>, i| {
            let (p, s) = (prod.get(i)?, shadow.get(i)?);
            let margin = match (band[i], band_factor) {
                (Some(b), Some(f)) => b * f,
                (Some(b), None) => b,
                // No band: no boundary list can hold a key, whatever the margin.
                (None, _) => -1.0,
            };
            let churn_unknown = band[i].is_none()
                || [prod_bi.get(i), shadow_bi.get(i)]
                    .iter()
                    .any(Option::is_none)
                || [prod_bs.get(i), shadow_bs.get(i)]
                    .iter()
                    .any(Option::is_none);
            let kth_or_nan = |kth: Option<f32>| kth.unwrap_or(f32::NAN);
            excluded.clear();
            excluded.extend(churn(
                prod_bi.get(i).unwrap_or(&[]),
                prod_bs.get(i).unwrap_or(&[]),
                kth_or_nan(prod_kth[i]),
                margin,
            ));
            excluded.extend(churn(
                shadow_bi.get(i).unwrap_or(&[]),
                shadow_bs.get(i).unwrap_or(&[]),
                kth_or_nan(shadow_kth[i]),
                margin,
            ));
            excluded.sort_unstable();
            excluded.dedup();
            let (all, clean) = overlap_with_and_without(p, s, excluded);
            Some(RowOverlap {
                step: step[i],
                layer: layer[i],
                token: token[i],
                dequant: dequant[i],
                jaccard: all.jaccard(),
                recall: all.recall(),
                jaccard_no_churn: clean.jaccard(),
                recall_no_churn: clean.recall(),
                churn_keys: excluded.len(),
                differing_keys: all.union - all.intersection,
                differing_churn: (all.union - all.intersection)
                    - (clean.union - clean.intersection),
                churn_unknown,
            })
        })
        .flatten()
        .collect();
    Ok((rows, skipped))
}

/// Per-layer summaries of row overlaps; `threshold` is the Jaccard below
/// which a row counts in [`LayerOverlap::share_below`].
#[must_use]
pub fn by_layer<'a>(
    rows: impl IntoIterator<Item = &'a RowOverlap>,
    skipped: &Uninformative,
    threshold: f64,
) -> Vec<LayerOverlap> {
    let mut groups: BTreeMap<i32, Vec<&RowOverlap>> =
        skipped.keys().map(|&l| (l, Vec::new())).collect();
    for row in rows {
        groups.entry(row.layer).or_default().push(row);
    }
    groups
        .into_iter()
        .map(|(layer, rows)| {
            let take = |f: fn(&RowOverlap) -> f64| Summary::of(rows.iter().map(|r| f(r)).collect());
            let n = rows.len();
            let (dense_rows, rows_without_shadow) =
                skipped.get(&layer).copied().unwrap_or_default();
            LayerOverlap {
                layer,
                informative_rows: n,
                dense_rows,
                rows_without_shadow,
                churn_unknown_rows: rows.iter().filter(|r| r.churn_unknown).count(),
                jaccard: take(|r| r.jaccard),
                recall: take(|r| r.recall),
                jaccard_no_churn: take(|r| r.jaccard_no_churn),
                recall_no_churn: take(|r| r.recall_no_churn),
                share_below: if n == 0 {
                    0.0
                } else {
                    rows.iter()
                        .filter(|r| r.jaccard_no_churn < threshold)
                        .count() as f64
                        / n as f64
                },
                churn_keys_mean: if n == 0 {
                    0.0
                } else {
                    rows.iter().map(|r| r.churn_keys as f64).sum::<f64>() / n as f64
                },
                churn_share: {
                    let differing: usize = rows.iter().map(|r| r.differing_keys).sum();
                    let churn: usize = rows.iter().map(|r| r.differing_churn).sum();
                    (differing > 0).then(|| churn as f64 / differing as f64)
                },
                unit: None,
            }
        })
        .collect()
}
