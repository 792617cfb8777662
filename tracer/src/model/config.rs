//! A model's `config.json`, as HF transformers writes it for `glm_moe_dsa`
//! (GLM-5 / 5.1 / 5.2) and `deepseek_v32` (DeepSeek-V3.2). Every number the
//! forward pass uses is read from here; defaults are transformers' own.

use std::path::Path;

use serde::Deserialize;

use super::ModelError;

/// The two architectures, which differ in the indexer's RoPE and in GLM's
/// shared indexer layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `glm_moe_dsa`: indexer RoPE interleaved; `indexer_types` may share.
    Glm,
    /// `deepseek_v32`: indexer RoPE half-split (NeoX).
    DeepSeek,
}

/// RoPE parameters (`rope_parameters`, or the older `rope_scaling` plus
/// `rope_theta`).
#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    /// Base.
    pub rope_theta: f64,
    /// `default` or `yarn`.
    #[serde(default = "default_rope_type")]
    pub rope_type: String,
    /// YaRN scale factor.
    pub factor: Option<f64>,
    /// YaRN: the context the model was trained at.
    pub original_max_position_embeddings: Option<f64>,
    /// YaRN ramp bounds.
    pub beta_fast: Option<f64>,
    /// YaRN ramp bounds.
    pub beta_slow: Option<f64>,
    /// YaRN attention scaling.
    pub mscale: Option<f64>,
    /// YaRN attention scaling applied to the softmax scale.
    pub mscale_all_dim: Option<f64>,
    /// YaRN explicit attention factor.
    pub attention_factor: Option<f64>,
}

fn default_rope_type() -> String {
    "default".to_owned()
}

/// The fields of `config.json` the forward pass reads.
#[derive(Debug, Clone, Deserialize)]
#[allow(
    missing_docs,
    reason = "HF config field names, documented by transformers"
)]
pub struct ModelConfig {
    pub model_type: String,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub moe_intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub n_shared_experts: i64,
    pub n_routed_experts: i64,
    pub routed_scaling_factor: f64,
    pub kv_lora_rank: i64,
    pub q_lora_rank: i64,
    pub qk_rope_head_dim: i64,
    pub v_head_dim: i64,
    pub qk_nope_head_dim: i64,
    pub n_group: i64,
    pub topk_group: i64,
    pub num_experts_per_tok: i64,
    pub norm_topk_prob: bool,
    pub rms_norm_eps: f64,
    pub index_topk: i64,
    pub index_head_dim: i64,
    pub index_n_heads: i64,
    #[serde(default)]
    pub first_k_dense_replace: Option<i64>,
    #[serde(default)]
    pub mlp_layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub indexer_types: Option<Vec<String>>,
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    pub rope_scaling: Option<RopeParameters>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub max_position_embeddings: Option<f64>,
}

impl ModelConfig {
    /// Reads and checks `config.json`.
    ///
    /// # Errors
    /// An unreadable file, invalid JSON, a missing field or an unsupported
    /// `model_type`.
    pub fn read(path: &Path) -> Result<(ModelConfig, Vec<u8>), ModelError> {
        let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
            path: path.to_owned(),
            source,
        })?;
        let config: ModelConfig =
            serde_json::from_slice(&bytes).map_err(|source| ModelError::Config {
                path: path.to_owned(),
                source,
            })?;
        config
            .architecture()
            .map_err(|got| ModelError::Unsupported {
                path: path.to_owned(),
                got,
            })?;
        Ok((config, bytes))
    }

    /// The architecture, or the unsupported `model_type`.
    ///
    /// # Errors
    /// A `model_type` other than `glm_moe_dsa` or `deepseek_v32`.
    pub fn architecture(&self) -> Result<Architecture, String> {
        match self.model_type.as_str() {
            "glm_moe_dsa" => Ok(Architecture::Glm),
            "deepseek_v32" => Ok(Architecture::DeepSeek),
            other => Err(other.to_owned()),
        }
    }

    /// Whether layer `i` has a MoE block (else a dense MLP).
    #[must_use]
    pub fn is_moe(&self, i: i64) -> bool {
        match &self.mlp_layer_types {
            Some(types) => types.get(i as usize).is_some_and(|t| t == "sparse"),
            None => i >= self.first_k_dense_replace.unwrap_or(0),
        }
    }

    /// Whether layer `i` runs its own indexer (GLM-5.2's `shared` layers
    /// reuse the previous full layer's top-k).
    #[must_use]
    pub fn runs_indexer(&self, i: i64) -> bool {
        self.indexer_types
            .as_ref()
            .and_then(|t| t.get(i as usize))
            .is_none_or(|t| t != "shared")
    }

    /// The RoPE parameters, whichever key holds them.
    #[must_use]
    pub fn rope(&self) -> RopeParameters {
        let mut rope = self
            .rope_parameters
            .clone()
            .or_else(|| self.rope_scaling.clone())
            .unwrap_or(RopeParameters {
                rope_theta: self.rope_theta.unwrap_or(10_000.0),
                rope_type: default_rope_type(),
                factor: None,
                original_max_position_embeddings: None,
                beta_fast: None,
                beta_slow: None,
                mscale: None,
                mscale_all_dim: None,
                attention_factor: None,
            });
        if let Some(theta) = self.rope_theta
            && self.rope_parameters.is_none()
        {
            rope.rope_theta = theta;
        }
        rope
    }

    /// Query/key head size of the main attention.
    #[must_use]
    pub fn qk_head_dim(&self) -> i64 {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}
