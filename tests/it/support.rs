//! Small runs and row builders shared by the tests.

use std::path::{Path, PathBuf};

use serde_json::Value;
use shadowtrace_analyzer::{Analysis, RunAnalysis};
use shadowtrace_schemas::MANIFEST_FILE;
use shadowtrace_tracer::record::{
    Comparison, EventRow, HiddenRow, HiddenShadow, LogitsRow, Record, Selection, SelectionUnit,
    TopLogits, TopkRow, VectorStats,
};
use shadowtrace_tracer::synth::SynthSpec;
use shadowtrace_tracer::{RunWriter, WriterOptions};

/// A synthetic run small enough to read back in a test, still with dense and
/// sparse topk rows and a planted NaN.
pub(crate) fn small_spec(run_id: &str) -> SynthSpec {
    SynthSpec {
        run_id: run_id.to_owned(),
        layers: 3,
        tokens: 48,
        hidden_size: 64,
        k: 16,
        topk_queries: 6,
        churn: 0.25,
        logits_positions: 4,
        logits_top_n: 5,
        planted_nan: Some((1, "attn_out", 30)),
        prompt_kind: "no_tool".to_owned(),
        seed: 11,
        ..SynthSpec::demo(run_id)
    }
}

/// Writes `spec`'s run at `dir/<run id>` after `edit` has changed its rows:
/// what the synthetic generator cannot plant by itself. Returns the run dir.
pub(crate) fn write_edited(
    dir: &Path,
    spec: &SynthSpec,
    edit: impl FnOnce(&mut Vec<Record>),
) -> PathBuf {
    let path = dir.join(&spec.run_id);
    let mut records = spec.records();
    edit(&mut records);
    let writer = RunWriter::create(&path, spec.identity(), WriterOptions::default()).unwrap();
    for record in records {
        let _ = writer.send(record);
    }
    writer.close().unwrap();
    path
}

/// Records in the run's manifest the content hash of each listed part as it
/// is on disk now, as the part's writer would have: for tests that rewrite a
/// part on purpose to plant what another check must find.
pub(crate) fn rehash(run: &Path) {
    edit_manifest(run, |m| {
        for entry in m["tables"].as_object_mut().unwrap().values_mut() {
            let files: Vec<String> = entry["files"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f.as_str().unwrap().to_owned())
                .collect();
            let hashes: serde_json::Map<String, serde_json::Value> = files
                .into_iter()
                .map(|f| {
                    let hash = shadowtrace_schemas::content_hash::of_file(&run.join(&f)).unwrap();
                    (f, hash.into())
                })
                .collect();
            entry["file_hashes"] = hashes.into();
        }
    });
}

/// Rewrites a run's manifest through `edit`.
pub(crate) fn edit_manifest(run: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = run.join(MANIFEST_FILE);
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut manifest);
    std::fs::write(&path, serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();
}

pub(crate) fn hidden_row(seq: i64, token: i32) -> HiddenRow {
    HiddenRow {
        seq,
        step: 0,
        layer: 0,
        site: "layer_in".to_owned(),
        token,
        numel: 8,
        prod: VectorStats {
            nan: 0,
            pos_inf: 0,
            neg_inf: 0,
            max_abs: 1.0,
            l2: 2.0,
        },
        shadow: None,
    }
}

/// Rows at the edges of what the format holds: non-finite floats, negative
/// zero, empty and padded index lists, all-null optionals.
pub(crate) fn edge_rows() -> (Vec<HiddenRow>, Vec<TopkRow>, Vec<EventRow>, Vec<LogitsRow>) {
    let hidden = vec![
        HiddenRow {
            prod: VectorStats {
                nan: 3,
                pos_inf: 1,
                neg_inf: 2,
                max_abs: f32::INFINITY,
                l2: f32::NAN,
            },
            ..hidden_row(1000, 1)
        },
        HiddenRow {
            shadow: Some(HiddenShadow {
                mode: "free".to_owned(),
                stats: VectorStats {
                    nan: 0,
                    pos_inf: 0,
                    neg_inf: 0,
                    max_abs: f32::MIN_POSITIVE / 2.0,
                    l2: -0.0,
                },
                comparison: Comparison {
                    rel_l2_err: f32::NEG_INFINITY,
                    cosine: f32::NAN,
                    max_abs_diff: f32::MAX,
                },
            }),
            ..hidden_row(1001, 2)
        },
    ];
    let topk = vec![
        TopkRow {
            step: 1,
            layer: 0,
            token: 0,
            indexer_layer: 0,
            unit: SelectionUnit::TOKEN,
            k: 2048,
            visible: 0,
            prod: Selection::default(),
            shadow: None,
            boundary_band: None,
        },
        TopkRow {
            step: 1,
            layer: 2,
            token: 9,
            indexer_layer: 1,
            unit: SelectionUnit::TOKEN,
            k: 4,
            visible: 10,
            prod: Selection {
                indices: vec![7, -1, 3, 9, -1, 0],
                kth_score: Some(f32::NAN),
                kth_margin: Some(0.0),
                boundary: Some(shadowtrace_tracer::record::Boundary {
                    indices: vec![9, 2],
                    scores: vec![0.5, 0.25],
                }),
            },
            shadow: Some((
                "dequant".to_owned(),
                Selection {
                    indices: vec![],
                    ..Selection::default()
                },
            )),
            boundary_band: Some(f32::INFINITY),
        },
    ];
    let events = vec![
        EventRow {
            seq: 1002,
            step: 1,
            layer: 2,
            site: "layer_out".to_owned(),
            path: "shadow".to_owned(),
            kind: "pos_inf".to_owned(),
            token: None,
            channel: None,
            count: 0,
            shadow_finite: None,
            check: None,
            passed: None,
            value: None,
            detail: None,
        },
        EventRow {
            seq: 1003,
            step: 1,
            layer: 0,
            site: "attn_out".to_owned(),
            path: "prod".to_owned(),
            kind: "sentinel".to_owned(),
            token: Some(0),
            channel: Some(511),
            count: 1,
            shadow_finite: Some(false),
            check: Some("kv_slot0_finite".to_owned()),
            passed: Some(false),
            value: Some(f32::NAN),
            detail: Some("reserved KV slot 0 read by padded rows".to_owned()),
        },
    ];
    let logits = vec![
        LogitsRow {
            step: 1,
            token: 5,
            prod: TopLogits::default(),
            shadow: None,
        },
        LogitsRow {
            step: 2,
            token: 6,
            prod: TopLogits {
                ids: vec![5, 1],
                logprobs: vec![-0.0, f32::NEG_INFINITY],
            },
            shadow: Some(TopLogits {
                ids: vec![1],
                logprobs: vec![-1.5],
            }),
        },
    ];
    (hidden, topk, events, logits)
}

/// The analysis of run `id` in `a`.
pub(crate) fn run<'a>(a: &'a Analysis, id: &str) -> &'a RunAnalysis {
    a.runs.iter().find(|r| r.run_id == id).unwrap()
}

/// Everything the analyzer measured in layer `layer`: top-k overlap and
/// hidden-state error at every site, as its JSON output holds them.
pub(crate) fn layer_metrics(r: &RunAnalysis, layer: i64) -> Value {
    let of = |rows: Value| -> Vec<Value> {
        rows.as_array()
            .unwrap()
            .iter()
            .filter(|row| row["layer"].as_i64() == Some(layer))
            .cloned()
            .collect()
    };
    serde_json::json!({
        "topk": of(serde_json::to_value(&r.topk).unwrap()),
        "hidden": of(serde_json::to_value(&r.hidden).unwrap()),
    })
}
