//! `shadowtrace demo`: the main job, end to end. It writes two synthetic
//! checkpoints with the real structure of GLM-5.1 and DeepSeek-V3.2 at small
//! width, traces a grid of prompts through the reference engine (production
//! FP8 path against an fp32 shadow), plants faults in one cell, then
//! analyses the grid and writes the report, with a suspects section: every
//! deviation beside the clean production path on both shapes, and how each
//! verdict depends on the synthetic checkpoint's assumptions
//! (`shadowtrace_tracer::suspects::demo`).

#![allow(
    clippy::print_stderr,
    reason = "a command line reports progress and errors on its terminal"
)]

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use shadowtrace_analyzer::report::{REPORT_FILE, render_terminal, sizes_line, write_report};
use shadowtrace_analyzer::{Options, analyze};
use shadowtrace_schemas::MANIFEST_FILE;
use shadowtrace_tracer::identity::SALT_FILE;
use shadowtrace_tracer::model::fault::{Fault, NonFiniteValue};
use shadowtrace_tracer::model::{Model, synthetic};
use shadowtrace_tracer::suspects::demo::{self as suspects_demo, ModelSweep};
use shadowtrace_tracer::suspects::prompts::demo_prompt;
use shadowtrace_tracer::suspects::report::{Report, Thresholds};
use shadowtrace_tracer::suspects::sweep::{PathSpec, SweepOptions, SweepPrompt, plan, sweep};
use shadowtrace_tracer::trace::{Mode, TraceOptions, trace};
use tch::Device;

const TOOLS: &str = include_str!("../../demo/corpus/tools.json");
const FILLER: &str = include_str!("../../demo/corpus/filler.txt");

/// Trace a grid of prompts through two synthetic DSA models, analyse, report.
///
/// The weights are synthetic (seeded random, with the indexer's projections
/// scaled so its scores spread as a trained model's do): the runs show what
/// shadowtrace finds, not how GLM-5.1 or DeepSeek-V3.2 behave. The cell
/// glm-tool-3k carries planted faults: noise on the indexer's keys at layer
/// 1 (a top-k selection collapse) and a NaN at layer 3 mlp_out, token 2500.
///
/// The suspects section then runs every deviation (shadowtrace suspects
/// --list) beside the clean production path on checkpoints of both shapes,
/// and again with each assumption of the synthetic weights switched
/// (indexer_scale 8 -> 1; indexer-key outliers none -> 4 channels x 16), and
/// reports which deviations move top-k and logits, per model and assumption.
#[derive(Debug, Parser)]
#[command(name = "shadowtrace demo", version)]
struct Args {
    /// Directory the models, runs and report are written under; an earlier
    /// demo there is replaced.
    #[arg(long, default_value = "out/demo")]
    out: PathBuf,
    /// Prompt lengths in tokens, below and above index_topk (2048).
    #[arg(long, value_delimiter = ',', default_values_t = [1024, 3072, 6144])]
    lengths: Vec<usize>,
    /// Decoder layers of each synthetic model (the first is dense, the rest MoE).
    #[arg(long, default_value_t = 4)]
    layers: i64,
    /// Prompt lengths of the suspects section: every deviation beside the
    /// clean production path on tool and no-tool prompts, and each synthetic
    /// assumption switched on the tool prompt at the longest. The default
    /// reaches past the 5.4-5.9k tokens where the central report's
    /// corruption sets in (TensorRT-LLM issue #15295).
    #[arg(long, value_delimiter = ',', default_values_t = [3072, 6144])]
    suspects_lengths: Vec<usize>,
    /// Decoder layers of the suspects section's checkpoints (the grid's
    /// shapes, seeds and assumptions; the first layer dense, the rest MoE).
    #[arg(long, default_value_t = 2)]
    suspects_layers: i64,
    /// Leave the suspects section out (it says so in its place).
    #[arg(long)]
    no_suspects: bool,
}

/// A prompt of `length` byte-level token ids: the three tool schemas first
/// for a tool prompt, then filler text, repeated as needed.
fn prompt(tool: bool, length: usize) -> Vec<i64> {
    let mut text = String::new();
    if tool {
        text.push_str("<tools>\n");
        text.push_str(TOOLS);
        text.push_str("</tools>\n");
    }
    while text.len() < length {
        text.push_str(FILLER);
    }
    text.bytes().take(length).map(i64::from).collect()
}

fn faults() -> Vec<Fault> {
    vec![
        Fault::IndexerKey {
            layer: 1,
            scale: 3.0,
        },
        Fault::NonFinite {
            layer: 3,
            site: "mlp_out".to_owned(),
            token: 2500,
            channel: 7,
            value: NonFiniteValue::Nan,
        },
    ]
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.layers < 4 {
        bail!(
            "--layers {}: the planted faults need at least 4 layers",
            args.layers
        );
    }
    if !args.no_suspects {
        check_suspects_args(&args)?;
    }
    let runs_dir = args.out.join("runs");
    let report_dir = args.out.join("report");
    clear_previous_demo(&args.out)?;
    let device = Device::cuda_if_available();
    let models = [
        (
            "synthetic/glm-5.1-shaped",
            "glm",
            synthetic::glm51_config(args.layers),
            51_i64,
        ),
        (
            "synthetic/deepseek-v3.2-shaped",
            "ds",
            synthetic::deepseek_v32_config(args.layers),
            32,
        ),
    ];
    let started = Instant::now();
    let cells = models.len() * 2 * args.lengths.len();
    let mut done = 0;
    for (name, short, config, seed) in &models {
        let dir = args.out.join("models").join(short);
        synthetic::write(&dir, config, *seed)
            .with_context(|| format!("writing {}", dir.display()))?;
        let model = Model::open(&dir, device)?;
        for kind in ["tool", "no_tool"] {
            for &length in &args.lengths {
                let run_id = format!("{short}-{kind}-{}k", length / 1024).replace('_', "-");
                let mut opts = TraceOptions::new(name);
                opts.modes = vec![Mode::Local];
                opts.prompt_kind = Some(kind.to_owned());
                opts.tags
                    .insert("weights".to_owned(), "synthetic".to_owned());
                if run_id == "glm-tool-3k" {
                    opts.faults = faults();
                }
                let cell = Instant::now();
                let ids = prompt(kind == "tool", length);
                tch::no_grad(|| trace(&model, &ids, &run_id, &runs_dir.join(&run_id), &opts))
                    .with_context(|| format!("tracing {run_id}"))?;
                done += 1;
                eprintln!(
                    "  [{done}/{cells}] {run_id}: {length} tokens, {} layers, {:.1} s",
                    args.layers,
                    cell.elapsed().as_secs_f64()
                );
            }
        }
    }
    eprintln!(
        "traced the grid in {:.1} s; analysing",
        started.elapsed().as_secs_f64()
    );

    let analysis = analyze(
        std::slice::from_ref(&runs_dir),
        &[],
        &Options::default(),
        |_, _, _| {},
    )?;
    print!("{}", render_terminal(&analysis));
    let files = write_report(&report_dir, &analysis)?;
    let section = if args.no_suspects {
        "## Suspects (synthetic weights)\n\nNot run: `shadowtrace demo --no-suspects`.\n".to_owned()
    } else {
        let sweeps = suspects_section(&args, &models, device)?;
        println!();
        print!("{}", suspects_demo::render_terminal(&sweeps));
        suspects_demo::render_markdown(&sweeps)
    };
    append_section(&report_dir.join(REPORT_FILE), &section)?;
    println!(
        "report: {} ({})",
        report_dir.join(REPORT_FILE).display(),
        sizes_line(&files)
    );
    println!();
    println!(
        "The weights are synthetic: seeded random checkpoints with the structure of GLM-5.1 and"
    );
    println!(
        "DeepSeek-V3.2 at small width ({}), run by the reference engine",
        args.out.join("models").display()
    );
    println!(
        "with FP8 production linears and indexer against an fp32 shadow. The numbers show what"
    );
    println!(
        "shadowtrace finds, not how the real models behave. glm-tool-3k carries planted faults:"
    );
    println!("noise on the indexer's keys at layer 1 and a NaN at layer 3 mlp_out, token 2500.");
    println!(
        "Re-run the analysis with `shadowtrace analyze {}`.",
        runs_dir.display()
    );
    Ok(())
}

/// The suspects section: every deviation on each model as drawn (tool and
/// no-tool prompts at every suspects length), then with each synthetic
/// assumption switched (tool prompt, longest length), on checkpoints of the
/// grid's shapes and seeds with `--suspects-layers` layers. Each sweep's
/// own report goes to `report/suspects/MODEL-VARIANT/`.
fn suspects_section(
    args: &Args,
    models: &[(&str, &str, serde_json::Value, i64)],
    device: Device,
) -> anyhow::Result<Vec<ModelSweep>> {
    let longest = check_suspects_args(args)?;
    let variants = suspects_demo::variants();
    eprintln!(
        "suspects: every deviation on {} models, {} variants of the synthetic assumptions",
        models.len(),
        variants.len()
    );
    let mut sweeps = Vec::new();
    for (name, short, config, seed) in models {
        let model_name = name.trim_start_matches("synthetic/").to_owned();
        for (v, variant) in variants.iter().enumerate() {
            let slug = variant
                .label
                .replace(|c: char| !c.is_ascii_alphanumeric(), "-");
            let dir = args
                .out
                .join("models")
                .join(format!("{short}-suspects-{slug}"));
            let mut config = config.clone();
            config["num_hidden_layers"] = args.suspects_layers.into();
            synthetic::write_with(&dir, &config, *seed, &variant.params)
                .with_context(|| format!("writing {}", dir.display()))?;
            let model = Model::open(&dir, device)?;
            let mut prompts = Vec::new();
            let lengths: Vec<usize> = if v == 0 {
                args.suspects_lengths.clone()
            } else {
                vec![longest]
            };
            for &length in &lengths {
                for (kind, tool) in [("tool", true), ("no_tool", false)] {
                    if v == 0 || tool {
                        prompts.push(SweepPrompt {
                            kind: kind.to_owned(),
                            ids: demo_prompt(tool, length),
                        });
                    }
                }
            }
            let (paths, not_run) = plan(&model, None, &PathSpec::every_deviation());
            let started = Instant::now();
            let mut result =
                tch::no_grad(|| sweep(&model, &prompts, &paths, &SweepOptions::default(), |_| {}))
                    .with_context(|| format!("sweeping {model_name} ({})", variant.label))?;
            result.not_run = not_run;
            eprintln!(
                "  {model_name}, {}: {} paths x {} prompts x {} layers, {:.1} s",
                variant.label,
                paths.len(),
                prompts.len(),
                model.config.num_hidden_layers,
                started.elapsed().as_secs_f64()
            );
            let synthetic_params = serde_json::from_slice::<serde_json::Value>(&model.config_bytes)
                .ok()
                .and_then(|c| c.get("synthetic_params").cloned());
            let report = Report::new(
                &model_name,
                synthetic_params,
                Thresholds::default(),
                result,
                None,
            );
            let dir = args
                .out
                .join("report")
                .join("suspects")
                .join(format!("{short}-{slug}"));
            shadowtrace_tracer::suspects::write_report(&dir, &report)?;
            sweeps.push(ModelSweep {
                model: model_name.clone(),
                variant: variant.label.clone(),
                report,
            });
        }
    }
    Ok(sweeps)
}

/// The suspects section's arguments, checked before the grid runs (minutes
/// before the section would need them); the longest suspects length.
fn check_suspects_args(args: &Args) -> anyhow::Result<usize> {
    let Some(&longest) = args.suspects_lengths.iter().max() else {
        bail!("--suspects-lengths: give at least one length, or --no-suspects");
    };
    if let Some(short) = args.suspects_lengths.iter().find(|&&l| l == 0) {
        bail!("--suspects-lengths {short}: a prompt needs at least one token");
    }
    if args.suspects_layers < 1 {
        bail!(
            "--suspects-layers {}: give at least 1",
            args.suspects_layers
        );
    }
    Ok(longest)
}

/// Appends `section` to the report the analyzer wrote.
fn append_section(report: &Path, section: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(report)
        .with_context(|| format!("opening {}", report.display()))?;
    writeln!(file, "\n{section}").with_context(|| format!("writing {}", report.display()))
}

/// Removes an earlier demo; refuses a directory that holds anything else.
fn clear_previous_demo(out: &Path) -> anyhow::Result<()> {
    if !out.exists() {
        return Ok(());
    }
    let ours = |name: &str| matches!(name, "runs" | "report" | "models");
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
            if path.file_name().is_some_and(|n| n == SALT_FILE) {
                continue;
            }
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
