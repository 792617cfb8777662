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
//! the row stays churn unknown). Rows that need them are found while the
//! summary is read, and only their row groups are read again with the lists.
//!
//! Read with the `parquet` crate's column readers a batch at a time
//! ([`crate::load::RowGroupBatches`]), row groups in parallel, not as polars
//! frames: a GLM-5.1 prefill's summary is 0.64 M rows, and decoding it whole
//! into fresh arrays (strings as views, 16 bytes a row) had the kernel zero
//! more pages than the rest of `analyze` took (docs/benchmarks.md, analyze throughput).

use std::collections::BTreeMap;

use parquet::data_type::ByteArray;
use parquet::file::metadata::ParquetMetaData;
use rayon::prelude::*;
use shadowtrace_schemas::columns::topk as c;
use shadowtrace_schemas::selection::{
    BoundaryView, ChurnCounts, Counts, churn_from_boundaries, extend_keys_from_gaps,
};

use super::selection_unit::{self, SelectionUnit, UNIT, UNIT_TOKENS};
use super::topk_overlap::{RowAt, RowOverlap, Rows, Skipped, SkippedRow};
use crate::AnalyzeError;
use crate::load::{ListColumn, Nullable, PartFile, RowBatch, has_column, same_i32, same_string};

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

/// A string column of one row group.
enum Strings<'a> {
    /// Not in the part (written before the column was).
    Absent,
    /// The one value of every row, from the footer's statistics: not decoded.
    Same(&'a str),
    /// Decoded, with the column's name for errors.
    Decoded(Nullable<'a, ByteArray>, &'static str),
}

impl<'a> Strings<'a> {
    /// The column of `batch`, or its one value `same` (from [`same_string`]).
    fn of(
        batch: &'a RowBatch<'_>,
        name: &'static str,
        same: Option<&'a str>,
        present: bool,
    ) -> Result<Strings<'a>, AnalyzeError> {
        Ok(match (present, same) {
            (false, _) => Strings::Absent,
            (true, Some(value)) => Strings::Same(value),
            (true, None) => Strings::Decoded(batch.nullable(name)?, name),
        })
    }

    /// Row `i`, `None` where null or absent.
    #[inline]
    fn get(&self, i: usize) -> Result<Option<&'a str>, AnalyzeError> {
        match self {
            Strings::Absent => Ok(None),
            Strings::Same(value) => Ok(Some(value)),
            Strings::Decoded(values, column) => values
                .get_ref(i)
                .map(|v| {
                    v.as_utf8().map_err(|_| AnalyzeError::Layout {
                        column: (*column).to_owned(),
                        detail: "a value that is not UTF-8".to_owned(),
                    })
                })
                .transpose(),
        }
    }
}

/// An INT32 column of one batch that never holds a null: decoded, or the one
/// value of every row of its row group, from the footer ([`same_i32`]).
#[derive(Debug, Clone, Copy)]
enum Required<'a> {
    Same(i32),
    Decoded(&'a [i32]),
}

impl<'a> Required<'a> {
    fn of(batch: &'a RowBatch<'_>, name: &str, same: Option<i32>) -> Result<Self, AnalyzeError> {
        Ok(match same {
            Some(value) => Required::Same(value),
            None => Required::Decoded(batch.values(name)?),
        })
    }

    #[inline]
    fn at(self, i: usize) -> i32 {
        match self {
            Required::Same(value) => value,
            Required::Decoded(values) => values[i],
        }
    }
}

/// A nullable INT32 column of one batch: absent from the part, the one value
/// of its row group (footer), or decoded.
#[derive(Debug, Clone, Copy)]
enum Ints<'a> {
    Absent,
    Same(i32),
    Decoded(Nullable<'a, i32>),
}

impl Ints<'_> {
    #[inline]
    fn get(self, i: usize) -> Option<i32> {
        match self {
            Ints::Absent => None,
            Ints::Same(value) => Some(value),
            Ints::Decoded(values) => values.get(i),
        }
    }
}

/// What one row group reads: the columns present, and the columns whose one
/// value its footer gives (a prefill's step, k, unit and shadow input): not
/// decoded, nor a reader built for them. The summary check
/// ([`super::topk_check`]) decodes them and counts the rows that differ from
/// what the footer claims.
pub(crate) struct GroupPlan {
    pub(crate) units: bool,
    pub(crate) same_input: Option<String>,
    pub(crate) same_unit: Option<String>,
    pub(crate) same_step: Option<i32>,
    pub(crate) same_k: Option<i32>,
    pub(crate) same_unit_tokens: Option<i32>,
}

impl GroupPlan {
    pub(crate) fn of(metadata: &ParquetMetaData, index: usize) -> GroupPlan {
        // Parts written before units were recorded are over tokens.
        let units = has_column(metadata, UNIT) && has_column(metadata, UNIT_TOKENS);
        GroupPlan {
            units,
            same_input: same_string(metadata, index, c::SHADOW_INPUT),
            same_unit: units.then(|| same_string(metadata, index, UNIT)).flatten(),
            same_step: same_i32(metadata, index, c::STEP),
            same_k: same_i32(metadata, index, c::K),
            same_unit_tokens: units
                .then(|| same_i32(metadata, index, UNIT_TOKENS))
                .flatten(),
        }
    }

    fn columns(&self, with_lists: bool) -> Vec<&'static str> {
        let mut columns: Vec<&str> = SUMMARY_COLUMNS
            .iter()
            .copied()
            .filter(|&name| match name {
                c::SHADOW_INPUT => self.same_input.is_none(),
                c::STEP => self.same_step.is_none(),
                c::K => self.same_k.is_none(),
                UNIT => self.units && self.same_unit.is_none(),
                UNIT_TOKENS => self.units && self.same_unit_tokens.is_none(),
                _ => true,
            })
            .collect();
        if with_lists {
            columns.extend(LIST_COLUMNS);
        }
        columns
    }
}

/// The summary columns of one batch.
struct Summary<'a> {
    step: Required<'a>,
    layer: &'a [i32],
    token: &'a [i32],
    k: Required<'a>,
    visible: &'a [i32],
    shadow_input: Strings<'a>,
    /// Every row's dequant flag, where the row group has one shadow input.
    same_dequant: Option<bool>,
    prod_selected: &'a [i32],
    shadow_selected: Nullable<'a, i32>,
    shared: Nullable<'a, i32>,
    band: Nullable<'a, f32>,
    churn: [Nullable<'a, i32>; 4],
    unit: Strings<'a>,
    unit_tokens: Ints<'a>,
}

impl<'a> Summary<'a> {
    fn of(batch: &'a RowBatch<'_>, plan: &'a GroupPlan) -> Result<Summary<'a>, AnalyzeError> {
        let shadow_input = Strings::of(batch, c::SHADOW_INPUT, plan.same_input.as_deref(), true)?;
        Ok(Summary {
            step: Required::of(batch, c::STEP, plan.same_step)?,
            layer: batch.values(c::LAYER)?,
            token: batch.values(c::TOKEN)?,
            k: Required::of(batch, c::K, plan.same_k)?,
            visible: batch.values(c::VISIBLE)?,
            same_dequant: match shadow_input {
                Strings::Absent => Some(false),
                Strings::Same(value) => Some(value == "dequant"),
                Strings::Decoded(..) => None,
            },
            shadow_input,
            prod_selected: batch.values(c::PROD_SELECTED)?,
            shadow_selected: batch.nullable(c::SHADOW_SELECTED)?,
            shared: batch.nullable(c::SHARED)?,
            band: batch.nullable(c::BOUNDARY_BAND)?,
            churn: [
                batch.nullable(c::CHURN_SHARED)?,
                batch.nullable(c::CHURN_PROD_ONLY)?,
                batch.nullable(c::CHURN_SHADOW_ONLY)?,
                batch.nullable(c::CHURN_UNSELECTED)?,
            ],
            unit: Strings::of(batch, UNIT, plan.same_unit.as_deref(), plan.units)?,
            unit_tokens: match (plan.units, plan.same_unit_tokens) {
                (false, _) => Ints::Absent,
                (true, Some(value)) => Ints::Same(value),
                (true, None) => Ints::Decoded(batch.nullable(UNIT_TOKENS)?),
            },
        })
    }

    /// Whether row `i`'s shadow scored the dequantized FP8 operands.
    #[inline]
    fn dequant(&self, i: usize) -> Result<bool, AnalyzeError> {
        match self.same_dequant {
            Some(dequant) => Ok(dequant),
            None => Ok(self.shadow_input.get(i)? == Some("dequant")),
        }
    }

    /// The recorded churn of row `i`, `None` where the producer left it null.
    #[inline]
    fn recorded_churn(&self, i: usize) -> Option<ChurnCounts> {
        recorded_churn(&self.churn, i)
    }
}

/// A count as stored (i32, never negative from a producer); a negative one
/// from a damaged file counts as zero rather than wrapping (the metric
/// refuses such a row first: [`contradiction`]).
pub(super) fn count(v: i32) -> usize {
    usize::try_from(v).unwrap_or(0)
}

/// What is impossible in one row's stored counts, `None` where they can
/// hold together: a negative count, more shared keys than either path
/// selected, or churn among the shared or one-path keys beyond what there
/// are. A damaged file, or a producer's defect: such a row's Jaccard would
/// be computed from counts no selection has, so it is counted as not
/// measured, never averaged in.
fn contradiction(
    prod_selected: i32,
    shadow_selected: i32,
    shared: i32,
    churn: Option<[i32; 4]>,
) -> Option<String> {
    let churn_named = [
        "churn_shared",
        "churn_prod_only",
        "churn_shadow_only",
        "churn_unselected",
    ];
    let mut named = vec![
        ("prod_selected", prod_selected),
        ("shadow_selected", shadow_selected),
        ("shared", shared),
    ];
    if let Some(churn) = churn {
        named.extend(churn_named.into_iter().zip(churn));
    }
    if let Some((name, v)) = named.iter().find(|(_, v)| *v < 0) {
        return Some(format!("{name} {v} < 0"));
    }
    let (prod, shadow, shared) = (
        i64::from(prod_selected),
        i64::from(shadow_selected),
        i64::from(shared),
    );
    if shared > prod {
        return Some(format!("shared {shared} > prod_selected {prod}"));
    }
    if shared > shadow {
        return Some(format!("shared {shared} > shadow_selected {shadow}"));
    }
    let [c_shared, c_prod, c_shadow, _] = churn?.map(i64::from);
    [
        ("churn_shared", c_shared, "shared", shared),
        (
            "churn_prod_only",
            c_prod,
            "prod_selected - shared",
            prod - shared,
        ),
        (
            "churn_shadow_only",
            c_shadow,
            "shadow_selected - shared",
            shadow - shared,
        ),
    ]
    .into_iter()
    .find(|(_, churn, _, limit)| churn > limit)
    .map(|(name, churn, what, limit)| format!("{name} {churn} > {what} {limit}"))
}

/// Rows of one part whose stored counts contradict each other
/// ([`contradiction`]): left out of every average, and counted so the
/// run's top-k verdict is not judged, with the part named.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Contradictions {
    /// Such rows.
    pub rows: usize,
    /// The first of them in the part's order: where, and what is impossible.
    pub first: Option<(RowAt, String)>,
}

impl Contradictions {
    fn add(&mut self, other: Contradictions) {
        self.rows += other.rows;
        if self.first.is_none() {
            self.first = other.first;
        }
    }
}

/// Row `i`'s churn counts as recorded in the four churn columns (shared,
/// prod-only, shadow-only, unselected), `None` where the producer left any
/// of them null.
#[inline]
pub(super) fn recorded_churn(churn: &[Nullable<'_, i32>; 4], i: usize) -> Option<ChurnCounts> {
    let [shared, prod_only, shadow_only, unselected] = churn;
    Some(ChurnCounts {
        shared: count(shared.get(i)?),
        prod_only: count(prod_only.get(i)?),
        shadow_only: count(shadow_only.get(i)?),
        unselected: count(unselected.get(i)?),
    })
}

/// The list columns of one batch ([`LIST_COLUMNS`]): the keys only one
/// path selected, and each path's boundary candidates (keys, offsets from
/// its k-th score, whether it selected them).
pub(super) struct Lists<'a> {
    pub(super) prod_only: ListColumn<'a, i32>,
    pub(super) shadow_only: ListColumn<'a, i32>,
    pub(super) boundary: [(
        ListColumn<'a, i32>,
        ListColumn<'a, f32>,
        ListColumn<'a, bool>,
    ); 2],
}

impl<'a> Lists<'a> {
    pub(super) fn of(batch: &'a RowBatch<'_>) -> Result<Lists<'a>, AnalyzeError> {
        Ok(Lists {
            prod_only: batch.list(c::PROD_ONLY_GAPS)?,
            shadow_only: batch.list(c::SHADOW_ONLY_GAPS)?,
            boundary: [
                (
                    batch.list(c::PROD_BOUNDARY_GAPS)?,
                    batch.list(c::PROD_BOUNDARY_OFFSETS)?,
                    batch.list(c::PROD_BOUNDARY_SELECTED)?,
                ),
                (
                    batch.list(c::SHADOW_BOUNDARY_GAPS)?,
                    batch.list(c::SHADOW_BOUNDARY_OFFSETS)?,
                    batch.list(c::SHADOW_BOUNDARY_SELECTED)?,
                ),
            ],
        })
    }
}

/// Buffers for one row's decoded keys: no allocation per row.
#[derive(Default)]
struct Scratch {
    prod_only: Vec<i32>,
    shadow_only: Vec<i32>,
    keys: [Vec<i32>; 2],
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
    let mut selected: [&[bool]; 2] = [&[], &[]];
    for (path, (gaps, offs, flags)) in lists.boundary.iter().enumerate() {
        s.keys[path].clear();
        let (Some(gaps), Some(offs)) = (gaps.get(i), offs.get(i)) else {
            complete = false;
            continue;
        };
        let flags = flags.get(i);
        complete &= flags.is_some();
        extend_keys_from_gaps(gaps, &mut s.keys[path]);
        offsets[path] = offs;
        selected[path] = flags.unwrap_or(&[]);
    }
    let view = |path: usize| BoundaryView {
        keys: &s.keys[path],
        offsets: offsets[path],
        selected: selected[path],
    };
    let churn = churn_from_boundaries(&s.prod_only, &s.shadow_only, view(0), view(1), margin);
    (churn, complete)
}

/// What one part's rows amount to: the overlap of each informative row (in
/// the part's order), the rows left out, and each layer's selection unit.
#[derive(Debug, Default)]
pub struct PartOverlaps {
    /// Informative rows whose shadow is the reference recompute.
    pub rows: Rows,
    /// Informative rows whose shadow scored the dequantized FP8 operands:
    /// kept apart as they are read, not split from the others after (a scan
    /// of every row, on one core).
    pub dequant_rows: Rows,
    /// Dense rows and rows without a shadow.
    pub skipped: Skipped,
    /// Each layer's unit ([`selection_unit`]).
    pub units: BTreeMap<i32, SelectionUnit>,
    /// Rows whose counts contradict each other, left out.
    pub contradictions: Contradictions,
}

/// Per-row overlap of a v2 `topk` part, row groups in parallel:
/// [`SUMMARY_COLUMNS`], and [`LIST_COLUMNS`] for each row group where a row
/// needs them for `band_factor`. `band_factor` scales each row's recorded
/// band (the caller has checked it against how far the lists reach).
///
/// # Errors
/// When the part cannot be read, a column is missing or has an unexpected
/// layout, or a layer's rows are over different units.
pub fn part_overlaps(
    part: &PartFile,
    band_factor: Option<f32>,
) -> Result<PartOverlaps, AnalyzeError> {
    let metadata = part.parquet_metadata()?;
    let groups: Vec<Result<PartOverlaps, AnalyzeError>> = (0..metadata.num_row_groups())
        .into_par_iter()
        .map(|index| {
            if let Some(group) = group_overlaps(part, &metadata, index, band_factor, false)? {
                return Ok(group);
            }
            // A row of this group needs its lists: read it again with them.
            group_overlaps(part, &metadata, index, band_factor, true)?.ok_or_else(|| {
                AnalyzeError::Layout {
                    column: c::PROD_ONLY_GAPS.to_owned(),
                    detail: "lists read and still asked for (a defect)".to_owned(),
                }
            })
        })
        .collect();
    let groups: Vec<PartOverlaps> = groups.into_iter().collect::<Result<_, _>>()?;
    let mut out = PartOverlaps::default();
    for group in groups {
        selection_unit::merge(&mut out.units, group.units)?;
        out.rows.append(group.rows);
        out.dequant_rows.append(group.dequant_rows);
        out.skipped.add(group.skipped);
        out.contradictions.add(group.contradictions);
    }
    Ok(out)
}

/// Whether two rows' (layer, unit, unit tokens) are the same: a row group's
/// one unit is the same string on every row, compared by address first.
#[inline]
fn same_unit(a: (i32, Option<&str>, Option<i32>), b: (i32, Option<&str>, Option<i32>)) -> bool {
    a.0 == b.0
        && a.2 == b.2
        && match (a.1, b.1) {
            (Some(x), Some(y)) => std::ptr::eq(x, y) || x == y,
            (x, y) => x == y,
        }
}

/// Row group `index` of a part, a batch at a time; `None` when a row needs
/// its lists and `with_lists` is false.
fn group_overlaps(
    part: &PartFile,
    metadata: &ParquetMetaData,
    index: usize,
    band_factor: Option<f32>,
    with_lists: bool,
) -> Result<Option<PartOverlaps>, AnalyzeError> {
    let plan = GroupPlan::of(metadata, index);
    let columns = plan.columns(with_lists);
    let mut batches = part.row_group_batches(metadata, index, &columns)?;
    let rows = usize::try_from(metadata.row_group(index).num_rows()).unwrap_or(0);
    let mut out = PartOverlaps::default();
    // Sized for every row (grown by doubling, the rows were copied into
    // fresh pages again and again): the vector of the row group's one shadow
    // input, or the reference one where inputs mix.
    let sized = || Vec::with_capacity(rows);
    let (mut reference, mut dequant_rows) = if plan.same_input.as_deref() == Some("dequant") {
        (Vec::new(), sized())
    } else {
        (sized(), Vec::new())
    };
    let mut left_out = Vec::new();
    let mut scratch = Scratch::default();
    while let Some(batch) = batches.next_batch() {
        let batch = batch?;
        let s = Summary::of(&batch, &plan)?;
        let lists = if with_lists {
            Some(Lists::of(&batch)?)
        } else {
            None
        };
        let mut last_unit = None;
        for i in 0..batch.rows {
            let unit = (s.layer[i], s.unit.get(i)?, s.unit_tokens.get(i));
            // A layer's rows come together: one map lookup per run of them.
            if last_unit.is_none_or(|last| !same_unit(last, unit)) {
                selection_unit::add_row(&mut out.units, unit.0, unit.1, unit.2)?;
                last_unit = Some(unit);
            }
            let dequant = s.dequant(i)?;
            let skip = |dense: bool| SkippedRow {
                step: s.step.at(i),
                layer: s.layer[i],
                token: s.token[i],
                dequant,
                dense,
            };
            if s.visible[i] <= s.k.at(i) {
                left_out.push(skip(true));
                continue;
            }
            let (Some(shadow_selected), Some(shared)) = (s.shadow_selected.get(i), s.shared.get(i))
            else {
                left_out.push(skip(false));
                continue;
            };
            let at = RowAt {
                step: s.step.at(i),
                layer: s.layer[i],
                token: s.token[i],
                dequant,
            };
            let stored_churn = match s.churn.each_ref().map(|c| c.get(i)) {
                [Some(a), Some(b), Some(c), Some(d)] => Some([a, b, c, d]),
                _ => None,
            };
            if let Some(why) =
                contradiction(s.prod_selected[i], shadow_selected, shared, stored_churn)
            {
                out.contradictions.rows += 1;
                if out.contradictions.first.is_none() {
                    out.contradictions.first = Some((at, why));
                }
                continue;
            }
            let recorded = s.recorded_churn(i);
            let (churn, churn_unknown) = match s.band.get(i) {
                // No band: no candidate was recorded, whatever the margin.
                None => (ChurnCounts::default(), true),
                // The recorded churn answers the recorded band.
                Some(band)
                    if recorded.is_some() && band_factor.is_none_or(|f| f * band == band) =>
                {
                    (recorded.unwrap_or_default(), false)
                }
                Some(band) => {
                    let Some(lists) = &lists else {
                        return Ok(None);
                    };
                    let margin = band_factor.map_or(band, |f| f * band);
                    let (churn, complete) = recount_churn(lists, i, margin, &mut scratch);
                    (churn, !complete)
                }
            };
            let counts = Counts {
                prod_selected: count(s.prod_selected[i]),
                shadow_selected: count(shadow_selected),
                shared: count(shared),
                churn,
            };
            let kept = if dequant {
                &mut dequant_rows
            } else {
                &mut reference
            };
            kept.push(RowOverlap::new(
                at,
                counts.overlap(),
                counts.overlap_no_churn(),
                churn.total(),
                churn.prod_only + churn.shadow_only,
                churn_unknown,
            ));
        }
    }
    out.rows.push(reference);
    out.dequant_rows.push(dequant_rows);
    out.skipped = Skipped::of(left_out);
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::fs::File;
    use std::sync::Arc;

    use arrow_array::{ArrayRef, Float32Array, Int32Array, RecordBatch, StringArray};
    use parquet::arrow::ArrowWriter;
    use parquet::file::properties::WriterProperties;

    use super::*;

    const GROUP: usize = 40;

    /// The shadow input of row `i`: the first row group all `dequant`, the
    /// second `reference` and `dequant` in turn.
    fn input(i: usize) -> &'static str {
        if i < GROUP || i.is_multiple_of(2) {
            "dequant"
        } else {
            "reference"
        }
    }

    /// Row `i`'s step: one in the first row group, two in the second.
    fn step(i: usize) -> i32 {
        i32::from(i >= GROUP && i.is_multiple_of(3))
    }

    /// A v2 summary of two row groups written by arrow-rs: rows with k = 4
    /// of 10 visible keys (every fifth dense, 3 visible, its band and churn
    /// null), each path selecting 4 and sharing `i % 5`, no churn.
    fn part(dir: &std::path::Path) -> PartFile {
        let rows = 2 * GROUP;
        let int = |f: fn(usize) -> i32| -> ArrayRef {
            Arc::new(Int32Array::from_iter_values((0..rows).map(f)))
        };
        let churn = || -> ArrayRef {
            Arc::new(Int32Array::from_iter(
                (0..rows).map(|i| (i % 5 != 4).then_some(0)),
            ))
        };
        let columns: Vec<(&str, ArrayRef)> = vec![
            (
                c::SHADOW_INPUT,
                Arc::new(StringArray::from_iter_values((0..rows).map(input))),
            ),
            (c::STEP, int(step)),
            (c::LAYER, int(|i| i32::try_from(i / 20).unwrap())),
            (c::TOKEN, int(|i| i32::try_from(i).unwrap())),
            (
                UNIT,
                Arc::new(StringArray::from_iter_values((0..rows).map(|_| "token"))),
            ),
            (UNIT_TOKENS, int(|_| 1)),
            (c::K, int(|_| 4)),
            (c::VISIBLE, int(|i| if i % 5 == 4 { 3 } else { 10 })),
            (c::PROD_SELECTED, int(|_| 4)),
            (c::SHADOW_SELECTED, int(|_| 4)),
            (c::SHARED, int(|i| i32::try_from(i % 5).unwrap())),
            // Null on dense rows, as the writers leave them.
            (
                c::BOUNDARY_BAND,
                Arc::new(Float32Array::from_iter(
                    (0..rows).map(|i| (i % 5 != 4).then_some(0.5)),
                )),
            ),
            (c::CHURN_SHARED, churn()),
            (c::CHURN_PROD_ONLY, churn()),
            (c::CHURN_SHADOW_ONLY, churn()),
            (c::CHURN_UNSELECTED, churn()),
        ];
        let batch = RecordBatch::try_from_iter(columns).unwrap();
        let path = dir.join("part.parquet");
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(GROUP))
            .build();
        let mut writer =
            ArrowWriter::try_new(File::create(&path).unwrap(), batch.schema(), Some(props))
                .unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
        PartFile::written_topk(path, rows as u64)
    }

    #[test]
    fn a_row_group_of_one_value_is_read_from_its_footer_and_a_mixed_one_decoded() {
        let tmp = tempfile::tempdir().unwrap();
        let part = part(tmp.path());
        let metadata = part.parquet_metadata().unwrap();
        assert_eq!(metadata.num_row_groups(), 2);
        assert_eq!(
            same_string(&metadata, 0, c::SHADOW_INPUT).as_deref(),
            Some("dequant")
        );
        assert_eq!(same_string(&metadata, 1, c::SHADOW_INPUT), None);
        assert_eq!(same_string(&metadata, 1, UNIT).as_deref(), Some("token"));
        assert_eq!(same_i32(&metadata, 0, c::STEP), Some(0));
        assert_eq!(same_i32(&metadata, 1, c::STEP), None);
        assert_eq!(same_i32(&metadata, 1, c::K), Some(4));
        // A nullable column holding nulls has no one value.
        assert_eq!(same_i32(&metadata, 0, c::CHURN_SHARED), None);

        let got = part_overlaps(&part, None).unwrap();
        // Every row in order, dense ones left out, each kept with the input
        // it was written with and the overlap its counts give: shared / (8 - shared).
        for (rows, dequant) in [(&got.rows, false), (&got.dequant_rows, true)] {
            let informative: Vec<usize> = (0..2 * GROUP)
                .filter(|&i| i % 5 != 4 && (input(i) == "dequant") == dequant)
                .collect();
            assert_eq!(rows.len(), informative.len());
            for (row, &i) in rows.iter().zip(&informative) {
                let shared = (i % 5) as f64;
                assert_eq!(row.token, i32::try_from(i).unwrap());
                assert_eq!(row.step, step(i), "row {i}");
                assert_eq!(row.dequant, dequant, "row {i}");
                assert!(!row.churn_unknown, "row {i}");
                assert_eq!(row.jaccard(), shared / (8.0 - shared), "row {i}");
                assert_eq!(row.recall(), shared / 4.0, "row {i}");
                assert_eq!(row.jaccard_no_churn(), row.jaccard());
            }
        }
        let dense: Vec<(i32, bool)> = got
            .skipped
            .rows
            .iter()
            .map(|r| (r.token, r.dequant))
            .collect();
        let expected: Vec<(i32, bool)> = (0..2 * GROUP)
            .filter(|i| i % 5 == 4)
            .map(|i| (i32::try_from(i).unwrap(), input(i) == "dequant"))
            .collect();
        assert_eq!(dense, expected);
        assert_eq!(got.units.len(), 4);
        assert!(got.units.values().all(|u| *u == SelectionUnit::token()));
    }
}
