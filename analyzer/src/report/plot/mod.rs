//! The report's plots, drawn with plotters: line charts by layer as SVG
//! (mean churn-free Jaccard per grid group, hidden-state error per run) and
//! a PNG heatmap per run (churn-free Jaccard by layer and query token). The
//! numbers behind each plot are also in the metrics Parquet.

mod axis;
mod font;
mod heatmap;
mod line;
#[cfg(test)]
mod tests;
mod text;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use axis::{AGREEMENT_FLOOR, Placed, Scale};
use heatmap::{Binned, Heatmap, MAX_BINS};
use line::{Limit, LimitValue, Line, LineChart};

use crate::analysis::identity_tag;
use crate::verdict::{MIN_FLOOR, NoiseFloor, Thresholds, deciding_mode, hidden_series};
use crate::{Analysis, AnalyzeError, RunAnalysis};

/// File of the Jaccard-by-layer chart.
pub const TOPK_CHART: &str = "topk_jaccard_vs_layer.svg";
/// File of the hidden-error-by-layer chart.
pub const HIDDEN_CHART: &str = "hidden_error_vs_layer.svg";

/// Legend suffix of a group whose runs have no informative top-k rows (no
/// query saw more than k keys): listed, but no line to draw.
pub const NO_ROWS: &str = "no informative rows";

/// File of a run's overlap heatmap.
#[must_use]
pub fn heatmap_file(run_id: &str) -> String {
    format!("overlap_heatmap_{run_id}.png")
}

/// Whether a run gets an overlap heatmap: it has a finite informative
/// top-k row (some query saw more than k keys).
pub(crate) fn has_heatmap(run: &RunAnalysis) -> bool {
    run.topk_rows
        .iter()
        .any(|r| r.jaccard_no_churn().is_finite())
}

/// Writes the plots into `dir`: the two line charts, and a heatmap per run
/// with informative top-k rows. Returns the files written.
pub(super) fn write_plots(dir: &Path, a: &Analysis) -> Result<Vec<PathBuf>, AnalyzeError> {
    let mut written = Vec::new();
    let mut save = |name: &str, bytes: &[u8]| -> Result<(), AnalyzeError> {
        let path = dir.join(name);
        std::fs::write(&path, bytes).map_err(|e| AnalyzeError::Write {
            path: path.clone(),
            detail: e.to_string(),
        })?;
        written.push(path);
        Ok(())
    };
    let drawing = |name: &str| {
        let path = dir.join(name);
        move |detail: String| AnalyzeError::Write { path, detail }
    };
    let (svg, _) = line::render(&topk_chart(a)).map_err(drawing(TOPK_CHART))?;
    save(TOPK_CHART, svg.as_bytes())?;
    let (svg, _) = line::render(&hidden_chart(a)).map_err(drawing(HIDDEN_CHART))?;
    save(HIDDEN_CHART, svg.as_bytes())?;
    for run in &a.runs {
        let Some(map) = overlap_heatmap(a, run) else {
            continue;
        };
        let name = heatmap_file(&run.run_id);
        let (png, _) = heatmap::render(&map).map_err(drawing(&name))?;
        save(&name, &png)?;
    }
    Ok(written)
}

/// One line for people: how many plots of each kind and their bytes, the
/// largest named.
#[must_use]
pub fn sizes_line(files: &[PathBuf]) -> String {
    let mut kinds: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    let mut largest: Option<(u64, String)> = None;
    for f in files {
        let Some(ext) = f.extension().map(|e| e.to_string_lossy().to_uppercase()) else {
            continue;
        };
        if ext != "SVG" && ext != "PNG" {
            continue;
        }
        let bytes = std::fs::metadata(f).map_or(0, |m| m.len());
        let entry = kinds.entry(ext).or_default();
        entry.0 += 1;
        entry.1 += bytes;
        if largest.as_ref().is_none_or(|(b, _)| bytes > *b) {
            let name = f
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
            largest = Some((bytes, name));
        }
    }
    let parts: Vec<String> = kinds
        .iter()
        .map(|(ext, (n, bytes))| format!("{n} {ext} {}", human_bytes(*bytes)))
        .collect();
    match largest {
        Some((bytes, name)) => format!(
            "plots: {} (largest {name}, {})",
            parts.join(", "),
            human_bytes(bytes)
        ),
        None => "plots: none".to_owned(),
    }
}

fn human_bytes(b: u64) -> String {
    if b >= 1_000_000 {
        format!("{:.1} MB", b as f64 / 1e6)
    } else {
        format!("{:.1} kB", b as f64 / 1e3)
    }
}

/// The floor a run's verdicts were calibrated against, if any (matched by
/// the manifest's model name, as [`crate::analyze`] matches it).
fn run_floor<'a>(a: &'a Analysis, run: &RunAnalysis) -> Option<&'a NoiseFloor> {
    identity_tag(&run.tags, "model").and_then(|m| a.floors.get(m))
}

/// The limits drawn on a chart: the fixed threshold where some run was
/// judged by it, and per model with a baseline, its calibrated limit per
/// layer (`limit(floor, layer)`).
fn limits(
    a: &Analysis,
    fixed: Limit,
    calibrated: impl Fn(&str, &NoiseFloor) -> Limit,
) -> Vec<Limit> {
    let mut out = Vec::new();
    if a.runs.iter().any(|r| run_floor(a, r).is_none()) {
        out.push(fixed);
    }
    let models: std::collections::BTreeSet<&String> = a
        .runs
        .iter()
        .filter_map(|r| identity_tag(&r.tags, "model"))
        .collect();
    for (model, floor) in &a.floors {
        if models.contains(model) {
            out.push(calibrated(model, floor));
        }
    }
    out
}

fn churn_text(t: &Thresholds) -> String {
    crate::verdict::churn_rule(t.churn_band)
}

/// Mean churn-free Jaccard per layer, one line per grid group (each run's
/// layer mean weighted by its informative rows), with the top-k limits.
pub(crate) fn topk_chart(a: &Analysis) -> LineChart {
    let t = &a.thresholds;
    let lines: Vec<Line> =
        a.grid
            .groups
            .iter()
            .map(|g| {
                let members =
                    a.runs.iter().filter(|r| {
                        a.grid.group_by.iter().zip(&g.key).all(|(tag, value)| {
                            r.tags.get(tag).map_or("-", String::as_str) == value
                        })
                    });
                let mut sums: BTreeMap<i32, (f64, usize)> = BTreeMap::new();
                for layer in members.flat_map(|r| &r.topk) {
                    if let Some(j) = layer.jaccard_no_churn {
                        let entry = sums.entry(layer.layer).or_default();
                        entry.0 += j.mean * layer.informative_rows as f64;
                        entry.1 += layer.informative_rows;
                    }
                }
                let points: Vec<(i32, f64)> = sums
                    .into_iter()
                    .map(|(l, (sum, n))| (l, sum / n as f64))
                    .collect();
                // A group below k tokens has a legend entry but no line: say why.
                let name = g.key.join(" / ");
                Line {
                    name: if points.is_empty() {
                        format!("{name} ({NO_ROWS})")
                    } else {
                        name
                    },
                    points,
                }
            })
            .collect();
    let fixed = Limit {
        label: format!("threshold {}: a verdict below", t.topk_jaccard),
        value: LimitValue::Constant(t.topk_jaccard),
    };
    let limits = limits(a, fixed, |model, floor| Limit {
        label: format!(
            "limit for {model}: 1 - {} x baseline floor",
            t.baseline_factor
        ),
        value: LimitValue::PerLayer(
            floor
                .topk
                .iter()
                .map(|(&l, &f)| (l, 1.0 - t.baseline_factor * f.max(MIN_FLOOR.1)))
                .collect(),
        ),
    });
    let mut title = vec![
        format!(
            "Mean churn-free top-k Jaccard by layer, one line per {}",
            a.grid.group_by.join(" / ")
        ),
        format!(
            "{}; informative rows only (more than k visible keys); axis spaced by log(1 - J)",
            churn_text(t)
        ),
    ];
    let clamped = lines
        .iter()
        .flat_map(|l| &l.points)
        .filter(|p| matches!(Scale::Agreement.place(p.1), Placed::Clamped(_)))
        .count();
    if clamped > 0 {
        title.push(format!(
            "{clamped} points at J >= {} drawn on it",
            1.0 - AGREEMENT_FLOOR
        ));
    }
    if lines.iter().all(|l| l.points.is_empty()) {
        title.push("no run has informative top-k rows: nothing to draw".to_owned());
    }
    LineChart {
        title,
        y_desc: "mean churn-free Jaccard".to_owned(),
        scale: Scale::Agreement,
        lines,
        limits,
    }
}

/// p95 relative L2 error per layer at the verdict's site, one line per run,
/// with the hidden-state limits.
pub(crate) fn hidden_chart(a: &Analysis) -> LineChart {
    let t = &a.thresholds;
    let lines: Vec<Line> = a
        .runs
        .iter()
        .map(|r| {
            let points = hidden_series(&r.hidden, t);
            Line {
                name: if points.is_empty() {
                    format!("{} (no hidden captures)", r.run_id)
                } else {
                    r.run_id.clone()
                },
                points,
            }
        })
        .collect();
    let mut modes: Vec<String> = a.runs.iter().map(|r| deciding_mode(&r.hidden, t)).collect();
    modes.sort();
    modes.dedup();
    let fixed = Limit {
        label: format!("threshold {}: a verdict above", t.hidden_rel_err),
        value: LimitValue::Constant(t.hidden_rel_err),
    };
    let limits = limits(a, fixed, |model, floor| Limit {
        label: format!("limit for {model}: {} x baseline floor", t.baseline_factor),
        value: LimitValue::PerLayer(
            floor
                .hidden
                .iter()
                .map(|(&l, &f)| (l, t.baseline_factor * f.max(MIN_FLOOR.0)))
                .collect(),
        ),
    });
    let mut title = vec![
        format!(
            "p95 relative L2 error at {} by layer, one line per run",
            t.hidden_site
        ),
        format!(
            "prod against the {} shadow (p95 over tokens); log scale",
            modes.join(" or ")
        ),
    ];
    let not_drawn = lines
        .iter()
        .flat_map(|l| &l.points)
        .filter(|p| Scale::Log.place(p.1) == Placed::Outside)
        .count();
    if not_drawn > 0 {
        title.push(format!(
            "{not_drawn} points not drawn (0 or not finite): the lines break there"
        ));
    }
    LineChart {
        title,
        y_desc: "p95 relative L2 error".to_owned(),
        scale: Scale::Log,
        lines,
        limits,
    }
}

/// A run's churn-free Jaccard by layer and query token; `None` without
/// informative rows.
pub(crate) fn overlap_heatmap(a: &Analysis, run: &RunAnalysis) -> Option<Heatmap> {
    let binned = Binned::from_rows(
        run.topk_rows
            .iter()
            .map(|r| (r.layer, r.token, r.jaccard_no_churn())),
        MAX_BINS,
    )?;
    let t = &a.thresholds;
    let threshold = match run_floor(a, run) {
        None => Some((t.topk_jaccard, format!("threshold {}", t.topk_jaccard))),
        // A calibrated limit differs per layer: no single mark on the bar.
        Some(_) => None,
    };
    let mut title = vec![
        format!(
            "{}: churn-free top-k Jaccard by layer and query token",
            run.run_id
        ),
        format!(
            "{} informative rows (more than k visible keys), tokens {}-{}; {}",
            binned.rows,
            binned.first_token,
            binned.last_token,
            churn_text(t)
        ),
    ];
    if threshold.is_none() {
        title.push(format!(
            "verdicts against {} x this model's baseline floor per layer (see the report)",
            t.baseline_factor
        ));
    }
    if binned.not_finite > 0 {
        title.push(format!("{} rows not drawn: not finite", binned.not_finite));
    }
    Some(Heatmap {
        title,
        value_desc: "churn-free Jaccard".to_owned(),
        range: (0.0, 1.0),
        threshold,
        binned,
    })
}
