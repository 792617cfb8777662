//! `shadowtrace demo`: the main job, end to end, on synthetic runs until the
//! reference engine exists. It writes a small grid of runs through the run
//! writer (two model shapes x tool / no-tool prompts x two lengths around
//! index_topk), with faults planted in one cell, then analyses the grid
//! with the analyzer and writes the report.

#![allow(
    clippy::print_stderr,
    reason = "a command line reports progress and errors on its terminal"
)]

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use shadowtrace_analyzer::report::{REPORT_FILE, render_terminal, write_report};
use shadowtrace_analyzer::{Options, analyze};
use shadowtrace_schemas::MANIFEST_FILE;
use shadowtrace_tracer::WriterOptions;
use shadowtrace_tracer::synth::SynthSpec;

/// Write a synthetic grid of shadowtrace runs, analyse it and report.
///
/// Every number in these runs is synthetic: no model ran. The runs have the
/// shape of GLM-5 and DeepSeek-V3.2 traces (index_topk 2048, FP8 prod, FP32
/// shadow) and plant known faults in the GLM long tool-prompt cell — a NaN
/// at layer 3 and a top-k selection collapse from layer 4 — so the analysis
/// has something true to find.
#[derive(Debug, Parser)]
#[command(name = "shadowtrace demo", version)]
struct Args {
    /// Directory the runs and the report are written under; an earlier demo
    /// there is replaced.
    #[arg(long, default_value = "out/demo")]
    out: PathBuf,
}

fn grid() -> Vec<SynthSpec> {
    let mut specs = Vec::new();
    for (model, short) in [
        ("synthetic/glm5-shaped", "glm"),
        ("synthetic/deepseek-v32-shaped", "ds"),
    ] {
        for kind in ["tool", "no_tool"] {
            for tokens in [1024, 3072] {
                let faulty = short == "glm" && kind == "tool" && tokens == 3072;
                specs.push(SynthSpec {
                    run_id: format!("{short}-{kind}-{}k", tokens / 1024).replace('_', "-"),
                    model: model.to_owned(),
                    tokens,
                    prompt_kind: kind.to_owned(),
                    planted_nan: faulty.then_some((3, "mlp_out", 2500)),
                    collapse_from_layer: faulty.then_some(4),
                    seed: u64::from(tokens.unsigned_abs()) + kind.len() as u64 + short.len() as u64,
                    ..SynthSpec::demo("demo")
                });
            }
        }
    }
    specs
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runs_dir = args.out.join("runs");
    let report_dir = args.out.join("report");
    clear_previous_demo(&args.out)?;

    let specs = grid();
    eprintln!(
        "writing {} synthetic runs to {}",
        specs.len(),
        runs_dir.display()
    );
    let started = Instant::now();
    for (i, spec) in specs.iter().enumerate() {
        let dir = runs_dir.join(&spec.run_id);
        spec.write(&dir, WriterOptions::default())
            .with_context(|| format!("writing {}", dir.display()))?;
        eprintln!(
            "  [{}/{}] {} ({} tokens, {} layers)",
            i + 1,
            specs.len(),
            spec.run_id,
            spec.tokens,
            spec.layers
        );
    }
    eprintln!(
        "wrote the grid in {:.1} s; analysing",
        started.elapsed().as_secs_f64()
    );

    let analysis = analyze(
        std::slice::from_ref(&runs_dir),
        &[],
        &Options::default(),
        |_, _, _| {},
    )?;
    print!("{}", render_terminal(&analysis));
    write_report(&report_dir, &analysis)?;
    println!("report: {}", report_dir.join(REPORT_FILE).display());
    println!();
    println!(
        "These runs are synthetic: no model ran, and the weights behind their numbers do not exist."
    );
    println!(
        "They exercise the trace format, writer, reader and analyzer end to end; the faults planted"
    );
    println!(
        "in glm-tool-3k (NaN at layer 3 mlp_out token 2500, top-k collapse from layer 4) are what the"
    );
    println!(
        "analysis above should find. Re-run it with `shadowtrace analyze {}`.",
        runs_dir.display()
    );
    Ok(())
}

/// Removes an earlier demo; refuses a directory that holds anything else.
fn clear_previous_demo(out: &Path) -> anyhow::Result<()> {
    if !out.exists() {
        return Ok(());
    }
    let ours = |name: &str| matches!(name, "runs" | "report");
    for entry in std::fs::read_dir(out).with_context(|| format!("reading {}", out.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !ours(&name) {
            bail!(
                "{} holds {name}, which the demo did not write; choose another --out",
                out.display()
            );
        }
    }
    let runs = out.join("runs");
    if runs.exists() {
        for entry in std::fs::read_dir(&runs)? {
            let path = entry?.path();
            if !path.join(MANIFEST_FILE).is_file() {
                bail!(
                    "{} is not a shadowtrace run; choose another --out",
                    path.display()
                );
            }
        }
    }
    std::fs::remove_dir_all(out)
        .with_context(|| format!("removing the previous demo in {}", out.display()))
}
