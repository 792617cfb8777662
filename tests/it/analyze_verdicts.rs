//! Every metric and verdict on synthetic runs whose answer is known by
//! construction: a planted NaN, hidden-state divergence from a layer on, a
//! selection collapse at a layer, churn only among tied scores at the
//! boundary, and a clean run.

use std::path::{Path, PathBuf};

use shadowtrace_analyzer::verdict::Thresholds;
use shadowtrace_analyzer::{Analysis, Options, RunAnalysis, analyze};
use shadowtrace_tracer::WriterOptions;
use shadowtrace_tracer::synth::SynthSpec;

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
    assert_eq!(run.logits.as_ref().unwrap().argmax_agreement, 1.0);
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
            "top-k: first layer whose mean Jaccard (churn within the recorded band excluded) falls below 0.8",
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
            churn_margin: Some(0.0),
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
        ("first", "second", 1.0)
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
