//! `shadowtrace suspects`: the clean production path and every deviation
//! (`crate::model::deviation`) run side by side on the same prompts, each
//! against the fp32 reference-convention shadow, and ranked against
//! observed production runs: which known cause reproduces what production
//! shows, and where it starts.
//!
//! - [`sweep`]: the paths in lockstep, one read of each layer's weights;
//! - [`profile`]: what is measured per path, prompt and layer (the
//!   analyzer's definitions, through the shared functions);
//! - [`rank`]: the distance to observed runs, and the ranking;
//! - [`report`]: terminal, Markdown and JSON; [`plot`]: Jaccard against
//!   prompt length;
//! - [`prompts`]: the demo's tool and no-tool prompts, or a user's files;
//! - [`demo`]: the demo's section: which deviations move top-k and logits,
//!   per model, and how the verdicts depend on the synthetic assumptions.

pub mod demo;
pub mod plot;
pub mod profile;
pub mod prompts;
pub mod rank;
pub mod report;
pub mod sweep;

use std::path::{Path, PathBuf};

use crate::TraceError;

/// The report's Markdown file name.
pub const REPORT_FILE: &str = "suspects.md";
/// The report's JSON file name.
pub const JSON_FILE: &str = "suspects.json";

/// Writes `suspects.md`, `suspects.json` and one plot per prompt kind
/// (`plots/topk_jaccard_vs_length_<kind>.svg`) into `dir`; returns the files.
///
/// # Errors
/// A file that cannot be written.
pub fn write_report(dir: &Path, report: &report::Report) -> Result<Vec<PathBuf>, TraceError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| TraceError::Io { path, source }
    };
    let plots_dir = dir.join("plots");
    std::fs::create_dir_all(&plots_dir).map_err(io(&plots_dir))?;
    let mut kinds: Vec<&str> = report.sweep.cells.iter().map(|c| c.kind.as_str()).collect();
    kinds.sort_unstable();
    kinds.dedup();
    let mut files = Vec::new();
    let mut plots = Vec::new();
    for kind in kinds {
        let name = format!(
            "plots/topk_jaccard_vs_length_{}.svg",
            kind.replace(|c: char| !c.is_ascii_alphanumeric() && c != '_', "-")
        );
        let path = dir.join(&name);
        std::fs::write(
            &path,
            plot::jaccard_vs_length(&report.sweep, kind, report.thresholds.topk),
        )
        .map_err(io(&path))?;
        files.push(path);
        plots.push(name);
    }
    let md = dir.join(REPORT_FILE);
    std::fs::write(&md, report::render_markdown(report, &plots)).map_err(io(&md))?;
    let json = dir.join(JSON_FILE);
    let text = serde_json::to_string_pretty(report).map_err(|source| TraceError::Manifest {
        path: json.clone(),
        source,
    })?;
    std::fs::write(&json, text).map_err(io(&json))?;
    files.push(md);
    files.push(json);
    Ok(files)
}
