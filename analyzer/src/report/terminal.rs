//! The analysis as terminal tables.

use std::fmt::Write;

use super::{
    argmax_text, churn_unknown_text, comparison_table, grid_table, layer_header, marks,
    model_label, num, sci,
};
use crate::Analysis;
use crate::analysis::RunAnalysis;
use crate::judged::{Question, cell, why_not_judged};
use crate::verdict::{Thresholds, deciding_mode};

pub use shadowtrace_schemas::text_table::TABLE_COLUMNS;
use shadowtrace_schemas::text_table::{Fit, table, wrap};

/// The grid's columns a narrow table leaves out first, in order (the NaN
/// runs are among the verdicts too; the worst layers are in each run's
/// table).
const GRID_DROPS: [&str; 3] = ["NaN runs", " p95", "worst top-k layer"];

/// The layer table's columns a narrow table leaves out first, in order:
/// what the verdicts and the marks column already say, or what only a
/// close reading needs.
const LAYER_DROPS: [&str; 6] = [
    "shadow-only NaN",
    "cos min",
    "J p5",
    "dense",
    "unit",
    "NaN tok",
];

/// Renders an analysis for a terminal: thresholds, grid, comparison,
/// determinism, then each run with its verdicts and layer table; tables
/// fit [`TABLE_COLUMNS`] where leaving out columns can make them.
#[must_use]
pub fn render_terminal(a: &Analysis) -> String {
    render_terminal_at(a, Some(TABLE_COLUMNS))
}

/// [`render_terminal`] with tables fitted to `fit` columns, or every column
/// whatever the width (`None`: `analyze --wide`).
#[must_use]
pub fn render_terminal_at(a: &Analysis, fit: Option<usize>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "shadowtrace analyze: {} run{}, {} skipped",
        a.runs.len(),
        plural(a.runs.len()),
        a.skipped.len()
    );
    for s in &a.skipped {
        let _ = writeln!(out, "  skipped: {s}");
    }
    for w in &a.warnings {
        let _ = writeln!(out, "  warning: {w}");
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "rules");
    for line in a.rule_lines() {
        out.push_str(&wrap(&line, fit, "  "));
    }
    let _ = writeln!(out);
    grid_section(&mut out, a, fit);
    if !a.determinism.is_empty() {
        let _ = writeln!(
            out,
            "determinism (prod against prod, same model, engine and prompt)"
        );
        for d in &a.determinism {
            let js = d.agreement.js_divergence.map(|s| s.max);
            let _ = writeln!(
                out,
                "  {} vs {}: argmax agreement {}, max JS {} bits",
                d.a,
                d.b,
                argmax_text(&d.agreement),
                sci(js)
            );
        }
        let _ = writeln!(out);
    }
    if let Some(cache) = &a.cache {
        let _ = writeln!(
            out,
            "prefix-cache pairs (a hit against a miss of the same prompt, at the first generated position)"
        );
        let (header, rows) = super::cache::cache_table(cache);
        table(&mut out, &header, &rows, Fit::none());
        for note in super::cache::cache_notes(cache) {
            let _ = writeln!(out, "  note: {note}");
        }
        let _ = writeln!(out);
    }
    if let Some(grafts) = &a.grafts {
        let _ = writeln!(
            out,
            "graft pairs (a graft run against its ungrafted base run of the same prompt)"
        );
        for line in super::graft_lines(grafts) {
            let _ = writeln!(out, "  {line}");
        }
        let _ = writeln!(out);
    }
    for run in &a.runs {
        run_section(&mut out, run, &a.thresholds, fit);
    }
    out
}

/// One line per run (`analyze --summary`): its status and verdicts
/// ([`crate::verdict::RunVerdict::line`]), then each prefix-cache pair that
/// parted, and each run skipped.
#[must_use]
pub fn render_summary(a: &Analysis) -> String {
    let mut out = String::new();
    for run in &a.verdict.runs {
        let _ = writeln!(out, "{}", run.line());
    }
    if let Some(pairs) = a.verdict.kinds.get("cache") {
        for p in pairs {
            let _ = writeln!(out, "{p} FAIL");
        }
    }
    for s in &a.skipped {
        let _ = writeln!(out, "NOT JUDGED (skipped: {s})");
    }
    out
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn grid_section(out: &mut String, a: &Analysis, fit: Option<usize>) {
    let _ = writeln!(out, "grid by {}", a.grid.group_by.join(", "));
    for u in &a.grid.user_tags {
        let _ = writeln!(out, "  {}", u.line());
    }
    let (header, rows) = grid_table(&a.grid);
    table(out, &header, &rows, Fit::to(fit, &GRID_DROPS));
    let _ = writeln!(out);
    if let Some((by, header, rows)) = comparison_table(&a.grid) {
        let _ = writeln!(
            out,
            "side by side by {by} (mean churn-free Jaccard; verdicts{})",
            if a.grid.has_outcomes() {
                "; the users' outcomes"
            } else {
                ""
            }
        );
        table(out, &header, &rows, Fit::none());
        let _ = writeln!(out);
    }
}

fn run_section(out: &mut String, run: &RunAnalysis, t: &Thresholds, fit: Option<usize>) {
    let tag = |k: &str| run.tags.get(k).map_or("-", String::as_str);
    let status = if run.complete {
        "complete"
    } else {
        "INCOMPLETE"
    };
    let _ = writeln!(
        out,
        "run {}: {} on {}, {} prompt of {} tokens, {status}",
        run.run_id,
        model_label(run),
        tag("engine"),
        tag("prompt_kind"),
        tag("prompt_len")
    );
    if let Some(r) = &run.ranks {
        let ranks: Vec<String> = r.ranks.iter().map(ToString::to_string).collect();
        let _ = writeln!(
            out,
            "  ranks {} read as one run: {} (max per-layer |dJ| {:.4}, max |d hidden p95| {:.2e})",
            ranks.join(", "),
            if r.same_verdicts {
                "same verdicts on every rank"
            } else {
                "RANKS DISAGREE on verdicts or onset"
            },
            r.max_jaccard_diff,
            r.max_hidden_p95_diff
        );
        for u in &r.uneven_layers {
            let ranks: Vec<String> = u.ranks.iter().map(ToString::to_string).collect();
            let _ = writeln!(
                out,
                "  layer {} recorded on rank{} {} only",
                u.layer,
                if u.ranks.len() == 1 { "" } else { "s" },
                ranks.join(", ")
            );
        }
    }
    // The user's judgement of the answer, beside the numerics that follow.
    if let Some(outcome) = &run.outcome {
        let _ = writeln!(out, "  {}", outcome.line());
    }
    // A capture the adapter misread makes every top-k metric below meaningless: first of all.
    for line in run.capture_lines().1 {
        let _ = writeln!(out, "  {line}");
    }
    // A convention the engine got wrong explains every metric below: it comes next.
    for m in &run.convention_mismatches {
        let _ = writeln!(out, "  {}", m.line());
    }
    if let Some(why) = why_not_judged(&run.not_measured, Question::Convention) {
        let _ = writeln!(out, "  convention:        not judged: {why}");
    }
    if !run.deviations.is_empty() {
        let _ = writeln!(
            out,
            "  deviations run on purpose: {}",
            run.deviations.join(", ")
        );
    }
    for (k, v) in run.counters.iter().filter(|(_, v)| **v > 0) {
        let _ = writeln!(out, "  counted: {k} = {v}");
    }
    for note in &run.notes {
        out.push_str(&wrap(&format!("note: {note}"), fit, "  "));
    }
    let onset = match &run.onset {
        Some(o) => format!(
            "step {}, layer {}, {}, token {}: {} (shadow {})",
            o.step,
            o.layer,
            o.site,
            o.token.map_or_else(|| "-".to_owned(), |t| t.to_string()),
            o.kind,
            match o.shadow_finite {
                Some(true) => "finite there",
                Some(false) => "non-finite there too",
                None => "unknown",
            }
        ),
        None => "none".to_owned(),
    };
    // A failed sentinel (a poisoned KV slot) explains the onset it causes: it comes first.
    for line in super::sentinel_lines(&run.failed_sentinels) {
        let _ = writeln!(out, "  failed sentinel:   {line}");
    }
    let _ = writeln!(
        out,
        "  non-finite onset:  {}",
        cell(&run.not_measured, Question::Nonfinite, &onset)
    );
    for (label, text) in run.nan_provenance.iter().flat_map(super::provenance::lines) {
        out.push_str(&wrap(
            &format!("{:<19}{text}", format!("{label}: ")),
            fit,
            "  ",
        ));
    }
    if let Some(worst) = run
        .topk_dequant
        .iter()
        .filter_map(|l| l.jaccard_no_churn.as_ref().map(|j| (l.layer, j.mean)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
    {
        let _ = writeln!(
            out,
            "  top-k vs dequantized FP8 operands (kernel error alone): worst layer {} mean J no churn {:.4}",
            worst.0, worst.1
        );
    }
    let hidden = run.hidden_verdict.as_ref().map_or_else(
        || "none".to_owned(),
        |v| {
            format!(
                "layer {}: p95 rel L2 err {:.3e} > {:.3e}",
                v.layer, v.value, v.limit
            )
        },
    );
    let _ = writeln!(
        out,
        "  hidden divergence: {}",
        cell(&run.not_measured, Question::Hidden, &hidden)
    );
    let topk = run.topk_verdict.as_ref().map_or_else(
        || super::topk_none(run).to_owned(),
        |v| {
            format!(
                "layer {}: mean Jaccard {:.4} < {:.4}",
                v.layer, v.value, v.limit
            )
        },
    );
    let _ = writeln!(
        out,
        "  top-k divergence:  {}{}",
        cell(&run.not_measured, Question::Topk, &topk),
        churn_unknown_text(run)
            .map(|t| format!("; {t}"))
            .unwrap_or_default()
    );
    if let Some(l) = &run.logits {
        let detail = if l.argmax_agreement.is_none() {
            String::new()
        } else {
            format!(
                ", JS mean {} max {} bits{}",
                sci(l.js_divergence.map(|s| s.mean)),
                sci(l.js_divergence.map(|s| s.max)),
                if l.nonfinite_positions > 0 {
                    format!(" ({} non-finite positions left out)", l.nonfinite_positions)
                } else {
                    String::new()
                }
            )
        };
        let found = format!("argmax agreement {}{detail}", argmax_text(l));
        let _ = writeln!(
            out,
            "  logits:            {}",
            cell(&run.not_measured, Question::Logits, &found)
        );
    }
    table(
        out,
        &layer_header(t),
        &layer_rows(run, t),
        Fit::to(fit, &LAYER_DROPS),
    );
    let _ = writeln!(out);
}

/// The per-run layer table: layer | top-k overlap | hidden-state error |
/// non-finite | verdict marks.
pub(crate) fn layer_rows(run: &RunAnalysis, th: &Thresholds) -> Vec<Vec<String>> {
    let mode = deciding_mode(&run.hidden, th);
    let mut layers: Vec<i32> = run
        .topk
        .iter()
        .map(|l| l.layer)
        .chain(run.hidden.iter().map(|h| h.layer))
        .collect();
    layers.sort_unstable();
    layers.dedup();
    layers
        .iter()
        .map(|&layer| {
            let t = run.topk.iter().find(|l| l.layer == layer);
            let h = run
                .hidden
                .iter()
                .find(|s| s.layer == layer && s.site == th.hidden_site && s.shadow_mode == mode);
            let worst = |count: fn(&crate::metrics::hidden_error::SiteError) -> usize| {
                run.hidden
                    .iter()
                    .filter(|s| s.layer == layer)
                    .map(count)
                    .max()
                    .unwrap_or(0)
            };
            let nonfinite = worst(|s| s.nonfinite_tokens);
            let shadow_nonfinite = worst(|s| s.shadow_nonfinite_tokens);
            let onset = run
                .onset
                .as_ref()
                .filter(|o| o.layer == layer)
                .map(|o| o.layer);
            let hv: Vec<i32> = run
                .hidden_verdict
                .iter()
                .filter(|v| v.layer == layer)
                .map(|v| v.layer)
                .collect();
            let kv: Vec<i32> = run
                .topk_verdict
                .iter()
                .filter(|v| v.layer == layer)
                .map(|v| v.layer)
                .collect();
            vec![
                layer.to_string(),
                num(t.and_then(|t| t.jaccard.map(|s| s.mean)), 4),
                num(t.and_then(|t| t.jaccard_no_churn.map(|s| s.mean)), 4),
                num(t.and_then(|t| t.jaccard_no_churn.map(|s| s.p5)), 4),
                t.map_or_else(|| "-".to_owned(), |t| t.informative_rows.to_string()),
                t.map_or_else(|| "-".to_owned(), |t| t.dense_rows.to_string()),
                t.and_then(|t| t.unit.as_ref())
                    .map_or_else(|| "-".to_owned(), ToString::to_string),
                sci(h.and_then(|h| h.rel_l2_err.map(|s| s.p95))),
                num(h.and_then(|h| h.cosine.map(|s| s.min)), 6),
                nonfinite.to_string(),
                shadow_nonfinite.to_string(),
                if onset.is_none() && hv.is_empty() && kv.is_empty() {
                    String::new()
                } else {
                    marks(onset, &hv, &kv)
                },
            ]
        })
        .collect()
}
