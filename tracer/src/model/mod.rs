//! The reference DSA engine: GLM-5 (`glm_moe_dsa`) and DeepSeek-V3.2
//! (`deepseek_v32`) forward passes on tch, configured from an HF
//! `config.json` and loaded from safetensors (BF16, or FP8 e4m3 with
//! 128x128 `weight_scale_inv` blocks), one layer's weights resident at a
//! time so a checkpoint larger than memory still runs.
//!
//! Checked against transformers 5.17.0 (`tests/python/test_reference_engine.py`):
//! per-layer hidden states, logits and indexer top-k of tiny configs of both
//! architectures with identical weights.
//!
//! GLM-5.3-Flash (`glm5_next`: KDA and MLA layers, a k-pool indexer,
//! hyper-connection streams) is its own engine, [`glm5_next`].

pub mod config;
pub mod convention;
pub mod deviation;
pub mod fault;
pub mod fp8_checkpoint;
pub mod glm5_next;
pub mod graft;
pub mod kernel_deviation;
pub mod layer;
pub mod rope;
pub(crate) mod router;
pub mod synthetic;
pub mod weights;

use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

pub use config::{Architecture, ModelConfig};
pub use layer::{Layer, LayerOutput, Numerics};
use rope::Rope;
use weights::Checkpoint;

/// What went wrong loading or running a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// `config.json` is not valid or lacks a field.
    #[error("{path}: {source}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What serde said.
        #[source]
        source: serde_json::Error,
    },
    /// A `model_type` this engine does not implement.
    #[error("{path}: model_type {got:?}, expected glm_moe_dsa or deepseek_v32")]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// The model_type found.
        got: String,
    },
    /// A weight file or tensor that cannot be used.
    #[error("{path}: {what}")]
    Weights {
        /// The file, or the tensor name.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
}

/// A model: its configuration and where its weights are.
#[derive(Debug)]
pub struct Model {
    /// `config.json`.
    pub config: ModelConfig,
    /// `config.json`'s bytes (the manifest hashes them).
    pub config_bytes: Vec<u8>,
    /// Which architecture.
    pub arch: Architecture,
    checkpoint: Checkpoint,
    /// The model directory.
    model_dir: PathBuf,
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

impl Model {
    /// Opens `dir` (`config.json` and `*.safetensors`).
    ///
    /// # Errors
    /// A missing or invalid config, an unsupported architecture, or no weights.
    pub fn open(dir: &Path, device: Device) -> Result<Model, ModelError> {
        let (config, config_bytes) = ModelConfig::read(&dir.join("config.json"))?;
        let arch = config
            .architecture()
            .map_err(|got| ModelError::Unsupported {
                path: dir.join("config.json"),
                got,
            })?;
        let checkpoint = Checkpoint::open(dir)?;
        Ok(Model {
            config,
            config_bytes,
            arch,
            checkpoint,
            model_dir: dir.to_owned(),
            device,
        })
    }

    /// Whether the checkpoint holds the tensor `name`.
    #[must_use]
    pub fn has_tensor(&self, name: &str) -> bool {
        self.checkpoint
            .names_with_prefix(name)
            .iter()
            .any(|n| n == name)
    }

    /// The activation scale format of an FP8 checkpoint's linears: ue8m0
    /// where `config.json`'s `quantization_config.scale_fmt` says `ue8m0` (as
    /// DeepSeek-V3.2's does), fp32 otherwise (`float`, or unset).
    #[must_use]
    pub fn checkpoint_scale_format(&self) -> crate::fp8::ScaleFormat {
        let fmt = serde_json::from_slice::<serde_json::Value>(&self.config_bytes)
            .ok()
            .and_then(|v| {
                v.pointer("/quantization_config/scale_fmt")
                    .and_then(serde_json::Value::as_str)
                    .map(str::to_owned)
            });
        if fmt.as_deref() == Some("ue8m0") {
            crate::fp8::ScaleFormat::Ue8m0
        } else {
            crate::fp8::ScaleFormat::Fp32
        }
    }

    /// Refuses a checkpoint that production cannot run as an FP8 checkpoint
    /// ([`Numerics::Fp8Checkpoint`]): one that stores no FP8 weight (its
    /// production would be bf16 throughout under an FP8 label), or whose
    /// `quantization_config` names blocks other than 128x128.
    ///
    /// # Errors
    /// Either case, saying which.
    pub fn check_fp8_checkpoint(&self) -> Result<(), ModelError> {
        let config = self.model_dir.join("config.json");
        let blocks = serde_json::from_slice::<serde_json::Value>(&self.config_bytes)
            .ok()
            .and_then(|v| v.pointer("/quantization_config/weight_block_size").cloned());
        if let Some(blocks) = blocks
            && blocks != serde_json::json!([128, 128])
        {
            return Err(ModelError::Weights {
                path: config,
                what: format!(
                    "quantization_config.weight_block_size {blocks}, expected [128, 128]"
                ),
            });
        }
        let fp8 = self
            .checkpoint
            .names_with_prefix("")
            .iter()
            .any(|n| n.ends_with("_scale_inv"));
        if !fp8 {
            return Err(ModelError::Weights {
                path: self.model_dir.clone(),
                what: "no FP8 weight (no *_scale_inv tensor): production would run bf16 \
                       throughout under an FP8 label"
                    .to_owned(),
            });
        }
        Ok(())
    }

    /// Loads the named tensors (fp32, on the model's device) with `prefix`
    /// stripped from their names.
    ///
    /// # Errors
    /// A tensor missing from the checkpoint or unreadable.
    pub fn load(&self, prefix: &str) -> Result<layer::Weights, ModelError> {
        let names: Vec<String> = self
            .checkpoint
            .names_with_prefix(prefix)
            .into_iter()
            // A weight's scales are read with it.
            .filter(|name| !name.ends_with("_scale_inv"))
            .collect();
        let loaded = self.checkpoint.load(&names, self.device)?;
        Ok(loaded
            .into_iter()
            .map(|(name, t)| (name[prefix.len()..].to_owned(), t))
            .collect())
    }

    /// The embeddings of `ids` `[S, hidden]`, fp32.
    ///
    /// # Errors
    /// The embedding table cannot be loaded.
    pub fn embed(&self, ids: &[i64]) -> Result<Tensor, ModelError> {
        let embed = self.load("model.embed_tokens.")?;
        let ids = Tensor::from_slice(ids).to_device(self.device);
        Ok(embed["weight"].index_select(0, &ids))
    }

    /// The rotary tables for positions `0..s`.
    #[must_use]
    pub fn rope(&self, s: i64) -> Rope {
        let c = &self.config;
        let positions = Tensor::arange(s, (Kind::Int64, self.device));
        let max_pos = c.max_position_embeddings.unwrap_or(4096.0);
        Rope::new(
            &c.rope(),
            c.qk_rope_head_dim,
            max_pos,
            &positions,
            self.device,
        )
    }

    /// The final norm and the LM head.
    ///
    /// # Errors
    /// Their weights cannot be loaded.
    pub fn head(&self) -> Result<Head, ModelError> {
        let weight = |prefix: &str| {
            self.load(prefix)?
                .remove("weight")
                .ok_or_else(|| ModelError::Weights {
                    path: PathBuf::from(format!("{prefix}weight")),
                    what: "not in the checkpoint".to_owned(),
                })
        };
        Ok(Head {
            norm: weight("model.norm.")?,
            lm_head: weight("lm_head.")?,
            eps: self.config.rms_norm_eps,
        })
    }

    /// One forward pass over `ids` in `numerics`, layer by layer.
    ///
    /// # Errors
    /// A weight that cannot be loaded.
    pub fn forward(&self, ids: &[i64], numerics: Numerics) -> Result<Forward, ModelError> {
        let c = &self.config;
        let mut h = self.embed(ids)?.to_kind(numerics.kind());
        let rope = self.rope(ids.len() as i64);
        let mut layers: Vec<LayerOutput> = Vec::new();
        for i in 0..c.num_hidden_layers {
            let weights = self.load(&format!("model.layers.{i}."))?;
            let layer = Layer {
                config: c,
                arch: self.arch,
                index: i,
                weights: &weights,
                numerics,
                fp8_indexer: None,
                faults: &[],
                deviations: &[],
                fallbacks: None,
                graft: None,
            };
            let prev = layers.last().map(|l| &l.topk);
            let out = layer.forward(&h, &rope, prev);
            h = out.layer_out.shallow_clone();
            layers.push(out);
        }
        let logits = self.head()?.logits(&h, h.kind());
        Ok(Forward { layers, logits })
    }
}

/// The final RMSNorm and the LM head.
#[derive(Debug)]
pub struct Head {
    norm: Tensor,
    lm_head: Tensor,
    eps: f64,
}

impl Head {
    /// Logits `[S, vocab]` (fp32) of the residual stream `h`, computed in `kind`.
    pub fn logits(&self, h: &Tensor, kind: Kind) -> Tensor {
        layer::rms_norm(&h.to_kind(kind), &self.norm, self.eps)
            .matmul(&self.lm_head.to_kind(kind).tr())
            .to_kind(Kind::Float)
    }
}
