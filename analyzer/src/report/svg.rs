//! Plots as hand-written SVG: no plotting dependency, deterministic bytes,
//! and the data behind each plot is also in the metrics Parquet.

use std::fmt::Write;
use std::path::{Path, PathBuf};

use crate::verdict::hidden_series;
use crate::{Analysis, AnalyzeError};

const W: f64 = 720.0;
const H: f64 = 360.0;
const M: (f64, f64, f64, f64) = (60.0, 20.0, 30.0, 50.0); // left, right, top, bottom
const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// Writes the plots: Jaccard vs layer (one line per grid group), hidden
/// error vs layer (one line per run), and a layer x token heatmap of
/// churn-free overlap per run.
pub(super) fn write_plots(dir: &Path, a: &Analysis) -> Result<Vec<PathBuf>, AnalyzeError> {
    let mut written = Vec::new();
    let mut save = |name: String, svg: String| -> Result<(), AnalyzeError> {
        let path = dir.join(name);
        std::fs::write(&path, svg).map_err(|e| AnalyzeError::Write {
            path: path.clone(),
            detail: e.to_string(),
        })?;
        written.push(path);
        Ok(())
    };
    let topk = group_topk_series(a);
    save(
        "topk_jaccard_vs_layer.svg".to_owned(),
        line_chart(
            "mean churn-free top-k Jaccard by layer, per group",
            "Jaccard",
            &topk,
            false,
        ),
    )?;
    let hidden: Vec<(String, Vec<(f64, f64)>)> = a
        .runs
        .iter()
        .map(|r| {
            (
                r.run_id.clone(),
                hidden_series(&r.hidden, &a.thresholds)
                    .into_iter()
                    .map(|(l, e)| (f64::from(l), e))
                    .collect(),
            )
        })
        .collect();
    let title = format!(
        "p95 relative L2 error at {} by layer (log scale)",
        a.thresholds.hidden_site
    );
    save(
        "hidden_error_vs_layer.svg".to_owned(),
        line_chart(&title, "rel L2 error", &hidden, true),
    )?;
    for run in &a.runs {
        if run.topk_rows.is_empty() {
            continue;
        }
        save(format!("overlap_heatmap_{}.svg", run.run_id), heatmap(run))?;
    }
    Ok(written)
}

/// Per grid group, the mean churn-free Jaccard per layer over the group's
/// informative rows (each run's layer mean weighted by its row count).
fn group_topk_series(a: &Analysis) -> Vec<(String, Vec<(f64, f64)>)> {
    a.grid
        .groups
        .iter()
        .map(|g| {
            let members = a.runs.iter().filter(|r| {
                a.grid
                    .group_by
                    .iter()
                    .zip(&g.key)
                    .all(|(tag, value)| r.tags.get(tag).map_or("-", String::as_str) == value)
            });
            let mut sums: std::collections::BTreeMap<i32, (f64, usize)> =
                std::collections::BTreeMap::new();
            for layer in members.flat_map(|r| &r.topk) {
                if let Some(j) = layer.jaccard_no_churn {
                    let entry = sums.entry(layer.layer).or_default();
                    entry.0 += j.mean * layer.informative_rows as f64;
                    entry.1 += layer.informative_rows;
                }
            }
            let points = sums
                .into_iter()
                .map(|(l, (sum, n))| (f64::from(l), sum / n as f64))
                .collect();
            (g.key.join(" / "), points)
        })
        .collect()
}

fn line_chart(
    title: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_y: bool,
) -> String {
    let ty = |v: f64| if log_y { v.max(1e-12).log10() } else { v };
    let points: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|&(x, y)| (x, ty(y))))
        .collect();
    let (x0, x1) = bounds(points.iter().map(|p| p.0));
    let (mut y0, mut y1) = bounds(points.iter().map(|p| p.1));
    if !log_y {
        (y0, y1) = (y0.min(0.0), y1.max(1.0));
    }
    let px = |x: f64| M.0 + (x - x0) / (x1 - x0).max(1e-12) * (W - M.0 - M.1);
    let py = |y: f64| H - M.3 - (y - y0) / (y1 - y0).max(1e-12) * (H - M.2 - M.3);
    let mut s = header(title);
    axes(&mut s, (x0, x1), (y0, y1), y_label, log_y, &px, &py);
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let path: Vec<String> = pts
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(ty(y))))
            .collect();
        if !path.is_empty() {
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
                path.join(" ")
            );
        }
        let ly = M.2 + 14.0 * i as f64 + 10.0;
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{ly:.1}" font-size="11" fill="{color}">{}</text>"#,
            W - M.1 - 200.0,
            escape(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn heatmap(run: &crate::RunAnalysis) -> String {
    let mut layers: Vec<i32> = run.topk_rows.iter().map(|r| r.layer).collect();
    layers.sort_unstable();
    layers.dedup();
    let mut tokens: Vec<i32> = run.topk_rows.iter().map(|r| r.token).collect();
    tokens.sort_unstable();
    tokens.dedup();
    let cw = (W - M.0 - M.1) / tokens.len().max(1) as f64;
    let ch = (H - M.2 - M.3) / layers.len().max(1) as f64;
    let mut s = header(&format!(
        "{}: churn-free Jaccard, layer x query token (white 1, red 0)",
        run.run_id
    ));
    for r in &run.topk_rows {
        let (Ok(xi), Ok(yi)) = (
            tokens.binary_search(&r.token),
            layers.binary_search(&r.layer),
        ) else {
            continue;
        };
        let v = r.jaccard_no_churn.clamp(0.0, 1.0);
        let g = (255.0 * v).round() as u8;
        let _ = writeln!(
            s,
            r#"<rect x="{:.2}" y="{:.2}" width="{:.2}" height="{:.2}" fill="rgb(255,{g},{g})"><title>layer {} token {}: {:.4}</title></rect>"#,
            M.0 + xi as f64 * cw,
            M.2 + yi as f64 * ch,
            cw.max(0.5),
            ch.max(0.5),
            r.layer,
            r.token,
            r.jaccard_no_churn
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" font-size="11">query tokens {}..{}</text>"#,
        M.0,
        H - 15.0,
        tokens.first().unwrap_or(&0),
        tokens.last().unwrap_or(&0)
    );
    let _ = writeln!(
        s,
        r#"<text x="8" y="{:.1}" font-size="11">layers {}..{}</text>"#,
        M.2 + 10.0,
        layers.first().unwrap_or(&0),
        layers.last().unwrap_or(&0)
    );
    s.push_str("</svg>\n");
    s
}

fn header(title: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" font-family=\"sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{:.1}\" y=\"18\" font-size=\"13\">{}</text>\n",
        M.0,
        escape(title)
    )
}

fn axes(
    s: &mut String,
    x: (f64, f64),
    y: (f64, f64),
    y_label: &str,
    log_y: bool,
    px: &dyn Fn(f64) -> f64,
    py: &dyn Fn(f64) -> f64,
) {
    let _ = writeln!(
        s,
        r##"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#333"/>"##,
        M.0,
        H - M.3,
        W - M.1,
        H - M.3
    );
    let _ = writeln!(
        s,
        r##"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#333"/>"##,
        M.0,
        M.2,
        M.0,
        H - M.3
    );
    for i in 0..=4 {
        let yv = y.0 + (y.1 - y.0) * f64::from(i) / 4.0;
        let label = if log_y {
            format!("1e{yv:.1}")
        } else {
            format!("{yv:.2}")
        };
        let _ = writeln!(
            s,
            r#"<text x="4" y="{:.1}" font-size="10">{label}</text>"#,
            py(yv) + 3.0
        );
        let xv = x.0 + (x.1 - x.0) * f64::from(i) / 4.0;
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" font-size="10">{xv:.0}</text>"#,
            px(xv) - 4.0,
            H - M.3 + 14.0
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" font-size="11">layer</text>"#,
        W / 2.0,
        H - 12.0
    );
    let _ = writeln!(
        s,
        r#"<text x="4" y="{:.1}" font-size="11">{}</text>"#,
        M.2 - 8.0,
        escape(y_label)
    );
}

fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
    if lo.is_finite() {
        if lo == hi {
            (lo - 1.0, hi + 1.0)
        } else {
            (lo, hi)
        }
    } else {
        (0.0, 1.0)
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
