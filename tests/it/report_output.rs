//! The terminal grid table and the Markdown report are pinned: people read
//! them. The report directory also holds plots and the metrics as Parquet.

use polars::prelude::{ParquetReader, SerReader};
use shadowtrace_analyzer::report::{
    NO_ROWS, TOPK_CHART, heatmap_file, render_markdown, render_terminal, write_report,
};
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
                    engine_assumed: false,
                }],
                ..deepseek("ds-tool")
            },
            SynthSpec {
                prompt_kind: "no_tool".to_owned(),
                ..deepseek("ds-plain")
            },
        ],
    );
    // The DeepSeek no-tool run lost its indexer capture in an earlier
    // request: its top-k verdict is not judged.
    crate::support::edit_manifest(&paths[3], |m| {
        m["settings"]["disabled_sites"] =
            serde_json::json!({"vllm:indexer": "RuntimeError: planted"});
    });
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
        "plots/overlap_heatmap_glm-plain.png",
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
    // One legend entry per group, labelled by its key, in the grid's order.
    let legend: Vec<usize> = a
        .grid
        .groups
        .iter()
        .map(|g| {
            let label = g
                .key
                .join(" / ")
                .replace('&', "&amp;")
                .replace('<', "&lt;")
                .replace('>', "&gt;");
            svg.find(&format!(">\n{label}\n</text>"))
                .unwrap_or_else(|| panic!("{label} missing from the legend"))
        })
        .collect();
    assert!(legend.windows(2).all(|w| w[0] < w[1]), "{legend:?}");
    assert!(svg.contains("threshold 0.8: a verdict below"));
    let png = std::fs::read(dir.join("plots/overlap_heatmap_glm-plain.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "a PNG");
}

#[test]
fn length_buckets_order_the_grid_by_length_not_by_text() {
    let tmp = tempfile::tempdir().unwrap();
    // k = 16: 16 tokens is <=16, 24 is 17-32, 64 is >32; as text, 17-32
    // would come first.
    let paths = write(
        tmp.path(),
        &[64, 16, 24].map(|tokens| SynthSpec {
            tokens,
            ..clean(&format!("glm-{tokens}"))
        }),
    );
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    let buckets: Vec<&str> = a.grid.groups.iter().map(|g| g.key[2].as_str()).collect();
    assert_eq!(buckets, ["<=16", "17-32", ">32"]);
    // The line chart's legend in the same order; the group at 16 tokens (no
    // query sees more than k = 16 keys) is listed and says why it has no line.
    let dir = tmp.path().join("report");
    write_report(&dir, &a).unwrap();
    let svg = std::fs::read_to_string(dir.join("plots").join(TOPK_CHART)).unwrap();
    let legend: Vec<usize> = [
        format!("&lt;=16 ({NO_ROWS})"),
        "17-32".to_owned(),
        "&gt;32".to_owned(),
    ]
    .iter()
    .map(|bucket| {
        svg.find(&format!(" / {bucket}\n</text>"))
            .unwrap_or_else(|| panic!("{bucket} missing from the legend"))
    })
    .collect();
    assert!(legend.windows(2).all(|w| w[0] < w[1]), "{legend:?}");
    // No heatmap for that run, and the report says so.
    assert!(!dir.join("plots").join(heatmap_file("glm-16")).exists());
    assert!(dir.join("plots").join(heatmap_file("glm-24")).exists());
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        md.contains(
            "No overlap heatmap for 1 run(s) without informative top-k rows \
             (no query saw more than k keys): glm-16."
        ),
        "{md}"
    );
    let by_bucket = shadowtrace_analyzer::Options {
        group_by: vec!["length_bucket".to_owned(), "model".to_owned()],
        ..Options::default()
    };
    let a = analyze(&paths, &[], &by_bucket, |_, _, _| {}).unwrap();
    assert_eq!(a.grid.comparison().columns, ["<=16", "17-32", ">32"]);
    let text = render_terminal(&a);
    let header = text
        .lines()
        .find(|l| l.contains("<=16") && l.contains(">32"))
        .expect("the side-by-side header");
    assert!(
        header.find("<=16") < header.find("17-32") && header.find("17-32") < header.find(">32")
    );
}
