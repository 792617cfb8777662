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
//!
//! ## Ties
//! A score is an estimate over a few layers and prompts, and each path's
//! entries scatter around it. Its noise is the standard error of that
//! estimate, from the entries themselves: for an RMS `r` over `n` squared
//! differences `d²`, `se(r) = sd(d²) / (2 r sqrt(n))` (the delta method; 0
//! where every entry is 0), the onset share's binomial error
//! `sqrt(p (1 - p) / runs)`, combined in quadrature with the weights above.
//! A path whose score lies within [`TIE_SIGMAS`] times the combined noise of
//! itself and the best path is tied with it, and the ranking says so: a
//! clean observed run comes out as "no deviation explains the observed runs
//! better than the clean path", never as rank 1 by a margin inside the noise.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::sweep::{ProdLinears, Sweep};

/// Decades of hidden-state error worth one unit of score, divided: one
/// decade counts as this much Jaccard.
pub const HIDDEN_WEIGHT: f64 = 0.1;

/// The floor under which hidden errors are not told apart.
pub const HIDDEN_FLOOR: f64 = 1e-6;

/// Two scores closer than this many combined standard errors are a tie.
pub const TIE_SIGMAS: f64 = 2.0;

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
    /// Production's dtype as its manifest says (`dtypes.prod`): what the
    /// sweep's production path must run to compare like with like.
    pub prod_dtype: String,
    /// The conventions its engine ran differently from the model, as the
    /// analyzer's verdict lines say them.
    pub convention_mismatches: Vec<String>,
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
                prod_dtype: tag("prod_dtype"),
                convention_mismatches: run
                    .get("convention_mismatches")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|m| m.get("name").and_then(Value::as_str))
                    .map(str::to_owned)
                    .collect(),
            }
        })
        .collect())
}

/// The production the sweep must run to compare like with like: the
/// precision every observed run's manifest names (`dtypes.prod`); `None`
/// without observed runs.
///
/// # Errors
/// Runs of different precisions (rank them in separate calls), or one the
/// sweep cannot run: ranking against another would compare unlike paths.
pub fn production_of(observed: &[Observed]) -> Result<Option<ProdLinears>, String> {
    let mut dtypes: Vec<&str> = observed.iter().map(|o| o.prod_dtype.as_str()).collect();
    dtypes.sort_unstable();
    dtypes.dedup();
    match dtypes.as_slice() {
        [] => Ok(None),
        [one] => ProdLinears::of_dtype(one).map(Some).ok_or_else(|| {
            format!(
                "production ran {one:?}; the sweep runs production in fp8 or bf16 only, and ranking against either would compare unlike paths"
            )
        }),
        many => Err(format!(
            "the runs ran production in {}: rank runs of one precision per call, so that each is compared with a clean path of its own",
            many.join(", ")
        )),
    }
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
    /// The standard error of the score, from the scatter of its entries
    /// (module docs, Ties).
    pub noise: f64,
    /// Whether its score is within [`TIE_SIGMAS`] combined standard errors
    /// of the best path's (the best path is tied with itself).
    pub tied_with_best: bool,
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
    /// The answer in one line: which path explains the observed runs, or
    /// that the best ones cannot be told apart (module docs, Ties).
    pub verdict: String,
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
            "noise (1 se)",
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
                    // Paths tied with the best share its rank.
                    if r.tied_with_best {
                        "=1".to_owned()
                    } else {
                        (i + 1).to_string()
                    },
                    r.path.clone(),
                    format!("{:.4}", r.score),
                    format!("{:.4}", r.noise),
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

/// The standard error of [`rms`] of `values` by the delta method: the
/// squares' sample deviation over `2 r sqrt(n)`; 0 for a single entry or an
/// RMS of 0, where the entries do not scatter.
fn rms_noise(values: &[f64]) -> f64 {
    let n = values.len();
    let r = rms(values).unwrap_or(0.0);
    if n < 2 || r == 0.0 {
        return 0.0;
    }
    let squares: Vec<f64> = values.iter().map(|v| v * v).collect();
    let mean = r * r;
    let var = squares.iter().map(|q| (q - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    var.sqrt() / (2.0 * r * (n as f64).sqrt())
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
        if !o.convention_mismatches.is_empty() {
            // The sweep's clean path takes the model's conventions; its
            // deviations each switch one. It cannot take a run's own set.
            notes.push(format!(
                "{} ran conventions other than the model's ({}): the sweep's clean path takes the model's, and each deviation switches one of them alone",
                o.run_id,
                o.convention_mismatches.join(", ")
            ));
        }
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
            let onset_noise = if runs == 0 {
                0.0
            } else {
                (onset * (1.0 - onset) / f64::from(runs)).sqrt()
            };
            let (topk, hidden) = (rms(&dj), rms(&dh));
            Ranked {
                path: path.clone(),
                topk,
                hidden,
                onset,
                score: topk.unwrap_or(0.0) + HIDDEN_WEIGHT * hidden.unwrap_or(0.0) + onset,
                noise: (rms_noise(&dj).powi(2)
                    + (HIDDEN_WEIGHT * rms_noise(&dh)).powi(2)
                    + onset_noise.powi(2))
                .sqrt(),
                tied_with_best: false,
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
    if let Some(best) = ranked.first().filter(|b| b.entries > 0).cloned() {
        for r in ranked.iter_mut().filter(|r| r.entries > 0) {
            let margin = TIE_SIGMAS * best.noise.hypot(r.noise);
            r.tied_with_best = r.score - best.score <= margin;
        }
    }
    Ranking {
        rule: format!(
            "score = RMS of the per-layer Jaccard differences + {HIDDEN_WEIGHT} x RMS of the per-layer hidden p95 differences in decades (floor {HIDDEN_FLOOR:e}) + the share of runs where only one side has a non-finite onset; lowest first; paths within {TIE_SIGMAS} combined standard errors of the best are tied with it"
        ),
        verdict: verdict(&ranked),
        ranked,
        notes,
    }
}

/// The ranking's answer in one line (module docs, Ties).
fn verdict(ranked: &[Ranked]) -> String {
    let Some(best) = ranked.first().filter(|b| b.entries > 0) else {
        return "not judged: no observed layer matched a swept one".to_owned();
    };
    let tied: Vec<&str> = ranked
        .iter()
        .filter(|r| r.tied_with_best)
        .map(|r| r.path.as_str())
        .collect();
    if tied.contains(&"clean") {
        let others: Vec<&&str> = tied.iter().filter(|p| **p != "clean").collect();
        let within = if others.is_empty() {
            String::new()
        } else {
            format!(
                "; tied with it: {}",
                others.iter().map(|p| **p).collect::<Vec<_>>().join(", ")
            )
        };
        return format!(
            "no deviation explains the observed runs better than the clean path, within the sweep's noise{within}"
        );
    }
    if tied.len() > 1 {
        return format!(
            "{} explain the observed runs equally well within the sweep's noise; the clean path does worse",
            tied.join(", ")
        );
    }
    match ranked.get(1).filter(|r| r.entries > 0) {
        Some(next) => format!(
            "{} explains the observed runs best: score {:.4} against {} {:.4}, apart by more than {TIE_SIGMAS} combined standard errors ({:.4})",
            best.path,
            best.score,
            next.path,
            next.score,
            TIE_SIGMAS * best.noise.hypot(next.noise)
        ),
        None => format!("{} is the only path compared", best.path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::suspects::profile::{Cell, LayerMetrics};
    use crate::suspects::sweep::ProdLinears;

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
            prod: ProdLinears::Fp8,
            base: "none".to_owned(),
            band: 1e-4,
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
            prod_dtype: "fp8_e4m3".to_owned(),
            convention_mismatches: Vec::new(),
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
            prod_dtype: "fp8_e4m3".to_owned(),
            convention_mismatches: Vec::new(),
        };
        let r = rank(&s, &[observed]);
        assert_eq!(r.ranked[0].path, "clean");
        let clean = &r.ranked[0];
        // One of three layers one decade off: sqrt(1/3) decades.
        assert!((clean.hidden.unwrap() - (1.0_f64 / 3.0).sqrt()).abs() < 1e-12);
        assert!((r.ranked[1].onset - 1.0).abs() < 1e-12);
    }

    /// `cell` with each layer's hidden p95 set.
    fn with_hidden(mut c: Cell, p95: &[f64]) -> Cell {
        for (l, &h) in c.layers.iter_mut().zip(p95) {
            l.hidden_p95 = Some(h);
        }
        c
    }

    fn observed(js: &[f64]) -> Observed {
        Observed {
            run_id: "prod".to_owned(),
            kind: "tool".to_owned(),
            length: 3072,
            topk: js.iter().enumerate().map(|(i, &j)| (i as i64, j)).collect(),
            hidden: BTreeMap::new(),
            onset: false,
            prod_dtype: "fp8_e4m3".to_owned(),
            convention_mismatches: Vec::new(),
        }
    }

    #[test]
    fn a_clean_observed_run_is_explained_by_no_deviation_more_than_by_clean() {
        // The observed run is clean: its layers scatter around the clean
        // path's by the sweep's own noise. A no-effect deviation lands 0.003
        // closer by chance, as the demo's clean-looking paths did.
        let s = sweep(vec![
            cell("clean", &[0.98, 0.97, 0.99, 0.98]),
            cell("weights_proj_bf16", &[0.975, 0.975, 0.985, 0.98]),
            cell("indexer_rope_neox", &[0.57, 0.55, 0.58, 0.56]),
        ]);
        let r = rank(&s, &[observed(&[0.97, 0.99, 0.98, 0.985])]);
        assert_eq!(r.ranked[0].path, "weights_proj_bf16");
        let clean = r.ranked.iter().find(|p| p.path == "clean").unwrap();
        assert!(clean.score > r.ranked[0].score, "{r:#?}");
        assert!(clean.tied_with_best, "{r:#?}");
        assert!(
            !r.ranked[2].tied_with_best,
            "a real effect is no tie: {r:#?}"
        );
        assert_eq!(
            r.verdict,
            "no deviation explains the observed runs better than the clean path, within the sweep's noise; tied with it: weights_proj_bf16"
        );
        let (_, rows) = r.table();
        assert_eq!(
            (
                rows[0][0].as_str(),
                rows[1][0].as_str(),
                rows[2][0].as_str()
            ),
            ("=1", "=1", "3")
        );
    }

    #[test]
    fn a_planted_deviation_apart_from_the_rest_beyond_the_noise_is_named() {
        let s = sweep(vec![
            cell("clean", &[0.98, 0.97, 0.99, 0.98]),
            cell("indexer_rope_neox", &[0.57, 0.55, 0.58, 0.56]),
        ]);
        let r = rank(&s, &[observed(&[0.56, 0.56, 0.57, 0.57])]);
        assert_eq!(r.ranked[0].path, "indexer_rope_neox");
        assert!(!r.ranked[1].tied_with_best);
        assert!(
            r.verdict
                .starts_with("indexer_rope_neox explains the observed runs best: score"),
            "{}",
            r.verdict
        );
    }

    #[test]
    fn the_noise_of_a_score_is_the_delta_method_standard_error_of_its_entries() {
        // d = (0.1, 0.3): r = sqrt(0.05); d^2 = (0.01, 0.09), sd = 0.08 / sqrt(2);
        // se(r) = sd / (2 r sqrt(2)).
        let want = (0.08 / 2.0_f64.sqrt()) / (2.0 * 0.05_f64.sqrt() * 2.0_f64.sqrt());
        assert!((rms_noise(&[0.1, 0.3]) - want).abs() < 1e-15);
        assert_eq!(
            rms_noise(&[0.2, 0.2, -0.2]),
            0.0,
            "entries that do not scatter"
        );
        assert_eq!(rms_noise(&[0.5]), 0.0);
        assert_eq!(rms_noise(&[0.0, 0.0]), 0.0);
        // The hidden component is weighted as in the score.
        let s = sweep(vec![with_hidden(cell("clean", &[0.9, 0.9]), &[1e-2, 1e-1])]);
        let mut o = observed(&[0.9, 0.9]);
        o.hidden = BTreeMap::from([(0, 1e-2), (1, 1e-2)]);
        let r = rank(&s, &[o]);
        let want = HIDDEN_WEIGHT * rms_noise(&[0.0, 1.0]);
        assert!((r.ranked[0].noise - want).abs() < 1e-15, "{r:#?}");
    }

    #[test]
    fn the_sweep_runs_production_in_the_precision_the_observed_manifests_name() {
        let with = |dtype: &str| Observed {
            prod_dtype: dtype.to_owned(),
            ..observed(&[0.9])
        };
        assert_eq!(production_of(&[]), Ok(None));
        assert_eq!(
            production_of(&[with("bf16"), with("bf16")]),
            Ok(Some(ProdLinears::Bf16))
        );
        assert_eq!(
            production_of(&[with("fp8_e4m3")]),
            Ok(Some(ProdLinears::Fp8))
        );
        let mixed = production_of(&[with("bf16"), with("fp8_e4m3")]).unwrap_err();
        assert!(mixed.contains("bf16, fp8_e4m3"), "{mixed}");
        let unknown = production_of(&[with("fp16")]).unwrap_err();
        assert!(unknown.contains("\"fp16\""), "{unknown}");
        assert_eq!(
            ProdLinears::Bf16.numerics(),
            crate::model::Numerics::Plain(tch::Kind::BFloat16)
        );
    }

    #[test]
    fn analysis_json_reads_into_observed_profiles() {
        let doc = serde_json::json!({"runs": [{
            "run_id": "r", "tags": {"prompt_kind": "no_tool", "prompt_len": "6144", "prod_dtype": "bf16"},
            "convention_mismatches": [{"name": "indexer_rope", "engine": "neox", "model": "interleaved"}],
            "topk": [{"layer": 1, "jaccard_no_churn": {"mean": 0.5}}, {"layer": 2, "jaccard_no_churn": null}],
            "hidden": [
                {"layer": 1, "site": "layer_out", "shadow_mode": "free", "rel_l2_err": {"p95": 0.3}},
                {"layer": 1, "site": "layer_out", "shadow_mode": "local", "rel_l2_err": {"p95": 0.01}},
                {"layer": 1, "site": "attn_out", "shadow_mode": "free", "rel_l2_err": {"p95": 0.02}}
            ],
            "onset": null
        }]});
        let obs = observed_from_analysis(&doc).unwrap();
        assert_eq!(obs[0].prod_dtype, "bf16");
        assert_eq!(obs[0].convention_mismatches, ["indexer_rope"]);
        assert_eq!(obs[0].kind, "no_tool");
        assert_eq!(obs[0].length, 6144);
        assert_eq!(obs[0].topk, BTreeMap::from([(1, 0.5)]));
        assert_eq!(obs[0].hidden, BTreeMap::from([(1, 0.3)]));
        assert!(!obs[0].onset);
        assert!(observed_from_analysis(&serde_json::json!({})).is_err());
    }
}
