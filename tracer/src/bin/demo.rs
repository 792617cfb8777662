//! `shadowtrace demo`: the main job, end to end. It opens the two trained
//! checkpoints with the real structure of GLM-5.1 and DeepSeek-V3.2 at small
//! width (`models/README.md`), traces a grid of prompts through the reference
//! engine (production FP8 path against an fp32 shadow), plants faults in one
//! cell, then analyses the grid and writes the report, with a suspects
//! section: every deviation beside the clean production path on both models
//! (`shadowtrace_tracer::suspects::demo`).

#![allow(
    clippy::print_stderr,
    reason = "a command line reports progress and errors on its terminal"
)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use shadowtrace_analyzer::report::{
    REPORT_FILE, TABLE_COLUMNS, render_terminal_at, sizes_line, write_report,
};
use shadowtrace_analyzer::{Options, analyze};
use shadowtrace_schemas::MANIFEST_FILE;
use shadowtrace_tracer::bisect::Unplanted;
use shadowtrace_tracer::bisect::demo as bisect_demo;
use shadowtrace_tracer::identity::SALT_FILE;
use shadowtrace_tracer::model::Model;
use shadowtrace_tracer::model::fault::{Fault, NonFiniteValue};
use shadowtrace_tracer::progress;
use shadowtrace_tracer::suspects::demo::{self as suspects_demo, ModelSweep};
use shadowtrace_tracer::suspects::prompts::demo_prompt;
use shadowtrace_tracer::suspects::report::{Report, Thresholds};
use shadowtrace_tracer::suspects::sweep::{PathSpec, SweepOptions, SweepPrompt, plan, sweep};
use shadowtrace_tracer::trace::{Mode, TraceOptions, trace};
use tch::Device;

const TOOLS: &str = include_str!("../../demo/corpus/tools.json");
const FILLER: &str = include_str!("../../demo/corpus/filler.txt");

/// Trace a grid of prompts through two trained DSA models, analyse, report.
///
/// The models (models/README.md) are small GLM-5.1- and DeepSeek-V3.2-shaped
/// models this project trained on the Python standard library's source, with
/// the DSA recipe: 3 layers, 3.5 M parameters. They learned text, but they are
/// not GLM-5.1 or DeepSeek-V3.2. The cell glm-tool-3k carries planted faults:
/// noise on the indexer's keys at layer 1 (a top-k selection collapse) and a
/// NaN at layer 2 mlp_out, token 2500.
///
/// The suspects section then runs every deviation (shadowtrace suspects
/// --list) beside the clean production path on both models and reports which
/// deviations move top-k and logits, per model and prompt kind.
#[derive(Debug, Parser)]
#[command(name = "shadowtrace demo", bin_name = "shadowtrace demo", version)]
struct Args {
    /// Directory the runs and report are written under; an earlier demo there
    /// is replaced.
    #[arg(long, default_value = "out/demo")]
    out: PathBuf,
    /// Directory holding the trained checkpoints (glm5-tiny, dsv32-tiny).
    #[arg(long, default_value = "models")]
    models: PathBuf,
    /// Prompt lengths in tokens, below and above index_topk (2048).
    #[arg(long, value_delimiter = ',', default_values_t = [1024, 3072, 6144])]
    lengths: Vec<usize>,
    /// Prompt lengths of the suspects section: every deviation beside the
    /// clean production path on tool and no-tool prompts.
    #[arg(long, value_delimiter = ',', default_values_t = [3072])]
    suspects_lengths: Vec<usize>,
    /// Leave the suspects section out (it says so in its place).
    #[arg(long)]
    no_suspects: bool,
    /// Print every column of every table. Without it, a table wider than 100
    /// columns leaves out its least needed columns, and a line after it
    /// names them.
    #[arg(long)]
    wide: bool,
}

/// The trained checkpoints: (model name, run-id prefix, folder under --models).
const MODELS: [(&str, &str, &str); 2] = [
    ("trained/glm-5.1-shaped", "glm", "glm5-tiny"),
    ("trained/deepseek-v3.2-shaped", "ds", "dsv32-tiny"),
];

/// The layer the planted NaN goes in: the last of the trained models' three.
const NAN_LAYER: i64 = 2;

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
    named_faults().into_iter().map(|(_, f)| f).collect()
}

/// The planted faults, each with how the report names it.
fn named_faults() -> Vec<(String, Fault)> {
    vec![
        (
            "noise on the indexer's keys at layer 1".to_owned(),
            Fault::IndexerKey {
                layer: 1,
                scale: 3.0,
            },
        ),
        (
            format!("a NaN at layer {NAN_LAYER} mlp_out, token 2500"),
            Fault::NonFinite {
                layer: NAN_LAYER,
                site: "mlp_out".to_owned(),
                token: 2500,
                channel: 7,
                value: NonFiniteValue::Nan,
            },
        ),
    ]
}

/// The faulted cell's prompt length.
const FAULTED_LENGTH: usize = 3072;

/// The bisection section: glm-tool-3k's planted faults bisected one by one and together,
/// and per model whether grafting the fp32 indexer heals the clean production path. Judged
/// on the last 1024 rows, past the indexer's top-2048, where every query chooses.
fn bisection_section(models: &[(&str, &str, Model)]) -> anyhow::Result<(String, Vec<String>)> {
    let ids = prompt(true, FAULTED_LENGTH);
    let rows = serde_json::json!({"kind": "last", "n": 1024});
    let (name, _, glm) = &models[0];
    let mut opts = TraceOptions::new(name);
    opts.tokens_setting = rows.clone();
    let faults = named_faults();
    let layers = glm.config.num_hidden_layers;
    let most = u64::try_from(faults.len() + 1).unwrap_or(0)
        * (1 + shadowtrace_tracer::bisect::max_forwards(layers, 4));
    let mut bar = progress::bar(most, "bisect glm-tool-3k");
    // The reference and clean floor of glm's prompt, run once for every fault set and its heal.
    let mut unplanted = Unplanted::default();
    let bisected = tch::no_grad(|| {
        bisect_demo::bisect_faults(glm, &ids, &opts, &faults, 0.01, &mut unplanted, |step| {
            bar.set_message(step.to_owned());
            bar.inc(1);
        })
    })
    .context("bisecting glm-tool-3k's faults")?;
    bar.finish_and_clear();
    let mut heals = Vec::new();
    for (name, _, model) in models {
        let mut opts = TraceOptions::new(name);
        opts.tokens_setting = rows.clone();
        let short = name.trim_start_matches("trained/");
        heals.push(
            tch::no_grad(|| bisect_demo::indexer_heal(short, model, &ids, &opts, &mut unplanted))
                .with_context(|| format!("grafting the fp32 indexer into {short}"))?,
        );
    }
    let md = bisect_demo::render_markdown(
        "glm-tool-3k's prompt (3072 tokens, the last 1024 rows compared)",
        &bisected,
        &heals,
    );
    let mut lines: Vec<String> = bisected
        .iter()
        .map(|f| format!("bisect {}: {}", f.planted, f.bisection.summary()))
        .collect();
    lines.extend(heals.iter().map(bisect_demo::IndexerHeal::line));
    Ok((md, lines))
}

fn main() -> ExitCode {
    shadowtrace_tracer::host_memory::keep_freed_memory();
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", shadowtrace_schemas::error_line(&*error));
            ExitCode::from(2)
        }
    }
}

fn run(args: &Args) -> anyhow::Result<()> {
    if !args.no_suspects {
        check_suspects_args(args)?;
    }
    let device = Device::cuda_if_available();
    let mut models = Vec::new();
    for (name, short, folder) in MODELS {
        let dir = args.models.join(folder);
        if !dir.join("config.json").is_file() {
            bail!(
                "no trained checkpoint at {}: run the demo from the repository root, or give \
                 --models the folder holding {folder}",
                dir.display()
            );
        }
        let model =
            Model::open(&dir, device).with_context(|| format!("opening {}", dir.display()))?;
        if model.config.num_hidden_layers <= NAN_LAYER {
            bail!(
                "{}: {} layers; the planted NaN needs layer {NAN_LAYER}",
                dir.display(),
                model.config.num_hidden_layers
            );
        }
        models.push((name, short, model));
    }
    let runs_dir = args.out.join("runs");
    let report_dir = args.out.join("report");
    clear_previous_demo(&args.out)?;
    let started = Instant::now();
    let cells = models.len() * 2 * args.lengths.len();
    let mut bar = progress::bar(u64::try_from(cells).unwrap_or(0), "grid");
    for (name, short, model) in &models {
        for kind in ["tool", "no_tool"] {
            for &length in &args.lengths {
                let run_id = format!("{short}-{kind}-{}k", length / 1024).replace('_', "-");
                bar.set_message(format!("{run_id}: {length} tokens"));
                let mut opts = TraceOptions::new(name);
                opts.modes = vec![Mode::Local];
                opts.prompt_kind = Some(kind.to_owned());
                opts.tags.insert("weights".to_owned(), "trained".to_owned());
                if run_id == "glm-tool-3k" {
                    opts.faults = faults();
                }
                let ids = prompt(kind == "tool", length);
                tch::no_grad(|| trace(model, &ids, &run_id, &runs_dir.join(&run_id), &opts))
                    .with_context(|| format!("tracing {run_id}"))?;
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    eprintln!(
        "traced the grid ({cells} runs, {} layers each) in {:.1} s; analysing",
        models
            .iter()
            .map(|m| m.2.config.num_hidden_layers)
            .max()
            .unwrap_or(0),
        started.elapsed().as_secs_f64()
    );

    let analysis = analyze(
        std::slice::from_ref(&runs_dir),
        &[],
        &Options::default(),
        |_, _, _| {},
    )?;
    let fit = (!args.wide).then_some(TABLE_COLUMNS);
    print!("{}", render_terminal_at(&analysis, fit));
    let files = write_report(&report_dir, &analysis)?;
    let section = if args.no_suspects {
        "## Suspects (trained weights)\n\nNot run: `shadowtrace demo --no-suspects`.\n".to_owned()
    } else {
        let sweeps = suspects_section(args, &models)?;
        println!();
        print!("{}", suspects_demo::render_terminal(&sweeps, fit));
        suspects_demo::render_markdown(&sweeps)
    };
    let models_text = models_section(&args.models, &models);
    append_section(
        &report_dir.join(REPORT_FILE),
        &format!("## The models\n\n{models_text}"),
    )?;
    append_section(&report_dir.join(REPORT_FILE), &section)?;
    let (bisection_md, bisection_lines) = bisection_section(&models)?;
    append_section(&report_dir.join(REPORT_FILE), &bisection_md)?;
    println!(
        "report: {} ({})",
        report_dir.join(REPORT_FILE).display(),
        sizes_line(&files)
    );
    println!(
        "demo: {:.0} s in all on {}",
        started.elapsed().as_secs_f64(),
        if device.is_cuda() {
            "the GPU"
        } else {
            "the CPU"
        }
    );
    println!();
    println!("{}", models_text.trim_end());
    println!(
        "Production: FP8 linears and TensorRT-LLM's FP8 indexer, against an fp32 shadow. \
         glm-tool-3k carries planted faults:"
    );
    println!(
        "noise on the indexer's keys at layer 1 and a NaN at layer {NAN_LAYER} mlp_out, token 2500."
    );
    println!(
        "Re-run the analysis with `shadowtrace analyze {}`.",
        runs_dir.display()
    );
    println!();
    println!(
        "Bisection on glm-tool-3k's prompt (argmax against the fp32 chain, the last 1024 rows):"
    );
    for line in bisection_lines {
        println!("{line}");
    }
    Ok(())
}

/// The suspects section: every deviation beside the clean production path
/// on each trained model, tool and no-tool prompts at every suspects length.
/// Each sweep's own report goes to `report/suspects/MODEL/`.
fn suspects_section(
    args: &Args,
    models: &[(&str, &str, Model)],
) -> anyhow::Result<Vec<ModelSweep>> {
    let mut sweeps = Vec::new();
    for (name, short, model) in models {
        let model_name = name.trim_start_matches("trained/").to_owned();
        let mut prompts = Vec::new();
        for &length in &args.suspects_lengths {
            for (kind, tool) in [("tool", true), ("no_tool", false)] {
                prompts.push(SweepPrompt {
                    kind: kind.to_owned(),
                    ids: demo_prompt(tool, length),
                });
            }
        }
        let (paths, not_run) = plan(
            model,
            None,
            SweepOptions::default().prod,
            &PathSpec::every_deviation(),
        );
        let layers = model.config.num_hidden_layers;
        let mut bar = progress::bar(
            u64::try_from(layers).unwrap_or(0),
            &format!("suspects {model_name}"),
        );
        bar.set_message(format!("{} paths x {} prompts", paths.len(), prompts.len()));
        let mut result = tch::no_grad(|| {
            sweep(model, &prompts, &paths, &SweepOptions::default(), |_| {
                bar.inc(1);
            })
        })
        .with_context(|| format!("sweeping {model_name}"))?;
        bar.finish_and_clear();
        result.not_run = not_run;
        eprintln!(
            "  suspects {model_name}: {} paths x {} prompts x {layers} layers",
            paths.len(),
            prompts.len(),
        );
        let report = Report::new(&model_name, None, Thresholds::default(), result, None);
        let dir = args.out.join("report").join("suspects").join(*short);
        shadowtrace_tracer::suspects::write_report(&dir, &report)?;
        sweeps.push(ModelSweep {
            model: model_name,
            variant: "as trained".to_owned(),
            report,
        });
    }
    Ok(sweeps)
}

/// The suspects section's arguments, checked before the grid runs (minutes
/// before the section would need them).
fn check_suspects_args(args: &Args) -> anyhow::Result<()> {
    if args.suspects_lengths.is_empty() {
        bail!("--suspects-lengths: give at least one length, or --no-suspects");
    }
    if let Some(short) = args.suspects_lengths.iter().find(|&&l| l == 0) {
        bail!("--suspects-lengths {short}: a prompt needs at least one token");
    }
    Ok(())
}

/// What the models are, from their training records: trained, their size,
/// their held-out loss, and what they are not.
fn models_section(models_dir: &Path, models: &[(&str, &str, Model)]) -> String {
    let mut text = String::from(
        "The models are trained (`models/README.md`): GLM-5.1- and DeepSeek-V3.2-shaped, \
         trained by this project on the Python standard library's source with the DSA recipe \
         (dense, indexer warm-up, sparse).\n",
    );
    for ((name, _, folder), (_, _, model)) in MODELS.iter().zip(models) {
        let path = models_dir.join(folder).join("training_record.json");
        let record = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
        let line = record.map_or_else(
            || format!("- {name}: no training record at {}\n", path.display()),
            |r| {
                format!(
                    "- {name}: {} parameters, {} layers, held-out {:.3} bits per byte\n",
                    r["parameters"],
                    model.config.num_hidden_layers,
                    r["heldout"]["bits_per_byte"].as_f64().unwrap_or(f64::NAN)
                )
            },
        );
        text.push_str(&line);
    }
    text.push_str(
        "\nThey learned text, but they are tiny (3 layers): not GLM-5.1's or DeepSeek-V3.2's \
         activation statistics, outlier channels or routing. A verdict here says what a trained \
         DSA model of this shape does, not what the real models do.\n",
    );
    text
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
    // `models` is what earlier demos wrote (synthetic checkpoints).
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
