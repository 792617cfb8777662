//! Analyze throughput on a GLM-5.1-sized top-k trace, side by side with
//! what a user would otherwise write: Python polars `list.set_intersection`
//! over the same Parquet files.
//!
//! The trace: 78 layers x 8192 query tokens, k = 2048 of up to 8192 visible
//! keys, prod and shadow selections (the shadow swaps 2% of prod's keys
//! among keys tied at the k-th score, recorded as boundary churn). Both
//! sides compute the per-row Jaccard of the two selections and its mean per
//! layer; shadowtrace also computes recall, the churn-free variants and the
//! distributions, and reads the run through its checks.
//!
//! Run inside `./dev`'s environment (it calls `python` with polars):
//! `cargo bench -p shadowtrace-e2e --bench analyze_throughput`
//! Environment: `SHADOWTRACE_BENCH_LAYERS` (78), `SHADOWTRACE_BENCH_TOKENS`
//! (8192), `SHADOWTRACE_BENCH_DIR` (a directory to keep the trace in
//! between runs; default a temporary one).

#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark prints its figures and stops on failure"
)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use shadowtrace_analyzer::{Options, analyze};
use shadowtrace_tracer::record::{Boundary, Selection, SelectionUnit, TopkRow};
use shadowtrace_tracer::synth::{
    SplitMix64, SynthSpec, realistic_selection_pair, symmetric_difference,
};
use shadowtrace_tracer::{RunWriter, WriterOptions};

const K: i32 = 2048;

fn env(name: &str, default: i32) -> i32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn write_trace(dir: &Path, layers: i32, tokens: i32) {
    let spec = SynthSpec {
        layers,
        tokens,
        k: K,
        ..SynthSpec::demo("glm51-sized")
    };
    let writer = RunWriter::create(dir, spec.identity(), WriterOptions::default()).unwrap();
    let mut rng = SplitMix64(1);
    for layer in 0..layers {
        for token in 0..tokens {
            let visible = token + 1;
            let (prod, shadow) = realistic_selection_pair(visible, K, 0.98, &mut rng);
            let dense = visible <= K;
            let swapped: Vec<i32> = if dense {
                Vec::new()
            } else {
                symmetric_difference(&prod, &shadow)
            };
            let selection = |indices: Vec<i32>| Selection {
                indices,
                kth_score: (!dense).then_some(1.0),
                kth_margin: (!dense).then_some(0.0),
                boundary: (!dense).then(|| Boundary {
                    indices: swapped.clone(),
                    scores: vec![1.0; swapped.len()],
                }),
            };
            let _ = writer.send(TopkRow {
                step: 0,
                layer,
                token,
                indexer_layer: layer,
                unit: SelectionUnit::TOKEN,
                k: K,
                visible,
                prod: selection(prod),
                shadow: Some(("raw".to_owned(), selection(shadow))),
                boundary_band: (!dense).then_some(1e-3),
            });
        }
    }
    writer.close().unwrap();
}

fn main() {
    let layers = env("SHADOWTRACE_BENCH_LAYERS", 78);
    let tokens = env("SHADOWTRACE_BENCH_TOKENS", 8192);
    let tmp = tempfile::tempdir().unwrap();
    let root = std::env::var("SHADOWTRACE_BENCH_DIR")
        .map_or_else(|_| tmp.path().to_owned(), PathBuf::from);
    let run = root.join(format!("glm51-{layers}x{tokens}"));
    if !run.join("manifest.json").exists() {
        let start = Instant::now();
        write_trace(&run, layers, tokens);
        println!(
            "wrote {layers} x {tokens} topk rows in {:.1} s",
            start.elapsed().as_secs_f64()
        );
    }
    let rows = f64::from(layers) * f64::from(tokens);
    let bytes: u64 = std::fs::read_dir(run.join("topk"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    println!(
        "trace: {} ({:.2} GB of topk Parquet, {rows} rows)",
        run.display(),
        bytes as f64 / 1e9
    );

    let start = Instant::now();
    let analysis = analyze(
        std::slice::from_ref(&run),
        &[],
        &Options::default(),
        |_, _, _| {},
    )
    .unwrap();
    let rust_secs = start.elapsed().as_secs_f64();
    let layer = &analysis.runs[0].topk[tokens.min(2) as usize % analysis.runs[0].topk.len()];
    println!(
        "shadowtrace analyze: {rust_secs:.2} s, {:.0} rows/s ({} threads; layer {} mean Jaccard {:.4})",
        rows / rust_secs,
        rayon::current_num_threads(),
        layer.layer,
        layer.jaccard.map_or(f64::NAN, |s| s.mean)
    );

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/polars_jaccard.py");
    let python = std::env::var("SHADOWTRACE_PYTHON").unwrap_or_else(|_| "python".to_owned());
    let out = Command::new(&python)
        .arg(script)
        .arg(run.join("topk"))
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let py_secs: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("seconds "))
        .and_then(|s| s.trim().parse().ok())
        .unwrap();
    println!(
        "python polars set_intersection: {py_secs:.2} s, {:.0} rows/s",
        rows / py_secs
    );
    println!(
        "ratio: shadowtrace is {:.2}x the speed of the polars expression",
        py_secs / rust_secs
    );
    print!(
        "{}",
        stdout
            .lines()
            .filter(|l| !l.starts_with("seconds"))
            .map(|l| format!("  polars: {l}\n"))
            .collect::<String>()
    );
}
