//! The demo's suspects section: which deviations move the indexer's top-k
//! and the logits, for which model, and, on synthetic checkpoints, how each
//! verdict depends on their assumptions ([`SyntheticParams`]).
//!
//! The demo runs it on the trained checkpoints (`models/`), one sweep per
//! model. On synthetic weights, which decide how strongly a deviation shows,
//! a model is swept as drawn and again with each assumption switched (the
//! same seed, so every other weight is the same draw), and the verdicts are
//! set side by side; the assumptions are not tuned to make a story.
//!
//! A verdict is read against the clean production path, so it is what the
//! deviation itself changes (the clean FP8 path's own distance to the fp32
//! reference is in the full reports):
//!
//! - **moves top-k**: its lowest per-layer mean churn-free Jaccard against
//!   the clean path's selection is below the top-k threshold (the
//!   analyzer's 0.8 by default);
//! - **moves logits**: its argmax agreement with the clean path over the
//!   last tokens is below [`MOVES_LOGITS_ARGMAX`];
//! - **non-finite**: production holds a NaN or an infinity (layer, site).

use std::collections::BTreeSet;
use std::fmt::Write;

use shadowtrace_schemas::text_table::{Fit, table, wrap};

use super::report::{Report, SummaryRow, Thresholds, md_table};
use crate::model::synthetic::SyntheticParams;

/// Argmax agreement with the clean path below which a deviation moves the
/// logits: one position in ten whose greedy token changes.
pub const MOVES_LOGITS_ARGMAX: f64 = 0.9;

/// One setting of the synthetic assumptions.
#[derive(Debug, Clone, PartialEq)]
pub struct Variant {
    /// Its label in the report.
    pub label: String,
    /// The assumptions.
    pub params: SyntheticParams,
}

/// The checkpoint as the demo draws it, then each assumption switched:
///
/// - `indexer_scale 1`: the indexer's projections at transformers' default
///   initialisation (the demo's 8x spreads the scores as a trained
///   indexer's spread);
/// - `key outliers 4 x 16`: four of the indexer key's NoPE channels 16x the
///   others (the demo draws none), the case the Hadamard rotation before FP8
///   exists for. Four and 16 are an assumption, not a measurement of GLM-5.1
///   or DeepSeek-V3.2.
#[must_use]
pub fn variants() -> Vec<Variant> {
    let drawn = SyntheticParams::default();
    vec![
        Variant {
            label: "as drawn".to_owned(),
            params: drawn,
        },
        Variant {
            label: "indexer_scale 1".to_owned(),
            params: SyntheticParams {
                indexer_scale: 1.0,
                ..drawn
            },
        },
        Variant {
            label: "key outliers 4 x 16".to_owned(),
            params: SyntheticParams {
                k_outlier_dims: 4,
                k_outlier_gain: 16.0,
                ..drawn
            },
        },
    ]
}

/// One model's sweep under one variant.
#[derive(Debug, Clone)]
pub struct ModelSweep {
    /// The model's short name (`glm-5.1-shaped`).
    pub model: String,
    /// The variant's label.
    pub variant: String,
    /// The sweep's report.
    pub report: Report,
}

/// What one deviation does to one prompt, against the clean path.
fn verdict(row: &SummaryRow, t: Thresholds) -> String {
    let mut moved = Vec::new();
    if row.min_jaccard_vs_clean.is_some_and(|j| j < t.topk) {
        moved.push("top-k".to_owned());
    }
    if row.argmax_vs_clean.is_some_and(|a| a < MOVES_LOGITS_ARGMAX) {
        moved.push("logits".to_owned());
    }
    if let Some((layer, site, _)) = &row.onset {
        moved.push(format!("NaN L{layer} {site}"));
    }
    let word = if moved.is_empty() {
        "none".to_owned()
    } else {
        moved.join(" + ")
    };
    let num = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"));
    format!(
        "{word} (J {}, argmax {})",
        num(row.min_jaccard_vs_clean),
        num(row.argmax_vs_clean)
    )
}

/// The cell of `path` on prompt `kind` in `report`: its verdict, or `not
/// run` (why is said once, after the table: [`not_run_lines`]).
fn cell(report: &Report, path: &str, kind: &str) -> String {
    if report.sweep.not_run.iter().any(|n| n.path == path) {
        return "not run".to_owned();
    }
    report
        .summary
        .iter()
        .find(|r| r.path == path && r.kind == kind)
        .map_or_else(|| "-".to_owned(), |r| verdict(r, report.thresholds))
}

/// Every deviation path of `sweeps`, in the order the sweeps list them
/// (the clean path left out: it is what the verdicts are read against).
fn deviation_paths<'a>(sweeps: impl Iterator<Item = &'a ModelSweep>) -> Vec<String> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for s in sweeps {
        let paths = s.report.sweep.paths.iter();
        for p in paths.chain(s.report.sweep.not_run.iter().map(|n| &n.path)) {
            if p != "clean" && seen.insert(p.clone()) {
                out.push(p.clone());
            }
        }
    }
    out
}

/// The prompt kinds of `reports`, tool prompts first: they are the report's
/// case.
fn kinds<'a>(reports: impl Iterator<Item = &'a Report>) -> Vec<String> {
    let set: BTreeSet<&str> = reports
        .flat_map(|r| r.sweep.cells.iter().map(|c| c.kind.as_str()))
        .collect();
    let mut kinds: Vec<String> = set.into_iter().map(str::to_owned).collect();
    kinds.sort_by_key(|k| (k != "tool", k.clone()));
    kinds
}

fn longest(report: &Report) -> i64 {
    report
        .sweep
        .cells
        .iter()
        .map(|c| c.length)
        .max()
        .unwrap_or(0)
}

/// Which deviations move top-k and logits: a row per model and deviation,
/// a column per prompt kind at the longest length, as the demo draws the
/// models (the first variant of each model). Also the columns a narrow
/// terminal leaves out, in order: every prompt kind but the tool prompt,
/// the report's case.
fn moves_table(sweeps: &[ModelSweep]) -> (Vec<String>, Vec<Vec<String>>, Vec<String>) {
    let drawn: Vec<&ModelSweep> = first_variant(sweeps);
    let kinds = kinds(drawn.iter().map(|s| &s.report));
    let lengths: BTreeSet<i64> = drawn.iter().map(|s| longest(&s.report)).collect();
    let at = lengths
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("/");
    let mut header = vec!["model".to_owned(), "deviation".to_owned()];
    header.extend(kinds.iter().map(|kind| format!("{kind} @ {at}")));
    let drops = header[2..]
        .iter()
        .zip(&kinds)
        .filter(|(_, kind)| *kind != "tool")
        .map(|(h, _)| h.clone())
        .collect();
    let mut rows = Vec::new();
    for s in &drawn {
        for path in deviation_paths(std::iter::once(*s)) {
            let mut row = vec![s.model.clone(), path.clone()];
            row.extend(kinds.iter().map(|kind| cell(&s.report, &path, kind)));
            rows.push(row);
        }
    }
    (header, rows, drops)
}

/// Why each deviation the tables say `not run` was not: the model, the
/// deviation, and the reason, once per model.
fn not_run_lines(sweeps: &[ModelSweep]) -> Vec<String> {
    first_variant(sweeps)
        .iter()
        .flat_map(|s| {
            s.report
                .sweep
                .not_run
                .iter()
                .map(|n| format!("{} {}: {}", s.model, n.path, n.reason))
        })
        .collect()
}

fn first_variant(sweeps: &[ModelSweep]) -> Vec<&ModelSweep> {
    let mut seen = BTreeSet::new();
    sweeps
        .iter()
        .filter(|s| seen.insert(s.model.clone()))
        .collect()
}

/// Per model and deviation, the verdict under each variant, side by side,
/// on the tool prompt at the variants' common longest length.
fn assumptions_table(sweeps: &[ModelSweep]) -> (Vec<String>, Vec<Vec<String>>) {
    let mut variants: Vec<&str> = Vec::new();
    for s in sweeps {
        if !variants.contains(&s.variant.as_str()) {
            variants.push(&s.variant);
        }
    }
    let mut header = vec!["model".to_owned(), "deviation".to_owned()];
    header.extend(variants.iter().map(|v| (*v).to_owned()));
    let mut rows = Vec::new();
    for first in first_variant(sweeps) {
        let of_model: Vec<&ModelSweep> = sweeps.iter().filter(|s| s.model == first.model).collect();
        for path in deviation_paths(of_model.iter().copied()) {
            let mut row = vec![first.model.clone(), path.clone()];
            for v in &variants {
                row.push(
                    of_model
                        .iter()
                        .find(|s| s.variant == *v)
                        .map_or_else(|| "-".to_owned(), |s| cell(&s.report, &path, "tool")),
                );
            }
            rows.push(row);
        }
    }
    (header, rows)
}

fn rules(sweeps: &[ModelSweep]) -> Vec<String> {
    let t = sweeps
        .first()
        .map_or_else(Thresholds::default, |s| s.report.thresholds);
    vec![
        format!(
            "moves top-k: the lowest per-layer mean churn-free Jaccard against the clean path's selection (J) is below {}",
            t.topk
        ),
        format!(
            "moves logits: argmax agreement with the clean path over the last {} tokens is below {MOVES_LOGITS_ARGMAX}",
            super::sweep::LOGITS_TOKENS
        ),
        "NaN: production's first non-finite value (layer, site)".to_owned(),
        clean_path(sweeps),
    ]
}

/// What the clean path runs: the grid above it runs TensorRT-LLM's FP8
/// indexer, the sweeps their own base, which a reader must not take for the
/// grid's production.
fn clean_path(sweeps: &[ModelSweep]) -> String {
    let bases: BTreeSet<&str> = sweeps
        .iter()
        .map(|s| s.report.sweep.base.as_str())
        .collect();
    let base = bases.into_iter().collect::<Vec<_>>().join(", ");
    let base = if base.is_empty() { "none" } else { &base };
    let indexer = if base == "none" {
        "the indexer unquantized (`--fp8-indexer none`: q and k in bf16, scores in fp32, as transformers computes it)".to_owned()
    } else {
        format!("the `{base}` FP8 indexer")
    };
    let grid = if base == "trtllm" {
        "the grid's production above"
    } else {
        "not the grid's production above (the trtllm FP8 indexer)"
    };
    format!(
        "the clean path: FP8 block-scaled linears and {indexer}, {grid}; each deviation is the one departure from it"
    )
}

fn variant_lines(sweeps: &[ModelSweep]) -> Vec<String> {
    let mut seen = BTreeSet::new();
    sweeps
        .iter()
        .filter(|s| seen.insert(s.variant.clone()))
        .map(|s| {
            let p = s.report.synthetic_params.as_ref().map_or_else(
                || "no synthetic_params recorded".to_owned(),
                ToString::to_string,
            );
            format!("{}: {p}", s.variant)
        })
        .collect()
}

/// "trained" where no sweep's checkpoint records synthetic assumptions, else
/// "synthetic".
fn weights(sweeps: &[ModelSweep]) -> &'static str {
    if sweeps.iter().all(|s| s.report.synthetic_params.is_none()) {
        "trained"
    } else {
        "synthetic"
    }
}

/// More than one variant was swept: the assumptions table has something to
/// set side by side.
fn has_variants(sweeps: &[ModelSweep]) -> bool {
    sweeps.iter().any(|s| s.variant != sweeps[0].variant)
}

/// The section as Markdown, for the demo's report.
#[must_use]
pub fn render_markdown(sweeps: &[ModelSweep]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "## Suspects ({} weights)\n", weights(sweeps));
    let _ = writeln!(
        out,
        "Every deviation (`shadowtrace suspects --list`) run beside the clean production path on the demo's models; a verdict is what the deviation changes against the clean path.\n"
    );
    for rule in rules(sweeps) {
        let _ = writeln!(out, "- {rule}");
    }
    let _ = writeln!(out, "\n### Which deviations move top-k and logits\n");
    let (h, rows, _) = moves_table(sweeps);
    md_table(&mut out, &h, &rows);
    let not_run = not_run_lines(sweeps);
    if !not_run.is_empty() {
        let _ = writeln!(
            out,
            "Not run, because the mathematics says they change nothing there:\n"
        );
        for line in not_run {
            let _ = writeln!(out, "- {line}");
        }
        let _ = writeln!(out);
    }
    if !has_variants(sweeps) {
        return out;
    }
    let _ = writeln!(
        out,
        "### How the verdicts depend on the synthetic assumptions\n"
    );
    let _ = writeln!(
        out,
        "The tool prompt, each model swept again with one assumption of its synthetic checkpoint switched (`tracer/src/model/synthetic.rs`, `shadowtrace suspects checkpoint --help`):\n"
    );
    for line in variant_lines(sweeps) {
        let _ = writeln!(out, "- {line}");
    }
    let _ = writeln!(out);
    let (h, rows) = assumptions_table(sweeps);
    md_table(&mut out, &h, &rows);
    out
}

/// The section for the demo's terminal, its verdict table fitted to `fit`
/// columns where leaving out prompt kinds can make it (`None`: every
/// column, `shadowtrace demo --wide`).
#[must_use]
pub fn render_terminal(sweeps: &[ModelSweep], fit: Option<usize>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "suspects ({} weights): each deviation against the clean production path",
        weights(sweeps)
    );
    // The rules and notes wrap at the table's width; `--wide` prints them whole.
    for rule in rules(sweeps) {
        out.push_str(&wrap(&rule, fit, "  "));
    }
    let _ = writeln!(out);
    let (h, rows, drops) = moves_table(sweeps);
    let drops: Vec<&str> = drops.iter().map(String::as_str).collect();
    table(&mut out, &h, &rows, Fit::to(fit, &drops));
    for line in not_run_lines(sweeps) {
        out.push_str(&wrap(&format!("not run: {line}"), fit, "  "));
    }
    if !has_variants(sweeps) {
        return out;
    }
    let _ = writeln!(
        out,
        "\nhow the verdicts depend on the synthetic assumptions (tool prompt)"
    );
    for line in variant_lines(sweeps) {
        let _ = writeln!(out, "  {line}");
    }
    // Every variant is the point of this table: printed whole.
    let (h, rows) = assumptions_table(sweeps);
    table(&mut out, &h, &rows, Fit::none());
    out
}
