//! The demo's suspects section as people read it: which deviations move
//! top-k and logits per model, and the verdicts under each synthetic
//! assumption side by side. The sweeps are built by hand with metrics whose
//! verdicts are known, so the snapshot pins the text and the assertions
//! pin the verdict rules.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use shadowtrace_schemas::stats::{Agreement, Summary};
use shadowtrace_schemas::text_table::TABLE_COLUMNS;
use shadowtrace_tracer::suspects::demo::{
    MOVES_LOGITS_ARGMAX, ModelSweep, render_markdown, render_terminal, variants,
};
use shadowtrace_tracer::suspects::profile::{Cell, LayerMetrics, Onset};
use shadowtrace_tracer::suspects::report::{Report, Thresholds};
use shadowtrace_tracer::suspects::sweep::{NotRun, ProdLinears, Sweep};

/// What one path does to one prompt: the lowest layer Jaccard against the
/// clean path, at layer `at`, and the argmax agreement with the clean path.
struct Effect {
    path: &'static str,
    j_vs_clean: f64,
    at: i64,
    argmax_vs_clean: f64,
    onset: Option<(i64, &'static str)>,
}

fn agreement(argmax: f64) -> Agreement {
    Agreement {
        positions: 256,
        nonfinite_positions: 0,
        argmax_agreement: Some(argmax),
        js_divergence: Summary::of(vec![0.01]),
    }
}

fn cell(e: &Effect, kind: &str) -> Cell {
    let layers = (0..4)
        .map(|layer| LayerMetrics {
            layer,
            topk_jaccard: Some(0.97),
            topk_jaccard_with_churn: Some(0.95),
            informative_rows: 1024,
            dense_rows: 2048,
            topk_jaccard_vs_clean: Some(if layer == e.at { e.j_vs_clean } else { 1.0 }),
            hidden_p95: Some(0.02),
            hidden_nonfinite_tokens: 0,
            hidden_p95_vs_clean: Some(0.0),
        })
        .collect();
    Cell {
        path: e.path.to_owned(),
        kind: kind.to_owned(),
        length: 3072,
        layers,
        onset: e.onset.map(|(layer, site)| Onset {
            layer,
            site: site.to_owned(),
            token: 0,
        }),
        logits: Some(agreement(0.99)),
        logits_vs_clean: Some(agreement(e.argmax_vs_clean)),
    }
}

fn model_sweep(
    model: &str,
    variant: &str,
    effects: &[Effect],
    not_run: &[(&str, &str)],
) -> ModelSweep {
    let kinds = if variant == "as drawn" || variant == "as trained" {
        vec!["tool", "no_tool"]
    } else {
        vec!["tool"]
    };
    let cells = kinds
        .iter()
        .flat_map(|kind| effects.iter().map(|e| cell(e, kind)))
        .collect();
    let sweep = Sweep {
        architecture: "glm_moe_dsa".to_owned(),
        index_topk: 2048,
        layers: 4,
        prod: ProdLinears::Fp8,
        base: "none".to_owned(),
        band: 1e-3,
        paths: effects.iter().map(|e| e.path.to_owned()).collect(),
        not_run: not_run
            .iter()
            .map(|(path, reason)| NotRun {
                path: (*path).to_owned(),
                reason: (*reason).to_owned(),
            })
            .collect(),
        cells,
        timings: Vec::new(),
        tokens: 6144,
        device: "Cpu".to_owned(),
    };
    let params = variants()
        .into_iter()
        .find(|v| v.label == variant)
        .map(|v| v.params.to_json());
    ModelSweep {
        model: model.to_owned(),
        variant: variant.to_owned(),
        report: Report::new(model, params, Thresholds::default(), sweep, None),
    }
}

fn effect(path: &'static str, j_vs_clean: f64, argmax_vs_clean: f64) -> Effect {
    Effect {
        path,
        j_vs_clean,
        at: 1,
        argmax_vs_clean,
        onset: None,
    }
}

fn sweeps() -> Vec<ModelSweep> {
    let clean = || effect("clean", 1.0, 1.0);
    let nan = || Effect {
        path: "kv_slot_nan",
        j_vs_clean: 1.0,
        at: 0,
        argmax_vs_clean: 0.0,
        onset: Some((0, "attn_out")),
    };
    vec![
        model_sweep(
            "glm-5.1-shaped",
            "as drawn",
            &[
                clean(),
                effect("indexer_rope_neox", 0.41, 0.62),
                effect("hadamard_dropped", 0.93, 0.98),
                nan(),
            ],
            &[(
                "indexer_rope_interleaved",
                "the model's indexer RoPE is interleaved already",
            )],
        ),
        model_sweep(
            "glm-5.1-shaped",
            "indexer_scale 1",
            &[
                clean(),
                effect("indexer_rope_neox", 0.55, 0.97),
                effect("hadamard_dropped", 0.71, 0.99),
                nan(),
            ],
            &[(
                "indexer_rope_interleaved",
                "the model's indexer RoPE is interleaved already",
            )],
        ),
        model_sweep(
            "glm-5.1-shaped",
            "key outliers 4 x 16",
            &[
                clean(),
                effect("indexer_rope_neox", 0.40, 0.60),
                effect("hadamard_dropped", 0.62, 0.85),
                nan(),
            ],
            &[(
                "indexer_rope_interleaved",
                "the model's indexer RoPE is interleaved already",
            )],
        ),
        model_sweep(
            "deepseek-v3.2-shaped",
            "as drawn",
            &[
                clean(),
                effect("indexer_rope_interleaved", 0.45, 0.70),
                nan(),
            ],
            &[(
                "indexer_rope_neox",
                "the model's indexer RoPE is NeoX already",
            )],
        ),
    ]
}

#[test]
fn the_demo_section_says_which_deviations_move_topk_and_logits_per_model_and_assumption() {
    let sweeps = sweeps();
    let md = render_markdown(&sweeps);
    insta::assert_snapshot!("demo_section_markdown", md);
    insta::assert_snapshot!(
        "demo_section_terminal",
        render_terminal(&sweeps, Some(TABLE_COLUMNS))
    );
    insta::assert_snapshot!("demo_section_terminal_wide", render_terminal(&sweeps, None));

    // The first table's rows, by model and deviation.
    let line = |model: &str, path: &str| {
        md.lines()
            .find(|l| l.starts_with(&format!("| {model} | {path} |")))
            .unwrap_or_else(|| panic!("no row for {model} {path} in\n{md}"))
            .to_owned()
    };
    // J 0.41 < 0.8 and argmax 0.62 < MOVES_LOGITS_ARGMAX on GLM; not run on DeepSeek.
    const { assert!(MOVES_LOGITS_ARGMAX > 0.62 && MOVES_LOGITS_ARGMAX < 0.98) };
    let neox = line("glm-5.1-shaped", "indexer_rope_neox");
    assert!(
        neox.contains("top-k + logits (J 0.41, argmax 0.62)"),
        "{neox}"
    );
    assert_eq!(
        line("deepseek-v3.2-shaped", "indexer_rope_neox"),
        "| deepseek-v3.2-shaped | indexer_rope_neox | not run | not run |"
    );
    assert!(
        md.contains(
            "- deepseek-v3.2-shaped indexer_rope_neox: the model's indexer RoPE is NeoX already\n"
        ),
        "{md}"
    );
    // J 0.93, argmax 0.98: moves neither as drawn.
    assert!(line("glm-5.1-shaped", "hadamard_dropped").contains("none (J 0.93, argmax 0.98)"));
    assert!(line("glm-5.1-shaped", "kv_slot_nan").contains("logits + NaN L0 attn_out"));
    // Side by side: the dropped Hadamard moves top-k only with an assumption switched.
    let side = md
        .lines()
        .rfind(|l| l.starts_with("| glm-5.1-shaped | hadamard_dropped |"))
        .unwrap();
    assert!(
        side.contains("| none (J 0.93, argmax 0.98) | top-k (J 0.71, argmax 0.99) | top-k + logits (J 0.62, argmax 0.85) |"),
        "{side}"
    );
}

#[test]
fn on_trained_checkpoints_the_section_says_trained_and_has_no_assumptions_table() {
    let sweeps = vec![
        model_sweep(
            "glm-5.1-shaped",
            "as trained",
            &[
                effect("clean", 1.0, 1.0),
                effect("indexer_rope_neox", 0.75, 0.96),
            ],
            &[],
        ),
        model_sweep(
            "deepseek-v3.2-shaped",
            "as trained",
            &[
                effect("clean", 1.0, 1.0),
                effect("indexer_rope_interleaved", 0.85, 0.97),
            ],
            &[],
        ),
    ];
    assert!(sweeps.iter().all(|s| s.report.synthetic_params.is_none()));
    let md = render_markdown(&sweeps);
    insta::assert_snapshot!("demo_section_trained_markdown", md);
    let terminal = render_terminal(&sweeps, Some(TABLE_COLUMNS));
    insta::assert_snapshot!("demo_section_trained_terminal", terminal);
    assert!(md.starts_with("## Suspects (trained weights)"), "{md}");
    assert!(
        terminal.starts_with("suspects (trained weights)"),
        "{terminal}"
    );
    assert!(!md.contains("synthetic assumptions"), "{md}");
    assert!(!terminal.contains("synthetic assumptions"), "{terminal}");
    // J 0.75 < 0.8 moves top-k; 0.85 does not.
    assert!(md.contains("top-k (J 0.75, argmax 0.96)"), "{md}");
    assert!(md.contains("none (J 0.85, argmax 0.97)"), "{md}");
}

/// The verdict table fits a 100-column terminal by leaving out the prompt
/// kinds but the tool prompt, and names them; `--wide` (no fit) prints them.
#[test]
fn the_verdict_table_fits_100_columns_and_names_what_it_left_out() {
    let sweeps = sweeps();
    let narrow = render_terminal(&sweeps, Some(TABLE_COLUMNS));
    let table: Vec<&str> = narrow
        .lines()
        .skip_while(|l| !l.starts_with("  model "))
        .take_while(|l| !l.is_empty())
        .collect();
    assert!(table[0].contains("tool @ 3072"), "{narrow}");
    assert!(!table[0].contains("no_tool"), "{narrow}");
    for l in table.iter().take_while(|l| !l.starts_with("  (")) {
        assert!(l.chars().count() <= TABLE_COLUMNS, "{} wide: {l}", l.len());
    }
    assert!(
        narrow.contains(
            "\n  (left out to fit 100 columns: no_tool @ 3072; --wide shows every column)\n"
        ),
        "{narrow}"
    );
    let wide = render_terminal(&sweeps, None);
    assert!(wide.contains("no_tool @ 3072"), "{wide}");
    assert!(!wide.contains("left out to fit"), "{wide}");
}
