//! `shadowtrace run`: the reference DSA engine on a model directory
//! (`config.json` and safetensors) and prompt files; traced when
//! `SHADOWTRACE=1` (or `--out`), as the `SHADOWTRACE_*` variables say.

#![allow(
    clippy::print_stderr,
    reason = "a command line reports progress and errors on its terminal"
)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use shadowtrace_tracer::fp8::ScaleFormat;
use shadowtrace_tracer::model::fault::Fault;
use shadowtrace_tracer::model::glm5_next::{Glm5Next, is_glm5_next};
use shadowtrace_tracer::model::graft::{self, Graft};
use shadowtrace_tracer::model::{Model, Numerics};
use shadowtrace_tracer::suspects::prompts::read_prompt;
use shadowtrace_tracer::trace::production_args::{Prod, ProductionArgs, fp8_checkpoint_numerics};
use shadowtrace_tracer::trace::{TraceOptions, TraceRunError, trace, trace_glm5_next};
use tch::{Device, Kind, Tensor};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Path {
    /// fp32 throughout (the shadow).
    Fp32,
    /// bf16 throughout (the shadow).
    Bf16,
    /// FP8 block-scaled linears, bf16 activations (production): every linear's weight
    /// quantized in 128x128 blocks with ue8m0 scales, activations in 1x128 with ue8m0 scales.
    Fp8,
    /// Production as transformers runs an FP8 checkpoint: the linears it stores in FP8 on
    /// their own codes and block scales (never re-quantized), activations in 1x128 groups
    /// with fp32 scales (transformers' FP8 kernel on Hopper), every other linear in bf16.
    Fp8Checkpoint,
    /// As fp8-checkpoint, with fp32 activations and every other linear in fp32: transformers'
    /// FP8 modules in a model held in fp32, where the FP8 GEMMs are all that is low precision.
    Fp8CheckpointFp32,
}

/// Run the reference GLM-5 / DeepSeek-V3.2 / GLM-5.3-Flash engine on prompts, traced or not.
///
/// With SHADOWTRACE=1 (or --out), each prompt is traced: the production FP8 path (FP8
/// linears as --prod says, the --fp8-indexer variant, any --deviation, --fault and --graft)
/// against the shadow the SHADOWTRACE_* variables ask for, one run per prompt under
/// SHADOWTRACE_DIR (or --out); each deviation is listed in the manifest. Without, one
/// untraced pass per prompt in --path numerics, where --deviation, --fault and --graft are
/// refused. See `shadowtrace env` for the variables.
///
/// GLM-5.3-Flash (model_type glm5_next): its k-pool indexer runs in the path's own
/// numerics (--fp8-indexer none); --fault plants non_finite faults only (a layer_out
/// channel indexes a token's hc_mult streams end to end); --deviation is refused.
///
/// Exit codes: 0 success, 2 bad input (a prompt, a variable, an unknown --deviation or one
/// outside the model's layers, a --fault whose layer, site, channel, token or linear does
/// not fit the model or prompt, --path in a traced pass) or error, 143 stopped by SIGTERM
/// (the run being traced is closed incomplete with counters.interrupted; every row it sent
/// is written or counted).
#[derive(Parser, Debug)]
#[command(name = "shadowtrace run", bin_name = "shadowtrace run", version)]
struct Args {
    /// Model directory: config.json and *.safetensors (BF16, or FP8 e4m3 with weight_scale_inv).
    #[arg(long)]
    model: PathBuf,
    /// Prompt files: a JSON list of token ids, or text read as byte-level ids (vocabularies of 256 or more).
    #[arg(required = true)]
    prompts: Vec<PathBuf>,
    /// Trace into this directory (implies tracing; overrides SHADOWTRACE_DIR).
    #[arg(long)]
    out: Option<PathBuf>,
    /// The model's name in the manifests (default: the directory name).
    #[arg(long)]
    name: Option<String>,
    #[command(flatten)]
    production: ProductionArgs,
    /// Production takes the local shadow's value at SITE in LAYERS, comma-separated.
    ///
    /// At the indexer it attends over the shadow's top-k; at attn_out, mlp_out and layer_out
    /// it continues from the shadow's tensor. LAYERS: N or N-M; every layer without @. The
    /// output changes on purpose: the manifest's tags say graft, and one line says so. Traced
    /// passes with the local shadow only; not for glm5_next. Replaces SHADOWTRACE_GRAFT, which
    /// takes the same.
    #[arg(long, value_name = "SITE[@LAYERS][,...]")]
    graft: Option<String>,
    /// Numerics of an untraced pass [default: fp8]. Refused in a traced pass, whose
    /// production --prod sets.
    #[arg(long, value_enum)]
    path: Option<Path>,
    /// Write every layer's hidden states (attn_out.L, mlp_out.L, layer_out.L), indexer top-k
    /// and scores, and the logits of an untraced pass to this safetensors file (one prompt only).
    #[arg(long)]
    dump: Option<PathBuf>,
}

impl Args {
    /// Whether production (traced or not) runs as the FP8 checkpoint stores it.
    fn fp8_checkpoint(&self) -> bool {
        self.production.prod == Prod::Fp8Checkpoint
            || matches!(
                self.path,
                Some(Path::Fp8Checkpoint | Path::Fp8CheckpointFp32)
            )
    }

    /// An untraced pass's numerics: --path, fp8 by default.
    fn untraced_path(&self) -> Path {
        self.path.unwrap_or(Path::Fp8)
    }

    /// Refuses --path in a traced pass: it would be ignored there, and the run
    /// would carry numerics other than those asked for.
    fn refuse_path_when_traced(&self, traced: bool) -> Result<()> {
        if let (true, Some(path)) = (traced, self.path) {
            let why = if self.out.is_some() {
                "--out"
            } else {
                "SHADOWTRACE=1"
            };
            bail!(
                "--path {} sets an untraced pass's numerics, and {why} makes this pass \
                 traced, whose production --prod sets: drop --path",
                path.to_possible_value()
                    .map_or_else(|| format!("{path:?}"), |v| v.get_name().to_owned())
            );
        }
        Ok(())
    }
}

fn main() -> ExitCode {
    shadowtrace_tracer::host_memory::keep_freed_memory();
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", shadowtrace_schemas::error_line(&*error));
            let interrupted = error.chain().any(|e| {
                matches!(
                    e.downcast_ref::<TraceRunError>(),
                    Some(TraceRunError::Interrupted { .. })
                )
            });
            ExitCode::from(if interrupted { 128 + 15 } else { 2 })
        }
    }
}

fn run(args: &Args) -> Result<()> {
    let device = Device::cuda_if_available();
    let config = std::fs::read(args.model.join("config.json")).unwrap_or_default();
    if is_glm5_next(&config) {
        return run_glm5_next(args, device);
    }
    let model = Model::open(&args.model, device)?;
    let name = model_name(args);
    let (mut opts, on, dir) = read_env(&name)?;
    let out = args.out.clone().or_else(|| on.then(|| PathBuf::from(&dir)));
    args.refuse_path_when_traced(out.is_some())?;
    // SIGTERM ends the trace at the next layer with every row sent written or counted,
    // instead of the default immediate death that would leave the run's rows unflushed.
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())
        .context("installing the SIGTERM handler")?;
    opts.stop = Some(stop);
    if matches!(
        args.path,
        Some(Path::Fp8Checkpoint | Path::Fp8CheckpointFp32)
    ) {
        model
            .check_fp8_checkpoint()
            .context("production as the FP8 checkpoint stores it")?;
    }
    args.production.apply(&model, &mut opts)?;
    if out.is_none() && !args.production.fault.is_empty() {
        bail!("--fault plants faults in traced passes only: set SHADOWTRACE=1 or give --out");
    }
    if out.is_none() && !args.production.deviation.is_empty() {
        bail!("--deviation runs in traced passes only: set SHADOWTRACE=1 or give --out");
    }
    if let Some(spec) = &args.graft {
        // --graft replaces SHADOWTRACE_GRAFT, as --out replaces SHADOWTRACE_DIR.
        opts.grafts = Graft::parse_all(spec).context("--graft")?;
    }
    if !opts.grafts.is_empty() {
        let given = if args.graft.is_some() {
            "--graft"
        } else {
            "SHADOWTRACE_GRAFT"
        };
        if out.is_none() {
            bail!("{given} runs in traced passes only: set SHADOWTRACE=1 or give --out");
        }
        for g in &opts.grafts {
            g.check(model.config.num_hidden_layers).context(given)?;
        }
        eprintln!(
            "graft {}: production takes the local shadow's value there, so its output changes on \
             purpose (tags.graft)",
            graft::spec(&opts.grafts)
        );
    }
    if args.dump.is_some() && (out.is_some() || args.prompts.len() != 1) {
        bail!("--dump takes one prompt and an untraced pass (unset SHADOWTRACE, no --out)");
    }
    for (i, path) in args.prompts.iter().enumerate() {
        let ids = read_prompt(path, model.config.vocab_size)?;
        args.production
            .check_prompt(&model, &opts, ids.len(), &path.display().to_string())?;
        let started = std::time::Instant::now();
        let Some(out) = &out else {
            let forward = tch::no_grad(|| {
                model.forward(
                    &ids,
                    numerics(args.untraced_path(), model.checkpoint_scale_format()),
                )
            })?;
            println!(
                "{}: {} ({} layers) on {device:?}, {} tokens, {:?}: {:.2} s",
                path.display(),
                model.config.model_type,
                forward.layers.len(),
                ids.len(),
                args.untraced_path(),
                started.elapsed().as_secs_f64()
            );
            if let Some(dump) = &args.dump {
                let mut tensors: Vec<(String, Tensor)> = Vec::new();
                for (l, layer) in forward.layers.iter().enumerate() {
                    for (site, t) in [
                        ("attn_out", &layer.attn_out),
                        ("mlp_out", &layer.mlp_out),
                        ("layer_out", &layer.layer_out),
                    ] {
                        tensors.push((
                            format!("{site}.{l}"),
                            t.to_kind(Kind::Float).to_device(Device::Cpu),
                        ));
                    }
                    tensors.push((format!("topk.{l}"), layer.topk.to_device(Device::Cpu)));
                    if let Some(scores) = &layer.index_scores {
                        tensors.push((format!("index_scores.{l}"), scores.to_device(Device::Cpu)));
                    }
                }
                tensors.push(("logits".to_owned(), forward.logits.to_device(Device::Cpu)));
                Tensor::write_safetensors(&tensors, dump)
                    .with_context(|| format!("writing {}", dump.display()))?;
            }
            continue;
        };
        // A graft run sits beside its base run in one directory (one salt, so the analyzer
        // can pair them by prompt): its id says the graft.
        let mut run_id = run_id(&name, path, i);
        if !opts.grafts.is_empty() {
            run_id = path_safe(&format!("{run_id}-graft-{}", graft::spec(&opts.grafts)));
        }
        let manifest = tch::no_grad(|| trace(&model, &ids, &run_id, &out.join(&run_id), &opts))
            .with_context(|| format!("tracing {}", path.display()))?;
        eprintln!(
            "traced {} ({} tokens) into {} in {:.1} s",
            path.display(),
            ids.len(),
            out.join(manifest.run_id()).display(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// GLM-5.3-Flash: its own engine (`model::glm5_next`). Deviations and every
/// fault kind but `non_finite` act on GLM-5's layers: refused here, not ignored.
fn run_glm5_next(args: &Args, device: Device) -> Result<()> {
    let model = Glm5Next::open(&args.model, device)?;
    if !args.production.deviation.is_empty() {
        bail!("--deviation is not implemented for glm5_next (GLM-5.3-Flash)");
    }
    if args.fp8_checkpoint() {
        bail!(
            "--prod/--path fp8-checkpoint: not implemented for glm5_next (GLM-5.3-Flash): its \
             engine was checked against transformers in fp32 and bf16, not on an FP8 checkpoint"
        );
    }
    let name = model_name(args);
    let (mut opts, on, dir) = read_env(&name)?;
    if args.graft.is_some() || !opts.grafts.is_empty() {
        bail!("--graft and SHADOWTRACE_GRAFT are not implemented for glm5_next (GLM-5.3-Flash)");
    }
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())
        .context("installing the SIGTERM handler")?;
    opts.stop = Some(stop);
    if let Some(name) = args
        .production
        .fp8_indexer
        .as_deref()
        .filter(|n| *n != "none")
    {
        bail!(
            "--fp8-indexer {name}: glm5_next's k-pool indexer runs in the path's own numerics \
             (no engine FP8 indexer variant is implemented for it): give none or leave it out"
        );
    }
    opts.fp8_indexer = None;
    opts.fp8_indexer_name = "none".to_owned();
    for f in &args.production.fault {
        let fault: Fault = serde_json::from_str(f).with_context(|| format!("--fault {f}"))?;
        if !Glm5Next::supports_fault(&fault) {
            bail!("--fault {f}: glm5_next (GLM-5.3-Flash) plants non_finite faults only");
        }
        model
            .check_fault(&fault, None)
            .with_context(|| format!("--fault {f}"))?;
        opts.faults.push(fault);
    }
    let out = args.out.clone().or_else(|| on.then(|| PathBuf::from(&dir)));
    args.refuse_path_when_traced(out.is_some())?;
    if out.is_none() && !args.production.fault.is_empty() {
        bail!("--fault plants faults in traced passes only: set SHADOWTRACE=1 or give --out");
    }
    if args.dump.is_some() && (out.is_some() || args.prompts.len() != 1) {
        bail!("--dump takes one prompt and an untraced pass (unset SHADOWTRACE, no --out)");
    }
    for (i, path) in args.prompts.iter().enumerate() {
        let ids = read_prompt(path, model.config.vocab_size)?;
        for (fault, f) in opts.faults.iter().zip(&args.production.fault) {
            model
                .check_fault(fault, Some(ids.len() as i64))
                .with_context(|| format!("--fault {f} on {}", path.display()))?;
        }
        let started = std::time::Instant::now();
        let Some(out) = &out else {
            let forward = tch::no_grad(|| {
                model.forward(&ids, numerics(args.untraced_path(), ScaleFormat::Fp32))
            })?;
            println!(
                "{}: glm5_next ({} layers) on {device:?}, {} tokens, {:?}: {:.2} s",
                path.display(),
                forward.layers.len(),
                ids.len(),
                args.untraced_path(),
                started.elapsed().as_secs_f64()
            );
            if let Some(dump) = &args.dump {
                let cpu = |t: &Tensor| t.to_device(Device::Cpu);
                let mut tensors: Vec<(String, Tensor)> = Vec::new();
                for (l, layer) in forward.layers.iter().enumerate() {
                    for (site, t) in [
                        ("attn_out", &layer.attn_out),
                        ("mlp_out", &layer.mlp_out),
                        ("layer_out", &layer.layer_out),
                    ] {
                        tensors.push((format!("{site}.{l}"), cpu(&t.to_kind(Kind::Float))));
                    }
                    if let Some(tokens) = &layer.tokens {
                        tensors.push((format!("topk.{l}"), cpu(tokens)));
                    }
                    if let Some(sel) = &layer.selection {
                        tensors.push((format!("index_scores.{l}"), cpu(&sel.scores)));
                        tensors.push((format!("pools.{l}"), cpu(&sel.pools)));
                    }
                }
                tensors.push(("logits".to_owned(), cpu(&forward.logits)));
                Tensor::write_safetensors(&tensors, dump)
                    .with_context(|| format!("writing {}", dump.display()))?;
            }
            continue;
        };
        let run_id = run_id(&name, path, i);
        let manifest =
            tch::no_grad(|| trace_glm5_next(&model, &ids, &run_id, &out.join(&run_id), &opts))
                .with_context(|| format!("tracing {}", path.display()))?;
        eprintln!(
            "traced {} ({} tokens) into {} in {:.1} s",
            path.display(),
            ids.len(),
            out.join(manifest.run_id()).display(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// The trace options the SHADOWTRACE_* variables ask for, whether tracing is
/// on, and the directory; a SHADOWTRACE_* name that is no variable (a typo,
/// which would trace with the default) is warned about once.
fn read_env(name: &str) -> Result<(TraceOptions, bool, String)> {
    let names: Vec<String> = std::env::vars_os()
        .map(|(name, _)| name.to_string_lossy().into_owned())
        .collect();
    for unknown in shadowtrace_schemas::env::unknown_names(names.iter().map(String::as_str)) {
        eprintln!("warning: {unknown}");
    }
    Ok(TraceOptions::from_env(name, |k| std::env::var(k).ok())?)
}

/// The model's name in the manifests: --name, else the directory's.
fn model_name(args: &Args) -> String {
    args.name.clone().unwrap_or_else(|| {
        args.model
            .file_name()
            .map_or_else(|| "model".to_owned(), |n| n.to_string_lossy().into_owned())
    })
}

/// An untraced pass's numerics.
fn numerics(path: Path, scales: ScaleFormat) -> Numerics {
    match path {
        Path::Fp32 => Numerics::Plain(Kind::Float),
        Path::Bf16 => Numerics::Plain(Kind::BFloat16),
        Path::Fp8 => Numerics::Fp8,
        Path::Fp8Checkpoint => fp8_checkpoint_numerics(Kind::BFloat16, scales),
        Path::Fp8CheckpointFp32 => fp8_checkpoint_numerics(Kind::Float, scales),
    }
}

/// A run's id: the model's name and the prompt file's stem, path-safe.
fn run_id(name: &str, prompt: &std::path::Path, i: usize) -> String {
    let stem = prompt.file_stem().map_or_else(
        || format!("prompt{i}"),
        |s| s.to_string_lossy().into_owned(),
    );
    path_safe(&format!("{name}-{stem}"))
}

/// `id` with every character but ASCII letters, digits and `._-` replaced by `-`.
fn path_safe(id: &str) -> String {
    id.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect()
}
