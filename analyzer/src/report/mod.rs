//! What an analysis becomes for people and tools: terminal tables, a
//! Markdown report with SVG plots, the metrics as Parquet (the notebooks'
//! input), and JSON.

mod markdown;
mod parquet;
mod svg;
mod terminal;

use std::path::{Path, PathBuf};

pub use markdown::render_markdown;
pub use terminal::render_terminal;

use crate::{Analysis, AnalyzeError};

/// Files a report directory holds, relative to it.
pub const REPORT_FILE: &str = "report.md";
/// Folder of the metrics Parquet files.
pub const METRICS_DIR: &str = "metrics";
/// Folder of the plots.
pub const PLOTS_DIR: &str = "plots";

/// Writes the report directory: `report.md`, `plots/*.svg` and
/// `metrics/*.parquet`. Returns the files written.
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
    let plots = svg::write_plots(&dir.join(PLOTS_DIR), analysis)?;
    let relative: Vec<String> = plots
        .iter()
        .filter_map(|p| {
            p.file_name()
                .map(|n| format!("{PLOTS_DIR}/{}", n.to_string_lossy()))
        })
        .collect();
    written.extend(plots);
    written.extend(parquet::write_metrics(&dir.join(METRICS_DIR), analysis)?);
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

/// A number for a table: fixed decimals, or `-` when absent.
pub(crate) fn num(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.decimals$}"))
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
