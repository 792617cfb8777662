//! GLM-5.3-Flash (`glm5_next`, transformers 5.24's `Glm5Next`) in the
//! reference engine: its text decoder, with its real structure. Layers are
//! KDA (Kimi delta attention) or MLA without RoPE (`layer_types`), each MLA
//! layer restricted to what its k-pool DSA indexer selects (or, `shared`,
//! what the previous layer's selected); the feed-forward is dense or MoE
//! (`mlp_layer_types`) with SwiGLU clamped at `swiglu_limit`; the residual
//! stream is `hc_mult` hyper-connection streams, mixed by Sinkhorn-normalised
//! weights and averaged before the final norm. Weights are read as
//! `save_pretrained` writes them (per-expert, the convolutions per q/k/v,
//! `hc_{attn,ffn}_{fn,base,scale}`), under `model.language_model.` (the
//! multimodal checkpoint) or `model.` (a text-only one). The vision tower is
//! not run: prompts are token ids.
//!
//! Checked against transformers 5.24.0 per layer in fp32
//! (`tests/python/test_reference_glm5_next.py`).

pub mod config;
pub mod hyper;
pub mod kda;
pub mod kpool;
pub mod layer;
mod layout;
pub mod mla;
pub mod ops;

use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

pub use config::{Glm5NextConfig, Mixer, is_glm5_next};
pub use layer::LayerOutput;
use layout::{fuse_experts, required};
use ops::Ops;

use super::ModelError;
use super::fault::{Fault, FaultError, NON_FINITE_SITES};
use super::layer::{Fallbacks, Numerics, Weights, rms_norm};
use super::weights::Checkpoint;

/// A GLM-5.3-Flash checkpoint: its text configuration and where its weights are.
#[derive(Debug)]
pub struct Glm5Next {
    /// `text_config` (or the flat config).
    pub config: Glm5NextConfig,
    /// `config.json`'s bytes (the manifest hashes them).
    pub config_bytes: Vec<u8>,
    checkpoint: Checkpoint,
    /// `model.language_model.` or `model.`: where the decoder's tensors are.
    prefix: &'static str,
    /// The device everything runs on.
    pub device: Device,
}

/// Every layer's output of one forward pass, and the logits.
#[derive(Debug)]
pub struct Forward {
    /// Per layer.
    pub layers: Vec<LayerOutput>,
    /// `[S, vocab]` fp32.
    pub logits: Tensor,
}

impl Glm5Next {
    /// Opens `dir` (`config.json` and `*.safetensors`).
    ///
    /// # Errors
    /// A missing or invalid config, another model type, or no decoder weights.
    pub fn open(dir: &Path, device: Device) -> Result<Glm5Next, ModelError> {
        let (config, config_bytes) = Glm5NextConfig::read(&dir.join("config.json"))?;
        let checkpoint = Checkpoint::open(dir)?;
        let prefix = ["model.language_model.", "model."]
            .into_iter()
            .find(|p| {
                !checkpoint
                    .names_with_prefix(&format!("{p}embed_tokens."))
                    .is_empty()
            })
            .ok_or_else(|| ModelError::Weights {
                path: dir.to_owned(),
                what: "no model.language_model.embed_tokens.weight or model.embed_tokens.weight"
                    .to_owned(),
            })?;
        Ok(Glm5Next {
            config,
            config_bytes,
            checkpoint,
            prefix,
            device,
        })
    }

    fn load(&self, prefix: &str) -> Result<Weights, ModelError> {
        let names: Vec<String> = self
            .checkpoint
            .names_with_prefix(prefix)
            .into_iter()
            .filter(|name| !name.ends_with("_scale_inv"))
            .collect();
        let loaded = self.checkpoint.load(&names, self.device)?;
        Ok(loaded
            .into_iter()
            .map(|(name, t)| (name[prefix.len()..].to_owned(), t))
            .collect())
    }

    fn tensor(&self, name: &str) -> Result<Tensor, ModelError> {
        let full = format!("{}{name}", self.prefix);
        let name = if name == "lm_head.weight" {
            name
        } else {
            &full
        };
        self.checkpoint
            .load(&[name.to_owned()], self.device)?
            .remove(name)
            .ok_or_else(|| ModelError::Weights {
                path: PathBuf::from(name),
                what: "not in the checkpoint".to_owned(),
            })
    }

    /// Layer `i`'s weights (fp32), every tensor its structure needs checked present.
    ///
    /// # Errors
    /// A tensor missing or unreadable.
    pub fn load_layer(&self, i: i64) -> Result<Weights, ModelError> {
        let prefix = format!("{}layers.{i}.", self.prefix);
        let mut weights = self.load(&prefix)?;
        for name in required(&self.config, i) {
            if !weights.contains_key(&name) {
                return Err(ModelError::Weights {
                    path: PathBuf::from(format!("{prefix}{name}")),
                    what: format!(
                        "not in the checkpoint, needed by layer {i} ({}, {})",
                        match self.config.mixer(i) {
                            Mixer::Kda => "KDA",
                            Mixer::Mla => "MLA",
                        },
                        if self.config.is_moe(i) {
                            "MoE"
                        } else {
                            "dense"
                        }
                    ),
                });
            }
        }
        if self.config.is_moe(i) {
            fuse_experts(&mut weights, self.config.n_routed_experts);
        }
        Ok(weights)
    }

    /// Checks a fault against the model and, given the prompt's length, its
    /// token. Only `non_finite` is planted in this engine; a channel of
    /// `layer_out` indexes a token's streams end to end (`hc_mult x hidden`).
    ///
    /// # Errors
    /// An index that does not fit. (Whether the kind is planted at all is
    /// [`Glm5Next::supports_fault`]'s answer.)
    pub fn check_fault(&self, fault: &Fault, tokens: Option<i64>) -> Result<(), FaultError> {
        let c = &self.config;
        let layer = fault.layer();
        if !(0..c.num_hidden_layers).contains(&layer) {
            return Err(FaultError::Layer {
                got: layer,
                layers: c.num_hidden_layers,
            });
        }
        if let Fault::NonFinite {
            site,
            token,
            channel,
            ..
        } = fault
        {
            if !NON_FINITE_SITES.contains(&site.as_str()) {
                return Err(FaultError::Site { got: site.clone() });
            }
            let width = if site == "layer_out" {
                c.hc_mult * c.hidden_size
            } else {
                c.hidden_size
            };
            if !(0..width).contains(channel) {
                return Err(FaultError::Channel {
                    got: *channel,
                    hidden: width,
                });
            }
            if let Some(n) = tokens
                && !(0..n).contains(token)
            {
                return Err(FaultError::Token {
                    got: *token,
                    tokens: n,
                });
            }
        }
        Ok(())
    }

    /// Whether this engine plants `fault`'s kind: `non_finite` only (the
    /// others act on GLM-5's layers: its KV slots, FP8 scales by linear
    /// name, input outliers, indexer keys).
    #[must_use]
    pub fn supports_fault(fault: &Fault) -> bool {
        matches!(fault, Fault::NonFinite { .. })
    }

    /// The streams entering layer 0 `[S, hc_mult, hidden]` (fp32): each
    /// token's embedding copied into every stream.
    ///
    /// # Errors
    /// The embedding table cannot be loaded.
    pub fn embed(&self, ids: &[i64]) -> Result<Tensor, ModelError> {
        let table = self.tensor("embed_tokens.weight")?;
        let ids = Tensor::from_slice(ids).to_device(self.device);
        let h = table.index_select(0, &ids);
        let s = ids.size()[0];
        Ok(h.unsqueeze(1)
            .expand([s, self.config.hc_mult, self.config.hidden_size], false)
            .contiguous())
    }

    /// The final norm and the LM head.
    ///
    /// # Errors
    /// Their weights cannot be loaded.
    pub fn head(&self) -> Result<Head, ModelError> {
        Ok(Head {
            norm: self.tensor("norm.weight")?,
            lm_head: self.tensor("lm_head.weight")?,
            eps: self.config.rms_norm_eps,
        })
    }

    /// Layer `i` on `streams` in `pass`; returns the streams leaving it.
    pub fn layer(
        &self,
        i: i64,
        weights: &Weights,
        pass: &Pass<'_>,
        streams: &Tensor,
        shared: Option<&Tensor>,
    ) -> (Tensor, LayerOutput) {
        let ops = Ops {
            config: &self.config,
            weights,
            numerics: pass.numerics,
            fallbacks: pass.fallbacks,
            faults: pass.faults,
        };
        layer::forward(&ops, i, streams, shared)
    }

    /// One forward pass over `ids` in `numerics`, layer by layer.
    ///
    /// # Errors
    /// A weight that cannot be loaded.
    pub fn forward(&self, ids: &[i64], numerics: Numerics) -> Result<Forward, ModelError> {
        let mut streams = self.embed(ids)?.to_kind(numerics.kind());
        let mut layers: Vec<LayerOutput> = Vec::new();
        for i in 0..self.config.num_hidden_layers {
            let weights = self.load_layer(i)?;
            let shared = layers.last().and_then(|l| l.tokens.as_ref());
            let (next, out) = self.layer(i, &weights, &Pass::plain(numerics), &streams, shared);
            streams = next;
            layers.push(out);
        }
        let logits = self.head()?.logits(&streams, streams.kind());
        Ok(Forward { layers, logits })
    }
}

/// How one pass computes: its numerics, and for production where its FP8
/// fallbacks are counted and which faults it carries.
#[derive(Debug, Clone, Copy)]
pub struct Pass<'a> {
    /// The numerics.
    pub numerics: Numerics,
    /// Where FP8 linears are counted (`None`: not counted).
    pub fallbacks: Option<&'a Fallbacks>,
    /// Faults planted (checked by [`Glm5Next::check_fault`]).
    pub faults: &'a [Fault],
}

impl Pass<'_> {
    /// A shadow's or an untraced pass: nothing counted, nothing planted.
    #[must_use]
    pub fn plain(numerics: Numerics) -> Pass<'static> {
        Pass {
            numerics,
            fallbacks: None,
            faults: &[],
        }
    }
}

/// The final collapse, norm and LM head.
#[derive(Debug)]
pub struct Head {
    norm: Tensor,
    lm_head: Tensor,
    eps: f64,
}

impl Head {
    /// Logits `[S, vocab]` (fp32) of the streams `[S, N, hidden]`: their
    /// unweighted mean (`Glm5NextTextHyperHead`), the final RMSNorm and the
    /// LM head, computed in `kind`.
    pub fn logits(&self, streams: &Tensor, kind: Kind) -> Tensor {
        let h = streams.to_kind(kind).mean_dim(1, false, kind);
        rms_norm(&h, &self.norm, self.eps)
            .matmul(&self.lm_head.to_kind(kind).tr())
            .to_kind(Kind::Float)
    }
}
