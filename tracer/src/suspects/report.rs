//! The sweep as people read it (terminal and Markdown) and as scripts read
//! it (JSON): per path and prompt kind, the first-divergence layer, the
//! shortest length at which top-k Jaccard falls below the threshold, and the
//! effect on logits; every threshold printed beside its verdict.

use std::collections::BTreeSet;
use std::fmt::Write;

use serde::Serialize;
use shadowtrace_schemas::text_table::{Fit, table, wrap};

use super::profile::Cell;
use super::rank::Ranking;
use super::sweep::Sweep;
use crate::model::deviation::{Deviation, DeviationKind};

/// The thresholds of the sweep's verdicts: the analyzer's defaults unless
/// the user asks for others.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Thresholds {
    /// p95 relative L2 error of `layer_out` above which a layer has diverged.
    pub hidden: f64,
    /// Mean churn-free Jaccard below which a layer's selection has diverged.
    pub topk: f64,
}

impl Default for Thresholds {
    fn default() -> Thresholds {
        // shadowtrace analyze's defaults (analyzer/src/verdict.rs).
        Thresholds {
            hidden: 0.1,
            topk: 0.8,
        }
    }
}

/// Everything the report says, as JSON writes it.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The model's name.
    pub model: String,
    /// The synthetic checkpoint's assumptions, when it is one.
    pub synthetic_params: Option<serde_json::Value>,
    /// The thresholds.
    pub thresholds: Thresholds,
    /// The rules, as printed.
    pub rules: Vec<String>,
    /// The sweep.
    pub sweep: Sweep,
    /// Per path and prompt kind.
    pub summary: Vec<SummaryRow>,
    /// The ranking against observed runs, if any.
    pub ranking: Option<Ranking>,
}

/// One path on one prompt kind, over the lengths swept.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SummaryRow {
    /// Path.
    pub path: String,
    /// Prompt kind.
    pub kind: String,
    /// The earliest first-divergence layer over the lengths, and the
    /// shortest length showing it.
    pub first_divergence: Option<(i64, i64)>,
    /// The shortest length at which a layer's mean churn-free Jaccard falls
    /// below the threshold.
    pub shortest_topk_length: Option<i64>,
    /// At the longest length: the lowest layer mean Jaccard.
    pub min_jaccard: Option<f64>,
    /// At the longest length: the lowest layer mean Jaccard against the
    /// clean path.
    pub min_jaccard_vs_clean: Option<f64>,
    /// At the longest length: argmax agreement with the reference chain.
    pub argmax: Option<f64>,
    /// At the longest length: mean JS divergence from the reference chain (bits).
    pub js_mean: Option<f64>,
    /// At the longest length: argmax agreement with the clean path.
    pub argmax_vs_clean: Option<f64>,
    /// The first non-finite value: (layer, site, length) at the shortest
    /// length holding one.
    pub onset: Option<(i64, String, i64)>,
}

impl Report {
    /// The report of a sweep.
    #[must_use]
    pub fn new(
        model: &str,
        synthetic_params: Option<serde_json::Value>,
        thresholds: Thresholds,
        sweep: Sweep,
        ranking: Option<Ranking>,
    ) -> Report {
        let rules = vec![
            format!(
                "hidden divergence: first layer whose p95 relative L2 error of layer_out against the fp32 reference chain exceeds {}",
                thresholds.hidden
            ),
            format!(
                "top-k divergence: first layer whose mean Jaccard against the fp32 indexer on the same layer input (churn within {:e} of each row's score scale, the mean |score| of the reference's top-k, of the k-th score excluded; rows with at most {} visible keys left out) falls below {}",
                sweep.band, sweep.index_topk, thresholds.topk
            ),
            "first divergence: the earliest of the non-finite onset, the hidden and the top-k divergence".to_owned(),
            format!(
                "logits: argmax agreement and Jensen-Shannon divergence (bits) over the top-20 of the last {} tokens",
                super::sweep::LOGITS_TOKENS
            ),
        ];
        let summary = summarise(&sweep, thresholds);
        Report {
            model: model.to_owned(),
            synthetic_params,
            thresholds,
            rules,
            sweep,
            summary,
            ranking,
        }
    }
}

fn summarise(sweep: &Sweep, t: Thresholds) -> Vec<SummaryRow> {
    let kinds: BTreeSet<&str> = sweep.cells.iter().map(|c| c.kind.as_str()).collect();
    let mut rows = Vec::new();
    for path in &sweep.paths {
        for kind in &kinds {
            let mut cells: Vec<&Cell> = sweep
                .cells
                .iter()
                .filter(|c| &c.path == path && c.kind == *kind)
                .collect();
            cells.sort_by_key(|c| c.length);
            let Some(longest) = cells.last() else {
                continue;
            };
            let first_divergence = cells
                .iter()
                .filter_map(|c| c.first_divergence(t.hidden, t.topk).map(|l| (l, c.length)))
                .min();
            let min_vs_clean = longest
                .layers
                .iter()
                .filter_map(|l| l.topk_jaccard_vs_clean)
                .min_by(f64::total_cmp);
            rows.push(SummaryRow {
                path: path.clone(),
                kind: (*kind).to_owned(),
                first_divergence,
                shortest_topk_length: cells
                    .iter()
                    .find(|c| c.topk_divergence(t.topk).is_some())
                    .map(|c| c.length),
                min_jaccard: longest.min_topk_jaccard(),
                min_jaccard_vs_clean: min_vs_clean,
                argmax: longest.logits.as_ref().and_then(|a| a.argmax_agreement),
                js_mean: longest
                    .logits
                    .as_ref()
                    .and_then(|a| a.js_divergence.map(|s| s.mean)),
                argmax_vs_clean: longest
                    .logits_vs_clean
                    .as_ref()
                    .and_then(|a| a.argmax_agreement),
                onset: cells.iter().find_map(|c| {
                    c.onset
                        .as_ref()
                        .map(|o| (o.layer, o.site.clone(), c.length))
                }),
            });
        }
    }
    rows
}

fn num(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

fn sci(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.2e}"))
}

fn tokens(n: i64) -> String {
    if n % 1024 == 0 {
        format!("{}k", n / 1024)
    } else {
        n.to_string()
    }
}

/// The summary table: header and rows.
fn summary_table(r: &Report) -> (Vec<String>, Vec<Vec<String>>) {
    let header = [
        "path",
        "prompt",
        "first divergence",
        "J < threshold from",
        "min J",
        "min J vs clean",
        "argmax",
        "JS mean",
        "argmax vs clean",
        "non-finite onset",
    ]
    .map(str::to_owned)
    .to_vec();
    let rows = r
        .summary
        .iter()
        .map(|s| {
            vec![
                s.path.clone(),
                s.kind.clone(),
                s.first_divergence.map_or_else(
                    || "none".to_owned(),
                    |(l, n)| format!("layer {l} @ {}", tokens(n)),
                ),
                s.shortest_topk_length
                    .map_or_else(|| "none".to_owned(), tokens),
                num(s.min_jaccard, 4),
                num(s.min_jaccard_vs_clean, 4),
                num(s.argmax, 3),
                sci(s.js_mean),
                num(s.argmax_vs_clean, 3),
                s.onset.as_ref().map_or_else(
                    || "none".to_owned(),
                    |(l, site, n)| format!("layer {l} {site} @ {}", tokens(*n)),
                ),
            ]
        })
        .collect();
    (header, rows)
}

/// The per-cell table: header and rows.
fn cell_table(r: &Report) -> (Vec<String>, Vec<Vec<String>>) {
    let t = r.thresholds;
    let header = [
        "path",
        "prompt",
        "tokens",
        "hidden div",
        "top-k div",
        "min J",
        "min J vs clean",
        "max hidden p95",
        "max p95 vs clean",
        "argmax",
        "JS mean",
    ]
    .map(str::to_owned)
    .to_vec();
    let layer = |v: Option<i64>| v.map_or_else(|| "none".to_owned(), |l| l.to_string());
    let max = |c: &Cell, f: fn(&super::profile::LayerMetrics) -> Option<f64>| {
        c.layers.iter().filter_map(f).max_by(f64::total_cmp)
    };
    let rows = r
        .sweep
        .cells
        .iter()
        .map(|c| {
            vec![
                c.path.clone(),
                c.kind.clone(),
                c.length.to_string(),
                layer(c.hidden_divergence(t.hidden)),
                layer(c.topk_divergence(t.topk)),
                num(c.min_topk_jaccard(), 4),
                num(
                    c.layers
                        .iter()
                        .filter_map(|l| l.topk_jaccard_vs_clean)
                        .min_by(f64::total_cmp),
                    4,
                ),
                sci(max(c, |l| l.hidden_p95)),
                sci(max(c, |l| l.hidden_p95_vs_clean)),
                num(c.logits.as_ref().and_then(|a| a.argmax_agreement), 3),
                sci(c
                    .logits
                    .as_ref()
                    .and_then(|a| a.js_divergence.map(|s| s.mean))),
            ]
        })
        .collect();
    (header, rows)
}

fn deviation_rows(r: &Report) -> Vec<Vec<String>> {
    let mut seen = BTreeSet::new();
    r.sweep
        .paths
        .iter()
        .chain(r.sweep.not_run.iter().map(|n| &n.path))
        .flat_map(|p| p.split('+'))
        .filter_map(|name| Deviation::parse(name).ok())
        .filter(|d| seen.insert(d.kind))
        .map(|d| {
            vec![
                d.kind.name().to_owned(),
                d.kind.behaviour().to_owned(),
                d.kind.source().to_owned(),
            ]
        })
        .collect()
}

fn header_lines(r: &Report) -> Vec<String> {
    let s = &r.sweep;
    let mut lines = vec![
        format!(
            "model {} ({}, {} layers, index_topk {}), on {}",
            r.model, s.architecture, s.layers, s.index_topk, s.device
        ),
        format!(
            "production: {}, indexer FP8 variant {}; each deviation departs from it",
            s.prod.describe(),
            s.base
        ),
        "reference: an fp32 chain from the embeddings (hidden states, logits), and the fp32 indexer on each path's own layer input (top-k)".to_owned(),
    ];
    if let Some(p) = &r.synthetic_params {
        lines.push(format!(
            "synthetic weights: {p} (the assumptions that decide how strongly a deviation shows; tracer/src/model/synthetic.rs)"
        ));
    }
    lines
}

/// The summary table's columns a narrow terminal leaves out first, in order:
/// what another column already says (the path against clean, the threshold's
/// length beside the first divergence) or what only a close reading needs.
const SUMMARY_DROPS: [&str; 4] = ["JS mean", "min J vs clean", "J < threshold from", "argmax"];

/// The per-prompt table's columns a narrow terminal leaves out first.
const CELL_DROPS: [&str; 5] = [
    "max p95 vs clean",
    "min J vs clean",
    "JS mean",
    "max hidden p95",
    "argmax",
];

/// The ranking's columns a narrow terminal leaves out first.
const RANKING_DROPS: [&str; 3] = ["entries", "noise (1 se)", "hidden (decades)"];

/// The report for a terminal `fit` columns wide (`None`: every column, the
/// prose on one line each): the prose wrapped, each table leaving out its
/// least needed columns, and saying which, until it fits.
#[must_use]
pub fn render_terminal(r: &Report, fit: Option<usize>) -> String {
    let mut out = String::from("shadowtrace suspects\n");
    let prose = |out: &mut String, text: &str| out.push_str(&wrap(text, fit, "  "));
    for line in header_lines(r) {
        prose(&mut out, &line);
    }
    out.push_str("\nrules\n");
    for rule in &r.rules {
        prose(&mut out, rule);
    }
    if !r.sweep.not_run.is_empty() {
        out.push_str("\nnot run: the mathematics says they change nothing here\n");
        for n in &r.sweep.not_run {
            prose(&mut out, &format!("{}: {}", n.path, n.reason));
        }
    }
    let _ = writeln!(out, "\nby path and prompt kind (lengths {})", lengths(r));
    let (h, rows) = summary_table(r);
    table(&mut out, &h, &rows, Fit::to(fit, &SUMMARY_DROPS));
    out.push_str("\nper prompt\n");
    let (h, rows) = cell_table(r);
    table(&mut out, &h, &rows, Fit::to(fit, &CELL_DROPS));
    if let Some(ranking) = &r.ranking {
        out.push('\n');
        out.push_str(&wrap(
            &format!("ranked against the observed runs ({})", ranking.rule),
            fit,
            "",
        ));
        prose(&mut out, &ranking.verdict);
        let (h, rows) = ranking.table();
        table(&mut out, &h, &rows, Fit::to(fit, &RANKING_DROPS));
        for note in &ranking.notes {
            prose(&mut out, &format!("note: {note}"));
        }
    }
    out.push('\n');
    out.push_str(&wrap(&timing_line(r), fit, ""));
    out
}

fn lengths(r: &Report) -> String {
    let set: BTreeSet<i64> = r.sweep.cells.iter().map(|c| c.length).collect();
    set.iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The timing line: load seconds per layer, and compute seconds per layer
/// per 1k tokens per path.
#[must_use]
pub fn timing_line(r: &Report) -> String {
    let s = &r.sweep;
    format!(
        "timing on {}: {} layers, {} paths, {} tokens per layer: {:.3} s per layer reading weights, {:.4} s per layer per 1k tokens per path computing",
        s.device,
        s.timings.len(),
        s.paths.len(),
        s.tokens,
        s.load_seconds_per_layer(),
        s.seconds_per_layer_per_1k_tokens_per_path()
    )
}

/// The report as Markdown; `plots` are paths relative to it.
#[must_use]
pub fn render_markdown(r: &Report, plots: &[String]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# shadowtrace suspects\n");
    for line in header_lines(r) {
        let _ = writeln!(out, "- {line}");
    }
    let _ = writeln!(out, "\n## Rules\n");
    for rule in &r.rules {
        let _ = writeln!(out, "- {rule}");
    }
    let _ = writeln!(out, "\n## Deviations\n");
    md_table(
        &mut out,
        &["deviation", "what production does", "source"].map(str::to_owned),
        &deviation_rows(r),
    );
    if !r.sweep.not_run.is_empty() {
        let _ = writeln!(
            out,
            "Not run, because the mathematics says they change nothing here:\n"
        );
        for n in &r.sweep.not_run {
            let _ = writeln!(out, "- `{}`: {}", n.path, n.reason);
        }
        let _ = writeln!(out);
    }
    let _ = writeln!(out, "## By path and prompt kind\n");
    let _ = writeln!(
        out,
        "Lengths {}; `min J`, `argmax` and `JS` at the longest.\n",
        lengths(r)
    );
    let (h, rows) = summary_table(r);
    md_table(&mut out, &h, &rows);
    if let Some(ranking) = &r.ranking {
        let _ = writeln!(out, "## Ranked against the observed runs\n");
        let _ = writeln!(out, "{}\n", ranking.rule);
        let _ = writeln!(out, "**{}**\n", ranking.verdict);
        let (h, rows) = ranking.table();
        md_table(&mut out, &h, &rows);
        for note in &ranking.notes {
            let _ = writeln!(out, "- {note}");
        }
        let _ = writeln!(out);
    }
    if !plots.is_empty() {
        let _ = writeln!(out, "## Plots\n");
        for p in plots {
            let _ = writeln!(out, "![{p}]({p})\n");
        }
    }
    let _ = writeln!(out, "## Per prompt\n");
    let (h, rows) = cell_table(r);
    md_table(&mut out, &h, &rows);
    let _ = writeln!(out, "## Timing\n\n{}", timing_line(r));
    out
}

pub(crate) fn md_table(out: &mut String, header: &[String], rows: &[Vec<String>]) {
    let _ = writeln!(out, "| {} |", header.join(" | "));
    let _ = writeln!(
        out,
        "|{}",
        header.iter().map(|_| " --- |").collect::<String>()
    );
    for row in rows {
        let _ = writeln!(out, "| {} |", row.join(" | "));
    }
    let _ = writeln!(out);
}

/// Every deviation, as `--list` prints it.
#[must_use]
pub fn render_list() -> String {
    let mut out = String::new();
    for kind in DeviationKind::ALL {
        let param = kind.default_param().map_or_else(String::new, |d| {
            format!("\n  parameter: {}:VALUE (default {d})", kind.name())
        });
        let _ = writeln!(
            out,
            "{}\n  {}{param}\n  source: {}\n",
            kind.name(),
            kind.behaviour(),
            kind.source()
        );
    }
    out
}
