//! Every metric and verdict on synthetic runs whose answer is known by
//! construction: a planted NaN, hidden-state divergence from a layer on, a
//! selection collapse at a layer, churn only among tied scores at the
//! boundary, a convention the engine runs differently from the model, and a
//! clean run.

use std::path::{Path, PathBuf};

use shadowtrace_analyzer::judged::{EVERY_QUESTION, NotMeasured, Question, why_not_judged};
use shadowtrace_analyzer::verdict::Thresholds;
use shadowtrace_analyzer::{Analysis, Options, RunAnalysis, analyze};
use shadowtrace_schemas::Convention;
use shadowtrace_tracer::WriterOptions;
use shadowtrace_tracer::record::Record;
use shadowtrace_tracer::synth::SynthSpec;

use crate::support::write_edited;

/// A run with churn only (2 of 16 selected keys swapped among keys tied at
/// the k-th score), no NaN, no divergence.
pub(crate) fn clean(run_id: &str) -> SynthSpec {
    SynthSpec {
        run_id: run_id.to_owned(),
        model: "synthetic/glm5-shaped".to_owned(),
        layers: 5,
        tokens: 64,
        hidden_size: 64,
        k: 16,
        topk_queries: 8,
        churn: 0.125,
        logits_positions: 4,
        logits_top_n: 5,
        planted_nan: None,
        ..SynthSpec::demo(run_id)
    }
}

pub(crate) fn write(dir: &Path, specs: &[SynthSpec]) -> Vec<PathBuf> {
    specs
        .iter()
        .map(|s| {
            let path = dir.join(&s.run_id);
            s.write(&path, WriterOptions::default()).unwrap();
            path
        })
        .collect()
}

fn analyze_one(spec: SynthSpec) -> RunAnalysis {
    let tmp = tempfile::tempdir().unwrap();
    let paths = write(tmp.path(), &[spec]);
    let mut a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    assert!(a.skipped.is_empty(), "{:?}", a.skipped);
    a.runs.remove(0)
}

#[test]
fn a_clean_run_has_no_verdict() {
    let run = analyze_one(clean("clean"));
    assert!(!run.has_verdict(), "{run:#?}");
    assert!(run.onset.is_none() && run.hidden_verdict.is_none() && run.topk_verdict.is_none());
    assert_eq!(run.logits.as_ref().unwrap().argmax_agreement, Some(1.0));
}

#[test]
fn churn_only_among_tied_scores_is_not_a_divergence() {
    let run = analyze_one(clean("churn"));
    for layer in &run.topk {
        let with_churn = layer.jaccard.unwrap().mean;
        let without = layer.jaccard_no_churn.unwrap();
        // 2 of 16 swapped: |P ∩ S| = 14, |P ∪ S| = 18.
        assert!(
            (with_churn - 14.0 / 18.0).abs() < 1e-12,
            "layer {}: {with_churn}",
            layer.layer
        );
        assert_eq!(
            (without.mean, without.min),
            (1.0, 1.0),
            "layer {}",
            layer.layer
        );
        assert_eq!(layer.churn_keys_mean, 4.0, "two keys each way");
    }
    assert!(run.topk_verdict.is_none());
}

#[test]
fn dense_rows_are_counted_apart_and_never_averaged() {
    let run = analyze_one(clean("dense"));
    // Queries at tokens 7, 15, ..., 63: the first two see at most k = 16 keys.
    for layer in &run.topk {
        assert_eq!(
            (layer.dense_rows, layer.informative_rows),
            (2, 6),
            "layer {}",
            layer.layer
        );
    }
}

#[test]
fn a_planted_nan_is_the_onset_at_its_layer_site_and_token_with_a_finite_shadow() {
    let run = analyze_one(SynthSpec {
        planted_nan: Some((2, "mlp_out", 30)),
        ..clean("nan")
    });
    let onset = run.onset.unwrap();
    assert_eq!(
        (onset.step, onset.layer, onset.site.as_str(), onset.token),
        (0, 2, "mlp_out", Some(30))
    );
    assert_eq!(
        (onset.kind.as_str(), onset.shadow_finite),
        ("nan", Some(true))
    );
    assert!(
        run.hidden_verdict.is_none(),
        "one NaN token is counted, not averaged into the error"
    );
    let layer2 = run
        .hidden
        .iter()
        .find(|s| s.layer == 2 && s.site == "mlp_out")
        .unwrap();
    assert_eq!(layer2.nonfinite_tokens, 1);
}

#[test]
fn hidden_divergence_is_found_at_the_layer_it_starts() {
    let run = analyze_one(SynthSpec {
        divergence_from_layer: Some(3),
        ..clean("diverge")
    });
    let v = run.hidden_verdict.unwrap();
    assert_eq!(v.layer, 3);
    assert!(v.value > 0.1 && v.limit == 0.1, "{v:?}");
    assert!(run.topk_verdict.is_none());
}

#[test]
fn a_selection_collapse_is_found_at_its_layer() {
    let run = analyze_one(SynthSpec {
        collapse_from_layer: Some(2),
        ..clean("collapse")
    });
    let v = run.topk_verdict.unwrap();
    assert_eq!(v.layer, 2);
    // The shadow swaps round(0.6 * 16) = 10 of 16 keys for unselected ones,
    // fewer where fewer are unselected: the query at token 23 sees 24 keys,
    // so 8 swaps (J = 8/24); the five later ones swap 10 (J = 6/26).
    let layer2 = run.topk.iter().find(|l| l.layer == 2).unwrap();
    let expected = (8.0 / 24.0 + 5.0 * 6.0 / 26.0) / 6.0;
    assert!(
        (layer2.jaccard_no_churn.unwrap().mean - expected).abs() < 1e-12,
        "{layer2:?}"
    );
    assert!(run.hidden_verdict.is_none());
}

#[test]
fn every_rule_is_printed_with_its_threshold() {
    let run = analyze_one(clean("rules"));
    assert_eq!(
        run.rules,
        [
            "hidden: first layer whose p95 relative L2 error at layer_out exceeds 0.1",
            "top-k: first layer whose mean Jaccard (churn within each row's recorded band excluded: the run's relative band x the mean |score| of the reference's top-k) falls below 0.8",
            "convention: a numerics convention whose engine value is known and differs from the model's (config.json and the family's reference code); an engine value the adapter assumed is not judged",
        ]
    );
}

#[test]
fn a_baseline_calibrates_a_per_layer_floor_and_catches_a_smaller_divergence() {
    let tmp = tempfile::tempdir().unwrap();
    let baseline = write(
        &tmp.path().join("baseline"),
        &[
            clean("healthy-a"),
            SynthSpec {
                seed: 99,
                ..clean("healthy-b")
            },
        ],
    );
    // Healthy error is about 1e-3; twenty times more stays under the fixed
    // 0.1 but is far above three times the floor.
    let bad = SynthSpec {
        divergence_from_layer: Some(4),
        divergence_scale: 20.0,
        ..clean("bad")
    };
    let runs = write(&tmp.path().join("runs"), &[clean("ok"), bad]);
    let fixed = analyze(&runs, &[], &Options::default(), |_, _, _| {}).unwrap();
    assert!(
        fixed.runs.iter().all(|r| r.hidden_verdict.is_none()),
        "the fixed threshold misses it"
    );
    let calibrated = analyze(&runs, &baseline, &Options::default(), |_, _, _| {}).unwrap();
    let by_id = |a: &Analysis, id: &str| a.runs.iter().find(|r| r.run_id == id).cloned().unwrap();
    assert!(
        by_id(&calibrated, "ok").hidden_verdict.is_none(),
        "a healthy run stays clean against its own floor"
    );
    assert_eq!(by_id(&calibrated, "bad").hidden_verdict.unwrap().layer, 4);
    assert_eq!(
        calibrated.floors["synthetic/glm5-shaped"].runs,
        ["healthy-a", "healthy-b"]
    );
    assert!(
        by_id(&calibrated, "bad").rules[0]
            .contains("3 x its baseline floor (from 2 baseline runs)")
    );
}

#[test]
fn a_stricter_churn_margin_turns_churn_back_into_difference() {
    let tmp = tempfile::tempdir().unwrap();
    let paths = write(tmp.path(), &[clean("margin")]);
    let options = Options {
        thresholds: Thresholds {
            churn_band: Some(0.0),
            ..Thresholds::default()
        },
        ..Options::default()
    };
    let a = analyze(&paths, &[], &options, |_, _, _| {}).unwrap();
    let j = a.runs[0].topk[0].jaccard_no_churn.unwrap().mean;
    assert!(j < 1.0, "with a zero margin only exact ties are churn: {j}");
}

#[test]
fn identical_runs_pair_up_as_deterministic() {
    let tmp = tempfile::tempdir().unwrap();
    let paths = write(tmp.path(), &[clean("first"), clean("second")]);
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    assert_eq!(a.determinism.len(), 1);
    let d = &a.determinism[0];
    assert_eq!(
        (d.a.as_str(), d.b.as_str(), d.agreement.argmax_agreement),
        ("first", "second", Some(1.0))
    );
    assert_eq!(d.agreement.js_divergence.unwrap().max, 0.0);
}

#[test]
fn runs_group_by_tags_and_compare_side_by_side() {
    let tmp = tempfile::tempdir().unwrap();
    let deepseek = |id: &str| SynthSpec {
        model: "synthetic/deepseek-v32-shaped".to_owned(),
        seed: 5,
        ..clean(id)
    };
    let paths = write(
        tmp.path(),
        &[
            clean("glm-tool"),
            SynthSpec {
                prompt_kind: "no_tool".to_owned(),
                collapse_from_layer: Some(3),
                ..clean("glm-plain")
            },
            SynthSpec {
                tokens: 16,
                ..deepseek("ds-short")
            },
            deepseek("ds-tool"),
        ],
    );
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    let keys: Vec<Vec<String>> = a.grid.groups.iter().map(|g| g.key.clone()).collect();
    assert_eq!(
        keys,
        [
            ["synthetic/deepseek-v32-shaped", "tool", "<=16"],
            ["synthetic/deepseek-v32-shaped", "tool", ">32"],
            ["synthetic/glm5-shaped", "no_tool", ">32"],
            ["synthetic/glm5-shaped", "tool", ">32"],
        ]
        .map(|k| k.map(str::to_owned).to_vec())
    );
    let plain = a
        .grid
        .groups
        .iter()
        .find(|g| g.key[1] == "no_tool")
        .unwrap();
    assert_eq!(plain.topk_verdicts, [3]);
    let c = a.grid.comparison();
    assert_eq!(
        c.columns,
        ["synthetic/deepseek-v32-shaped", "synthetic/glm5-shaped"]
    );
    let tool_long = c
        .rows
        .iter()
        .find(|(label, _)| label == &["tool", ">32"])
        .unwrap();
    assert!(
        tool_long.1.iter().all(Option::is_some),
        "both models ran a long tool prompt"
    );
}

#[test]
fn runs_with_and_without_a_baseline_each_print_the_rule_they_were_judged_by() {
    let tmp = tempfile::tempdir().unwrap();
    let baseline = write(&tmp.path().join("baseline"), &[clean("healthy-glm")]);
    let deepseek = SynthSpec {
        model: "synthetic/deepseek-v32-shaped".to_owned(),
        ..clean("ds")
    };
    let runs = write(&tmp.path().join("runs"), &[clean("glm"), deepseek]);
    let a = analyze(&runs, &baseline, &Options::default(), |_, _, _| {}).unwrap();
    let lines = a.rule_lines();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("exceeds 3 x its baseline floor (from 1 baseline run)")),
        "{lines:#?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.ends_with("at layer_out exceeds 0.1")),
        "the DeepSeek run has no baseline: {lines:#?}"
    );
    assert!(
        lines.contains(&"baseline for synthetic/glm5-shaped: healthy-glm".to_owned()),
        "{lines:#?}"
    );
}

/// One run of `spec` with its rows edited, analysed with `options`.
fn analyze_edited(
    spec: &SynthSpec,
    options: &Options,
    edit: impl FnOnce(&mut Vec<Record>),
) -> (Analysis, RunAnalysis) {
    let tmp = tempfile::tempdir().unwrap();
    let path = write_edited(tmp.path(), spec, edit);
    let a = analyze(&[path], &[], options, |_, _, _| {}).unwrap();
    assert!(a.skipped.is_empty(), "{:?}", a.skipped);
    let run = a.runs[0].clone();
    (a, run)
}

#[test]
fn the_onset_token_is_the_events_row_s_when_hidden_rows_are_sampled() {
    // SHADOWTRACE_TOKENS=every:139 keeps hidden rows at tokens 0, 139, 278,
    // 417 and 556; the NaN starts at token 415 and reaches every later token.
    // The events row of the same capture saw the whole tensor: it is the truth.
    let spec = SynthSpec {
        tokens: 600,
        topk_queries: 2,
        planted_nan: Some((1, "mlp_out", 415)),
        ..clean("sampled")
    };
    let (_, run) = analyze_edited(&spec, &Options::default(), |records| {
        let sites = shadowtrace_tracer::synth::HIDDEN_SITES;
        let capture = |layer: i32, site: &str| {
            i64::from(layer) * 4 + sites.iter().position(|s| *s == site).unwrap() as i64
        };
        for record in records.iter_mut() {
            match record {
                // One sequence number per capture, as the producers number them.
                Record::Hidden(h) => {
                    h.seq = capture(h.layer, &h.site);
                    if h.seq >= capture(1, "mlp_out") && h.token >= 415 {
                        h.prod.nan = 1;
                    }
                }
                Record::Event(e) => e.seq = capture(e.layer, &e.site),
                _ => {}
            }
        }
        records.retain(|r| !matches!(r, Record::Hidden(h) if h.token % 139 != 0));
    });
    let onset = run.onset.unwrap();
    assert_eq!(
        (onset.layer, onset.site.as_str(), onset.token),
        (1, "mlp_out", Some(415)),
        "the events row's first token, not the first sampled one (417)"
    );
}

#[test]
fn all_nan_logits_keep_an_agreement_that_counts_them() {
    let (a, run) = analyze_edited(&clean("nan-logits"), &Options::default(), |records| {
        for record in records.iter_mut() {
            if let Record::Logits(l) = record {
                l.prod.logprobs.fill(f32::NAN);
            }
        }
    });
    let logits = serde_json::to_value(run.logits.as_ref().expect("positions matched")).unwrap();
    assert_eq!(logits["nonfinite_positions"], 4, "{logits}");
    assert_eq!(logits["positions"], 0, "{logits}");
    assert!(logits["argmax_agreement"].is_null(), "{logits}");
    let text = shadowtrace_analyzer::report::render_terminal(&a);
    assert!(
        text.contains("argmax agreement none: all 4 positions non-finite"),
        "{text}"
    );
}

#[test]
fn dequant_dense_rows_are_counted_in_the_dequant_summary() {
    let (_, run) = analyze_edited(&clean("dequant"), &Options::default(), |records| {
        let dequant: Vec<Record> = records
            .iter()
            .filter_map(|r| match r {
                Record::Topk(t) => {
                    let mut t = t.clone();
                    t.shadow = t.shadow.map(|(_, s)| ("dequant".to_owned(), s));
                    Some(Record::Topk(t))
                }
                _ => None,
            })
            .collect();
        records.extend(dequant);
    });
    assert_eq!(run.topk_dequant.len(), 5);
    for layer in run.topk_dequant.iter().chain(&run.topk) {
        assert_eq!(
            (layer.dense_rows, layer.informative_rows),
            (2, 6),
            "layer {}",
            layer.layer
        );
    }
}

#[test]
fn rows_without_boundary_lists_are_counted_as_churn_unknown_beside_the_verdict() {
    let options = Options {
        thresholds: Thresholds {
            churn_band: Some(5e-4),
            ..Thresholds::default()
        },
        ..Options::default()
    };
    let (a, run) = analyze_edited(&clean("no-band"), &options, |records| {
        for record in records.iter_mut() {
            if let Record::Topk(t) = record {
                t.boundary_band = None;
                t.prod.boundary = None;
                if let Some((_, s)) = t.shadow.as_mut() {
                    s.boundary = None;
                }
            }
        }
    });
    for layer in &run.topk {
        let value = serde_json::to_value(layer).unwrap();
        assert_eq!(value["churn_unknown_rows"], 6, "{value}");
        // Their differences all count: nothing was removed as churn.
        assert_eq!(layer.jaccard_no_churn, layer.jaccard);
    }
    let text = shadowtrace_analyzer::report::render_terminal(&a);
    let verdict = text
        .lines()
        .find(|l| l.contains("top-k divergence:"))
        .unwrap();
    assert!(
        verdict.contains("churn unknown on 30 of 30 rows (no boundary lists)"),
        "{verdict}"
    );
}

#[test]
fn shadow_only_non_finite_tokens_are_counted_and_shown() {
    let (a, run) = analyze_edited(&clean("shadow-nan"), &Options::default(), |records| {
        for record in records.iter_mut() {
            if let Record::Hidden(h) = record
                && h.layer == 2
                && h.site == "layer_out"
                && (h.token == 5 || h.token == 6)
                && let Some(s) = h.shadow.as_mut()
            {
                s.stats.nan = 3;
                s.comparison.rel_l2_err = f32::NAN;
                s.comparison.cosine = f32::NAN;
                s.comparison.max_abs_diff = f32::NAN;
            }
        }
    });
    let site = run
        .hidden
        .iter()
        .find(|s| s.layer == 2 && s.site == "layer_out")
        .unwrap();
    let value = serde_json::to_value(site).unwrap();
    assert_eq!(
        (
            &value["nonfinite_tokens"],
            &value["shadow_nonfinite_tokens"]
        ),
        (&0.into(), &2.into()),
        "{value}"
    );
    assert_eq!(site.rel_l2_err.unwrap().n, 62);
    // Every column (`--wide`): the narrow table leaves this one out first.
    let text = shadowtrace_analyzer::report::render_terminal_at(&a, None);
    let header = text.lines().find(|l| l.contains("NaN tok")).unwrap();
    assert!(header.contains("NaN tok  shadow-only NaN"), "{header}");
    let row = text
        .lines()
        .skip_while(|l| !l.contains("shadow-only NaN"))
        .find(|l| l.split_whitespace().next() == Some("2"))
        .unwrap();
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells[cells.len() - 1], "2", "{row}");
}

#[test]
fn zero_norm_shadows_make_the_error_infinite_and_the_verdict_fires() {
    // Ten of 64 tokens at layer 3 have an all-zero shadow (and a non-zero
    // prod): their relative error is +inf, so the layer's p95 is too.
    let (_, run) = analyze_edited(&clean("zero-shadow"), &Options::default(), |records| {
        for record in records.iter_mut() {
            if let Record::Hidden(h) = record
                && h.layer == 3
                && h.site == "layer_out"
                && h.token < 10
                && let Some(s) = h.shadow.as_mut()
            {
                s.stats.l2 = 0.0;
                s.stats.max_abs = 0.0;
                s.comparison.rel_l2_err = f32::INFINITY;
            }
        }
    });
    let site = run
        .hidden
        .iter()
        .find(|s| s.layer == 3 && s.site == "layer_out")
        .unwrap();
    let err = site.rel_l2_err.unwrap();
    assert_eq!(
        (err.p95, err.max),
        (f64::INFINITY, f64::INFINITY),
        "{err:?}"
    );
    assert!(err.p50.is_finite());
    assert_eq!(run.hidden_verdict.unwrap().layer, 3);
}

#[test]
fn a_user_model_tag_is_kept_and_the_grid_says_it_grouped_by_it() {
    let tmp = tempfile::tempdir().unwrap();
    let paths = write(tmp.path(), &[clean("tagged"), clean("untagged")]);
    crate::support::edit_manifest(&paths[0], |m| {
        m["tags"]["model"] = "glm-5.1-fp8-prod".into();
    });
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    let tagged = a.runs.iter().find(|r| r.run_id == "tagged").unwrap();
    assert_eq!(tagged.tags["model"], "glm-5.1-fp8-prod");
    assert_eq!(tagged.tags["manifest.model"], "synthetic/glm5-shaped");
    let keys: Vec<&str> = a.grid.groups.iter().map(|g| g.key[0].as_str()).collect();
    assert_eq!(keys, ["glm-5.1-fp8-prod", "synthetic/glm5-shaped"]);
    let text = shadowtrace_analyzer::report::render_terminal(&a);
    assert!(
        text.contains(
            "model: the user's tag on 1 of 2 runs (tagged: glm-5.1-fp8-prod, manifest synthetic/glm5-shaped)"
        ),
        "{text}"
    );
}

fn convention(name: &str, engine: serde_json::Value, model: serde_json::Value) -> Convention {
    Convention {
        name: name.to_owned(),
        engine,
        model,
        engine_source: "engine module".to_owned(),
        model_source: "config.json".to_owned(),
        engine_assumed: false,
    }
}

#[test]
fn a_convention_the_engine_runs_differently_is_its_own_verdict() {
    let run = analyze_one(SynthSpec {
        conventions: vec![
            convention("indexer_rope", "neox".into(), "interleaved".into()),
            convention("rope_theta", 1e6.into(), 1e6.into()),
        ],
        ..clean("neox-on-glm")
    });
    assert_eq!(run.convention_mismatches.len(), 1, "{run:#?}");
    assert_eq!(
        run.convention_mismatches[0].line(),
        "convention mismatch: indexer rope: engine neox, model interleaved"
    );
    assert!(
        run.has_verdict(),
        "a mismatch is a verdict with no metric needed"
    );
    assert!(
        run.topk_verdict.is_none() && run.hidden_verdict.is_none(),
        "the metrics of this synthetic run are clean: the verdict stands alone"
    );
    let text = render_terminal_of(&run);
    let mismatch = text.find("convention mismatch").unwrap();
    let first_metric = text.find("non-finite onset").unwrap();
    assert!(mismatch < first_metric, "named before any metric:\n{text}");
}

#[test]
fn agreeing_and_unknown_conventions_are_no_verdict() {
    let run = analyze_one(SynthSpec {
        conventions: vec![
            convention("indexer_rope", "interleaved".into(), "interleaved".into()),
            // An engine value nobody could read, and a model that defines none.
            convention("indexer_rope", serde_json::Value::Null, "neox".into()),
            convention("indexer_hadamard", false.into(), serde_json::Value::Null),
        ],
        ..clean("agree")
    });
    assert!(run.convention_mismatches.is_empty(), "{run:#?}");
    assert!(!run.has_verdict());
    assert_eq!(
        run.conventions.len(),
        3,
        "all of them are kept for the report"
    );
    // The engine value nobody could read is no agreement: not judged.
    assert!(!run.judged(Question::Convention));
    assert_eq!(
        why_not_judged(&run.not_measured, Question::Convention).unwrap(),
        "indexer rope: the engine's value was not read (engine module); the model's is neox"
    );
}

#[test]
fn a_convention_whose_engine_value_was_assumed_is_not_judged_agreeing_or_not() {
    let assumed = |engine: serde_json::Value, model: serde_json::Value| Convention {
        engine_source: "assumed from tensorrt_llm layout new".to_owned(),
        engine_assumed: true,
        ..convention("indexer_hadamard", engine, model)
    };
    for (engine, model) in [(false, true), (true, true)] {
        let run = analyze_one(SynthSpec {
            conventions: vec![assumed(engine.into(), model.into())],
            ..clean("assumed")
        });
        assert!(run.convention_mismatches.is_empty(), "{run:#?}");
        assert!(!run.judged(Question::Convention));
        assert!(run.judged(Question::Topk), "the metrics stay judged");
        let text = render_terminal_of(&run);
        assert!(
            text.contains(&format!(
                "  convention:        not judged: indexer hadamard: the engine's value ({engine}) is assumed (assumed from tensorrt_llm layout new), not read from the engine; the model's is {model}\n"
            )),
            "{text}"
        );
    }
    // A model that defines no value has nothing to judge.
    let run = analyze_one(SynthSpec {
        conventions: vec![assumed(false.into(), serde_json::Value::Null)],
        ..clean("nothing-to-judge")
    });
    assert!(run.judged(Question::Convention));
}

fn render_terminal_of(run: &RunAnalysis) -> String {
    let analysis = Analysis {
        thresholds: Thresholds::default(),
        floors: std::collections::BTreeMap::new(),
        runs: vec![run.clone()],
        skipped: Vec::new(),
        warnings: Vec::new(),
        grid: shadowtrace_analyzer::grid::group_runs(
            std::slice::from_ref(run),
            &["model".to_owned()],
            &Thresholds::default(),
        ),
        determinism: Vec::new(),
        cache: None,
        grafts: None,
        verdict: shadowtrace_analyzer::verdict::Overall::of(
            std::slice::from_ref(run),
            None,
            0,
            "layer_out",
        ),
    };
    shadowtrace_analyzer::report::render_terminal(&analysis)
}

#[test]
fn a_layer_without_baseline_data_takes_the_fixed_threshold_and_the_rule_says_so() {
    // The baseline traced layers 0-2 only (SHADOWTRACE_LAYERS=0-2, say). A
    // floor of nothing at layers 3 and 4 would make their healthy rounding
    // (about 1e-3) a verdict against 3 x 1e-6.
    let tmp = tempfile::tempdir().unwrap();
    let baseline = write(
        &tmp.path().join("baseline"),
        &[SynthSpec {
            layers: 3,
            ..clean("healthy-3-layers")
        }],
    );
    let runs = write(&tmp.path().join("runs"), &[clean("ok")]);
    let a = analyze(&runs, &baseline, &Options::default(), |_, _, _| {}).unwrap();
    let run = &a.runs[0];
    assert!(run.hidden_verdict.is_none(), "{:?}", run.hidden_verdict);
    assert!(run.topk_verdict.is_none(), "{:?}", run.topk_verdict);
    assert!(
        run.rules[0].ends_with(
            "(from 1 baseline run); layers 3-4 had no baseline data and took the fixed threshold 0.1"
        ),
        "{}",
        run.rules[0]
    );
    assert!(
        run.rules[1].ends_with(
            "(from 1 baseline run); layers 3-4 had no baseline data and took the fixed threshold 0.8"
        ),
        "{}",
        run.rules[1]
    );
    // The fixed threshold still judges those layers: a collapse there is found.
    let bad = SynthSpec {
        collapse_from_layer: Some(4),
        ..clean("collapse")
    };
    let runs = write(&tmp.path().join("bad"), &[bad]);
    let a = analyze(&runs, &baseline, &Options::default(), |_, _, _| {}).unwrap();
    assert_eq!(a.runs[0].topk_verdict.as_ref().unwrap().layer, 4);
}

#[test]
fn a_capture_disabled_in_an_earlier_request_leaves_its_verdicts_not_judged() {
    let tmp = tempfile::tempdir().unwrap();
    let paths = write(tmp.path(), &[clean("indexer-off"), clean("unknown-loss")]);
    // The hooks disabled the indexer capture in an earlier request of the
    // process: this run is complete, with no error of its own.
    crate::support::edit_manifest(&paths[0], |m| {
        m["settings"]["disabled_sites"] =
            serde_json::json!({"transformers:indexer": "RuntimeError: planted"});
        m["tables"]["logits"]["dropped_rows"] = 2.into();
    });
    crate::support::edit_manifest(&paths[1], |m| {
        m["counters"]["rows_lost_some_new_way"] = 7.into();
    });
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    let run = a.runs.iter().find(|r| r.run_id == "indexer-off").unwrap();
    assert!(run.complete && run.can_be_judged());
    assert!(!run.judged(Question::Topk) && !run.judged(Question::Logits));
    assert!(run.judged(Question::Hidden) && run.judged(Question::Nonfinite));
    let text = render_terminal_of(run);
    assert!(
        text.contains(
            "  top-k divergence:  not judged: capture transformers:indexer disabled in this process: RuntimeError: planted\n"
        ),
        "{text}"
    );
    assert!(
        text.contains("  logits:            not judged: counted dropped_rows.logits = 2; the partial data shows argmax agreement"),
        "{text}"
    );
    assert!(text.contains("  hidden divergence: none\n"), "{text}");
    // inspect says so from the manifest alone.
    let inspected = shadowtrace_analyzer::inspect::render_run(
        &shadowtrace_analyzer::Run::open(&paths[0]).unwrap(),
    );
    assert!(
        inspected.contains(
            "UNMEASURED - capture transformers:indexer disabled in this process: RuntimeError: planted (leaves not judged: top-k divergence)\n"
        ),
        "{inspected}"
    );
    // A counter the analyzer does not know is a loss of every verdict.
    let unknown = a.runs.iter().find(|r| r.run_id == "unknown-loss").unwrap();
    assert!(!unknown.can_be_judged());
    assert_eq!(
        unknown.not_measured,
        [NotMeasured {
            questions: EVERY_QUESTION.to_vec(),
            why: "counted rows_lost_some_new_way = 7".to_owned(),
        }]
    );
    let grid = &a.grid.groups[0];
    assert_eq!(grid.not_judged_runs, 2);
}

fn with_capture_check(path: &Path, layers: serde_json::Value) {
    crate::support::edit_manifest(path, |m| {
        m["engine"]["name"] = "vllm".into();
        m["engine"]["version"] = "0.34.0".into();
        m["settings"]["capture_check"] = serde_json::json!({
            "tolerance": 1e-3,
            "sources": ["recomputed: production's FP8 q, k and scales"],
            "layers": layers,
        });
    });
}

#[test]
fn a_capture_the_adapter_misread_is_its_own_verdict_first_and_leaves_top_k_not_judged() {
    let tmp = tempfile::tempdir().unwrap();
    let paths = write(tmp.path(), &[clean("misread"), clean("read-right")]);
    with_capture_check(
        &paths[0],
        serde_json::json!({
            "1": {"rows": 40, "disagree": 0, "first_token": null},
            "3": {"rows": 40, "disagree": 38, "first_token": 24}
        }),
    );
    with_capture_check(
        &paths[1],
        serde_json::json!({"1": {"rows": 40, "disagree": 0, "first_token": null}}),
    );
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    let bad = a.runs.iter().find(|r| r.run_id == "misread").unwrap();
    assert!(bad.capture_inconsistent() && bad.has_verdict());
    assert!(!bad.judged(Question::Topk));
    assert!(bad.judged(Question::Hidden) && bad.judged(Question::Nonfinite));
    let text = render_terminal_of(bad);
    let verdict = "  CAPTURE INCONSISTENT at layer 3: 38 of 40 informative rows (95.0%) select keys production's own scores rank outside its top-k (first at token 24); the adapter may not match vllm 0.34.0, so this layer's top-k rows are not judged as numerics\n";
    let at = text.find(verdict).unwrap_or_else(|| panic!("{text}"));
    assert!(at < text.find("non-finite onset").unwrap(), "{text}");
    assert!(
        text.contains(
            "  top-k divergence:  not judged: capture inconsistent at layer 3 (38 of 40 rows)"
        ),
        "{text}"
    );
    let good = a.runs.iter().find(|r| r.run_id == "read-right").unwrap();
    assert!(!good.capture_inconsistent() && !good.has_verdict());
    assert!(good.judged(Question::Topk));
    assert!(
        render_terminal_of(good).contains(
            "  capture self-check: 1 layer, 40 informative rows, every selection production's own scores' top-k (tolerance 1e-3; scores recomputed: production's FP8 q, k and scales)\n"
        )
    );
    let inspected = shadowtrace_analyzer::inspect::render_run(
        &shadowtrace_analyzer::Run::open(&paths[0]).unwrap(),
    );
    assert!(
        inspected.contains("CAPTURE    CAPTURE INCONSISTENT at layer 3: 38 of 40"),
        "{inspected}"
    );
    assert!(
        inspected.contains("- capture inconsistent at layer 3 (38 of 40 rows) (leaves not judged: top-k divergence)"),
        "{inspected}"
    );
}

#[test]
fn an_unreadable_capture_check_leaves_top_k_not_judged() {
    let tmp = tempfile::tempdir().unwrap();
    let paths = write(tmp.path(), &[clean("garbled")]);
    with_capture_check(
        &paths[0],
        serde_json::json!({"3": {"rows": 1, "disagree": 5, "first_token": 0}}),
    );
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    let run = &a.runs[0];
    assert!(!run.judged(Question::Topk));
    assert!(run.capture_check.is_none());
    assert!(
        why_not_judged(&run.not_measured, Question::Topk)
            .unwrap()
            .contains("settings.capture_check: layer 3: 5 rows disagree of 1 checked")
    );
}
