//! Which suspect explains what production shows: the sweep's paths ranked by
//! how closely their per-layer, per-length profile matches observed
//! production runs.
//!
//! ## Definition
//! An observed run is read as `shadowtrace analyze` reads it (its JSON
//! output, `runs[]`): prompt kind and length from its tags, per layer the
//! mean churn-free top-k Jaccard (`topk[].jaccard_no_churn.mean`), the p95
//! relative L2 error of `layer_out` in `free` shadow mode where recorded
//! (`hidden[]`), and whether it has a non-finite onset. It is matched to the
//! swept cell of the same prompt kind whose length is nearest its own (the
//! match is printed). For each path, over every matched (run, layer):
//!
//! ```text
//! topk   = sqrt(mean (J_path - J_observed)^2)
//! hidden = sqrt(mean (log10 max(p95_path, 1e-6) - log10 max(p95_observed, 1e-6))^2)
//! onset  = share of matched runs where exactly one of the two has a non-finite onset
//! score  = topk + HIDDEN_WEIGHT * hidden + onset
//! ```
//!
//! Jaccard differences are in Jaccard units (0.1 is a large effect); hidden
//! errors span decades, so they are compared in decades, one decade counting
//! as [`HIDDEN_WEIGHT`] of Jaccard; a path that poisons where production does
//! not (or the reverse) is a whole unit away. The lowest score ranks first.
//! A component with no matched entry is left out of the sum and shown as `-`.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::sweep::Sweep;

/// Decades of hidden-state error worth one unit of score, divided: one
/// decade counts as this much Jaccard.
pub const HIDDEN_WEIGHT: f64 = 0.1;

/// The floor under which hidden errors are not told apart.
pub const HIDDEN_FLOOR: f64 = 1e-6;

/// One observed production run's profile.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Observed {
    /// Run id.
    pub run_id: String,
    /// Prompt kind.
    pub kind: String,
    /// Prompt length.
    pub length: i64,
    /// Mean churn-free Jaccard per layer.
    pub topk: BTreeMap<i64, f64>,
    /// p95 relative L2 error of `layer_out`, free shadow mode, per layer.
    pub hidden: BTreeMap<i64, f64>,
    /// Whether a non-finite onset was found.
    pub onset: bool,
}

/// The observed runs of `shadowtrace analyze --format json` output.
///
/// # Errors
/// A document without a `runs` list.
pub fn observed_from_analysis(doc: &Value) -> Result<Vec<Observed>, String> {
    let runs = doc
        .get("runs")
        .and_then(Value::as_array)
        .ok_or("expected the JSON of `shadowtrace analyze --format json`: no runs list")?;
    Ok(runs
        .iter()
        .map(|run| {
            let tag = |k: &str| {
                run.pointer(&format!("/tags/{k}"))
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned()
            };
            let layer = |v: &Value| v.get("layer").and_then(Value::as_i64);
            let topk = run
                .get("topk")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|l| Some((layer(l)?, l.pointer("/jaccard_no_churn/mean")?.as_f64()?)))
                .collect();
            let hidden = run
                .get("hidden")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter(|s| {
                    s.get("site").and_then(Value::as_str) == Some("layer_out")
                        && s.get("shadow_mode").and_then(Value::as_str) == Some("free")
                })
                .filter_map(|s| Some((layer(s)?, s.pointer("/rel_l2_err/p95")?.as_f64()?)))
                .collect();
            Observed {
                run_id: run
                    .get("run_id")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
                kind: tag("prompt_kind"),
                length: tag("prompt_len").parse().unwrap_or(0),
                topk,
                hidden,
                onset: run.get("onset").is_some_and(|o| !o.is_null()),
            }
        })
        .collect())
}

/// One path's distance from the observed runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Ranked {
    /// Path.
    pub path: String,
    /// Top-k component (Jaccard units), if any entry matched.
    pub topk: Option<f64>,
    /// Hidden component (decades), if any entry matched.
    pub hidden: Option<f64>,
    /// Onset component.
    pub onset: f64,
    /// The score it is ranked by.
    pub score: f64,
    /// (run, layer) entries compared.
    pub entries: usize,
}

/// The ranking, best match first.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Ranking {
    /// The rule, printed with it.
    pub rule: String,
    /// Paths, best first.
    pub ranked: Vec<Ranked>,
    /// Which swept cell each observed run was matched to, and runs that
    /// matched none.
    pub notes: Vec<String>,
}

impl Ranking {
    /// The table: header and rows.
    #[must_use]
    pub fn table(&self) -> (Vec<String>, Vec<Vec<String>>) {
        let header = [
            "rank",
            "path",
            "score",
            "top-k (J)",
            "hidden (decades)",
            "onset",
            "entries",
        ]
        .map(str::to_owned)
        .to_vec();
        let f = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.4}"));
        let rows = self
            .ranked
            .iter()
            .enumerate()
            .map(|(i, r)| {
                vec![
                    (i + 1).to_string(),
                    r.path.clone(),
                    format!("{:.4}", r.score),
                    f(r.topk),
                    f(r.hidden),
                    format!("{:.2}", r.onset),
                    r.entries.to_string(),
                ]
            })
            .collect();
        (header, rows)
    }
}

fn rms(values: &[f64]) -> Option<f64> {
    (!values.is_empty())
        .then(|| (values.iter().map(|v| v * v).sum::<f64>() / values.len() as f64).sqrt())
}

/// Ranks the sweep's paths against `observed` (module docs).
#[must_use]
pub fn rank(sweep: &Sweep, observed: &[Observed]) -> Ranking {
    let mut notes = Vec::new();
    // Each observed run's matched length, per kind.
    let mut matched: Vec<(&Observed, i64)> = Vec::new();
    for o in observed {
        let nearest = sweep
            .cells
            .iter()
            .filter(|c| c.kind == o.kind)
            .map(|c| c.length)
            .min_by_key(|len| (len - o.length).abs());
        match nearest {
            Some(len) => {
                notes.push(format!(
                    "{} ({} prompt, {} tokens) matched to the swept {} tokens",
                    o.run_id, o.kind, o.length, len
                ));
                matched.push((o, len));
            }
            None => notes.push(format!(
                "{} ({} prompt): no swept prompt of that kind, not compared",
                o.run_id, o.kind
            )),
        }
    }
    let log = |v: f64| v.max(HIDDEN_FLOOR).log10();
    let mut ranked: Vec<Ranked> = sweep
        .paths
        .iter()
        .map(|path| {
            let (mut dj, mut dh, mut onset, mut runs) = (Vec::new(), Vec::new(), 0.0, 0);
            for (o, len) in &matched {
                let Some(cell) = sweep
                    .cells
                    .iter()
                    .find(|c| &c.path == path && c.kind == o.kind && c.length == *len)
                else {
                    continue;
                };
                runs += 1;
                for l in &cell.layers {
                    if let (Some(j), Some(jo)) = (l.topk_jaccard, o.topk.get(&l.layer)) {
                        dj.push(j - jo);
                    }
                    if let (Some(h), Some(ho)) = (l.hidden_p95, o.hidden.get(&l.layer)) {
                        dh.push(log(h) - log(*ho));
                    }
                }
                if cell.onset.is_some() != o.onset {
                    onset += 1.0;
                }
            }
            let onset = if runs == 0 {
                0.0
            } else {
                onset / f64::from(runs)
            };
            let (topk, hidden) = (rms(&dj), rms(&dh));
            Ranked {
                path: path.clone(),
                topk,
                hidden,
                onset,
                score: topk.unwrap_or(0.0) + HIDDEN_WEIGHT * hidden.unwrap_or(0.0) + onset,
                entries: dj.len() + dh.len(),
            }
        })
        .collect();
    ranked.sort_by(|a, b| {
        // Paths with nothing to compare rank last.
        (a.entries == 0)
            .cmp(&(b.entries == 0))
            .then(a.score.total_cmp(&b.score))
            .then(a.path.cmp(&b.path))
    });
    Ranking {
        rule: format!(
            "score = RMS of the per-layer Jaccard differences + {HIDDEN_WEIGHT} x RMS of the per-layer hidden p95 differences in decades (floor {HIDDEN_FLOOR:e}) + the share of runs where only one side has a non-finite onset; lowest first"
        ),
        ranked,
        notes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::suspects::profile::{Cell, LayerMetrics};

    fn cell(path: &str, js: &[f64]) -> Cell {
        Cell {
            path: path.to_owned(),
            kind: "tool".to_owned(),
            length: 3072,
            layers: js
                .iter()
                .enumerate()
                .map(|(i, &j)| LayerMetrics {
                    layer: i as i64,
                    topk_jaccard: Some(j),
                    topk_jaccard_with_churn: Some(j),
                    informative_rows: 1,
                    dense_rows: 0,
                    topk_jaccard_vs_clean: None,
                    hidden_p95: Some(1e-2),
                    hidden_nonfinite_tokens: 0,
                    hidden_p95_vs_clean: None,
                })
                .collect(),
            onset: None,
            logits: None,
            logits_vs_clean: None,
        }
    }

    fn sweep(cells: Vec<Cell>) -> Sweep {
        Sweep {
            architecture: "glm_moe_dsa".to_owned(),
            index_topk: 2048,
            layers: 3,
            base: "none".to_owned(),
            band: 1e-3,
            paths: cells.iter().map(|c| c.path.clone()).collect(),
            not_run: Vec::new(),
            cells,
            timings: Vec::new(),
            tokens: 3072,
            device: "Cpu".to_owned(),
        }
    }

    #[test]
    fn the_planted_profile_ranks_first_with_its_distance_by_definition() {
        let s = sweep(vec![
            cell("clean", &[0.99, 0.99, 0.99]),
            cell("indexer_rope_neox", &[0.40, 0.35, 0.30]),
            cell("hadamard_dropped", &[0.95, 0.93, 0.90]),
        ]);
        let observed = Observed {
            run_id: "prod".to_owned(),
            kind: "tool".to_owned(),
            length: 3000,
            topk: BTreeMap::from([(0, 0.42), (1, 0.35), (2, 0.28)]),
            hidden: BTreeMap::new(),
            onset: false,
        };
        let r = rank(&s, &[observed]);
        assert_eq!(r.ranked[0].path, "indexer_rope_neox");
        // RMS of (-0.02, 0, 0.02) = sqrt(0.0008 / 3).
        let want = (0.0008_f64 / 3.0).sqrt();
        assert!((r.ranked[0].score - want).abs() < 1e-12, "{r:?}");
        assert_eq!(
            r.ranked[0].hidden, None,
            "no free-mode hidden rows observed"
        );
        assert_eq!(r.ranked.last().unwrap().path, "clean");
        assert!(
            r.notes[0].contains("matched to the swept 3072 tokens"),
            "{:?}",
            r.notes
        );
    }

    #[test]
    fn an_onset_only_one_side_has_costs_a_whole_unit() {
        let mut poisoned = cell("kv_slot_nan", &[0.99, 0.99, 0.99]);
        poisoned.onset = Some(crate::suspects::profile::Onset {
            layer: 0,
            site: "attn_out".to_owned(),
            token: 0,
        });
        let s = sweep(vec![cell("clean", &[0.99, 0.99, 0.99]), poisoned]);
        let observed = Observed {
            run_id: "prod".to_owned(),
            kind: "tool".to_owned(),
            length: 3072,
            topk: BTreeMap::from([(0, 0.99), (1, 0.99), (2, 0.99)]),
            hidden: BTreeMap::from([(0, 1e-2), (1, 1e-1), (2, 1e-2)]),
            onset: false,
        };
        let r = rank(&s, &[observed]);
        assert_eq!(r.ranked[0].path, "clean");
        let clean = &r.ranked[0];
        // One of three layers one decade off: sqrt(1/3) decades.
        assert!((clean.hidden.unwrap() - (1.0_f64 / 3.0).sqrt()).abs() < 1e-12);
        assert!((r.ranked[1].onset - 1.0).abs() < 1e-12);
    }

    #[test]
    fn analysis_json_reads_into_observed_profiles() {
        let doc = serde_json::json!({"runs": [{
            "run_id": "r", "tags": {"prompt_kind": "no_tool", "prompt_len": "6144"},
            "topk": [{"layer": 1, "jaccard_no_churn": {"mean": 0.5}}, {"layer": 2, "jaccard_no_churn": null}],
            "hidden": [
                {"layer": 1, "site": "layer_out", "shadow_mode": "free", "rel_l2_err": {"p95": 0.3}},
                {"layer": 1, "site": "layer_out", "shadow_mode": "local", "rel_l2_err": {"p95": 0.01}},
                {"layer": 1, "site": "attn_out", "shadow_mode": "free", "rel_l2_err": {"p95": 0.02}}
            ],
            "onset": null
        }]});
        let obs = observed_from_analysis(&doc).unwrap();
        assert_eq!(obs[0].kind, "no_tool");
        assert_eq!(obs[0].length, 6144);
        assert_eq!(obs[0].topk, BTreeMap::from([(1, 0.5)]));
        assert_eq!(obs[0].hidden, BTreeMap::from([(1, 0.3)]));
        assert!(!obs[0].onset);
        assert!(observed_from_analysis(&serde_json::json!({})).is_err());
    }
}
