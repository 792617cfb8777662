//! Top-k overlap from a trace format v2 `topk` table (`schemas/v2/topk.json`).
//!
//! A v2 row stores counts, not selections: prod_selected, shadow_selected,
//! shared and the churn counts within the recorded `boundary_band`. Jaccard
//! and recall with and without churn follow from them exactly
//! (`shadowtrace_schemas::selection::Counts`), so the summary columns
//! ([`SUMMARY_COLUMNS`]) are all most analyses read, and the result equals
//! what v1's full lists give for the same selections.
//!
//! The lists ([`LIST_COLUMNS`]: differences and boundary candidates) are read
//! only where the counts cannot answer: a churn band other than a row's
//! recorded one (churn recounted within it from the candidates' offsets), or
//! a row with a band whose churn the producer left null because one path listed no
//! candidates (what the other path's list shows is removed, as v1 does, and
//! the row stays churn unknown). [`needs_lists`] says when.

use shadowtrace_schemas::columns::topk as c;
use shadowtrace_schemas::selection::{
    BoundaryView, ChurnCounts, Counts, churn_from_boundaries, extend_keys_from_gaps,
};

use super::topk_overlap::{RowOverlap, Skipped, SkippedRow};
use crate::AnalyzeError;
use crate::frame::{
    BoolListView, ListView, NullView, bool_list, i32s, list, null_view, str_equals,
};

/// The summary columns: enough for every row whose recorded churn answers
/// the margin asked for.
pub const SUMMARY_COLUMNS: [&str; 16] = [
    c::SHADOW_INPUT,
    c::STEP,
    c::LAYER,
    c::TOKEN,
    c::UNIT,
    c::UNIT_TOKENS,
    c::K,
    c::VISIBLE,
    c::PROD_SELECTED,
    c::SHADOW_SELECTED,
    c::SHARED,
    c::BOUNDARY_BAND,
    c::CHURN_SHARED,
    c::CHURN_PROD_ONLY,
    c::CHURN_SHADOW_ONLY,
    c::CHURN_UNSELECTED,
];

/// The lists read besides the summary when churn must be recounted.
pub const LIST_COLUMNS: [&str; 8] = [
    c::PROD_ONLY_GAPS,
    c::SHADOW_ONLY_GAPS,
    c::PROD_BOUNDARY_GAPS,
    c::PROD_BOUNDARY_OFFSETS,
    c::PROD_BOUNDARY_SELECTED,
    c::SHADOW_BOUNDARY_GAPS,
    c::SHADOW_BOUNDARY_OFFSETS,
    c::SHADOW_BOUNDARY_SELECTED,
];

/// The summary columns of one frame.
struct Summary<'a> {
    step: &'a [i32],
    layer: &'a [i32],
    token: &'a [i32],
    k: &'a [i32],
    visible: &'a [i32],
    dequant: Vec<bool>,
    prod_selected: &'a [i32],
    shadow_selected: NullView<'a, i32>,
    shared: NullView<'a, i32>,
    band: NullView<'a, f32>,
    churn: [NullView<'a, i32>; 4],
}

impl<'a> Summary<'a> {
    fn of(frame: &'a polars::prelude::DataFrame) -> Result<Summary<'a>, AnalyzeError> {
        Ok(Summary {
            step: i32s(frame, c::STEP)?,
            layer: i32s(frame, c::LAYER)?,
            token: i32s(frame, c::TOKEN)?,
            k: i32s(frame, c::K)?,
            visible: i32s(frame, c::VISIBLE)?,
            dequant: str_equals(frame, c::SHADOW_INPUT, "dequant")?,
            prod_selected: i32s(frame, c::PROD_SELECTED)?,
            shadow_selected: null_view(frame, c::SHADOW_SELECTED)?,
            shared: null_view(frame, c::SHARED)?,
            band: null_view(frame, c::BOUNDARY_BAND)?,
            churn: [
                null_view(frame, c::CHURN_SHARED)?,
                null_view(frame, c::CHURN_PROD_ONLY)?,
                null_view(frame, c::CHURN_SHADOW_ONLY)?,
                null_view(frame, c::CHURN_UNSELECTED)?,
            ],
        })
    }

    fn informative(&self, i: usize) -> bool {
        self.visible[i] > self.k[i] && self.shadow_selected.get(i).is_some()
    }

    /// The recorded churn of row `i`, `None` where the producer left it null.
    fn recorded_churn(&self, i: usize) -> Option<ChurnCounts> {
        let [shared, prod_only, shadow_only, unselected] = &self.churn;
        Some(ChurnCounts {
            shared: count(shared.get(i)?),
            prod_only: count(prod_only.get(i)?),
            shadow_only: count(shadow_only.get(i)?),
            unselected: count(unselected.get(i)?),
        })
    }

    /// Whether row `i` needs its lists to answer `band_factor`.
    fn needs_lists(&self, i: usize, band_factor: Option<f32>) -> bool {
        let Some(band) = self.band.get(i) else {
            // No band: no candidate was recorded, whatever the margin.
            return false;
        };
        self.informative(i)
            && (self.recorded_churn(i).is_none() || band_factor.is_some_and(|f| f * band != band))
    }
}

/// A count as stored (i32, never negative from a producer); a negative one
/// from a damaged file counts as zero rather than wrapping.
fn count(v: i32) -> usize {
    usize::try_from(v).unwrap_or(0)
}

/// Whether some row of a summary frame ([`SUMMARY_COLUMNS`]) needs
/// [`LIST_COLUMNS`] too for `band_factor`.
///
/// # Errors
/// When a summary column is missing or has an unexpected layout.
pub fn needs_lists(
    frame: &polars::prelude::DataFrame,
    band_factor: Option<f32>,
) -> Result<bool, AnalyzeError> {
    // Row group by row group: a part's columns hold one chunk per row group.
    for chunk in frame.clone().split_chunks() {
        let s = Summary::of(&chunk)?;
        if (0..chunk.height()).any(|i| s.needs_lists(i, band_factor)) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The list columns of one frame.
struct Lists<'a> {
    prod_only: ListView<'a, i32>,
    shadow_only: ListView<'a, i32>,
    boundary: [(ListView<'a, i32>, ListView<'a, f32>, BoolListView<'a>); 2],
}

impl<'a> Lists<'a> {
    fn of(frame: &'a polars::prelude::DataFrame) -> Result<Lists<'a>, AnalyzeError> {
        Ok(Lists {
            prod_only: list(frame, c::PROD_ONLY_GAPS)?,
            shadow_only: list(frame, c::SHADOW_ONLY_GAPS)?,
            boundary: [
                (
                    list(frame, c::PROD_BOUNDARY_GAPS)?,
                    list(frame, c::PROD_BOUNDARY_OFFSETS)?,
                    bool_list(frame, c::PROD_BOUNDARY_SELECTED)?,
                ),
                (
                    list(frame, c::SHADOW_BOUNDARY_GAPS)?,
                    list(frame, c::SHADOW_BOUNDARY_OFFSETS)?,
                    bool_list(frame, c::SHADOW_BOUNDARY_SELECTED)?,
                ),
            ],
        })
    }
}

/// Per-worker buffers for one row's decoded lists: no allocation per row.
#[derive(Default)]
struct Scratch {
    prod_only: Vec<i32>,
    shadow_only: Vec<i32>,
    keys: [Vec<i32>; 2],
    selected: [Vec<bool>; 2],
}

/// Row `i`'s churn within `margin`, recounted from its lists; `false` as the
/// second value when a path listed no candidates.
fn recount_churn(lists: &Lists<'_>, i: usize, margin: f32, s: &mut Scratch) -> (ChurnCounts, bool) {
    s.prod_only.clear();
    s.shadow_only.clear();
    extend_keys_from_gaps(lists.prod_only.get(i).unwrap_or(&[]), &mut s.prod_only);
    extend_keys_from_gaps(lists.shadow_only.get(i).unwrap_or(&[]), &mut s.shadow_only);
    let mut complete = true;
    let mut offsets: [&[f32]; 2] = [&[], &[]];
    for (path, (gaps, offs, selected)) in lists.boundary.iter().enumerate() {
        s.keys[path].clear();
        let listed = gaps.get(i).is_some() && offs.get(i).is_some();
        complete &= listed && selected.fill(i, &mut s.selected[path]);
        if !listed {
            s.selected[path].clear();
            continue;
        }
        extend_keys_from_gaps(gaps.get(i).unwrap_or(&[]), &mut s.keys[path]);
        offsets[path] = offs.get(i).unwrap_or(&[]);
    }
    let view = |path: usize| BoundaryView {
        keys: &s.keys[path],
        offsets: offsets[path],
        selected: &s.selected[path],
    };
    let churn = churn_from_boundaries(&s.prod_only, &s.shadow_only, view(0), view(1), margin);
    (churn, complete)
}

/// Per-row overlap of a v2 `topk` frame: [`SUMMARY_COLUMNS`], plus
/// [`LIST_COLUMNS`] where [`needs_lists`] says so. `band_factor` scales
/// each row's recorded band, as for v1 (the caller has checked it against
/// how far the lists reach).
///
/// # Errors
/// When a column is missing or has an unexpected layout, or a row needs the
/// lists and the frame lacks them.
pub fn row_overlaps(
    frame: &polars::prelude::DataFrame,
    band_factor: Option<f32>,
) -> Result<(Vec<RowOverlap>, Skipped), AnalyzeError> {
    let s = Summary::of(frame)?;
    let lists = if frame.column(c::PROD_ONLY_GAPS).is_ok() {
        Some(Lists::of(frame)?)
    } else {
        None
    };
    let mut left_out = Vec::new();
    let mut rows = Vec::with_capacity(frame.height());
    let mut scratch = Scratch::default();
    for i in 0..frame.height() {
        let skip = |dense: bool| SkippedRow {
            step: s.step[i],
            layer: s.layer[i],
            token: s.token[i],
            dequant: s.dequant[i],
            dense,
        };
        if s.visible[i] <= s.k[i] {
            left_out.push(skip(true));
            continue;
        }
        let (Some(shadow_selected), Some(shared)) = (s.shadow_selected.get(i), s.shared.get(i))
        else {
            left_out.push(skip(false));
            continue;
        };
        let (churn, churn_unknown) = match (s.band.get(i), s.needs_lists(i, band_factor), &lists) {
            (None, _, _) => (ChurnCounts::default(), true),
            (Some(band), true, Some(lists)) => {
                let margin = band_factor.map_or(band, |f| f * band);
                let (churn, complete) = recount_churn(lists, i, margin, &mut scratch);
                (churn, !complete)
            }
            (Some(_), true, None) => {
                return Err(AnalyzeError::Layout {
                    column: c::PROD_ONLY_GAPS.to_owned(),
                    detail: "row needs its lists to count churn and the frame lacks them"
                        .to_owned(),
                });
            }
            (Some(_), false, _) => (s.recorded_churn(i).unwrap_or_default(), false),
        };
        let counts = Counts {
            prod_selected: count(s.prod_selected[i]),
            shadow_selected: count(shadow_selected),
            shared: count(shared),
            churn,
        };
        let (all, clean) = (counts.overlap(), counts.overlap_no_churn());
        rows.push(RowOverlap {
            step: s.step[i],
            layer: s.layer[i],
            token: s.token[i],
            dequant: s.dequant[i],
            jaccard: all.jaccard(),
            recall: all.recall(),
            jaccard_no_churn: clean.jaccard(),
            recall_no_churn: clean.recall(),
            churn_keys: churn.total(),
            differing_keys: all.union - all.intersection,
            differing_churn: churn.prod_only + churn.shadow_only,
            churn_unknown,
        });
    }
    Ok((rows, Skipped::of(left_out)))
}
