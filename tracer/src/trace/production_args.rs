//! The command-line arguments that say what production runs, shared by
//! `shadowtrace run` and `shadowtrace bisect`: the FP8 indexer variant,
//! production's numerics, and what is planted in it (deviations, faults).

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};

use crate::fp8::ScaleFormat;
use crate::indexer::Fp8Indexer;
use crate::model::deviation::{Deviation, Effect};
use crate::model::fault::Fault;
use crate::model::{Model, Numerics};
use crate::trace::TraceOptions;
use tch::Kind;

/// Production's numerics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Prod {
    /// Every linear re-quantized in 128x128 blocks with ue8m0 scales.
    Fp8,
    /// An FP8 checkpoint's linears on their stored codes and block scales.
    Fp8Checkpoint,
}

/// What production runs and what is planted in it.
#[derive(Args, Debug, Clone)]
pub struct ProductionArgs {
    /// Production's FP8 indexer: trtllm (the default), sglang, vllm, deepseek_reference, or
    /// none (q and k in bf16, scores in fp32, as transformers computes it).
    ///
    /// `suspects` defaults to none instead, on purpose: there the FP8 indexer is itself a
    /// suspect (deviations indexer_fp8, hadamard_dropped, indexer_k_cache_fp8), which a
    /// production that had one already would hide. glm5_next (GLM-5.3-Flash) has no FP8
    /// indexer variant: none is its default and the only value it takes.
    #[arg(long, value_name = "NAME")]
    pub fp8_indexer: Option<String>,
    /// Engine behaviours production runs on purpose, comma-separated; NAME@LAYER acts in that
    /// layer alone. Repeatable.
    ///
    /// `shadowtrace suspects --list` describes each, with its source.
    #[arg(long, value_delimiter = ',', value_name = "NAME[,NAME]")]
    pub deviation: Vec<String>,
    /// A fault planted in production, as JSON. Repeatable.
    ///
    /// Kinds: non_finite, kv_slot, fp8_scale, outlier, indexer_key, for example
    /// '{"kind":"non_finite","layer":2,"site":"mlp_out","token":100,"channel":0,"value":"nan"}'.
    /// Every index it carries is checked against the model and each prompt.
    #[arg(long)]
    pub fault: Vec<String>,
    /// Production's numerics: fp8 or fp8-checkpoint.
    ///
    /// fp8: every linear re-quantized in 128x128 blocks with ue8m0 scales, the engines'
    /// re-quantizing FP8 path. fp8-checkpoint: an FP8 checkpoint's linears on their stored
    /// codes and block scales, the rest in bf16, as transformers runs it (the checkpoint must
    /// store FP8 weights). GLM-5.3-Flash takes fp8.
    #[arg(long, value_enum, default_value = "fp8")]
    pub prod: Prod,
}

/// An FP8 checkpoint's numerics with activations held in `activations` and
/// activation scales of the format `scales`: the checkpoint's own
/// ([`Model::checkpoint_scale_format`]: power-of-two scales for a `ue8m0`
/// checkpoint, as DeepSeek's reference linear quantizes them; fp32 scales,
/// as transformers' kernel on Hopper, otherwise).
#[must_use]
pub fn fp8_checkpoint_numerics(activations: Kind, scales: ScaleFormat) -> Numerics {
    Numerics::Fp8Checkpoint {
        activations,
        scales,
    }
}

impl ProductionArgs {
    /// Sets `opts`' FP8 indexer, production numerics, deviations and faults
    /// for `model` (GLM-5 and DeepSeek-V3.2 layers), each checked against it;
    /// says on stderr which deviation changes nothing on this model.
    ///
    /// # Errors
    /// An unknown indexer or deviation, a deviation or fault outside the
    /// model, fault JSON written wrong, or `fp8-checkpoint` on a checkpoint
    /// without FP8 weights.
    pub fn apply(&self, model: &Model, opts: &mut TraceOptions) -> Result<()> {
        let fp8_indexer = self.fp8_indexer.as_deref().unwrap_or("trtllm");
        opts.fp8_indexer = match fp8_indexer {
            "none" => None,
            name => Some(Fp8Indexer::named(name).with_context(|| {
                format!(
                    "--fp8-indexer {name}: expected trtllm, sglang, vllm, deepseek_reference or none"
                )
            })?),
        };
        fp8_indexer.clone_into(&mut opts.fp8_indexer_name);
        if self.prod == Prod::Fp8Checkpoint {
            model
                .check_fp8_checkpoint()
                .context("production as the FP8 checkpoint stores it")?;
            opts.prod = fp8_checkpoint_numerics(Kind::BFloat16, model.checkpoint_scale_format());
        }
        for text in &self.deviation {
            let deviation =
                Deviation::parse(text).with_context(|| format!("--deviation {text}"))?;
            deviation
                .check(model.config.num_hidden_layers)
                .with_context(|| format!("--deviation {text}"))?;
            opts.deviations.push(deviation);
        }
        for d in &opts.deviations {
            if let Effect::None(why) = d.effect(
                &model.config,
                opts.fp8_indexer,
                !matches!(opts.prod, Numerics::Plain(_)),
                &opts.deviations,
            ) {
                #[allow(clippy::print_stderr, reason = "a command line's own notice")]
                {
                    eprintln!("deviation {d}: changes nothing on this model: {why}");
                }
            }
        }
        for f in &self.fault {
            let fault: Fault = serde_json::from_str(f).with_context(|| format!("--fault {f}"))?;
            fault
                .check(model, None)
                .with_context(|| format!("--fault {f}"))?;
            opts.faults.push(fault);
        }
        Ok(())
    }

    /// Checks every fault against a prompt of `tokens` tokens.
    ///
    /// # Errors
    /// A fault whose token lies past the prompt.
    pub fn check_prompt(
        &self,
        model: &Model,
        opts: &TraceOptions,
        tokens: usize,
        prompt: &str,
    ) -> Result<()> {
        for (fault, f) in opts.faults.iter().zip(&self.fault) {
            fault
                .check(model, Some(tokens as i64))
                .with_context(|| format!("--fault {f} on {prompt}"))?;
        }
        Ok(())
    }
}
