//! `shadowtrace suspects`: the clean production path and every deviation
//! side by side against the fp32 reference-convention shadow, and ranked
//! against observed production runs. Builds without polars
//! (`--no-default-features`); observed run directories are then read as
//! `shadowtrace analyze --format json` output instead.

#![allow(
    clippy::print_stderr,
    reason = "a command line reports progress and errors on its terminal"
)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use shadowtrace_schemas::text_table::TABLE_COLUMNS;
use shadowtrace_tracer::indexer::Fp8Indexer;
use shadowtrace_tracer::model::Model;
use shadowtrace_tracer::model::deviation::Deviation;
use shadowtrace_tracer::model::fp8_checkpoint::{planned_bytes, write_fp8};
use shadowtrace_tracer::model::synthetic::{self, SyntheticParams};
use shadowtrace_tracer::suspects::prompts::{demo_prompt, read_prompt};
use shadowtrace_tracer::suspects::rank::{Observed, observed_from_analysis, production_of, rank};
use shadowtrace_tracer::suspects::report::{Report, Thresholds, render_list, render_terminal};
use shadowtrace_tracer::suspects::sweep::{
    PathSpec, ProdLinears, SweepOptions, SweepPrompt, plan, sweep,
};
use shadowtrace_tracer::suspects::{REPORT_FILE, write_report};
use tch::Device;

/// Run the clean production path and every deviation side by side.
///
/// Each deviation (see --list) is a known engine behaviour that departs from the model's
/// reference numerics. The sweep runs the model's production path (FP8 linears, the
/// --fp8-indexer) clean and with each deviation, on every prompt at every length, layer by
/// layer with each layer's weights read once, against an fp32 shadow that takes the model's
/// conventions.
///
/// Per deviation: the first-divergence layer, the shortest length at which top-k Jaccard
/// falls below --topk-threshold, tool against no-tool prompts, and the effect on logits.
/// With --observed it ranks the deviations by how closely they reproduce observed runs.
///
/// Exit codes: 0 success, 2 bad input or error.
#[derive(Parser, Debug)]
#[command(
    name = "shadowtrace suspects",
    bin_name = "shadowtrace suspects",
    version,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    sweep: SweepArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Write a synthetic checkpoint: the demo's small shapes (BF16, one file), or
    /// --full-width: the real GLM-5.1 or DeepSeek-V3.2 widths, FP8 with 128x128
    /// weight_scale_inv blocks, one shard per layer, an index and an MTP layer.
    Checkpoint(CheckpointArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Shape {
    /// GLM-5.1 (glm_moe_dsa): indexer 32 heads, interleaved indexer RoPE.
    Glm51,
    /// DeepSeek-V3.2 (deepseek_v32): indexer 64 heads, NeoX indexer RoPE, YaRN.
    DeepseekV32,
}

#[derive(Args, Debug)]
struct CheckpointArgs {
    /// The model shape.
    #[arg(long, value_enum)]
    shape: Shape,
    /// Decoder layers (an MTP layer follows them in a --full-width checkpoint).
    #[arg(long)]
    layers: i64,
    /// Dense layers before the MoE ones [default: 1; with --full-width, 3 as published].
    #[arg(long)]
    dense_layers: Option<i64>,
    /// Directory to write; it must not hold a checkpoint.
    #[arg(long)]
    out: PathBuf,
    /// The published widths, FP8, sharded.
    #[arg(long)]
    full_width: bool,
    /// Seed of the weights.
    #[arg(long, default_value_t = 51)]
    seed: i64,
    /// Synthetic assumption: std multiple of the indexer's wq_b and wk.
    #[arg(long, default_value_t = SyntheticParams::default().indexer_scale)]
    indexer_scale: f64,
    /// Synthetic assumption: outlier channels of the indexer's key.
    #[arg(long, default_value_t = SyntheticParams::default().k_outlier_dims)]
    k_outlier_dims: i64,
    /// Synthetic assumption: their LayerNorm weight.
    #[arg(long, default_value_t = SyntheticParams::default().k_outlier_gain)]
    k_outlier_gain: f64,
}

#[derive(Args, Debug)]
struct SweepArgs {
    /// Model directory: config.json and safetensors (sharded with an index, FP8 or BF16).
    #[arg(long, required_unless_present = "list")]
    model: Option<PathBuf>,
    /// Prompt files as KIND=FILE (kind tool, no_tool or a word of yours), cut to each length:
    /// a JSON list of token ids, or text read as byte-level ids. Repeatable.
    #[arg(long, value_name = "KIND=FILE")]
    prompts: Vec<String>,
    /// The demo's tool and no-tool prompts (three JSON function schemas and filler text,
    /// byte-level ids; vocabularies of 256 or more).
    #[arg(long)]
    demo_prompts: bool,
    /// Prompt lengths in tokens.
    #[arg(long, value_delimiter = ',', required_unless_present = "list")]
    lengths: Vec<usize>,
    /// Deviations to run, comma-separated, NAME+NAME for several in one path [default:
    /// every deviation, each alone].
    #[arg(long, value_delimiter = ',')]
    deviations: Vec<String>,
    /// The production FP8 indexer the deviations depart from: none (the default; no FP8 in
    /// the indexer, as transformers computes it), deepseek_reference, sglang, trtllm or vllm.
    ///
    /// none, unlike `run` and `bisect` (trtllm), on purpose: here the FP8 indexer is itself a
    /// suspect (deviations indexer_fp8, hadamard_dropped, indexer_k_cache_fp8), which a
    /// production that had one already would hide.
    #[arg(long, default_value = "none", value_name = "NAME")]
    fp8_indexer: String,
    /// Write suspects.md, suspects.json and plots/*.svg into this directory.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Observed production runs to rank the deviations against: run directories (read
    /// through the analyzer), or the JSON of `shadowtrace analyze --format json`.
    /// Repeatable.
    #[arg(long)]
    observed: Vec<PathBuf>,
    /// Mean churn-free top-k Jaccard below which a layer's selection has diverged.
    #[arg(long, default_value_t = Thresholds::default().topk)]
    topk_threshold: f64,
    /// p95 relative L2 error of layer_out above which a layer has diverged.
    #[arg(long, default_value_t = Thresholds::default().hidden)]
    hidden_threshold: f64,
    /// The boundary-churn band, relative to each row's score scale (the mean |score| of the
    /// reference path's top-k), as `analyze --churn-band` and SHADOWTRACE_BOUNDARY_BAND.
    ///
    /// Keys within it of either path's k-th score are boundary churn, excluded from the
    /// churn-free Jaccard. The default is SHADOWTRACE_BOUNDARY_BAND's, the band a trace
    /// records unless told otherwise.
    #[arg(long, default_value_t = SweepOptions::default().band, value_name = "BAND")]
    churn_band: f32,
    /// Renamed --churn-band (same meaning); still read, with a warning.
    #[arg(long, hide = true, conflicts_with = "churn_band", value_name = "BAND")]
    band: Option<f32>,
    /// The model's name in the report (default: the directory name).
    #[arg(long)]
    name: Option<String>,
    /// Describe every deviation and its source, and exit.
    #[arg(long)]
    list: bool,
    /// Print every column of every table, and each line of prose whole. Without it, a
    /// table wider than 100 columns leaves out its least needed columns, and a line after
    /// it names them; prose wraps at 100.
    #[arg(long)]
    wide: bool,
}

fn main() -> ExitCode {
    shadowtrace_tracer::host_memory::keep_freed_memory();
    let cli = Cli::parse();
    let result = match &cli.command {
        Some(Command::Checkpoint(args)) => checkpoint(args),
        None => run(&cli.sweep),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", shadowtrace_schemas::error_line(&*error));
            ExitCode::from(2)
        }
    }
}

fn checkpoint(args: &CheckpointArgs) -> Result<()> {
    if args.out.join("config.json").exists() {
        bail!("{} already holds a checkpoint", args.out.display());
    }
    let params = SyntheticParams {
        indexer_scale: args.indexer_scale,
        k_outlier_dims: args.k_outlier_dims,
        k_outlier_gain: args.k_outlier_gain,
    };
    if !args.full_width {
        let dense = args.dense_layers.unwrap_or(1);
        let mut config = match args.shape {
            Shape::Glm51 => synthetic::glm51_config(args.layers),
            Shape::DeepseekV32 => synthetic::deepseek_v32_config(args.layers),
        };
        config["first_k_dense_replace"] = dense.into();
        synthetic::write_with(&args.out, &config, args.seed, &params)?;
        eprintln!("wrote {}", args.out.display());
        return Ok(());
    }
    let dense = args.dense_layers.unwrap_or(3).min(args.layers);
    let config = match args.shape {
        Shape::Glm51 => synthetic::glm51_full_config(args.layers, dense),
        Shape::DeepseekV32 => synthetic::deepseek_v32_full_config(args.layers, dense),
    };
    let gib = |b: u64| b as f64 / f64::from(1 << 30);
    eprintln!(
        "writing {} ({} layers, {dense} dense, + 1 MTP layer): {:.1} GiB",
        args.out.display(),
        args.layers,
        gib(planned_bytes(&config))
    );
    let started = std::time::Instant::now();
    let device = Device::cuda_if_available();
    let written = tch::no_grad(|| {
        write_fp8(
            &args.out,
            &config,
            &params,
            args.seed,
            device,
            |i, n, done, total| {
                eprintln!(
                    "  shard {i}/{n}: {:.1} of {:.1} GiB, {:.0} s",
                    gib(done),
                    gib(total),
                    started.elapsed().as_secs_f64()
                );
            },
        )
    })?;
    eprintln!(
        "wrote {} shards, {:.1} GiB in {:.0} s",
        written.shards.len(),
        gib(written.bytes),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The paths to run: each requested entry (NAME or NAME+NAME), or every
/// deviation alone.
fn requested_paths(entries: &[String], layers: i64) -> Result<Vec<PathSpec>> {
    if entries.is_empty() {
        return Ok(PathSpec::every_deviation());
    }
    entries
        .iter()
        .map(|entry| {
            let deviations = entry
                .split('+')
                .map(|name| {
                    let d = Deviation::parse(name.trim())?;
                    d.check(layers)?;
                    Ok(d)
                })
                .collect::<Result<Vec<_>, shadowtrace_tracer::model::deviation::DeviationError>>()
                .with_context(|| format!("--deviations {entry}"))?;
            Ok(PathSpec::of(deviations))
        })
        .collect()
}

fn prompts(args: &SweepArgs, vocab: i64) -> Result<Vec<SweepPrompt>> {
    let mut sources: Vec<(String, Vec<i64>)> = Vec::new();
    for entry in &args.prompts {
        let Some((kind, file)) = entry.split_once('=') else {
            bail!("--prompts {entry}: expected KIND=FILE, for example tool=prompt.txt");
        };
        let ids = read_prompt(Path::new(file), vocab)?;
        sources.push((kind.to_owned(), ids));
    }
    if args.demo_prompts && vocab < 256 {
        bail!(
            "--demo-prompts: byte-level ids need a vocabulary of 256 or more, the model has {vocab}"
        );
    }
    if sources.is_empty() && !args.demo_prompts {
        bail!("no prompts: give --prompts KIND=FILE or --demo-prompts");
    }
    let mut out = Vec::new();
    for &length in &args.lengths {
        if args.demo_prompts {
            for (kind, tool) in [("tool", true), ("no_tool", false)] {
                out.push(SweepPrompt {
                    kind: kind.to_owned(),
                    ids: demo_prompt(tool, length),
                });
            }
        }
        for (kind, ids) in &sources {
            if ids.len() < length {
                bail!(
                    "the {kind} prompt has {} tokens, fewer than the length {length} asked for",
                    ids.len()
                );
            }
            out.push(SweepPrompt {
                kind: kind.clone(),
                ids: ids[..length].to_vec(),
            });
        }
    }
    Ok(out)
}

fn observed(paths: &[PathBuf]) -> Result<Vec<Observed>> {
    let mut out = Vec::new();
    let (files, dirs): (Vec<&PathBuf>, Vec<&PathBuf>) = paths.iter().partition(|p| p.is_file());
    for file in files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let doc: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not JSON", file.display()))?;
        out.extend(
            observed_from_analysis(&doc)
                .map_err(anyhow::Error::msg)
                .with_context(|| file.display().to_string())?,
        );
    }
    if !dirs.is_empty() {
        out.extend(observed_dirs(&dirs)?);
    }
    Ok(out)
}

#[cfg(feature = "demo")]
fn observed_dirs(dirs: &[&PathBuf]) -> Result<Vec<Observed>> {
    use shadowtrace_analyzer::{Options, analyze};
    let dirs: Vec<PathBuf> = dirs.iter().map(|d| (*d).clone()).collect();
    let analysis = analyze(&dirs, &[], &Options::default(), |_, _, _| {})?;
    for s in &analysis.skipped {
        eprintln!("warning: observed run skipped: {s}");
    }
    observed_from_analysis(&serde_json::to_value(&analysis)?).map_err(anyhow::Error::msg)
}

#[cfg(not(feature = "demo"))]
fn observed_dirs(dirs: &[&PathBuf]) -> Result<Vec<Observed>> {
    bail!(
        "{}: this build reads no run directories (it was built without the analyzer); give the \
         JSON of `shadowtrace analyze {} --format json` instead",
        dirs[0].display(),
        dirs[0].display()
    )
}

fn run(args: &SweepArgs) -> Result<()> {
    let band = match args.band {
        Some(band) => {
            eprintln!(
                "warning: --band is renamed --churn-band, with the same meaning (relative to each \
                 row's score scale); read as --churn-band {band}"
            );
            band
        }
        None => args.churn_band,
    };
    anyhow::ensure!(
        band.is_finite() && band >= 0.0,
        "--churn-band: expected a non-negative value, got {band}"
    );
    if args.list {
        print!("{}", render_list());
        return Ok(());
    }
    let Some(model_dir) = &args.model else {
        bail!("--model is required");
    };
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.topk_threshold),
        "--topk-threshold: expected a value in [0, 1], got {}",
        args.topk_threshold
    );
    anyhow::ensure!(
        args.hidden_threshold >= 0.0,
        "--hidden-threshold: expected a non-negative value, got {}",
        args.hidden_threshold
    );
    anyhow::ensure!(
        !args.lengths.is_empty(),
        "--lengths: give at least one length"
    );
    let device = Device::cuda_if_available();
    let model = Model::open(model_dir, device)?;
    let c = &model.config;
    let base = match args.fp8_indexer.as_str() {
        "none" => None,
        name => Some(Fp8Indexer::named(name).with_context(|| {
            format!(
                "--fp8-indexer {name}: expected none, deepseek_reference, sglang, trtllm or vllm"
            )
        })?),
    };
    let requested = requested_paths(&args.deviations, c.num_hidden_layers)?;
    let prompts = prompts(args, c.vocab_size)?;
    // Read the observed runs first: a bad path fails before the sweep's minutes.
    let observed = observed(&args.observed)?;
    let prod = production_of(&observed)
        .map_err(|e| anyhow::anyhow!("--observed: {e}"))?
        .unwrap_or(ProdLinears::Fp8);
    let (paths, not_run) = plan(&model, base, prod, &requested);
    anyhow::ensure!(
        prod == ProdLinears::Fp8 || base.is_none(),
        "--fp8-indexer {}: the observed runs ran bf16 linears, and the sweep runs an engine's FP8 \
         indexer only beside FP8 linears; give it as a deviation instead (indexer_fp8, \
         hadamard_dropped, indexer_k_cache_fp8 act on bf16 production too)",
        args.fp8_indexer
    );
    if !observed.is_empty() {
        eprintln!(
            "production path: {}, as the observed runs' manifests say",
            prod.describe()
        );
    }
    let name = args.name.clone().unwrap_or_else(|| {
        model_dir
            .file_name()
            .map_or_else(|| "model".to_owned(), |n| n.to_string_lossy().into_owned())
    });
    eprintln!(
        "sweeping {name}: {} paths ({} not run: no effect on this model), {} prompts, {} layers on {device:?}",
        paths.len(),
        not_run.len(),
        prompts.len(),
        c.num_hidden_layers
    );
    let mut result = tch::no_grad(|| {
        sweep(
            &model,
            &prompts,
            &paths,
            &SweepOptions {
                prod,
                base,
                base_name: args.fp8_indexer.clone(),
                band,
                ..SweepOptions::default()
            },
            |p| {
                eprintln!(
                    "  layer {}/{}: read {:.1} s, computed {:.1} s; {:.0} s elapsed, about {:.0} s left",
                    p.done,
                    p.layers,
                    p.last.load_s,
                    p.last.compute_s,
                    p.elapsed_s,
                    p.remaining_s()
                );
            },
        )
    })?;
    result.not_run = not_run;
    let ranking = (!observed.is_empty()).then(|| rank(&result, &observed));
    let synthetic_params = serde_json::from_slice::<serde_json::Value>(&model.config_bytes)
        .ok()
        .and_then(|v| v.get("synthetic_params").cloned());
    let report = Report::new(
        &name,
        synthetic_params,
        Thresholds {
            hidden: args.hidden_threshold,
            topk: args.topk_threshold,
        },
        result,
        ranking,
    );
    print!(
        "{}",
        render_terminal(&report, (!args.wide).then_some(TABLE_COLUMNS))
    );
    if let Some(dir) = &args.report {
        write_report(dir, &report)?;
        eprintln!("report: {}", dir.join(REPORT_FILE).display());
    }
    Ok(())
}
