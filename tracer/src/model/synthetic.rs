//! Synthetic checkpoints with the real structure of GLM-5.1 and
//! DeepSeek-V3.2 at small width, written as `config.json` and BF16
//! safetensors like a real checkpoint, so the same loader reads them.
//!
//! The demo runs the trained checkpoints of `models/` instead; these stay
//! where a property must hold by construction or a width must be had without
//! weights: `shadowtrace suspects checkpoint` (any depth, and the published
//! widths in FP8 for the GPU sweep), the Rust tests that plant a deviation at
//! a chosen layer of a 4-layer model, and the assumption sweeps
//! ([`SyntheticParams`]).
//!
//! What stays real: index_topk 2048 and index_head_dim 128 (so the sparse
//! regime starts above 2048 visible keys and FP8 blocks are one head), MLA
//! with q/kv LoRA, dense first layer then MoE with shared experts, each
//! model's routing groups and RoPE (GLM: theta 1e6, interleaved indexer RoPE;
//! DeepSeek: YaRN factor 40 from 4096, half-split indexer RoPE).
//!
//! Initialisation: normal(0, 0.02) as transformers initialises these models,
//! except where a [`SyntheticParams`] assumption says otherwise. Those
//! assumptions decide how strongly a numerics deviation shows in a synthetic
//! model, so each is named, documented and recorded in `config.json`
//! (`synthetic_params`), and a report can show how a verdict depends on it:
//!
//! - [`SyntheticParams::indexer_scale`] (default 8): the indexer's `wq_b` and
//!   `wk` drawn with std 0.02 x this. With plain initialisation q.k is of
//!   order 1e-2 and the indexer's scores nearly tie, so any two precisions
//!   disagree about the top-2048 and every run looks broken; at 8x the
//!   scores spread over units, with a few near-ties at the k-th boundary, as
//!   a trained indexer's do;
//! - [`SyntheticParams::k_outlier_dims`] and
//!   [`SyntheticParams::k_outlier_gain`] (default none): outlier channels of
//!   the indexer's key, its LayerNorm weight multiplied by the gain on that
//!   many NoPE dimensions. An FP8 block's ue8m0 scale follows its largest
//!   value, so outliers push the other values of the block toward e4m3's
//!   subnormals, which the Hadamard rotation exists to prevent: without them
//!   a dropped Hadamard has little to show.

use std::path::Path;

use serde_json::{Value, json};
use tch::{Kind, Tensor};

use super::ModelError;

/// The GLM-5.1 shape at small width.
#[must_use]
pub fn glm51_config(layers: i64) -> Value {
    json!({
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": 256, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 1, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": true,
        "kv_lora_rank": 64, "q_lora_rank": 128, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 4, "indexer_rope_interleave": true,
        "first_k_dense_replace": 1, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    })
}

/// The DeepSeek-V3.2 shape at small width (twice GLM's indexer heads, as
/// the real models have 64 against 32).
#[must_use]
pub fn deepseek_v32_config(layers: i64) -> Value {
    json!({
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "vocab_size": 256, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 1, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 2.5, "norm_topk_prob": true,
        "kv_lora_rank": 64, "q_lora_rank": 96, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 8,
        "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 163840,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
            "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0},
    })
}

/// The assumptions of a synthetic checkpoint that decide how strongly a
/// numerics deviation shows (module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyntheticParams {
    /// Multiple of the default init std (0.02) for the indexer's `wq_b` and `wk`.
    pub indexer_scale: f64,
    /// How many of the indexer key's NoPE dimensions are outlier channels.
    pub k_outlier_dims: i64,
    /// Their LayerNorm weight (1 elsewhere).
    pub k_outlier_gain: f64,
}

impl Default for SyntheticParams {
    fn default() -> SyntheticParams {
        SyntheticParams {
            indexer_scale: 8.0,
            k_outlier_dims: 0,
            k_outlier_gain: 1.0,
        }
    }
}

impl SyntheticParams {
    /// The parameters as `config.json` records them.
    #[must_use]
    pub fn to_json(&self) -> Value {
        json!({
            "indexer_scale": self.indexer_scale,
            "k_outlier_dims": self.k_outlier_dims,
            "k_outlier_gain": self.k_outlier_gain,
        })
    }

    /// The outlier dimensions of a `dim`-wide key with `rope` rotated ones:
    /// spread over the NoPE part, which RoPE leaves in place.
    #[must_use]
    pub fn outlier_dims(&self, dim: i64, rope: i64) -> Vec<i64> {
        let nope = (dim - rope).max(1);
        (0..self.k_outlier_dims.min(nope))
            .map(|j| rope + (j * 13) % nope)
            .collect()
    }
}

/// GLM-5.1 at full width (`../shared/reference/dsa_numerics.md` section 5)
/// with `layers` decoder layers, the first `dense` of them dense, and one MTP
/// layer after them, FP8 with 128x128 blocks as GLM-5.1-FP8 is published.
#[must_use]
pub fn glm51_full_config(layers: i64, dense: i64) -> Value {
    json!({
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": 154_880, "hidden_size": 6144, "intermediate_size": 12_288, "moe_intermediate_size": 2048,
        "num_hidden_layers": layers, "num_nextn_predict_layers": 1, "num_attention_heads": 64, "num_key_value_heads": 64,
        "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": true,
        "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "indexer_rope_interleave": true,
        "rope_interleave": true, "first_k_dense_replace": dense, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 202_752,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]},
    })
}

/// DeepSeek-V3.2 at full width, as [`glm51_full_config`].
#[must_use]
pub fn deepseek_v32_full_config(layers: i64, dense: i64) -> Value {
    json!({
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "vocab_size": 129_280, "hidden_size": 7168, "intermediate_size": 18_432, "moe_intermediate_size": 2048,
        "num_hidden_layers": layers, "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
        "routed_scaling_factor": 2.5, "norm_topk_prob": true,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
        "first_k_dense_replace": dense, "rms_norm_eps": 1e-6, "max_position_embeddings": 163_840,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
            "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0},
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
    })
}

fn int(config: &Value, key: &str) -> i64 {
    config.get(key).and_then(Value::as_i64).unwrap_or(0)
}

/// Writes `config` and seeded weights for it into `dir`, with the default
/// [`SyntheticParams`].
///
/// # Errors
/// A directory or file that cannot be written.
pub fn write(dir: &Path, config: &Value, seed: i64) -> Result<(), ModelError> {
    write_with(dir, config, seed, &SyntheticParams::default())
}

/// Writes `config` (with `params` recorded as `synthetic_params`) and seeded
/// weights for it into `dir`.
///
/// # Errors
/// A directory or file that cannot be written.
pub fn write_with(
    dir: &Path,
    config: &Value,
    seed: i64,
    params: &SyntheticParams,
) -> Result<(), ModelError> {
    let io = |source| ModelError::Io {
        path: dir.to_owned(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut config = config.clone();
    if let Some(object) = config.as_object_mut() {
        object.insert("synthetic_params".to_owned(), params.to_json());
    }
    let config = &config;
    let text = serde_json::to_string_pretty(config).unwrap_or_default();
    std::fs::write(dir.join("config.json"), text).map_err(io)?;
    tch::manual_seed(seed);
    // Drawn in the order of the specs: the same seed gives the same weights.
    let bf16: Vec<(String, Tensor)> = tensor_specs(config, params)
        .iter()
        .map(|spec| {
            (
                spec.name.clone(),
                spec.init
                    .draw(&spec.shape, tch::Device::Cpu)
                    .to_kind(Kind::BFloat16),
            )
        })
        .collect();
    let path = dir.join("model.safetensors");
    Tensor::write_safetensors(&bf16, &path).map_err(|e| ModelError::Weights {
        path,
        what: e.to_string(),
    })
}

/// How a synthetic tensor is initialised.
#[derive(Debug, Clone, PartialEq)]
pub enum Init {
    /// normal(0, std).
    Normal(f64),
    /// All ones but the listed entries, which take the value.
    Ones(Vec<(i64, f64)>),
    /// All zeros.
    Zeros,
}

impl Init {
    /// The tensor, fp32 on `device` (drawing from the global generator for
    /// `Normal`).
    pub fn draw(&self, shape: &[i64], device: tch::Device) -> Tensor {
        match self {
            Init::Normal(std) => Tensor::randn(shape, (Kind::Float, device)) * *std,
            Init::Ones(entries) => {
                let t = Tensor::ones(shape, (Kind::Float, device));
                for &(i, v) in entries {
                    let _ = t.get(i).fill_(v);
                }
                t
            }
            Init::Zeros => Tensor::zeros(shape, (Kind::Float, device)),
        }
    }
}

/// One tensor of a synthetic checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    /// Its checkpoint name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// How it is drawn.
    pub init: Init,
    /// The decoder layer it belongs to (`None`: embeddings, final norm, head).
    pub layer: Option<i64>,
}

/// Every tensor of a checkpoint of `config`, in drawing order: embeddings,
/// final norm, head, then each layer's.
#[must_use]
pub fn tensor_specs(config: &Value, params: &SyntheticParams) -> Vec<TensorSpec> {
    let (h, v) = (int(config, "hidden_size"), int(config, "vocab_size"));
    let (heads, q_rank, kv_rank) = (
        int(config, "num_attention_heads"),
        int(config, "q_lora_rank"),
        int(config, "kv_lora_rank"),
    );
    let (nope, rope, v_dim) = (
        int(config, "qk_nope_head_dim"),
        int(config, "qk_rope_head_dim"),
        int(config, "v_head_dim"),
    );
    let (ih, id) = (int(config, "index_n_heads"), int(config, "index_head_dim"));
    let (experts, moe_i, dense_i) = (
        int(config, "n_routed_experts"),
        int(config, "moe_intermediate_size"),
        int(config, "intermediate_size"),
    );
    let spec = |name: String, shape: &[i64], init: Init, layer: Option<i64>| TensorSpec {
        name,
        shape: shape.to_vec(),
        init,
        layer,
    };
    let normal = Init::Normal;
    let ones = || Init::Ones(Vec::new());
    let outliers: Vec<(i64, f64)> = params
        .outlier_dims(id, rope)
        .into_iter()
        .map(|d| (d, params.k_outlier_gain))
        .collect();
    let mut t = vec![
        spec(
            "model.embed_tokens.weight".to_owned(),
            &[v, h],
            normal(1.0),
            None,
        ),
        spec("model.norm.weight".to_owned(), &[h], ones(), None),
        spec("lm_head.weight".to_owned(), &[v, h], normal(0.02), None),
    ];
    let indexer_std = 0.02 * params.indexer_scale;
    for i in 0..int(config, "num_hidden_layers") {
        let l = Some(i);
        let p = |name: &str| format!("model.layers.{i}.{name}");
        t.extend([
            spec(p("input_layernorm.weight"), &[h], ones(), l),
            spec(p("post_attention_layernorm.weight"), &[h], ones(), l),
            spec(
                p("self_attn.q_a_proj.weight"),
                &[q_rank, h],
                normal(0.02),
                l,
            ),
            spec(p("self_attn.q_a_layernorm.weight"), &[q_rank], ones(), l),
            spec(
                p("self_attn.q_b_proj.weight"),
                &[heads * (nope + rope), q_rank],
                normal(0.02),
                l,
            ),
            spec(
                p("self_attn.kv_a_proj_with_mqa.weight"),
                &[kv_rank + rope, h],
                normal(0.02),
                l,
            ),
            spec(p("self_attn.kv_a_layernorm.weight"), &[kv_rank], ones(), l),
            spec(
                p("self_attn.kv_b_proj.weight"),
                &[heads * (nope + v_dim), kv_rank],
                normal(0.02),
                l,
            ),
            spec(
                p("self_attn.o_proj.weight"),
                &[h, heads * v_dim],
                normal(0.02),
                l,
            ),
            spec(
                p("self_attn.indexer.wq_b.weight"),
                &[ih * id, q_rank],
                normal(indexer_std),
                l,
            ),
            spec(
                p("self_attn.indexer.wk.weight"),
                &[id, h],
                normal(indexer_std),
                l,
            ),
            spec(
                p("self_attn.indexer.k_norm.weight"),
                &[id],
                Init::Ones(outliers.clone()),
                l,
            ),
            spec(p("self_attn.indexer.k_norm.bias"), &[id], Init::Zeros, l),
            spec(
                p("self_attn.indexer.weights_proj.weight"),
                &[ih, h],
                normal(0.02),
                l,
            ),
        ]);
        let mlp = |prefix: String, inter: i64| {
            [
                spec(
                    format!("{prefix}.gate_proj.weight"),
                    &[inter, h],
                    normal(0.02),
                    l,
                ),
                spec(
                    format!("{prefix}.up_proj.weight"),
                    &[inter, h],
                    normal(0.02),
                    l,
                ),
                spec(
                    format!("{prefix}.down_proj.weight"),
                    &[h, inter],
                    normal(0.02),
                    l,
                ),
            ]
        };
        if i < int(config, "first_k_dense_replace") {
            t.extend(mlp(p("mlp"), dense_i));
        } else {
            t.push(spec(p("mlp.gate.weight"), &[experts, h], normal(0.02), l));
            t.push(spec(
                p("mlp.gate.e_score_correction_bias"),
                &[experts],
                normal(0.05),
                l,
            ));
            for e in 0..experts {
                t.extend(mlp(p(&format!("mlp.experts.{e}")), moe_i));
            }
            t.extend(mlp(
                p("mlp.shared_experts"),
                moe_i * int(config, "n_shared_experts"),
            ));
        }
    }
    t
}
