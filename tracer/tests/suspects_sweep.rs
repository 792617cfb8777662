//! The suspects sweep on a small GLM-shaped checkpoint: the paths run in
//! lockstep from the same embeddings, so a deviation planted at one layer
//! leaves every earlier layer bit-identical to the clean path and departs
//! from it at that layer; a deviation the model's reference already runs is
//! not run, with the reason; the report and its files are written.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use shadowtrace_schemas::text_table::TABLE_COLUMNS;
use shadowtrace_tracer::model::deviation::{Deviation, DeviationKind};
use shadowtrace_tracer::model::{Model, synthetic};
use shadowtrace_tracer::suspects::prompts::demo_prompt;
use shadowtrace_tracer::suspects::report::{Report, Thresholds, render_terminal};
use shadowtrace_tracer::suspects::sweep::{
    PathSpec, ProdLinears, SweepOptions, SweepPrompt, plan, sweep,
};
use shadowtrace_tracer::suspects::write_report;
use tch::Device;

fn at(kind: DeviationKind, layer: i64) -> PathSpec {
    PathSpec::of(vec![Deviation {
        kind,
        layer: Some(layer),
        param: None,
    }])
}

#[test]
fn a_deviation_planted_at_a_layer_departs_from_the_clean_path_there_and_not_before() {
    let tmp = tempfile::tempdir().unwrap();
    let mut config = synthetic::glm51_config(3);
    // k = 64: 256-token prompts reach the sparse regime.
    config["index_topk"] = 64.into();
    synthetic::write(tmp.path(), &config, 5).unwrap();
    let model = Model::open(tmp.path(), Device::Cpu).unwrap();
    let requested = [
        at(DeviationKind::IndexerRopeNeox, 1),
        at(DeviationKind::KvSlotNan, 2),
        PathSpec::of(vec![Deviation::everywhere(
            DeviationKind::IndexerRopeInterleaved,
        )]),
    ];
    let (paths, not_run) = plan(&model, None, ProdLinears::Fp8, &requested);
    let names: Vec<&str> = paths.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["clean", "indexer_rope_neox@1", "kv_slot_nan@2"]);
    assert_eq!(not_run.len(), 1);
    assert_eq!(
        (not_run[0].path.as_str(), not_run[0].reason.as_str()),
        (
            "indexer_rope_interleaved",
            "the model's indexer RoPE is interleaved already"
        )
    );
    let prompts: Vec<SweepPrompt> = [("tool", true), ("no_tool", false)]
        .into_iter()
        .map(|(kind, tool)| SweepPrompt {
            kind: kind.to_owned(),
            ids: demo_prompt(tool, 256),
        })
        .collect();
    let mut progress = Vec::new();
    let mut result = tch::no_grad(|| {
        sweep(&model, &prompts, &paths, &SweepOptions::default(), |p| {
            progress.push((p.done, p.layers));
        })
    })
    .unwrap();
    assert_eq!(progress, [(1, 3), (2, 3), (3, 3)], "one report per layer");
    assert_eq!(result.cells.len(), 6, "3 paths x 2 prompts");

    for cell in &result.cells {
        let l = &cell.layers;
        assert_eq!(l.len(), 3, "{}", cell.path);
        assert!(
            l.iter()
                .all(|m| m.informative_rows == 256 - 64 && m.dense_rows == 64),
            "{}: rows past k are informative",
            cell.path
        );
        match cell.path.as_str() {
            "clean" => {
                assert!(cell.onset.is_none());
                let logits = cell.logits.as_ref().expect("logits against the reference");
                assert!((0.0..=1.0).contains(&logits.argmax_agreement.unwrap()));
            }
            "indexer_rope_neox@1" => {
                assert_eq!(l[0].topk_jaccard_vs_clean, Some(1.0));
                assert_eq!(l[0].hidden_p95_vs_clean, Some(0.0));
                let j = l[1].topk_jaccard_vs_clean.unwrap();
                assert!(j < 0.9, "{}: NeoX pairs on GLM move top-k: {j}", cell.kind);
                assert!(l[1].hidden_p95_vs_clean.unwrap() > 0.0);
                assert!(cell.onset.is_none());
            }
            "kv_slot_nan@2" => {
                for m in &l[..2] {
                    assert_eq!(m.topk_jaccard_vs_clean, Some(1.0));
                    assert_eq!(m.hidden_p95_vs_clean, Some(0.0));
                }
                let onset = cell.onset.as_ref().expect("the NaN is an onset");
                assert_eq!(
                    (onset.layer, onset.site.as_str(), onset.token),
                    (2, "attn_out", 0)
                );
                assert!(l[2].hidden_nonfinite_tokens > 0);
            }
            other => panic!("unexpected path {other}"),
        }
    }

    result.not_run = not_run;
    let report = Report::new("tiny-glm", None, Thresholds::default(), result, None);
    let text = render_terminal(&report, None);
    let narrow = render_terminal(&report, Some(TABLE_COLUMNS));
    for line in narrow.lines() {
        assert!(line.chars().count() <= TABLE_COLUMNS, "{line}\n{narrow}");
    }
    assert!(
        text.lines().any(|l| l.chars().count() > TABLE_COLUMNS)
            && text.contains("max p95 vs clean  argmax"),
        "--wide prints every column:\n{text}"
    );
    assert!(
        narrow.contains("(left out to fit 100 columns: max p95 vs clean,")
            && !narrow.contains("max p95 vs clean  argmax"),
        "the narrow table names what it left out:\n{narrow}"
    );
    assert!(
        text.contains("falls below 0.8"),
        "the threshold is printed:\n{text}"
    );
    assert!(
        text.contains("the model's indexer RoPE is interleaved already"),
        "{text}"
    );
    let out = tmp.path().join("report");
    let files = write_report(&out, &report).unwrap();
    for name in [
        "suspects.md",
        "suspects.json",
        "plots/topk_jaccard_vs_length_tool.svg",
    ] {
        assert!(out.join(name).is_file(), "{name} in {files:?}");
    }
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("suspects.json")).unwrap()).unwrap();
    assert_eq!(json["sweep"]["paths"].as_array().unwrap().len(), 3);
}

#[test]
fn a_bf16_production_sweep_runs_its_clean_path_without_fp8_and_departs_less_from_fp32() {
    // An observed bf16 run (transformers on a bf16 checkpoint) is ranked
    // against a clean path in bf16: the FP8 clean path would sit an FP8
    // error away from it before any deviation acts.
    let tmp = tempfile::tempdir().unwrap();
    let mut config = synthetic::glm51_config(2);
    config["index_topk"] = 64.into();
    synthetic::write(tmp.path(), &config, 5).unwrap();
    let model = Model::open(tmp.path(), Device::Cpu).unwrap();
    let (paths, _) = plan(&model, None, ProdLinears::Fp8, &[]);
    let prompts = [SweepPrompt {
        kind: "tool".to_owned(),
        ids: demo_prompt(true, 256),
    }];
    let run = |prod| {
        let opts = SweepOptions {
            prod,
            ..SweepOptions::default()
        };
        tch::no_grad(|| sweep(&model, &prompts, &paths, &opts, |_| {})).unwrap()
    };
    let (fp8, bf16) = (run(ProdLinears::Fp8), run(ProdLinears::Bf16));
    assert_eq!((fp8.prod, bf16.prod), (ProdLinears::Fp8, ProdLinears::Bf16));
    let p95 = |s: &shadowtrace_tracer::suspects::sweep::Sweep| -> Vec<f64> {
        s.cells[0]
            .layers
            .iter()
            .map(|l| l.hidden_p95.unwrap())
            .collect()
    };
    let (e8, e16) = (p95(&fp8), p95(&bf16));
    // bf16 rounding (2^-9) sits well under FP8's (2^-4 per element, ~1e-2 per layer).
    for (a, b) in e8.iter().zip(&e16) {
        assert!(b < a, "bf16 {e16:?} against fp8 {e8:?}");
    }
    let report = Report::new(
        "bf16",
        None,
        Thresholds {
            hidden: 0.1,
            topk: 0.8,
        },
        bf16,
        None,
    );
    assert!(
        render_terminal(&report, None).contains("production: bf16 linears, no FP8"),
        "the report names the production it ran"
    );
}

#[test]
fn the_fp8_indexer_deviations_move_the_selection_of_a_bf16_production_on_the_trained_glm() {
    // Issue 40: against observed bf16 runs (transformers on glm5-tiny), the sweep runs
    // production with bf16 linears; the FP8 indexer deviations must still quantize that
    // production's indexer, as an FP8 indexer patched into transformers does (which moves
    // the observed Jaccard from 0.999 to 0.977). They used to act only beside FP8 linears,
    // so on this path they gave the clean path's selection on every layer.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/glm5-tiny");
    let model = Model::open(&dir, Device::Cpu).unwrap();
    let requested: Vec<PathSpec> = [
        DeviationKind::IndexerFp8,
        DeviationKind::IndexerKCacheFp8,
        DeviationKind::HadamardDropped,
    ]
    .into_iter()
    .map(|kind| PathSpec::of(vec![Deviation::everywhere(kind)]))
    .collect();
    let (paths, not_run) = plan(&model, None, ProdLinears::Bf16, &requested);
    assert!(not_run.is_empty(), "{not_run:?}");
    // 2560 tokens: the last 512 queries choose among more keys than k = 2048.
    let prompts = [SweepPrompt {
        kind: "tool".to_owned(),
        ids: demo_prompt(true, 2560),
    }];
    let opts = SweepOptions {
        prod: ProdLinears::Bf16,
        ..SweepOptions::default()
    };
    let result = tch::no_grad(|| sweep(&model, &prompts, &paths, &opts, |_| {})).unwrap();
    for cell in result.cells.iter().filter(|c| c.path != "clean") {
        let vs_clean: Vec<f64> = cell
            .layers
            .iter()
            .map(|l| l.topk_jaccard_vs_clean.unwrap())
            .collect();
        assert!(
            vs_clean.iter().any(|j| *j < 1.0),
            "{}: the selection equals the clean path's on every layer: {vs_clean:?}",
            cell.path
        );
    }
}
