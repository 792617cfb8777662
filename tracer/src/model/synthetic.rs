//! Synthetic checkpoints with the real structure of GLM-5.1 and
//! DeepSeek-V3.2 at small width, written as `config.json` and BF16
//! safetensors like a real checkpoint, so the same loader reads them.
//!
//! What stays real: index_topk 2048 and index_head_dim 128 (so the sparse
//! regime starts above 2048 visible keys and FP8 blocks are one head), MLA
//! with q/kv LoRA, dense first layer then MoE with shared experts, each
//! model's routing groups and RoPE (GLM: theta 1e6, interleaved indexer RoPE;
//! DeepSeek: YaRN factor 40 from 4096, half-split indexer RoPE).
//!
//! Initialisation: normal(0, 0.02) as transformers initialises these models,
//! except the indexer's `wq_b` and `wk`, drawn with std 0.16 (8x). With plain
//! initialisation q.k is of order 1e-2 and the indexer's scores nearly tie,
//! so any two precisions disagree about the top-2048 and every run looks
//! broken; at 8x the scores spread over units, with a few near-ties at the
//! k-th boundary, as a trained indexer's do.

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

fn int(config: &Value, key: &str) -> i64 {
    config.get(key).and_then(Value::as_i64).unwrap_or(0)
}

/// Writes `config` and seeded weights for it into `dir`.
///
/// # Errors
/// A directory or file that cannot be written.
pub fn write(dir: &Path, config: &Value, seed: i64) -> Result<(), ModelError> {
    let io = |source| ModelError::Io {
        path: dir.to_owned(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let text = serde_json::to_string_pretty(config).unwrap_or_default();
    std::fs::write(dir.join("config.json"), text).map_err(io)?;
    tch::manual_seed(seed);
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
    let normal =
        |shape: &[i64], std: f64| Tensor::randn(shape, (Kind::Float, tch::Device::Cpu)) * std;
    let ones = |n: i64| Tensor::ones([n], (Kind::Float, tch::Device::Cpu));
    let mut t: Vec<(String, Tensor)> = vec![
        ("model.embed_tokens.weight".to_owned(), normal(&[v, h], 1.0)),
        ("model.norm.weight".to_owned(), ones(h)),
        ("lm_head.weight".to_owned(), normal(&[v, h], 0.02)),
    ];
    for i in 0..int(config, "num_hidden_layers") {
        let p = |name: &str| format!("model.layers.{i}.{name}");
        let mut layer = vec![
            (p("input_layernorm.weight"), ones(h)),
            (p("post_attention_layernorm.weight"), ones(h)),
            (p("self_attn.q_a_proj.weight"), normal(&[q_rank, h], 0.02)),
            (p("self_attn.q_a_layernorm.weight"), ones(q_rank)),
            (
                p("self_attn.q_b_proj.weight"),
                normal(&[heads * (nope + rope), q_rank], 0.02),
            ),
            (
                p("self_attn.kv_a_proj_with_mqa.weight"),
                normal(&[kv_rank + rope, h], 0.02),
            ),
            (p("self_attn.kv_a_layernorm.weight"), ones(kv_rank)),
            (
                p("self_attn.kv_b_proj.weight"),
                normal(&[heads * (nope + v_dim), kv_rank], 0.02),
            ),
            (
                p("self_attn.o_proj.weight"),
                normal(&[h, heads * v_dim], 0.02),
            ),
            (
                p("self_attn.indexer.wq_b.weight"),
                normal(&[ih * id, q_rank], 0.16),
            ),
            (p("self_attn.indexer.wk.weight"), normal(&[id, h], 0.16)),
            (p("self_attn.indexer.k_norm.weight"), ones(id)),
            (p("self_attn.indexer.k_norm.bias"), ones(id) * 0.0),
            (
                p("self_attn.indexer.weights_proj.weight"),
                normal(&[ih, h], 0.02),
            ),
        ];
        let mlp = |prefix: String, inter: i64| {
            vec![
                (
                    format!("{prefix}.gate_proj.weight"),
                    normal(&[inter, h], 0.02),
                ),
                (
                    format!("{prefix}.up_proj.weight"),
                    normal(&[inter, h], 0.02),
                ),
                (
                    format!("{prefix}.down_proj.weight"),
                    normal(&[h, inter], 0.02),
                ),
            ]
        };
        if i < int(config, "first_k_dense_replace") {
            layer.extend(mlp(p("mlp"), dense_i));
        } else {
            layer.push((p("mlp.gate.weight"), normal(&[experts, h], 0.02)));
            layer.push((
                p("mlp.gate.e_score_correction_bias"),
                normal(&[experts], 0.05),
            ));
            for e in 0..experts {
                layer.extend(mlp(p(&format!("mlp.experts.{e}")), moe_i));
            }
            layer.extend(mlp(
                p("mlp.shared_experts"),
                moe_i * int(config, "n_shared_experts"),
            ));
        }
        t.extend(layer);
    }
    let bf16: Vec<(String, Tensor)> = t
        .into_iter()
        .map(|(n, x)| (n, x.to_kind(Kind::BFloat16)))
        .collect();
    let path = dir.join("model.safetensors");
    Tensor::write_safetensors(&bf16, &path).map_err(|e| ModelError::Weights {
        path,
        what: e.to_string(),
    })
}
