//! What an analysis becomes for people and tools: terminal tables, a
//! Markdown report with plots (SVG line charts, PNG heatmaps), the metrics
//! as Parquet (the notebooks' input), and JSON.

mod cache;
mod markdown;
mod parquet;
mod plot;
mod provenance;
mod terminal;

use std::path::{Path, PathBuf};

pub use markdown::render_markdown;
pub use plot::{HIDDEN_CHART, NO_ROWS, TOPK_CHART, heatmap_file, sizes_line};
pub use terminal::{TABLE_COLUMNS, render_summary, render_terminal, render_terminal_at};

use crate::analysis::RunAnalysis;
use crate::grid::{Grid, GroupRow};
use crate::metrics::logits::Agreement;
use crate::verdict::Thresholds;
use crate::{Analysis, AnalyzeError};

/// Files a report directory holds, relative to it.
pub const REPORT_FILE: &str = "report.md";
/// The whole analysis as JSON (what `--format json` prints).
pub const ANALYSIS_FILE: &str = "analysis.json";
/// Folder of the metrics Parquet files.
pub const METRICS_DIR: &str = "metrics";
/// Folder of the plots.
pub const PLOTS_DIR: &str = "plots";

/// Writes the report directory: `report.md`, `analysis.json`,
/// `plots/*.svg` (line charts by layer), `plots/*.png` (a heatmap per run)
/// and `metrics/*.parquet`. Returns the files written.
///
/// # Errors
/// When a file cannot be written.
pub fn write_report(dir: &Path, analysis: &Analysis) -> Result<Vec<PathBuf>, AnalyzeError> {
    let mkdir = |p: &Path| {
        std::fs::create_dir_all(p).map_err(|e| AnalyzeError::Write {
            path: p.to_owned(),
            detail: e.to_string(),
        })
    };
    mkdir(&dir.join(PLOTS_DIR))?;
    mkdir(&dir.join(METRICS_DIR))?;
    let mut written = Vec::new();
    let plots = plot::write_plots(&dir.join(PLOTS_DIR), analysis)?;
    let relative: Vec<String> = plots
        .iter()
        .filter_map(|p| {
            p.file_name()
                .map(|n| format!("{PLOTS_DIR}/{}", n.to_string_lossy()))
        })
        .collect();
    written.extend(plots);
    written.extend(parquet::write_metrics(&dir.join(METRICS_DIR), analysis)?);
    let json = dir.join(ANALYSIS_FILE);
    let text = serde_json::to_string_pretty(analysis).map_err(|e| AnalyzeError::Write {
        path: json.clone(),
        detail: e.to_string(),
    })?;
    std::fs::write(&json, text + "\n").map_err(|e| AnalyzeError::Write {
        path: json.clone(),
        detail: e.to_string(),
    })?;
    written.push(json);
    let report = dir.join(REPORT_FILE);
    std::fs::write(&report, render_markdown(analysis, &relative)).map_err(|e| {
        AnalyzeError::Write {
            path: report.clone(),
            detail: e.to_string(),
        }
    })?;
    written.push(report);
    Ok(written)
}

/// A run's model as its header names it: the `model` tag, and the
/// manifest's model name beside it where a user tag displaced it.
pub(crate) fn model_label(run: &RunAnalysis) -> String {
    let model = run.tags.get("model").map_or("-", String::as_str);
    match run
        .tags
        .get(&format!("{}model", crate::analysis::MANIFEST_TAG_PREFIX))
    {
        Some(manifest) => format!("{model} (user tag; manifest model {manifest})"),
        None => model.to_owned(),
    }
}

/// Argmax agreement as the reports say it: the share and over how many
/// positions, or why there is none.
pub(crate) fn argmax_text(a: &Agreement) -> String {
    match a.argmax_agreement {
        Some(share) => format!("{share:.4} over {} positions", a.positions),
        None => format!("none: all {} positions non-finite", a.nonfinite_positions),
    }
}

/// Beside a run's top-k verdict: how many of its informative rows had no
/// boundary lists, so that no churn could be removed there; `None` when
/// every row's churn was computed.
pub(crate) fn churn_unknown_text(run: &RunAnalysis) -> Option<String> {
    let unknown: usize = run.topk.iter().map(|l| l.churn_unknown_rows).sum();
    let rows: usize = run.topk.iter().map(|l| l.informative_rows).sum();
    (unknown > 0).then(|| {
        format!(
            "churn unknown on {unknown} of {rows} rows (no boundary lists): every difference there counts"
        )
    })
}

/// What a run's top-k line says where no layer diverged: `none` only where
/// informative rows were measured; otherwise `n/a` and why, so that a run
/// whose rows were all dense (no row saw more than k keys, every key
/// selected on both paths) never reads as a pass.
pub(crate) fn topk_none(run: &RunAnalysis) -> &'static str {
    let sum = |f: fn(&crate::metrics::topk_overlap::LayerOverlap) -> usize| -> usize {
        run.topk.iter().map(f).sum()
    };
    if sum(|l| l.informative_rows) > 0 {
        "none"
    } else if sum(|l| l.dense_rows) > 0 {
        "n/a (dense: no row saw more than k keys)"
    } else if sum(|l| l.rows_without_shadow) > 0 {
        "n/a (no top-k row has a shadow selection)"
    } else {
        "n/a (no top-k rows recorded)"
    }
}

/// A number for a table: fixed decimals, or `-` when absent.
pub(crate) fn num(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.decimals$}"))
}

/// The graft pairs as lines: one per pair, its notes, then the graft runs
/// left unpaired.
pub(crate) fn graft_lines(g: &crate::graft_pair::GraftPairs) -> Vec<String> {
    let mut out = Vec::new();
    for p in &g.pairs {
        out.push(p.line());
        out.extend(p.notes.iter().map(|n| format!("note: {n}")));
    }
    out.extend(g.unpaired.iter().map(|u| format!("unpaired graft run {u}")));
    out
}

/// A small number in scientific notation, or `-`.
pub(crate) fn sci(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.2e}"))
}

/// The verdict marks of a group or run: `NaN@L3 hidden@L5 topk@L4`, or `-`.
pub(crate) fn marks(nonfinite: Option<i32>, hidden: &[i32], topk: &[i32]) -> String {
    let mut out: Vec<String> = Vec::new();
    if let Some(l) = nonfinite {
        out.push(format!("NaN@L{l}"));
    }
    out.extend(hidden.iter().map(|l| format!("hidden@L{l}")));
    out.extend(topk.iter().map(|l| format!("topk@L{l}")));
    if out.is_empty() {
        "-".to_owned()
    } else {
        out.join(" ")
    }
}

/// A group's verdict marks, every kind `--fail-on` knows, then how many of
/// its runs have a verdict not judged: `convention x6 NaN@L2 topk@L4
/// not-judged x1`, or `-`. A reader who scans only the grid must not take a
/// run for clean.
fn group_marks(g: &GroupRow) -> String {
    let mut out: Vec<String> = Vec::new();
    for (n, kind) in [
        (g.capture_runs, "capture-inconsistent"),
        (g.convention_runs, "convention"),
        (g.sentinel_runs, "sentinel"),
    ] {
        if n > 0 {
            out.push(format!("{kind} x{n}"));
        }
    }
    out.extend(g.nonfinite_layers.iter().map(|l| format!("NaN@L{l}")));
    let found = marks(None, &g.hidden_verdicts, &g.topk_verdicts);
    if found != "-" {
        out.push(found);
    }
    if g.not_judged_runs > 0 {
        out.push(format!("not-judged x{}", g.not_judged_runs));
    }
    if out.is_empty() {
        "-".to_owned()
    } else {
        out.join(" ")
    }
}

/// Header of the per-run layer table.
/// `rows` and `dense` count query rows; `unit` is what their keys are (and so
/// what k and the Jaccard count): `token`, or pool or compressed entries of
/// so many tokens. `NaN tok` counts tokens whose prod vector is non-finite at any site of
/// the layer (the largest count over its sites), `shadow-only NaN` those whose
/// shadow alone is.
pub(crate) const LAYER_COLUMNS: [&str; 12] = [
    "layer",
    "J",
    "J no churn",
    "J p5",
    "rows",
    "dense",
    "unit",
    "hidden p95",
    "cos min",
    "NaN tok",
    "shadow-only NaN",
    "marks",
];

/// The layer table's header, its hidden-state columns named after the site
/// and shadow mode the hidden verdict reads (`--hidden-site`,
/// `--shadow-mode`), so the table and the verdict above it agree.
pub(crate) fn layer_header(t: &Thresholds) -> Vec<String> {
    LAYER_COLUMNS
        .map(|c| match c {
            "hidden p95" => format!("{} p95", t.hidden_site),
            other => other.to_owned(),
        })
        .to_vec()
}

/// The grid table: header, then one row per group.
pub(crate) fn grid_table(grid: &Grid) -> (Vec<String>, Vec<Vec<String>>) {
    let mut header = grid.group_by.clone();
    header.extend([
        "runs".to_owned(),
        "J no churn".to_owned(),
        "worst top-k layer".to_owned(),
        format!("worst {} p95", grid.hidden_site),
        "NaN runs".to_owned(),
        "verdicts".to_owned(),
    ]);
    // The user's outcomes, where any run records one ([`crate::outcome`]).
    let outcomes = grid.has_outcomes();
    if outcomes {
        header.push("outcome".to_owned());
    }
    let rows = grid
        .groups
        .iter()
        .map(|g| {
            let mut row = g.key.clone();
            row.extend([
                g.runs.to_string(),
                num(g.jaccard_no_churn, 4),
                g.worst_topk_layer
                    .map_or_else(|| "-".to_owned(), |(l, j)| format!("L{l} {j:.4}")),
                g.worst_hidden_layer
                    .map_or_else(|| "-".to_owned(), |(l, e)| format!("L{l} {e:.2e}")),
                g.nonfinite_runs.to_string(),
                group_marks(g),
            ]);
            if outcomes {
                row.push(g.outcomes.cell());
            }
            row
        })
        .collect();
    (header, rows)
}

/// The side-by-side table along the grid's first tag, if it has two or
/// more values: title, header, rows.
pub(crate) fn comparison_table(grid: &Grid) -> Option<(String, Vec<String>, Vec<Vec<String>>)> {
    let c = grid.comparison();
    if c.columns.len() < 2 {
        return None;
    }
    let outcomes = grid.has_outcomes();
    let mut header = c.rest.clone();
    header.extend(c.columns.iter().cloned());
    // The NaN onsets are among the marks.
    let cell = |g: &GroupRow| {
        let outcome = if outcomes {
            format!(", outcome {}", g.outcomes.cell())
        } else {
            String::new()
        };
        format!("{} {}{outcome}", num(g.jaccard_no_churn, 4), group_marks(g))
    };
    let rows = c
        .rows
        .iter()
        .map(|(label, cells)| {
            let mut row = label.clone();
            row.extend(
                cells
                    .iter()
                    .map(|g| g.as_ref().map_or_else(|| "-".to_owned(), cell)),
            );
            row
        })
        .collect();
    Some((c.by, header, rows))
}

/// Failed sentinel checks as report lines, in execution order: the first
/// [`SENTINEL_LINES`] in full, then how many more (a poisoned slot fails the
/// same check in every later layer and step).
pub(crate) fn sentinel_lines(failed: &[crate::metrics::nonfinite::FailedSentinel]) -> Vec<String> {
    let mut lines: Vec<String> = failed
        .iter()
        .take(SENTINEL_LINES)
        .map(|s| {
            format!(
                "{} at step {}, layer {}{}",
                s.check,
                s.step,
                s.layer,
                s.detail
                    .as_ref()
                    .map(|d| format!(" ({d})"))
                    .unwrap_or_default()
            )
        })
        .collect();
    if failed.len() > SENTINEL_LINES {
        lines.push(format!(
            "and {} more failed checks",
            failed.len() - SENTINEL_LINES
        ));
    }
    lines
}

/// Failed sentinel checks a report lists in full.
pub(crate) const SENTINEL_LINES: usize = 3;
