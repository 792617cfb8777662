//! The analysis as a Markdown report.

use std::fmt::Write;

use super::terminal::layer_rows;
use super::{argmax_text, churn_unknown_text, comparison_table, grid_table, model_label, sci};
use crate::Analysis;
use crate::judged::{Question, cell, why_not_judged};

/// Renders the report; `plots` are paths relative to the report, embedded
/// in order.
#[must_use]
pub fn render_markdown(a: &Analysis, plots: &[String]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# shadowtrace report\n");
    let _ = writeln!(
        out,
        "{} run{} analysed, {} skipped.\n",
        a.runs.len(),
        if a.runs.len() == 1 { "" } else { "s" },
        a.skipped.len()
    );
    for s in &a.skipped {
        let _ = writeln!(out, "- skipped: `{s}`");
    }
    for w in &a.warnings {
        let _ = writeln!(out, "- warning: {w}");
    }
    let _ = writeln!(out, "## Rules\n");
    for line in a.rule_lines() {
        let _ = writeln!(out, "- {line}");
    }
    let _ = writeln!(
        out,
        "- non-finite onset: first NaN or Inf of prod in execution order, with the shadow's finiteness there\n"
    );

    let _ = writeln!(out, "## Grid by {}\n", a.grid.group_by.join(", "));
    for u in &a.grid.user_tags {
        let _ = writeln!(out, "- {}\n", u.line());
    }
    let (header, rows) = grid_table(&a.grid);
    table(&mut out, &header, &rows);
    if let Some((by, header, rows)) = comparison_table(&a.grid) {
        let _ = writeln!(out, "## Side by side by {by}\n");
        table(&mut out, &header, &rows);
    }
    if !a.determinism.is_empty() {
        let _ = writeln!(out, "## Determinism\n");
        let rows: Vec<Vec<String>> = a
            .determinism
            .iter()
            .map(|d| {
                vec![
                    d.a.clone(),
                    d.b.clone(),
                    d.agreement.positions.to_string(),
                    d.agreement.argmax_agreement.map_or_else(
                        || format!("none ({} non-finite)", d.agreement.nonfinite_positions),
                        |share| format!("{share:.4}"),
                    ),
                    sci(d.agreement.js_divergence.map(|s| s.max)),
                ]
            })
            .collect();
        table(
            &mut out,
            &[
                "run a",
                "run b",
                "positions",
                "argmax agreement",
                "max JS (bits)",
            ]
            .map(str::to_owned),
            &rows,
        );
    }
    if let Some(cache) = &a.cache {
        let _ = writeln!(out, "## Prefix-cache pairs\n");
        let _ = writeln!(
            out,
            "A cache hit against a miss of the same prompt, at the first generated position.\n"
        );
        let (header, rows) = super::cache::cache_table(cache);
        table(&mut out, &header, &rows);
        for note in super::cache::cache_notes(cache) {
            let _ = writeln!(out, "- {note}");
        }
        if !super::cache::cache_notes(cache).is_empty() {
            let _ = writeln!(out);
        }
    }
    if let Some(grafts) = &a.grafts {
        let _ = writeln!(out, "## Graft pairs\n");
        let _ = writeln!(out, "Rule: {}.\n", grafts.rule);
        for line in super::graft_lines(grafts) {
            let _ = writeln!(out, "- {line}");
        }
        let _ = writeln!(out);
    }
    if !plots.is_empty() {
        let _ = writeln!(out, "## Plots\n");
        for p in plots {
            let _ = writeln!(out, "![{p}]({p})\n");
        }
        let without: Vec<&str> = a
            .runs
            .iter()
            .filter(|r| !super::plot::has_heatmap(r))
            .map(|r| r.run_id.as_str())
            .collect();
        if !without.is_empty() {
            let _ = writeln!(
                out,
                "No overlap heatmap for {} run(s) without informative top-k rows \
                 (no query saw more than k keys): {}.\n",
                without.len(),
                without.join(", ")
            );
        }
    }
    let _ = writeln!(out, "## Runs\n");
    for run in &a.runs {
        let tag = |k: &str| run.tags.get(k).map_or("-", String::as_str);
        let _ = writeln!(
            out,
            "### {}\n\n{} on {}, {} prompt of {} tokens, {}.\n",
            run.run_id,
            model_label(run),
            tag("engine"),
            tag("prompt_kind"),
            tag("prompt_len"),
            if run.complete {
                "complete"
            } else {
                "**incomplete**"
            }
        );
        if let Some(outcome) = &run.outcome {
            let _ = match outcome {
                crate::outcome::Outcome::Malformed { .. } => {
                    writeln!(out, "- **{}**", outcome.line())
                }
                _ => writeln!(out, "- {}", outcome.line()),
            };
        }
        let (alarm, lines) = run.capture_lines();
        for line in lines {
            let _ = if alarm {
                writeln!(out, "- **{line}**")
            } else {
                writeln!(out, "- {line}")
            };
        }
        for m in &run.convention_mismatches {
            let _ = writeln!(
                out,
                "- **{}** (engine: {}; model: {})",
                m.line(),
                m.engine_source,
                m.model_source
            );
        }
        if let Some(why) = why_not_judged(&run.not_measured, Question::Convention) {
            let _ = writeln!(out, "- convention: not judged: {why}");
        }
        if !run.deviations.is_empty() {
            let _ = writeln!(
                out,
                "- deviations run on purpose: {}",
                run.deviations.join(", ")
            );
        }
        for line in super::sentinel_lines(&run.failed_sentinels) {
            let _ = writeln!(out, "- failed sentinel: {line}");
        }
        let onset = run.onset.as_ref().map_or_else(
            || "none".to_owned(),
            |o| {
                format!(
                    "step {}, layer {}, `{}`, token {}: {} (shadow {})",
                    o.step,
                    o.layer,
                    o.site,
                    o.token.map_or_else(|| "-".to_owned(), |t| t.to_string()),
                    o.kind,
                    match o.shadow_finite {
                        Some(true) => "finite",
                        Some(false) => "non-finite too",
                        None => "unknown",
                    }
                )
            },
        );
        let hidden = run.hidden_verdict.as_ref().map_or_else(
            || "none".to_owned(),
            |v| {
                format!(
                    "layer {} (p95 rel L2 err {:.4e} > {:.4e})",
                    v.layer, v.value, v.limit
                )
            },
        );
        let topk = run.topk_verdict.as_ref().map_or_else(
            || super::topk_none(run).to_owned(),
            |v| {
                format!(
                    "layer {} (mean Jaccard {:.4} < {:.4})",
                    v.layer, v.value, v.limit
                )
            },
        );
        let nm = &run.not_measured;
        let _ = writeln!(
            out,
            "- non-finite onset: {}",
            cell(nm, Question::Nonfinite, &onset)
        );
        for (label, text) in run.nan_provenance.iter().flat_map(super::provenance::lines) {
            let _ = writeln!(out, "- {label}: {text}");
        }
        let _ = writeln!(
            out,
            "- hidden divergence: {}",
            cell(nm, Question::Hidden, &hidden)
        );
        let _ = writeln!(
            out,
            "- top-k divergence: {}",
            cell(nm, Question::Topk, &topk)
        );
        if let Some(text) = churn_unknown_text(run) {
            let _ = writeln!(out, "- top-k {text}");
        }
        if let Some(l) = &run.logits {
            let found = format!("argmax agreement {}", argmax_text(l));
            let _ = writeln!(out, "- logits: {}", cell(nm, Question::Logits, &found));
        }
        for note in &run.notes {
            let _ = writeln!(out, "- note: {note}");
        }
        let _ = writeln!(out);
        table(
            &mut out,
            &super::layer_header(&a.thresholds),
            &layer_rows(run, &a.thresholds),
        );
    }
    out
}

fn table(out: &mut String, header: &[String], rows: &[Vec<String>]) {
    let _ = writeln!(out, "| {} |", header.join(" | "));
    let _ = writeln!(
        out,
        "|{}",
        header.iter().map(|_| " --- |").collect::<String>()
    );
    for row in rows {
        let _ = writeln!(
            out,
            "| {} |",
            row.iter()
                .map(|c| if c.is_empty() { " " } else { c.as_str() })
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    let _ = writeln!(out);
}
