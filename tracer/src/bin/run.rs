//! `shadowtrace run`: the reference DSA engine on a model directory
//! (`config.json` and safetensors) and a prompt of token ids.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use shadowtrace_tracer::model::{Model, Numerics};
use tch::{Device, Kind, Tensor};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Path {
    /// fp32 throughout (the shadow).
    Fp32,
    /// bf16 throughout (the shadow).
    Bf16,
    /// FP8 block-scaled linears, bf16 activations (production).
    Fp8,
}

/// Runs the reference GLM-5 / DeepSeek-V3.2 engine on one prompt.
#[derive(Parser, Debug)]
#[command(name = "shadowtrace run", version)]
struct Args {
    /// Model directory: config.json and *.safetensors (BF16, or FP8 e4m3 with weight_scale_inv).
    #[arg(long)]
    model: PathBuf,
    /// Prompt as a JSON list of token ids.
    #[arg(long)]
    ids: PathBuf,
    /// Numerics of the pass.
    #[arg(long, value_enum, default_value = "fp32")]
    path: Path,
    /// Write every layer's hidden states, indexer top-k and the logits to this safetensors file.
    #[arg(long)]
    dump: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = Device::cuda_if_available();
    let model = Model::open(&args.model, device)?;
    let text = std::fs::read_to_string(&args.ids)
        .with_context(|| format!("reading {}", args.ids.display()))?;
    let ids: Vec<i64> = serde_json::from_str(&text)
        .with_context(|| format!("{}: expected a JSON list of token ids", args.ids.display()))?;
    if ids.is_empty() {
        bail!("{}: the prompt has no tokens", args.ids.display());
    }
    if let Some(bad) = ids
        .iter()
        .find(|&&id| id < 0 || id >= model.config.vocab_size)
    {
        bail!(
            "{}: token id {bad} is outside the vocabulary [0, {})",
            args.ids.display(),
            model.config.vocab_size
        );
    }
    let numerics = match args.path {
        Path::Fp32 => Numerics::Plain(Kind::Float),
        Path::Bf16 => Numerics::Plain(Kind::BFloat16),
        Path::Fp8 => Numerics::Fp8,
    };
    let started = std::time::Instant::now();
    let out = tch::no_grad(|| model.forward(&ids, numerics))?;
    println!(
        "{} ({} layers) on {:?}, {} tokens, {:?}: {:.2} s",
        model.config.model_type,
        out.layers.len(),
        device,
        ids.len(),
        args.path,
        started.elapsed().as_secs_f64()
    );
    if let Some(dump) = args.dump {
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        for (i, layer) in out.layers.iter().enumerate() {
            tensors.push((
                format!("layer_out.{i}"),
                layer.layer_out.to_kind(Kind::Float).to_device(Device::Cpu),
            ));
            tensors.push((format!("topk.{i}"), layer.topk.to_device(Device::Cpu)));
            if let Some(scores) = &layer.index_scores {
                tensors.push((format!("index_scores.{i}"), scores.to_device(Device::Cpu)));
            }
        }
        tensors.push(("logits".to_owned(), out.logits.to_device(Device::Cpu)));
        Tensor::write_safetensors(&tensors, &dump)
            .with_context(|| format!("writing {}", dump.display()))?;
    }
    Ok(())
}
