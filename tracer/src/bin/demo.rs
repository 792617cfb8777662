//! `shadowtrace demo`: the smallest end-to-end path that exists today. It
//! writes a synthetic run through the run writer (the reference engine that
//! will produce real traces is a later piece of work), then reads it back
//! through the analyzer's loader and prints what `shadowtrace inspect` prints.

#![allow(
    clippy::print_stderr,
    reason = "a command line reports progress and errors on its terminal"
)]

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use shadowtrace_analyzer::{Run, inspect};
use shadowtrace_schemas::MANIFEST_FILE;
use shadowtrace_tracer::WriterOptions;
use shadowtrace_tracer::synth::SynthSpec;

/// Write a synthetic shadowtrace run and inspect it.
///
/// The run has the shape of a GLM-5 trace (index_topk 2048 over a 3072-token
/// prompt, FP8 prod and FP32 shadow, a NaN planted at layer 3 mlp_out token
/// 2500) but every number in it is synthetic: no model ran.
#[derive(Debug, Parser)]
#[command(name = "shadowtrace demo", version)]
struct Args {
    /// Directory the run is written under; an earlier demo run there is replaced.
    #[arg(long, default_value = "out/demo")]
    out: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let spec = SynthSpec::demo("demo-synthetic-tool-3k");
    let dir = args.out.join(&spec.run_id);
    clear_previous_run(&dir)?;

    eprintln!(
        "writing synthetic run {} ({} layers x {} tokens) to {}",
        spec.run_id,
        spec.layers,
        spec.tokens,
        dir.display()
    );
    let started = Instant::now();
    let manifest = spec
        .write(&dir, WriterOptions::default())
        .with_context(|| format!("writing {}", dir.display()))?;
    let total_rows: u64 = manifest.tables.values().map(|t| t.rows).sum();
    eprintln!(
        "wrote {total_rows} rows in {:.2} s; reading it back",
        started.elapsed().as_secs_f64()
    );

    let run = Run::open(&dir).with_context(|| format!("reading {}", dir.display()))?;
    print!("{}", inspect::render_run(&run));
    println!();
    println!("The numbers in this run are synthetic: no model ran. It exercises the trace format,");
    println!(
        "the writer and the reader end to end; inspect it again with `shadowtrace inspect {}`.",
        dir.display()
    );
    Ok(())
}

/// Removes an earlier demo run at `dir`; refuses to touch anything else.
fn clear_previous_run(dir: &Path) -> anyhow::Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    if !dir.join(MANIFEST_FILE).is_file() {
        bail!(
            "{} exists and is not a shadowtrace run; choose another --out",
            dir.display()
        );
    }
    std::fs::remove_dir_all(dir)
        .with_context(|| format!("removing the previous demo run {}", dir.display()))
}
