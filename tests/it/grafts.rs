//! Grafts in the reference engine (issue 30): production takes the local
//! shadow's value at one site of one layer. Traced and read back by the
//! analyzer: every layer before the graft measures as the ungrafted run's,
//! and at the grafted site production's recorded value is the shadow's, but
//! for its rounding to production's bf16.
//!
//! A synthetic 3-layer checkpoint with index_topk 64, as the deviations'
//! tests use: the graft's mechanics hold for any weights, and a 64-key top-k
//! reaches the sparse regime in a 256-token prompt (the trained models'
//! 2048 would need prompts past 2048 tokens).

use std::path::{Path, PathBuf};

use crate::support::{layer_metrics, run};

use shadowtrace_analyzer::{Options, RunAnalysis, analyze};
use shadowtrace_tracer::model::graft::Graft;
use shadowtrace_tracer::model::{Model, synthetic};
use shadowtrace_tracer::trace::{Mode, TraceOptions, TraceRunError, trace};
use tch::Device;

const GRAFTED: i64 = 1;
const TOKENS: i64 = 256;
/// A shadow's value rounded to bf16 departs from it by at most bf16's unit
/// roundoff, 2^-8, of each element, so by at most that in relative L2 norm.
const BF16_ROUNDING: f64 = 1.0 / 256.0;

fn ids() -> Vec<i64> {
    (0..TOKENS).map(|i| (i * 37 + 11) % 256).collect()
}

fn checkpoint(dir: &Path) -> Model {
    let mut config = synthetic::glm51_config(3);
    config["index_topk"] = 64.into();
    synthetic::write(dir, &config, 13).unwrap();
    Model::open(dir, Device::Cpu).unwrap()
}

fn options(grafts: &str) -> TraceOptions {
    let mut opts = TraceOptions::new("synthetic");
    if !grafts.is_empty() {
        opts.grafts = Graft::parse_all(grafts).unwrap();
    }
    opts
}

fn traced(model: &Model, runs: &Path, name: &str, grafts: &str) -> PathBuf {
    let dir = runs.join(name);
    tch::no_grad(|| trace(model, &ids(), name, &dir, &options(grafts))).unwrap();
    dir
}

/// The largest per-token relative L2 error of production against the local
/// shadow at `site` of `layer`.
fn max_error(r: &RunAnalysis, layer: i64, site: &str) -> f64 {
    let hidden = serde_json::to_value(&r.hidden).unwrap();
    let row = hidden
        .as_array()
        .unwrap()
        .iter()
        .find(|h| {
            h["layer"].as_i64() == Some(layer) && h["site"] == site && h["shadow_mode"] == "local"
        })
        .unwrap_or_else(|| panic!("no local {site} row at layer {layer}"))
        .clone();
    row["rel_l2_err"]["max"].as_f64().unwrap()
}

fn mean_jaccard(r: &RunAnalysis, layer: i64) -> f64 {
    let topk = serde_json::to_value(&r.topk).unwrap();
    topk.as_array()
        .unwrap()
        .iter()
        .find(|t| t["layer"].as_i64() == Some(layer))
        .unwrap()["jaccard"]["mean"]
        .as_f64()
        .unwrap()
}

#[test]
fn a_graft_leaves_production_before_its_layer_bit_identical_and_takes_the_shadows_value_there() {
    let tmp = tempfile::tempdir().unwrap();
    let model = checkpoint(&tmp.path().join("model"));
    let runs = tmp.path().join("runs");
    let sites = ["attn_out", "mlp_out", "layer_out", "indexer"];
    let mut dirs = vec![traced(&model, &runs, "clean", "")];
    for site in sites {
        dirs.push(traced(&model, &runs, site, &format!("{site}@{GRAFTED}")));
    }
    let a = analyze(&dirs, &[], &Options::default(), |_, _, _| {}).unwrap();
    let clean = run(&a, "clean");
    assert!(!clean.tags.contains_key("graft"), "{:?}", clean.tags);
    for site in sites {
        let r = run(&a, site);
        assert_eq!(
            r.tags.get("graft").map(String::as_str),
            Some(format!("{site}@{GRAFTED}").as_str())
        );
        for layer in 0..GRAFTED {
            assert_eq!(
                layer_metrics(r, layer),
                layer_metrics(clean, layer),
                "{site}: layer {layer}, before the graft"
            );
        }
        if site == "indexer" {
            // The trace records what production's own indexer chose (the clean
            // run's selection), and attention read the shadow's: attn_out there
            // is no longer the clean run's.
            assert!((mean_jaccard(r, GRAFTED) - mean_jaccard(clean, GRAFTED)).abs() < 1e-12);
            assert!(mean_jaccard(clean, GRAFTED) < 1.0);
            assert!(
                (max_error(r, GRAFTED, "attn_out") - max_error(clean, GRAFTED, "attn_out")).abs()
                    > 0.0,
                "the indexer graft changed nothing downstream"
            );
        } else {
            let grafted = max_error(r, GRAFTED, site);
            let own = max_error(clean, GRAFTED, site);
            assert!(grafted <= BF16_ROUNDING, "{site}: {grafted}");
            // The check can fail: ungrafted, FP8 production departs further
            // (measured: grafted 1.9e-3 at each site; clean 0.47 at attn_out,
            // 0.40 at mlp_out, 6e-3 to 8e-3 at layer_out, whose residual
            // stream dilutes the error).
            assert!(
                own > 2.0 * grafted,
                "{site}: clean {own}, grafted {grafted}"
            );
        }
    }
    // After the graft production goes on from the shadow's value: the last
    // layer's output differs from the clean run's.
    let last = model.config.num_hidden_layers - 1;
    assert_ne!(
        layer_metrics(run(&a, "layer_out"), last),
        layer_metrics(clean, last)
    );
}

#[test]
fn a_graft_without_the_local_shadow_or_past_the_last_layer_is_refused_before_a_run_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let model = checkpoint(&tmp.path().join("model"));
    let mut free_only = options("layer_out@1");
    free_only.modes = vec![Mode::Free];
    let dir = tmp.path().join("runs").join("free");
    let err = tch::no_grad(|| trace(&model, &ids(), "free", &dir, &free_only)).unwrap_err();
    assert!(
        matches!(err, TraceRunError::GraftWithoutLocalShadow { .. }),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "graft layer_out@1: production takes the local shadow's values, and this trace runs no local shadow"
    );
    assert!(!dir.exists());
    let dir = tmp.path().join("runs").join("past");
    let err =
        tch::no_grad(|| trace(&model, &ids(), "past", &dir, &options("indexer@2-3"))).unwrap_err();
    assert_eq!(
        err.to_string(),
        "graft indexer@2-3: the model has 3 layers (0 to 2)"
    );
    assert!(!dir.exists());
}

/// A NaN planted at layer 1's mlp_out, token 100: every later row of the output is NaN.
fn nan_fault() -> shadowtrace_tracer::model::fault::Fault {
    serde_json::from_str(
        r#"{"kind":"non_finite","layer":1,"site":"mlp_out","token":100,"channel":0,"value":"nan"}"#,
    )
    .unwrap()
}

#[test]
fn a_graft_run_is_paired_with_its_base_run_and_shows_the_output_healed_and_the_onset_gone() {
    let tmp = tempfile::tempdir().unwrap();
    let model = checkpoint(&tmp.path().join("model"));
    let runs = tmp.path().join("runs");
    let traced_with = |name: &str, grafts: &str, ids: &[i64]| {
        let mut opts = options(grafts);
        opts.modes = vec![Mode::Local, Mode::Free];
        opts.faults = vec![nan_fault()];
        let dir = runs.join(name);
        tch::no_grad(|| trace(&model, ids, name, &dir, &opts)).unwrap();
        dir
    };
    let other: Vec<i64> = ids().iter().map(|i| (i + 1) % 256).collect();
    let dirs = [
        traced_with("base", "", &ids()),
        traced_with("healed", &format!("mlp_out@{GRAFTED}"), &ids()),
        traced_with("elsewhere", &format!("mlp_out@{GRAFTED}"), &other),
    ];
    let a = analyze(&dirs, &[], &Options::default(), |_, _, _| {}).unwrap();
    let grafts = a.grafts.as_ref().expect("graft runs are paired");
    let [pair] = grafts.pairs.as_slice() else {
        panic!("one pair: {grafts:?}");
    };
    assert_eq!(
        (pair.graft.as_str(), pair.base.as_str(), pair.spec.as_str()),
        ("healed", "base", "mlp_out@1")
    );
    assert_eq!(grafts.unpaired.len(), 1, "{:?}", grafts.unpaired);
    assert!(grafts.unpaired[0].starts_with("elsewhere: no ungrafted run of its prompt"));
    // Before: token 100's row and the rows attending to it are NaN; after: none, and the
    // output agrees with the free shadow as a clean FP8 production does.
    let before = pair.before.as_ref().unwrap();
    let after = pair.after.as_ref().unwrap();
    assert!(before.nonfinite_positions > 0, "{before:?}");
    assert_eq!(after.nonfinite_positions, 0);
    assert!(after.argmax_agreement.unwrap() > 0.9, "{after:?}");
    assert_eq!(pair.onset, (format!("layer {GRAFTED}"), "none".to_owned()));
    assert!(pair.notes.is_empty(), "{:?}", pair.notes);
    let line = pair.line();
    assert!(
        line.starts_with(
            "graft mlp_out@1 (healed against base): argmax agreement with the free shadow"
        ),
        "{line}"
    );
    assert!(line.ends_with("non-finite onset layer 1 -> none"), "{line}");
    // A graft changes production on purpose: it is no determinism pair of its base.
    assert!(
        a.determinism
            .iter()
            .all(|d| !(d.a == "base" && d.b == "healed")),
        "{:?}",
        a.determinism
    );
    let report = shadowtrace_analyzer::report::render_terminal(&a);
    assert!(report.contains("graft pairs (a graft run against its ungrafted base run of the same prompt)\n  graft mlp_out@1 (healed against base)"), "{report}");
}

#[test]
fn a_graft_pair_without_the_free_shadow_leaves_the_output_not_judged_and_says_why() {
    let tmp = tempfile::tempdir().unwrap();
    let model = checkpoint(&tmp.path().join("model"));
    let runs = tmp.path().join("runs");
    let dirs = [
        traced(&model, &runs, "base", ""),
        traced(&model, &runs, "grafted", "layer_out@1"),
    ];
    let a = analyze(&dirs, &[], &Options::default(), |_, _, _| {}).unwrap();
    let pair = &a.grafts.as_ref().unwrap().pairs[0];
    assert!(pair.before.is_none() && pair.after.is_none());
    assert_eq!(pair.notes.len(), 2, "{:?}", pair.notes);
    assert!(
        pair.notes[0].contains("no free shadow's logits (trace with SHADOWTRACE_MODE=local,free)")
    );
    assert!(
        pair.line()
            .contains("output against the reference not judged")
    );
    assert!(
        pair.changed.is_some(),
        "what the graft changed is still given"
    );
}

#[test]
fn a_graft_pair_says_not_judged_where_a_runs_data_is_not_whole_never_none() {
    // The graft run's hidden capture was disabled in an earlier request and its logits
    // lost rows: "none" there would be a clean verdict nothing measured.
    let tmp = tempfile::tempdir().unwrap();
    let model = checkpoint(&tmp.path().join("model"));
    let runs = tmp.path().join("runs");
    let traced_free = |name: &str, grafts: &str| {
        let mut opts = options(grafts);
        opts.modes = vec![Mode::Local, Mode::Free];
        let dir = runs.join(name);
        tch::no_grad(|| trace(&model, &ids(), name, &dir, &opts)).unwrap();
        dir
    };
    let dirs = [
        traced_free("base", ""),
        traced_free("grafted", "layer_out@1"),
    ];
    crate::support::edit_manifest(&dirs[1], |m| {
        m["settings"]["disabled_sites"] =
            serde_json::json!({"transformers:hidden": "RuntimeError: planted"});
        m["tables"]["logits"]["dropped_rows"] = 2.into();
    });
    let a = analyze(&dirs, &[], &Options::default(), |_, _, _| {}).unwrap();
    let pair = &a.grafts.as_ref().unwrap().pairs[0];
    assert_eq!(pair.hidden_first.0, "none", "the base run's data is whole");
    assert!(
        pair.hidden_first.1.starts_with("not judged: "),
        "{:?}",
        pair.hidden_first
    );
    assert!(pair.before.is_some() && pair.after.is_none() && pair.changed.is_none());
    assert!(
        pair.notes
            .iter()
            .any(|n| n.starts_with("grafted: logits not judged: ")),
        "{:?}",
        pair.notes
    );
    assert!(
        pair.line()
            .contains("first hidden divergence none -> not judged: "),
        "{}",
        pair.line()
    );

    // A graft the producer did not apply at one layer: the run's own data are whole, and
    // the pair does not judge its output.
    crate::support::edit_manifest(&dirs[1], |m| {
        m["settings"]["disabled_sites"] = serde_json::json!({});
        m["tables"]["logits"]["dropped_rows"] = 0.into();
        m["counters"]["graft_not_applied"] = 1.into();
    });
    let a = analyze(&dirs, &[], &Options::default(), |_, _, _| {}).unwrap();
    let graft_run = run(&a, "grafted");
    assert!(
        graft_run.not_measured.is_empty(),
        "{:?}",
        graft_run.not_measured
    );
    let pair = &a.grafts.as_ref().unwrap().pairs[0];
    assert!(pair.after.is_none() && pair.changed.is_none());
    assert!(
        pair.notes
            .iter()
            .any(|n| n.contains("the graft was not applied at 1 grafted layer")),
        "{:?}",
        pair.notes
    );
}

#[test]
fn a_graft_run_with_steps_served_ungrafted_from_a_cache_is_not_judged_and_says_how_many() {
    // The hooks re-run a grafted layer only on a step without a cache: a prefill served
    // from the prefix cache (or a decode step) ran ungrafted, and the run counts it
    // (`graft_skipped_cached_steps`). Judging that run as grafted would credit or blame a
    // graft that never ran.
    let tmp = tempfile::tempdir().unwrap();
    let model = checkpoint(&tmp.path().join("model"));
    let runs = tmp.path().join("runs");
    let traced_free = |name: &str, grafts: &str| {
        let mut opts = options(grafts);
        opts.modes = vec![Mode::Local, Mode::Free];
        let dir = runs.join(name);
        tch::no_grad(|| trace(&model, &ids(), name, &dir, &opts)).unwrap();
        dir
    };
    let dirs = [
        traced_free("base", ""),
        traced_free("grafted", "layer_out@1"),
    ];
    let a = analyze(&dirs, &[], &Options::default(), |_, _, _| {}).unwrap();
    let pair = &a.grafts.as_ref().unwrap().pairs[0];
    assert!(
        pair.after.is_some() && pair.changed.is_some(),
        "grafted on every step: judged ({:?})",
        pair.notes
    );
    crate::support::edit_manifest(&dirs[1], |m| {
        m["counters"]["graft_skipped_cached_steps"] = 2.into();
    });
    let a = analyze(&dirs, &[], &Options::default(), |_, _, _| {}).unwrap();
    assert!(
        run(&a, "grafted").not_measured.is_empty(),
        "the run's own data are whole"
    );
    let pair = &a.grafts.as_ref().unwrap().pairs[0];
    assert!(pair.before.is_some(), "the base run is still measured");
    assert!(pair.after.is_none() && pair.changed.is_none(), "{pair:?}");
    assert!(
        pair.notes
            .iter()
            .any(|n| n.starts_with("grafted: 2 step(s) ran ungrafted from a cache")),
        "{:?}",
        pair.notes
    );
    assert!(
        pair.line()
            .contains("output against the reference not judged (the notes say why)"),
        "{}",
        pair.line()
    );
}
