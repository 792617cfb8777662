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
use shadowtrace_schemas::selection::{Overlap, churn, overlap_with_and_without};

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
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Skipped {
    /// Rows whose shadow (if any) is the reference recompute.
    pub reference: Uninformative,
    /// Rows whose shadow scored the dequantized FP8 operands.
    pub dequant: Uninformative,
    /// The same rows by key, so that ranks whose rows together make one
    /// request (vLLM's ShardQ) count each row once ([`crate::ranks`]).
    pub rows: Pieces<SkippedRow>,
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
        out.rows = rows.into();
        out
    }

    /// Adds another chunk's rows and counts after these.
    pub fn add(&mut self, other: Skipped) {
        self.rows.append(other.rows);
        for (mine, theirs) in [
            (&mut self.reference, other.reference),
            (&mut self.dequant, other.dequant),
        ] {
            for (layer, (dense, no_shadow)) in theirs {
                let entry = mine.entry(layer).or_default();
                entry.0 += dense;
                entry.1 += no_shadow;
            }
        }
    }
}

/// Overlap of one informative row: its counts, from which each metric is
/// computed when read. Counts in u32, not the metrics in f64: 48 bytes a
/// row, not 72, for the half million rows a GLM-5.1 prefill keeps in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowOverlap {
    /// Forward step.
    pub step: i32,
    /// Layer.
    pub layer: i32,
    /// Query token.
    pub token: i32,
    /// The shadow scored the dequantized FP8 operands (`shadow_input` dequant).
    pub dequant: bool,
    /// The row lacks the band or a path's boundary list: its churn could
    /// not be (fully) computed, and its churn-free values are lower bounds.
    pub churn_unknown: bool,
    all: Count3,
    clean: Count3,
    churn_keys: u32,
    differing_churn: u32,
}

/// An [`Overlap`] in u32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Count3 {
    intersection: u32,
    union: u32,
    reference_len: u32,
}

/// A count as kept: counts are of keys, far below 2^32.
fn narrow(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl From<Overlap> for Count3 {
    fn from(o: Overlap) -> Count3 {
        Count3 {
            intersection: narrow(o.intersection),
            union: narrow(o.union),
            reference_len: narrow(o.reference_len),
        }
    }
}

impl From<Count3> for Overlap {
    fn from(c: Count3) -> Overlap {
        Overlap {
            intersection: c.intersection as usize,
            union: c.union as usize,
            reference_len: c.reference_len as usize,
        }
    }
}

/// Where a row is and what its shadow scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowAt {
    /// Forward step.
    pub step: i32,
    /// Layer.
    pub layer: i32,
    /// Query token.
    pub token: i32,
    /// The shadow scored the dequantized FP8 operands.
    pub dequant: bool,
}

impl RowOverlap {
    /// A row at `at` whose selections overlap as `all`, and as `clean` with
    /// `churn_keys` churn keys removed, `differing_churn` of them keys one
    /// path selected and the other did not.
    #[must_use]
    pub fn new(
        at: RowAt,
        all: Overlap,
        clean: Overlap,
        churn_keys: usize,
        differing_churn: usize,
        churn_unknown: bool,
    ) -> RowOverlap {
        RowOverlap {
            step: at.step,
            layer: at.layer,
            token: at.token,
            dequant: at.dequant,
            churn_unknown,
            all: all.into(),
            clean: clean.into(),
            churn_keys: narrow(churn_keys),
            differing_churn: narrow(differing_churn),
        }
    }

    /// Jaccard, churn included.
    #[must_use]
    pub fn jaccard(&self) -> f64 {
        Overlap::from(self.all).jaccard()
    }

    /// Recall of the shadow's keys, churn included.
    #[must_use]
    pub fn recall(&self) -> f64 {
        Overlap::from(self.all).recall()
    }

    /// Jaccard with boundary churn removed.
    #[must_use]
    pub fn jaccard_no_churn(&self) -> f64 {
        Overlap::from(self.clean).jaccard()
    }

    /// Recall with boundary churn removed.
    #[must_use]
    pub fn recall_no_churn(&self) -> f64 {
        Overlap::from(self.clean).recall()
    }

    /// Keys removed as churn.
    #[must_use]
    pub fn churn_keys(&self) -> usize {
        self.churn_keys as usize
    }

    /// Keys one path selected and the other did not.
    #[must_use]
    pub fn differing_keys(&self) -> usize {
        // Saturating: counts a damaged part stored may claim more shared
        // keys than either path selected (the v2 reader leaves such rows
        // out; this keeps any other source from wrapping or panicking).
        self.all.union.saturating_sub(self.all.intersection) as usize
    }

    /// Of those, the keys that were churn.
    #[must_use]
    pub fn differing_churn(&self) -> usize {
        self.differing_churn as usize
    }
}

/// A run's rows, kept in the pieces they were computed in (one per v2 row
/// group): joined by moving the pieces, never by copying their rows into one
/// vector. A GLM-5.1 prefill has half a million informative rows, some 25 MB,
/// and copying them into fresh pages one thread at a time took a third of a
/// remembered `analyze` (docs/benchmarks.md, analyze throughput); its skipped rows, a
/// tenth of that, still took a quarter of some calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Pieces<T> {
    pieces: Vec<Vec<T>>,
}

/// A run's row overlaps.
pub type Rows = Pieces<RowOverlap>;

impl<T> Default for Pieces<T> {
    fn default() -> Self {
        Pieces { pieces: Vec::new() }
    }
}

impl<T> Pieces<T> {
    /// The pieces, in order.
    pub fn pieces(&self) -> impl Iterator<Item = &[T]> {
        self.pieces.iter().map(Vec::as_slice)
    }

    /// Every row, piece by piece in order.
    pub fn iter(&self) -> impl Iterator<Item = &T> + Clone {
        self.pieces.iter().flatten()
    }

    /// How many rows.
    #[must_use]
    pub fn len(&self) -> usize {
        self.pieces.iter().map(Vec::len).sum()
    }

    /// Whether there is no row.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.pieces.iter().all(Vec::is_empty)
    }

    /// Appends `piece` after the rows there are.
    pub fn push(&mut self, piece: Vec<T>) {
        if !piece.is_empty() {
            self.pieces.push(piece);
        }
    }

    /// Appends `other`'s rows after these.
    pub fn append(&mut self, other: Pieces<T>) {
        self.pieces.extend(other.pieces);
    }

    /// The rows where `f` holds, and the others, each in order.
    #[must_use]
    pub fn partition(self, f: impl Fn(&T) -> bool) -> (Pieces<T>, Pieces<T>) {
        let (mut yes, mut no) = (Pieces::default(), Pieces::default());
        for piece in self.pieces {
            if piece.iter().all(&f) {
                yes.push(piece);
            } else if !piece.iter().any(&f) {
                no.push(piece);
            } else {
                let (y, n): (Vec<T>, Vec<T>) = piece.into_iter().partition(&f);
                yes.push(y);
                no.push(n);
            }
        }
        (yes, no)
    }
}

impl<T> From<Vec<T>> for Pieces<T> {
    fn from(piece: Vec<T>) -> Pieces<T> {
        let mut rows = Pieces::default();
        rows.push(piece);
        rows
    }
}

impl<'a, T> IntoIterator for &'a Pieces<T> {
    type Item = &'a T;
    type IntoIter = std::iter::Flatten<std::slice::Iter<'a, Vec<T>>>;

    fn into_iter(self) -> Self::IntoIter {
        self.pieces.iter().flatten()
    }
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

/// Per-row overlap of a v1 `topk` frame ([`COLUMNS_V1`]; one chunk per
/// column, see [`crate::frame::list`]), in parallel over rows, with no
/// allocation per row; v2 parts: [`super::topk_v2::part_overlaps`].
/// `band_factor` scales each row's recorded band. Also returns the dense and
/// shadow-less row counts per layer.
///
/// # Errors
/// When a column is missing or has an unexpected layout.
pub fn row_overlaps_v1(
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
            let at = RowAt {
                step: step[i],
                layer: layer[i],
                token: token[i],
                dequant: dequant[i],
            };
            let differing = |o: Overlap| o.union.saturating_sub(o.intersection);
            Some(RowOverlap::new(
                at,
                all,
                clean,
                excluded.len(),
                differing(all).saturating_sub(differing(clean)),
                churn_unknown,
            ))
        })
        .flatten()
        .collect();
    Ok((rows, skipped))
}

/// Per-layer summaries of row overlaps, given as slices (a run's pieces,
/// [`Rows::pieces`]); `threshold` is the Jaccard below which a row counts in
/// [`LayerOverlap::share_below`].
#[must_use]
pub fn by_layer<'a>(
    pieces: impl IntoIterator<Item = &'a [RowOverlap]>,
    skipped: &Uninformative,
    threshold: f64,
) -> Vec<LayerOverlap> {
    // Each layer's rows as the slices they lie in: a layer's rows come in
    // runs, so a few slices a layer, not a pointer a row (gathered one at a
    // time on one core into fresh pages, those were a fifth of a remembered
    // analyze). The pieces are split into runs in parallel.
    let pieces: Vec<&[RowOverlap]> = pieces.into_iter().collect();
    let runs: Vec<Vec<&[RowOverlap]>> = pieces
        .par_iter()
        .map(|piece| piece.chunk_by(|a, b| a.layer == b.layer).collect())
        .collect();
    let mut layers: BTreeMap<i32, Vec<&[RowOverlap]>> =
        skipped.keys().map(|&l| (l, Vec::new())).collect();
    for run in runs.into_iter().flatten() {
        layers.entry(run[0].layer).or_default().push(run);
    }
    // Layers in parallel (in order): sorting each layer's values for its
    // quantiles was a fifth of a remembered analyze, on one core.
    let layers: Vec<(i32, Vec<&[RowOverlap]>)> = layers.into_iter().collect();
    layers
        .into_par_iter()
        .map(|(layer, runs)| layer_overlap(layer, &runs, skipped, threshold))
        .collect()
}

/// What `runs`, the rows of `layer`, amount to: each row read once.
fn layer_overlap(
    layer: i32,
    runs: &[&[RowOverlap]],
    skipped: &Uninformative,
    threshold: f64,
) -> LayerOverlap {
    let n: usize = runs.iter().map(|r| r.len()).sum();
    let mut values: [Vec<f64>; 4] = std::array::from_fn(|_| Vec::with_capacity(n));
    let (mut differing, mut churn, mut churn_unknown, mut below) = (0, 0, 0, 0);
    let mut churn_keys = 0.0;
    for r in runs.iter().copied().flatten() {
        let jaccard_no_churn = r.jaccard_no_churn();
        values[0].push(r.jaccard());
        values[1].push(r.recall());
        values[2].push(jaccard_no_churn);
        values[3].push(r.recall_no_churn());
        differing += r.differing_keys();
        churn += r.differing_churn();
        churn_unknown += usize::from(r.churn_unknown);
        below += usize::from(jaccard_no_churn < threshold);
        churn_keys += r.churn_keys() as f64;
    }
    let [jaccard, recall, jaccard_no_churn, recall_no_churn] = values.map(Summary::of);
    let (dense_rows, rows_without_shadow) = skipped.get(&layer).copied().unwrap_or_default();
    let per_row = |total: f64| if n == 0 { 0.0 } else { total / n as f64 };
    LayerOverlap {
        layer,
        informative_rows: n,
        dense_rows,
        rows_without_shadow,
        churn_unknown_rows: churn_unknown,
        jaccard,
        recall,
        jaccard_no_churn,
        recall_no_churn,
        share_below: per_row(below as f64),
        churn_keys_mean: per_row(churn_keys),
        churn_share: (differing > 0).then(|| churn as f64 / differing as f64),
        unit: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(token: i32, dequant: bool) -> RowOverlap {
        let at = RowAt {
            step: 0,
            layer: 0,
            token,
            dequant,
        };
        RowOverlap::new(at, Overlap::default(), Overlap::default(), 0, 0, false)
    }

    fn tokens(rows: &Rows) -> Vec<i32> {
        rows.iter().map(|r| r.token).collect()
    }

    #[test]
    fn rows_split_by_a_rule_keep_their_order_across_whole_and_mixed_pieces() {
        let mut rows = Rows::default();
        rows.push(vec![row(0, true), row(1, true)]);
        rows.push(Vec::new());
        rows.push(vec![row(2, false), row(3, true), row(4, false)]);
        rows.push(vec![row(5, false)]);
        assert_eq!(rows.len(), 6);
        let (dequant, reference) = rows.partition(|r| r.dequant);
        assert_eq!(tokens(&dequant), [0, 1, 3]);
        assert_eq!(tokens(&reference), [2, 4, 5]);
        assert!(Rows::default().is_empty());
        assert!(!dequant.is_empty());
    }

    #[test]
    fn a_row_keeps_the_metrics_of_its_counts() {
        let all = Overlap {
            intersection: 3,
            union: 5,
            reference_len: 4,
        };
        let clean = Overlap {
            intersection: 3,
            union: 4,
            reference_len: 3,
        };
        let at = RowAt {
            step: 1,
            layer: 2,
            token: 3,
            dequant: false,
        };
        let r = RowOverlap::new(at, all, clean, 2, 1, true);
        assert_eq!(r.jaccard(), 3.0 / 5.0);
        assert_eq!(r.recall(), 3.0 / 4.0);
        assert_eq!(r.jaccard_no_churn(), 3.0 / 4.0);
        assert_eq!(r.recall_no_churn(), 1.0);
        assert_eq!(
            (r.churn_keys(), r.differing_keys(), r.differing_churn()),
            (2, 2, 1)
        );
        assert!(r.churn_unknown);
    }

    #[test]
    fn a_layer_whose_rows_lie_in_several_pieces_is_summarised_as_one() {
        // Row (layer, i): i of 10 keys shared on both paths, i churn keys,
        // churn unknown where i is odd.
        let row = |layer: i32, i: usize| {
            let at = RowAt {
                step: 0,
                layer,
                token: i32::try_from(i).unwrap(),
                dequant: false,
            };
            let o = Overlap {
                intersection: i,
                union: 10,
                reference_len: 10,
            };
            RowOverlap::new(at, o, o, i, 0, i % 2 == 1)
        };
        let first = vec![row(0, 1), row(0, 2), row(1, 5)];
        let second = vec![row(0, 3), row(1, 6), row(1, 7)];
        let skipped: Uninformative = [(0, (4, 0)), (2, (8, 1))].into_iter().collect();
        let layers = by_layer([first.as_slice(), &second], &skipped, 0.25);
        assert_eq!(
            layers.iter().map(|l| l.layer).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        let zero = &layers[0];
        assert_eq!(
            (
                zero.informative_rows,
                zero.dense_rows,
                zero.churn_unknown_rows
            ),
            (3, 4, 2)
        );
        let jaccard = zero.jaccard.unwrap();
        assert_eq!((jaccard.min, jaccard.p50, jaccard.max), (0.1, 0.2, 0.3));
        assert_eq!(jaccard.mean, (0.1 + 0.2 + 0.3) / 3.0);
        assert_eq!(zero.share_below, 2.0 / 3.0);
        assert_eq!(zero.churn_keys_mean, 2.0);
        // 9 + 8 + 7 differing keys, none of them churn.
        assert_eq!(zero.churn_share, Some(0.0));
        assert_eq!(layers[1].informative_rows, 3);
        let two = &layers[2];
        assert_eq!(
            (
                two.informative_rows,
                two.dense_rows,
                two.rows_without_shadow
            ),
            (0, 8, 1)
        );
        assert!(two.jaccard.is_none());
        // The same rows in one piece, in the same order within each layer.
        let one: Vec<RowOverlap> = [
            row(0, 1),
            row(0, 2),
            row(0, 3),
            row(1, 5),
            row(1, 6),
            row(1, 7),
        ]
        .into();
        assert_eq!(by_layer([one.as_slice()], &skipped, 0.25), layers);
    }
}
