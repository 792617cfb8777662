//! Top-k Jaccard against prompt length, one line per path: a minimal SVG,
//! kept in this one file so the analyzer's plotting module can replace it.
//! The plotted numbers are the report's (`min J` per cell: the lowest layer
//! mean churn-free Jaccard), so the plot is checked through its data.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::sweep::Sweep;

const W: f64 = 720.0;
const H: f64 = 420.0;
const LEFT: f64 = 60.0;
const RIGHT: f64 = 220.0;
const TOP: f64 = 30.0;
const BOTTOM: f64 = 50.0;
const COLOURS: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

/// Per path, the (length, lowest layer mean Jaccard) points of prompt `kind`.
#[must_use]
pub fn series(sweep: &Sweep, kind: &str) -> BTreeMap<String, Vec<(i64, f64)>> {
    let mut out: BTreeMap<String, Vec<(i64, f64)>> = BTreeMap::new();
    for c in sweep.cells.iter().filter(|c| c.kind == kind) {
        if let Some(j) = c.min_topk_jaccard() {
            out.entry(c.path.clone()).or_default().push((c.length, j));
        }
    }
    for points in out.values_mut() {
        points.sort_by_key(|p| p.0);
    }
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The SVG of prompt `kind`, the verdict's threshold drawn across.
#[must_use]
pub fn jaccard_vs_length(sweep: &Sweep, kind: &str, threshold: f64) -> String {
    let data = series(sweep, kind);
    let lengths: Vec<i64> = data.values().flatten().map(|p| p.0).collect();
    let (lo, hi) = (
        lengths.iter().copied().min().unwrap_or(0) as f64,
        lengths.iter().copied().max().unwrap_or(1) as f64,
    );
    let span = (hi - lo).max(1.0);
    let x = |len: f64| LEFT + (len - lo) / span * (W - LEFT - RIGHT);
    let y = |j: f64| TOP + (1.0 - j.clamp(0.0, 1.0)) * (H - TOP - BOTTOM);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="18">top-k Jaccard (lowest layer mean, churn excluded) against prompt length: {} prompts</text>"#,
        escape(kind)
    );
    for tick in [0.0, 0.25, 0.5, 0.75, 1.0] {
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{tick}</text>"##,
            W - RIGHT,
            y(tick),
            y(tick),
            LEFT - 6.0,
            y(tick) + 4.0
        );
    }
    let mut ticks = lengths.clone();
    ticks.sort_unstable();
    ticks.dedup();
    for len in ticks {
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{len}</text>"#,
            x(len as f64),
            H - BOTTOM + 18.0
        );
    }
    let _ = writeln!(
        out,
        r##"<line x1="{LEFT}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#000" stroke-dasharray="4 3"/><text x="{:.1}" y="{:.1}">threshold {threshold}</text>"##,
        W - RIGHT,
        y(threshold),
        y(threshold),
        W - RIGHT + 4.0,
        y(threshold) + 4.0
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">prompt length (tokens)</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        H - 8.0
    );
    for (i, (path, points)) in data.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let coords: Vec<String> = points
            .iter()
            .map(|&(len, j)| format!("{:.1},{:.1}", x(len as f64), y(j)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"><title>{}</title></polyline>"#,
            coords.join(" "),
            escape(path)
        );
        let ly = TOP + 16.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{:.1}" x2="{:.1}" y1="{ly:.1}" y2="{ly:.1}" stroke="{colour}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            W - RIGHT + 10.0,
            W - RIGHT + 30.0,
            W - RIGHT + 34.0,
            ly + 4.0,
            escape(path)
        );
    }
    out.push_str("</svg>\n");
    out
}
