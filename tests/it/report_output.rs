//! The terminal grid table and the Markdown report are pinned: people read
//! them. The report directory also holds plots and the metrics as Parquet.

use polars::prelude::{ParquetReader, SerReader};
use shadowtrace_analyzer::report::{render_markdown, render_terminal, write_report};
use shadowtrace_analyzer::{Options, analyze};
use shadowtrace_tracer::synth::SynthSpec;

use crate::analyze_verdicts::{clean, write};

fn grid() -> (tempfile::TempDir, shadowtrace_analyzer::Analysis) {
    let tmp = tempfile::tempdir().unwrap();
    let deepseek = |id: &str| SynthSpec {
        model: "synthetic/deepseek-v32-shaped".to_owned(),
        seed: 5,
        ..clean(id)
    };
    let paths = write(
        tmp.path(),
        &[
            SynthSpec {
                planted_nan: Some((1, "attn_out", 40)),
                failed_sentinel: Some((1, "kv_slot0_finite")),
                ..clean("glm-tool")
            },
            SynthSpec {
                prompt_kind: "no_tool".to_owned(),
                collapse_from_layer: Some(3),
                ..clean("glm-plain")
            },
            SynthSpec {
                divergence_from_layer: Some(2),
                // TensorRT-LLM's FP8 indexer on DeepSeek-V3.2: no Hadamard
                // where the reference rotates (PR #11899).
                conventions: vec![shadowtrace_schemas::Convention {
                    name: "indexer_hadamard".to_owned(),
                    engine: false.into(),
                    model: true.into(),
                    engine_source: "tensorrt_llm Indexer (fused_cat_fp8)".to_owned(),
                    model_source: "DeepSeek-V3.2 inference/model.py rotate_activation".to_owned(),
                }],
                ..deepseek("ds-tool")
            },
            SynthSpec {
                prompt_kind: "no_tool".to_owned(),
                ..deepseek("ds-plain")
            },
        ],
    );
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    (tmp, a)
}

#[test]
fn terminal_output_is_pinned() {
    let (_tmp, a) = grid();
    insta::assert_snapshot!(render_terminal(&a));
}

#[test]
fn markdown_report_is_pinned() {
    let (_tmp, a) = grid();
    insta::assert_snapshot!(render_markdown(
        &a,
        &["plots/topk_jaccard_vs_layer.svg".to_owned()]
    ));
}

#[test]
fn the_report_directory_holds_the_report_plots_and_metrics() {
    let (tmp, a) = grid();
    let dir = tmp.path().join("report");
    let files = write_report(&dir, &a).unwrap();
    let names: Vec<String> = files
        .iter()
        .map(|f| f.strip_prefix(&dir).unwrap().display().to_string())
        .collect();
    for expected in [
        "report.md",
        "analysis.json",
        "plots/topk_jaccard_vs_layer.svg",
        "plots/hidden_error_vs_layer.svg",
        "plots/overlap_heatmap_glm-plain.svg",
        "metrics/runs.parquet",
        "metrics/topk_layers.parquet",
        "metrics/topk_rows.parquet",
        "metrics/hidden_layers.parquet",
        "metrics/hidden_tokens.parquet",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} missing from {names:?}"
        );
    }
    let runs = ParquetReader::new(std::fs::File::open(dir.join("metrics/runs.parquet")).unwrap())
        .finish()
        .unwrap();
    assert_eq!(runs.height(), 4);
    let layers =
        ParquetReader::new(std::fs::File::open(dir.join("metrics/topk_layers.parquet")).unwrap())
            .finish()
            .unwrap();
    assert_eq!(layers.height(), 4 * 5, "4 runs x 5 layers");
    let svg = std::fs::read_to_string(dir.join("plots/topk_jaccard_vs_layer.svg")).unwrap();
    assert!(svg.starts_with("<svg"));
    assert!(
        svg.contains("synthetic/glm5-shaped / no_tool / &gt;32"),
        "one line per group, labelled by its key"
    );
    assert_eq!(svg.matches("<polyline").count(), 4, "four groups");
}
