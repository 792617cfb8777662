//! Every deviation of the reference engine, planted at one layer of a
//! GLM-shaped and a DeepSeek-shaped checkpoint, traced and read back by the
//! analyzer: its effect shows at the layer it was planted in and nowhere
//! before, or, where the mathematics says it changes nothing for the model
//! (NeoX indexer RoPE on DeepSeek-V3.2, whose reference is NeoX), every
//! layer's metrics are those of the clean run and the manifest says why.
//! The convention verdict fires for the deviations that change a recorded
//! convention, and not for the clean runs.

use std::path::{Path, PathBuf};

use crate::support::{layer_metrics, run};

use serde_json::Value;
use shadowtrace_analyzer::{Analysis, Options, analyze};
use shadowtrace_tracer::model::deviation::{Deviation, DeviationKind, Effect};
use shadowtrace_tracer::model::{Model, synthetic};
use shadowtrace_tracer::trace::{TraceOptions, trace};
use tch::Device;

/// The layer every deviation is planted in: after the dense layer 0, before
/// the last layer, so "nowhere before" and "the effect propagates" both have
/// a layer to show in.
const PLANTED: i64 = 1;

/// 256 tokens: queries past the 64th select among more keys than k, and the
/// prefix-reuse deviations have a prefix of two 64-token blocks.
const TOKENS: i64 = 256;

fn ids() -> Vec<i64> {
    (0..TOKENS).map(|i| (i * 37 + 11) % 256).collect()
}

/// A 3-layer checkpoint of `config` with index_topk 64, so a short prompt
/// reaches the sparse regime the indexer deviations act in.
fn checkpoint(dir: &Path, mut config: Value) -> Model {
    config["index_topk"] = 64.into();
    synthetic::write(dir, &config, 13).unwrap();
    Model::open(dir, Device::Cpu).unwrap()
}

/// One traced run of production (no FP8 in the indexer, as transformers
/// computes it) with `deviations`; its directory.
fn traced(model: &Model, runs: &Path, name: &str, deviations: &[Deviation]) -> PathBuf {
    let mut opts = TraceOptions::new("synthetic");
    opts.fp8_indexer = None;
    opts.fp8_indexer_name = "none".to_owned();
    opts.deviations = deviations.to_vec();
    let dir = runs.join(name);
    tch::no_grad(|| trace(model, &ids(), name, &dir, &opts)).unwrap();
    dir
}

fn analysis(dirs: &[PathBuf]) -> Analysis {
    analyze(dirs, &[], &Options::default(), |_, _, _| {}).unwrap()
}

/// One planted deviation and what it was compared with.
struct Case {
    name: String,
    path: Vec<Deviation>,
    baseline: String,
}

/// `kind` at the planted layer, with a parameter that acts on a 256-token
/// prompt where its default would not: a paged-logits kernel wrong past 128
/// keys, a reduction that fails past 128, a candidate buffer of 8 (the
/// defaults, 4096 and 131072 keys, lie past the prompt).
fn at(kind: DeviationKind) -> Deviation {
    let param = match kind {
        DeviationKind::PagedLogitsPastLen | DeviationKind::ReductionZerosLarge => Some(128),
        DeviationKind::TopkDropsWinners => Some(8),
        _ => None,
    };
    Deviation {
        kind,
        layer: Some(PLANTED),
        param,
    }
}

/// Each deviation alone against the clean run; tie order on top of bf16
/// indexer logits against those logits alone, because a tie order shows only
/// where scores tie exactly, which fp32 scores of random weights never do.
fn cases(kinds: &[DeviationKind]) -> Vec<Case> {
    kinds
        .iter()
        .map(|&kind| {
            if kind == DeviationKind::TieOrder {
                Case {
                    name: "tie_order".to_owned(),
                    path: vec![at(DeviationKind::IndexerLogitsBf16), at(kind)],
                    baseline: "indexer_logits_bf16".to_owned(),
                }
            } else {
                Case {
                    name: kind.name().to_owned(),
                    path: vec![at(kind)],
                    baseline: "clean".to_owned(),
                }
            }
        })
        .collect()
}

/// Traces the clean run and every case on `config`, and checks each case's
/// effect against what [`Deviation::effect`] settles beforehand; returns the
/// runs' directory (kept while it lives), the analysis and the cases whose
/// effect is none.
fn check_every_deviation(
    config: Value,
    kinds: &[DeviationKind],
) -> (tempfile::TempDir, Analysis, Vec<String>) {
    let tmp = tempfile::tempdir().unwrap();
    let model = checkpoint(&tmp.path().join("model"), config);
    let runs = tmp.path().join("runs");
    let cases = cases(kinds);
    let mut dirs = vec![traced(&model, &runs, "clean", &[])];
    for case in &cases {
        dirs.push(traced(&model, &runs, &case.name, &case.path));
    }
    let a = analysis(&dirs);
    let layers = model.config.num_hidden_layers;
    let mut none = Vec::new();
    for case in &cases {
        let planted = case.path.last().unwrap();
        let effect = planted.effect(&model.config, None, true, &case.path);
        let (r, base) = (run(&a, &case.name), run(&a, &case.baseline));
        assert_eq!(r.deviations.len(), case.path.len(), "{}", case.name);
        let differs: Vec<i64> = (0..layers)
            .filter(|&l| layer_metrics(r, l) != layer_metrics(base, l))
            .collect();
        match effect {
            Effect::None(why) => {
                assert!(
                    differs.is_empty(),
                    "{}: none expected ({why}), metrics differ in layers {differs:?}",
                    case.name
                );
                none.push(case.name.clone());
            }
            Effect::Changes => assert_eq!(
                differs.first(),
                Some(&PLANTED),
                "{}: the effect starts where it was planted",
                case.name
            ),
        }
    }
    (tmp, a, none)
}

#[test]
fn every_deviation_shows_at_its_layer_on_glm_or_is_stated_to_have_no_effect() {
    let kinds: Vec<DeviationKind> = DeviationKind::ALL.to_vec();
    let (_tmp, a, none) = check_every_deviation(synthetic::glm51_config(3), &kinds);
    assert_eq!(
        none,
        ["indexer_rope_interleaved", "zero_rope_writer"],
        "GLM's indexer RoPE is interleaved; its RoPE writers skip the reserved slot"
    );
    let poisoned = run(&a, "kv_slot_nan");
    let onset = poisoned.onset.as_ref().expect("a NaN onset");
    assert_eq!(onset.layer, PLANTED as i32, "{onset:?}");
    assert!(run(&a, "clean").onset.is_none());
    // The NaN lies in the cache's reserved slot, where the KV sentinel looks.
    let first = poisoned
        .failed_sentinels
        .first()
        .expect("the KV sentinel sees the poisoned slot");
    assert_eq!(
        (first.check.as_str(), first.layer),
        ("kv_slot0_finite", PLANTED as i32),
        "{first:?}"
    );
    assert!(run(&a, "clean").failed_sentinels.is_empty());

    let neox = run(&a, "indexer_rope_neox");
    let lines: Vec<String> = neox
        .convention_mismatches
        .iter()
        .map(|m| m.line())
        .collect();
    assert_eq!(
        lines,
        ["convention mismatch: indexer rope: engine neox, model interleaved"]
    );
    assert!(
        run(&a, "clean").convention_mismatches.is_empty(),
        "a clean run takes every convention from the model"
    );
    let inspected = shadowtrace_analyzer::inspect::render_run(
        &shadowtrace_analyzer::Run::open(&neox.dir).unwrap(),
    );
    for line in [
        "- indexer_rope_neox (layers [1]): changes production",
        "- indexer_rope MISMATCH: neox | interleaved",
        "- rope_theta: 1000000.0 | 1000000.0",
    ] {
        assert!(
            inspected.contains(line),
            "inspect lists {line:?}:\n{inspected}"
        );
    }
    let proj = run(&a, "weights_proj_bf16");
    let lines: Vec<String> = proj
        .convention_mismatches
        .iter()
        .map(|m| m.line())
        .collect();
    assert_eq!(
        lines,
        ["convention mismatch: indexer weights proj dtype: engine bf16, model fp32"]
    );
}

#[test]
fn every_deviation_shows_at_its_layer_on_deepseek_or_is_stated_to_have_no_effect() {
    let kinds: Vec<DeviationKind> = DeviationKind::ALL
        .into_iter()
        // One prefix-reuse deviation and no kv slot here: GLM runs them all.
        .filter(|k| {
            !matches!(
                k,
                DeviationKind::KvSlotNan | DeviationKind::StalePrefixState
            )
        })
        .collect();
    let (_tmp, a, none) = check_every_deviation(synthetic::deepseek_v32_config(3), &kinds);
    assert_eq!(
        none,
        ["indexer_rope_neox", "zero_rope_writer"],
        "DeepSeek-V3.2's indexer RoPE is NeoX"
    );
    let manifest_effect = |id: &str| -> String {
        let run = shadowtrace_analyzer::Run::open(&a.runs[0].dir.with_file_name(id)).unwrap();
        run.manifest.identity.deviations[0]["effect"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(
        manifest_effect("indexer_rope_neox"),
        "none: the model's indexer RoPE is NeoX already"
    );
    assert_eq!(
        manifest_effect("indexer_rope_interleaved"),
        "changes production"
    );
    assert!(
        run(&a, "indexer_rope_neox")
            .convention_mismatches
            .is_empty()
    );
    let dropped = run(&a, "hadamard_dropped");
    let lines: Vec<String> = dropped
        .convention_mismatches
        .iter()
        .map(|m| m.line())
        .collect();
    assert_eq!(
        lines,
        ["convention mismatch: indexer hadamard: engine false, model true"]
    );
    assert!(run(&a, "clean").convention_mismatches.is_empty());
}

#[test]
fn the_zero_rope_writer_poisons_a_model_without_rotary_dimensions_at_its_layer() {
    let mut config = synthetic::glm51_config(3);
    config["qk_rope_head_dim"] = 0.into();
    let kinds = [
        DeviationKind::ZeroRopeWriter,
        DeviationKind::IndexerRopeNeox,
    ];
    let (_tmp, a, none) = check_every_deviation(config, &kinds);
    assert_eq!(
        none,
        ["indexer_rope_neox"],
        "no rotary dimensions to rotate"
    );
    let onset = run(&a, "zero_rope_writer")
        .onset
        .as_ref()
        .expect("a NaN onset");
    assert_eq!(
        (onset.layer, onset.site.as_str()),
        (PLANTED as i32, "attn_out")
    );
}
