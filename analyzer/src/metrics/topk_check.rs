//! Whether a v2 `topk` row's summary agrees with its lists.
//!
//! ## What it checks
//! A v2 producer (the Rust writer, the Python hooks) stores per row both the
//! counts and the lists they come from. Where both exist:
//! - `shared`: prod_selected − len(prod_only) = shadow_selected − len(shadow_only) = shared;
//! - `jaccard` and `jaccard_no_churn`: equal to what the counts give, within
//!   [`JACCARD_TOLERANCE`] (the producer rounds to f32, and may divide in f32);
//! - `churn`: the four churn counts equal a recount within `boundary_band`
//!   from both paths' boundary candidates and the differences, whose keys
//!   are ascending (keys out of order are a disagreement: the recount, like
//!   every reader, takes them as sorted);
//! - `full_list`: a sampled full prod list holds prod_selected keys,
//!   ascending, and every prod-only key;
//! - `missing_lists`: a row with a shadow has both difference lists, and a
//!   row whose churn counts were recorded has the boundary lists they were
//!   counted from. A summary without its lists cannot be checked, and is a
//!   disagreement, never a row checked clean;
//! - `footer`: where a row group's footer statistics say every row holds
//!   one step, k, shadow input, unit or unit size, `analyze` takes that
//!   value and does not decode the column ([`super::topk_v2`]); every row,
//!   with a shadow or not, must hold it. A writer whose statistics say
//!   otherwise than its rows would move rows to another step or unit
//!   unseen.
//!
//! ## Why it matters
//! The top-k metric reads only the counts ([`super::topk_v2`]). A producer
//! whose counts drift from its lists would change every verdict silently;
//! this check makes the drift a counted disagreement (`analyze`) and a
//! problem (`inspect`).

use std::path::Path;

use parquet::data_type::ByteArray;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use shadowtrace_schemas::columns::topk as c;
use shadowtrace_schemas::selection::{
    BoundaryView, Counts, churn_from_boundaries, extend_keys_from_gaps,
};

use super::check_memo;
use super::selection_unit::{UNIT, UNIT_TOKENS};
use super::topk_v2::{GroupPlan, Lists, count, recorded_churn};
use crate::load::{ListColumn, Nullable, PartFile, RowBatch, Run};
use crate::{AnalyzeError, RunProblem};

/// Largest difference between a stored Jaccard and the one its counts give
/// that counts as rounding: two f32 ulps at 1.
pub const JACCARD_TOLERANCE: f64 = 2.0 * f32::EPSILON as f64;

/// Columns the check reads.
pub const COLUMNS: [&str; 24] = [
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
    c::JACCARD,
    c::JACCARD_NO_CHURN,
    c::PROD_ONLY_GAPS,
    c::SHADOW_ONLY_GAPS,
    c::PROD_BOUNDARY_GAPS,
    c::PROD_BOUNDARY_OFFSETS,
    c::PROD_BOUNDARY_SELECTED,
    c::SHADOW_BOUNDARY_GAPS,
    c::SHADOW_BOUNDARY_OFFSETS,
    c::SHADOW_BOUNDARY_SELECTED,
    c::PROD_GAPS,
    c::STEP,
    c::LAYER,
    c::TOKEN,
];

/// Where a row is: its step, layer and query token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RowAt {
    /// Forward step.
    pub step: i32,
    /// Layer.
    pub layer: i32,
    /// Query token.
    pub token: i32,
}

/// Rows checked and the disagreements found, by check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SummaryCheck {
    /// Part files the check covers.
    #[serde(default)]
    pub parts: usize,
    /// Of those, the parts whose result came from the memo of an earlier
    /// check of the same bytes ([`super::check_memo`]), not decoded now.
    #[serde(default)]
    pub parts_remembered: usize,
    /// Rows with a shadow (the rows a summary describes), and rows without
    /// one that hold other than their footer claims (`footer`).
    pub rows_checked: usize,
    /// Rows with at least one disagreement.
    pub rows_disagreeing: usize,
    /// `shared` against the differences.
    pub shared: usize,
    /// `jaccard` against the counts.
    pub jaccard: usize,
    /// `jaccard_no_churn` against the counts.
    pub jaccard_no_churn: usize,
    /// The churn counts against a recount from the boundary candidates.
    pub churn: usize,
    /// A sampled full prod list against prod_selected and the differences.
    pub full_list: usize,
    /// Rows with a shadow whose difference lists are null, or whose churn
    /// counts were recorded without the boundary lists they come from: a
    /// summary with nothing to check it against.
    pub missing_lists: usize,
    /// Rows whose step, k, shadow input, unit or unit size is not the one
    /// value their row group's footer statistics claim for every row (the
    /// value `analyze` reads instead of the column).
    #[serde(default)]
    pub footer: usize,
    /// The first disagreeing row, by (step, layer, token): where to look.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_disagreeing: Option<RowAt>,
}

impl SummaryCheck {
    fn add(&mut self, other: &SummaryCheck) {
        self.parts += other.parts;
        self.parts_remembered += other.parts_remembered;
        self.rows_checked += other.rows_checked;
        self.rows_disagreeing += other.rows_disagreeing;
        self.shared += other.shared;
        self.jaccard += other.jaccard;
        self.jaccard_no_churn += other.jaccard_no_churn;
        self.churn += other.churn;
        self.full_list += other.full_list;
        self.missing_lists += other.missing_lists;
        self.footer += other.footer;
        // The smallest, whatever order parts and threads finish in.
        self.first_disagreeing = match (self.first_disagreeing, other.first_disagreeing) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// One line for a person: `3 of 120 top-k rows' summaries disagree with
    /// their lists (shared 1, churn 2); the first at step 0, layer 4, token 2900`.
    #[must_use]
    pub fn text(&self) -> String {
        let kinds: Vec<String> = [
            ("shared", self.shared),
            ("jaccard", self.jaccard),
            ("jaccard_no_churn", self.jaccard_no_churn),
            ("churn", self.churn),
            ("full_list", self.full_list),
            ("missing_lists", self.missing_lists),
            ("footer", self.footer),
        ]
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!("{name} {n}"))
        .collect();
        let first = self.first_disagreeing.map_or_else(String::new, |at| {
            format!(
                "; the first at step {}, layer {}, token {}",
                at.step, at.layer, at.token
            )
        });
        format!(
            "{} of {} top-k rows' summaries disagree with their lists or footers ({}){first}",
            self.rows_disagreeing,
            self.rows_checked,
            kinds.join(", ")
        )
    }
}

/// Whether `keys` are strictly ascending, as v2 stores every key list.
fn ascending(keys: &[i32]) -> bool {
    keys.windows(2).all(|w| w[0] < w[1])
}

fn close(stored: Option<f32>, counted: f64) -> bool {
    stored.is_none_or(|s| (f64::from(s) - counted).abs() <= JACCARD_TOLERANCE)
}

/// The columns of one batch of rows the check reads ([`COLUMNS`]).
struct Columns<'a> {
    step: &'a [i32],
    layer: &'a [i32],
    token: &'a [i32],
    k: &'a [i32],
    visible: &'a [i32],
    prod_selected: &'a [i32],
    shadow_selected: Nullable<'a, i32>,
    shared: Nullable<'a, i32>,
    band: Nullable<'a, f32>,
    churn: [Nullable<'a, i32>; 4],
    jaccard: Nullable<'a, f32>,
    jaccard_no_churn: Nullable<'a, f32>,
    lists: Lists<'a>,
    prod_gaps: ListColumn<'a, i32>,
}

impl<'a> Columns<'a> {
    fn of(g: &'a RowBatch<'_>) -> Result<Columns<'a>, AnalyzeError> {
        Ok(Columns {
            step: g.values::<i32>(c::STEP)?,
            layer: g.values::<i32>(c::LAYER)?,
            token: g.values::<i32>(c::TOKEN)?,
            k: g.values::<i32>(c::K)?,
            visible: g.values::<i32>(c::VISIBLE)?,
            prod_selected: g.values::<i32>(c::PROD_SELECTED)?,
            shadow_selected: g.nullable::<i32>(c::SHADOW_SELECTED)?,
            shared: g.nullable::<i32>(c::SHARED)?,
            band: g.nullable::<f32>(c::BOUNDARY_BAND)?,
            churn: [
                g.nullable::<i32>(c::CHURN_SHARED)?,
                g.nullable::<i32>(c::CHURN_PROD_ONLY)?,
                g.nullable::<i32>(c::CHURN_SHADOW_ONLY)?,
                g.nullable::<i32>(c::CHURN_UNSELECTED)?,
            ],
            jaccard: g.nullable::<f32>(c::JACCARD)?,
            jaccard_no_churn: g.nullable::<f32>(c::JACCARD_NO_CHURN)?,
            lists: Lists::of(g)?,
            prod_gaps: g.list::<i32>(c::PROD_GAPS)?,
        })
    }
}

/// What a row group's footer claims every row holds ([`GroupPlan`]: the
/// values `analyze` reads instead of decoding), with the decoded columns
/// that must hold it.
struct Claims<'a> {
    step: Option<i32>,
    k: Option<i32>,
    unit_tokens: Option<(i32, Nullable<'a, i32>)>,
    strings: Vec<(&'a str, Nullable<'a, ByteArray>)>,
}

impl<'a> Claims<'a> {
    fn of(batch: &'a RowBatch<'_>, plan: &'a GroupPlan) -> Result<Self, AnalyzeError> {
        let mut strings = Vec::new();
        for (same, name) in [(&plan.same_input, c::SHADOW_INPUT), (&plan.same_unit, UNIT)] {
            if let Some(value) = same.as_deref() {
                strings.push((value, batch.nullable(name)?));
            }
        }
        let unit_tokens = match plan.same_unit_tokens {
            Some(value) => Some((value, batch.nullable(UNIT_TOKENS)?)),
            None => None,
        };
        Ok(Claims {
            step: plan.same_step,
            k: plan.same_k,
            unit_tokens,
            strings,
        })
    }

    /// The columns besides [`COLUMNS`] the claims of `plan` are held to.
    fn columns(plan: &GroupPlan) -> Vec<&'static str> {
        [
            (plan.same_input.is_some(), c::SHADOW_INPUT),
            (plan.same_unit.is_some(), UNIT),
            (plan.same_unit_tokens.is_some(), UNIT_TOKENS),
        ]
        .into_iter()
        .filter_map(|(claimed, name)| claimed.then_some(name))
        .collect()
    }

    /// Whether row `i` holds other than the footer claims (a null, where
    /// the footer counted none, included).
    fn broken(&self, t: &Columns<'_>, i: usize) -> bool {
        self.step.is_some_and(|value| t.step[i] != value)
            || self.k.is_some_and(|value| t.k[i] != value)
            || self
                .unit_tokens
                .as_ref()
                .is_some_and(|(value, column)| column.get(i) != Some(*value))
            || self.strings.iter().any(|(value, column)| {
                column
                    .get_ref(i)
                    .is_none_or(|got| got.data() != value.as_bytes())
            })
    }
}

/// One worker's buffers for a row's decoded lists: no allocation per row.
#[derive(Default)]
struct Scratch {
    prod_only: Vec<i32>,
    shadow_only: Vec<i32>,
    keys: [Vec<i32>; 2],
    full: Vec<i32>,
}

/// Decodes a gap-coded list into `out`; `false` where the list is null.
fn decode(list: &ListColumn<'_, i32>, i: usize, out: &mut Vec<i32>) -> bool {
    out.clear();
    list.get(i)
        .map(|gaps| extend_keys_from_gaps(gaps, out))
        .is_some()
}

/// Checks row `i`, which holds other than its footer claims where `footer`;
/// `None` for a row without a shadow (no summary to check) that holds them.
fn check_row(t: &Columns<'_>, i: usize, s: &mut Scratch, footer: bool) -> Option<SummaryCheck> {
    let mut row = SummaryCheck {
        rows_checked: 1,
        footer: usize::from(footer),
        ..SummaryCheck::default()
    };
    match (t.shadow_selected.get(i), t.shared.get(i)) {
        (Some(shadow_n), Some(shared_n)) => check_summary(t, i, s, shadow_n, shared_n, &mut row),
        _ if footer => {}
        _ => return None,
    }
    if row.shared
        + row.jaccard
        + row.jaccard_no_churn
        + row.churn
        + row.full_list
        + row.missing_lists
        + row.footer
        > 0
    {
        row.rows_disagreeing = 1;
        row.first_disagreeing = Some(RowAt {
            step: t.step[i],
            layer: t.layer[i],
            token: t.token[i],
        });
    }
    Some(row)
}

/// The summary of row `i` (`shadow_n` keys selected by the shadow, `shared_n`
/// by both) against its lists, into `row`.
fn check_summary(
    t: &Columns<'_>,
    i: usize,
    s: &mut Scratch,
    shadow_n: i32,
    shared_n: i32,
    row: &mut SummaryCheck,
) {
    let prod_only_listed = decode(&t.lists.prod_only, i, &mut s.prod_only);
    let differences = prod_only_listed & decode(&t.lists.shadow_only, i, &mut s.shadow_only);
    row.missing_lists = usize::from(!differences);
    if differences {
        let from_prod = i64::from(t.prod_selected[i]) - s.prod_only.len() as i64;
        let from_shadow = i64::from(shadow_n) - s.shadow_only.len() as i64;
        row.shared =
            usize::from(from_prod != i64::from(shared_n) || from_shadow != i64::from(shared_n));
    }
    let recorded = recorded_churn(&t.churn, i);
    let counts = Counts {
        prod_selected: count(t.prod_selected[i]),
        shadow_selected: count(shadow_n),
        shared: count(shared_n),
        churn: recorded.unwrap_or_default(),
    };
    row.jaccard = usize::from(!close(t.jaccard.get(i), counts.overlap().jaccard()));
    if recorded.is_some() {
        row.jaccard_no_churn = usize::from(!close(
            t.jaccard_no_churn.get(i),
            counts.overlap_no_churn().jaccard(),
        ));
    }
    if let (Some(band), Some(recorded), true) = (t.band.get(i), recorded, differences)
        && t.visible[i] > t.k[i]
    {
        let mut listed = true;
        let mut offsets: [&[f32]; 2] = [&[], &[]];
        let mut selected: [&[bool]; 2] = [&[], &[]];
        for (path, (gaps, offs, flags)) in t.lists.boundary.iter().enumerate() {
            listed &= decode(gaps, i, &mut s.keys[path]);
            match (offs.get(i), flags.get(i)) {
                (Some(o), Some(f)) => (offsets[path], selected[path]) = (o, f),
                _ => listed = false,
            }
        }
        if listed {
            let view = |path: usize| BoundaryView {
                keys: &s.keys[path],
                offsets: offsets[path],
                selected: selected[path],
            };
            let ordered = [&s.prod_only, &s.shadow_only, &s.keys[0], &s.keys[1]]
                .iter()
                .all(|keys| ascending(keys));
            let recount =
                churn_from_boundaries(&s.prod_only, &s.shadow_only, view(0), view(1), band);
            row.churn = usize::from(!ordered || recount != recorded);
        } else {
            row.missing_lists = 1;
        }
    }
    if decode(&t.prod_gaps, i, &mut s.full) {
        let full = &s.full;
        let holds_prod_only = !prod_only_listed
            || s.prod_only
                .iter()
                .all(|key| full.binary_search(key).is_ok());
        row.full_list = usize::from(
            full.len() != count(t.prod_selected[i]) || !ascending(full) || !holds_prod_only,
        );
    }
}

/// Rows a worker checks at a time: large enough that splitting costs
/// nothing, small enough that both cores share a batch.
const ROWS_PER_TASK: usize = 2048;

/// Checks every row of one batch of a v2 `topk` part ([`COLUMNS`]), in
/// parallel over rows, and every row against what its row group's footer
/// claims (`plan`; [`Claims::columns`] decoded too).
///
/// # Errors
/// When a column is missing or has an unexpected layout.
fn check(batch: &RowBatch<'_>, plan: &GroupPlan) -> Result<SummaryCheck, AnalyzeError> {
    let t = Columns::of(batch)?;
    let claims = Claims::of(batch, plan)?;
    let tasks = batch.rows.div_ceil(ROWS_PER_TASK);
    Ok((0..tasks)
        .into_par_iter()
        .map_init(Scratch::default, |scratch, task| {
            let rows = task * ROWS_PER_TASK..batch.rows.min((task + 1) * ROWS_PER_TASK);
            let mut out = SummaryCheck::default();
            for i in rows {
                if let Some(row) = check_row(&t, i, scratch, claims.broken(&t, i)) {
                    out.add(&row);
                }
            }
            out
        })
        .reduce(SummaryCheck::default, |mut a, b| {
            a.add(&b);
            a
        }))
}

/// Checks every v2 top-k part of a run; `None` for a v1 run (no summary).
/// Row groups are checked in parallel, each a batch of rows at a time with
/// every column of a batch decoded as a task of its own
/// ([`crate::load::RowGroupBatches`]), so one batch's lists per row group
/// being checked are in memory at once. With `memo`, a part checked before
/// and unchanged since takes its remembered result, and each part checked
/// now is remembered ([`super::check_memo`]).
///
/// # Errors
/// When a part cannot be read or a column is missing.
pub fn check_run(run: &Run, memo: Option<&Path>) -> Result<Option<SummaryCheck>, AnalyzeError> {
    if run.manifest.schema_version < 2 {
        return Ok(None);
    }
    let parts: Vec<&PartFile> = run
        .files
        .get(&shadowtrace_schemas::Table::Topk)
        .into_iter()
        .flatten()
        .collect();
    let keys: Vec<_> = parts
        .iter()
        .map(|part| memo.and_then(|_| check_memo::key(part)))
        .collect();
    let mut total = SummaryCheck::default();
    let mut unchecked = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        match memo
            .zip(key.as_ref())
            .and_then(|(dir, key)| check_memo::recall(dir, key))
        {
            Some(mut remembered) => {
                remembered.parts = 1;
                remembered.parts_remembered = 1;
                total.add(&remembered);
            }
            None => unchecked.push(i),
        }
    }
    let metadata = unchecked
        .par_iter()
        .map(|&i| parts[i].parquet_metadata())
        .collect::<Result<Vec<_>, _>>()?;
    let groups: Vec<(usize, _, usize)> = unchecked
        .iter()
        .zip(&metadata)
        .enumerate()
        .flat_map(|(slot, (_, m))| (0..m.num_row_groups()).map(move |g| (slot, m, g)))
        .collect();
    let per_group = groups
        .par_iter()
        .map(|(slot, metadata, index)| {
            let part = parts[unchecked[*slot]];
            let plan = GroupPlan::of(metadata, *index);
            let mut columns = COLUMNS.to_vec();
            columns.extend(Claims::columns(&plan));
            let mut batches = part.row_group_batches(metadata, *index, &columns)?;
            let mut sum = SummaryCheck::default();
            while let Some(batch) = batches.next_batch() {
                sum.add(&check(&batch?, &plan)?);
            }
            Ok((*slot, sum))
        })
        .collect::<Result<Vec<_>, AnalyzeError>>()?;
    let mut per_part = vec![
        SummaryCheck {
            parts: 1,
            ..SummaryCheck::default()
        };
        unchecked.len()
    ];
    for (slot, sum) in &per_group {
        per_part[*slot].add(sum);
    }
    for (slot, checked) in per_part.iter().enumerate() {
        if let (Some(dir), Some(key)) = (memo, keys[unchecked[slot]].as_ref()) {
            check_memo::remember(dir, key, checked);
        }
        total.add(checked);
    }
    Ok(Some(total))
}

/// The problem `inspect` reports for a run whose top-k summaries disagree
/// with their lists; `None` for a v1 run or when every row agrees.
///
/// # Errors
/// When a part cannot be read or a column is missing.
pub fn problem(run: &Run) -> Result<Option<RunProblem>, AnalyzeError> {
    Ok(check_run(run, None)?
        .filter(|c| c.rows_disagreeing > 0)
        .map(|c| RunProblem::SummaryDisagreement {
            manifest: run.dir.join(shadowtrace_schemas::MANIFEST_FILE),
            detail: c.text(),
        }))
}
