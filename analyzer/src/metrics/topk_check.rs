//! Whether a v2 `topk` row's summary agrees with its lists.
//!
//! ## What it checks
//! A v2 producer (the Rust writer, the Python hooks) stores per row both the
//! counts and the lists they come from. Where both exist:
//! - `shared`: prod_selected − len(prod_only) = shadow_selected − len(shadow_only) = shared;
//! - `jaccard` and `jaccard_no_churn`: equal to what the counts give, within
//!   [`JACCARD_TOLERANCE`] (the producer rounds to f32, and may divide in f32);
//! - `churn`: the four churn counts equal a recount within `boundary_band`
//!   from both paths' boundary candidates and the differences;
//! - `full_list`: a sampled full prod list holds prod_selected keys,
//!   ascending, and every prod-only key.
//!
//! ## Why it matters
//! The top-k metric reads only the counts ([`super::topk_v2`]). A producer
//! whose counts drift from its lists would change every verdict silently;
//! this check makes the drift a counted disagreement (`analyze`) and a
//! problem (`inspect`).

use rayon::prelude::*;
use serde::Serialize;
use shadowtrace_schemas::columns::topk as c;
use shadowtrace_schemas::selection::{
    BoundaryView, ChurnCounts, Counts, churn_from_boundaries, keys_from_gaps,
};

use crate::frame::{bool_list, i32s, list, opt_f32s, opt_i32s};
use crate::load::Run;
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

/// Rows checked and the disagreements found, by check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SummaryCheck {
    /// Rows with a shadow (the rows a summary describes).
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
}

impl SummaryCheck {
    fn add(&mut self, other: &SummaryCheck) {
        self.rows_checked += other.rows_checked;
        self.rows_disagreeing += other.rows_disagreeing;
        self.shared += other.shared;
        self.jaccard += other.jaccard;
        self.jaccard_no_churn += other.jaccard_no_churn;
        self.churn += other.churn;
        self.full_list += other.full_list;
    }

    /// One line for a person: `3 of 120 rows (shared 1, churn 2)`.
    #[must_use]
    pub fn text(&self) -> String {
        let kinds: Vec<String> = [
            ("shared", self.shared),
            ("jaccard", self.jaccard),
            ("jaccard_no_churn", self.jaccard_no_churn),
            ("churn", self.churn),
            ("full_list", self.full_list),
        ]
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!("{name} {n}"))
        .collect();
        format!(
            "{} of {} top-k rows' summaries disagree with their lists ({})",
            self.rows_disagreeing,
            self.rows_checked,
            kinds.join(", ")
        )
    }
}

fn count(v: i32) -> usize {
    usize::try_from(v).unwrap_or(0)
}

fn close(stored: Option<f32>, counted: f64) -> bool {
    stored.is_none_or(|s| (f64::from(s) - counted).abs() <= JACCARD_TOLERANCE)
}

/// Checks every row of a v2 `topk` frame ([`COLUMNS`]).
///
/// # Errors
/// When a column is missing or has an unexpected layout.
pub fn check(frame: &polars::prelude::DataFrame) -> Result<SummaryCheck, AnalyzeError> {
    let k = i32s(frame, c::K)?;
    let visible = i32s(frame, c::VISIBLE)?;
    let prod_selected = i32s(frame, c::PROD_SELECTED)?;
    let shadow_selected = opt_i32s(frame, c::SHADOW_SELECTED)?;
    let shared = opt_i32s(frame, c::SHARED)?;
    let band = opt_f32s(frame, c::BOUNDARY_BAND)?;
    let churn_columns = [
        opt_i32s(frame, c::CHURN_SHARED)?,
        opt_i32s(frame, c::CHURN_PROD_ONLY)?,
        opt_i32s(frame, c::CHURN_SHADOW_ONLY)?,
        opt_i32s(frame, c::CHURN_UNSELECTED)?,
    ];
    let jaccard = opt_f32s(frame, c::JACCARD)?;
    let jaccard_no_churn = opt_f32s(frame, c::JACCARD_NO_CHURN)?;
    let prod_only = list::<i32>(frame, c::PROD_ONLY_GAPS)?;
    let shadow_only = list::<i32>(frame, c::SHADOW_ONLY_GAPS)?;
    let boundary = [
        (
            list::<i32>(frame, c::PROD_BOUNDARY_GAPS)?,
            list::<f32>(frame, c::PROD_BOUNDARY_OFFSETS)?,
            bool_list(frame, c::PROD_BOUNDARY_SELECTED)?,
        ),
        (
            list::<i32>(frame, c::SHADOW_BOUNDARY_GAPS)?,
            list::<f32>(frame, c::SHADOW_BOUNDARY_OFFSETS)?,
            bool_list(frame, c::SHADOW_BOUNDARY_SELECTED)?,
        ),
    ];
    let prod_gaps = list::<i32>(frame, c::PROD_GAPS)?;

    let mut out = SummaryCheck::default();
    let mut selected = [Vec::new(), Vec::new()];
    for i in 0..frame.height() {
        let (Some(shadow_n), Some(shared_n)) = (shadow_selected[i], shared[i]) else {
            continue;
        };
        let mut row = SummaryCheck {
            rows_checked: 1,
            ..SummaryCheck::default()
        };
        let po = prod_only.get(i).map(keys_from_gaps);
        let so = shadow_only.get(i).map(keys_from_gaps);
        if let (Some(po), Some(so)) = (&po, &so) {
            let from_prod = i64::from(prod_selected[i]) - po.len() as i64;
            let from_shadow = i64::from(shadow_n) - so.len() as i64;
            row.shared =
                usize::from(from_prod != i64::from(shared_n) || from_shadow != i64::from(shared_n));
        }
        let recorded = (|| {
            let [a, b, c, d] = &churn_columns;
            Some(ChurnCounts {
                shared: count(a[i]?),
                prod_only: count(b[i]?),
                shadow_only: count(c[i]?),
                unselected: count(d[i]?),
            })
        })();
        let counts = Counts {
            prod_selected: count(prod_selected[i]),
            shadow_selected: count(shadow_n),
            shared: count(shared_n),
            churn: recorded.unwrap_or_default(),
        };
        row.jaccard = usize::from(!close(jaccard[i], counts.overlap().jaccard()));
        if recorded.is_some() {
            row.jaccard_no_churn = usize::from(!close(
                jaccard_no_churn[i],
                counts.overlap_no_churn().jaccard(),
            ));
        }
        let keys: Vec<Vec<i32>> = boundary
            .iter()
            .map(|(gaps, _, _)| gaps.get(i).map(keys_from_gaps).unwrap_or_default())
            .collect();
        let listed = boundary
            .iter()
            .zip(&mut selected)
            .all(|((gaps, offsets, flags), out)| {
                gaps.get(i).is_some() && offsets.get(i).is_some() && flags.fill(i, out)
            });
        if let (Some(band), Some(recorded), true, Some(po), Some(so)) =
            (band[i], recorded, listed, &po, &so)
            && visible[i] > k[i]
        {
            let view = |path: usize| BoundaryView {
                keys: &keys[path],
                offsets: boundary[path].1.get(i).unwrap_or(&[]),
                selected: &selected[path],
            };
            row.churn =
                usize::from(churn_from_boundaries(po, so, view(0), view(1), band) != recorded);
        }
        if let Some(full) = prod_gaps.get(i).map(keys_from_gaps) {
            let ascending = full.windows(2).all(|w| w[0] < w[1]);
            let holds_prod_only = po
                .as_ref()
                .is_none_or(|po| po.iter().all(|key| full.binary_search(key).is_ok()));
            row.full_list = usize::from(
                full.len() != count(prod_selected[i]) || !ascending || !holds_prod_only,
            );
        }
        row.rows_disagreeing = usize::from(
            row.shared + row.jaccard + row.jaccard_no_churn + row.churn + row.full_list > 0,
        );
        out.add(&row);
    }
    Ok(out)
}

/// Checks every v2 top-k part of a run; `None` for a v1 run (no summary).
///
/// # Errors
/// When a part cannot be read or a column is missing.
pub fn check_run(run: &Run) -> Result<Option<SummaryCheck>, AnalyzeError> {
    if run.manifest.schema_version < 2 {
        return Ok(None);
    }
    let parts: Vec<_> = run
        .files
        .get(&shadowtrace_schemas::Table::Topk)
        .into_iter()
        .flatten()
        .collect();
    // Parts in parallel: a v2 part's differences and candidates are small.
    let per_part: Vec<Result<SummaryCheck, AnalyzeError>> = parts
        .par_iter()
        .map(|part| {
            let mut frame = part.read(Some(&COLUMNS))?;
            let mut total = SummaryCheck::default();
            for chunk in frame.split_chunks() {
                total.add(&check(&chunk)?);
            }
            Ok(total)
        })
        .collect();
    let mut total = SummaryCheck::default();
    for part in per_part {
        total.add(&part?);
    }
    Ok(Some(total))
}

/// The problem `inspect` reports for a run whose top-k summaries disagree
/// with their lists; `None` for a v1 run or when every row agrees.
///
/// # Errors
/// When a part cannot be read or a column is missing.
pub fn problem(run: &Run) -> Result<Option<RunProblem>, AnalyzeError> {
    Ok(check_run(run)?.filter(|c| c.rows_disagreeing > 0).map(|c| {
        RunProblem::SummaryDisagreement {
            manifest: run.dir.join(shadowtrace_schemas::MANIFEST_FILE),
            detail: c.text(),
        }
    }))
}
