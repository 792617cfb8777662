//! The tensors a GLM-5.3-Flash layer reads, as `save_pretrained` names them
//! (checked before a layer runs, so a missing one is refused by name rather
//! than panicking inside the forward pass), and the one layout change made
//! at load: the routed experts' fused gate-and-up weights.

use tch::Tensor;

use super::config::{Glm5NextConfig, Mixer};
use crate::model::layer::Weights;

/// Each routed expert's gate and up projections as one
/// `mlp.experts.{e}.gate_up_proj.weight` `[2 * moe_intermediate, hidden]`,
/// gate rows first: the layout transformers loads the per-expert checkpoint
/// into (`MergeModulelist` + `Concatenate`) and multiplies in one GEMM.
pub(super) fn fuse_experts(weights: &mut Weights, experts: i64) {
    for e in 0..experts {
        let name = |p: &str| format!("mlp.experts.{e}.{p}.weight");
        if let (Some(gate), Some(up)) = (
            weights.remove(&name("gate_proj")),
            weights.remove(&name("up_proj")),
        ) {
            weights.insert(name("gate_up_proj"), Tensor::cat(&[gate, up], 0));
        }
    }
}

/// The tensors layer `i` reads, by name within the layer (as the checkpoint
/// names them: before [`fuse_experts`]).
pub(super) fn required(c: &Glm5NextConfig, i: i64) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    let mut add = |prefix: &str, leaves: &[&str]| {
        names.extend(leaves.iter().map(|leaf| format!("{prefix}{leaf}")));
    };
    for hc in ["attn", "ffn"] {
        add(&format!("hc_{hc}_"), &["fn", "base", "scale"]);
    }
    add(
        "",
        &["input_layernorm.weight", "post_attention_layernorm.weight"],
    );
    let linears =
        |names: &[&str]| -> Vec<String> { names.iter().map(|n| format!("{n}.weight")).collect() };
    let attn: Vec<String> = match c.mixer(i) {
        Mixer::Kda => {
            let mut v = linears(&[
                "q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj",
                "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_norm", "o_proj",
            ]);
            v.extend(["dt_bias".to_owned(), "A_log".to_owned()]);
            v
        }
        Mixer::Mla => {
            let mut v = linears(&[
                "q_a_proj",
                "q_a_layernorm",
                "q_b_proj",
                "kv_a_proj_with_mqa",
                "kv_a_layernorm",
                "kv_b_proj",
                "o_proj",
            ]);
            if c.runs_indexer(i) {
                v.extend(
                    linears(&["wq_b", "wk", "k_norm", "weights_proj"])
                        .into_iter()
                        .chain([
                            "k_norm.bias".to_owned(),
                            "index_kpool_compress_ape".to_owned(),
                            "index_kpool_compress_gate".to_owned(),
                        ])
                        .map(|n| format!("indexer.{n}")),
                );
            }
            v
        }
    };
    names.extend(attn.into_iter().map(|n| format!("self_attn.{n}")));
    let mlp = ["gate_proj", "up_proj", "down_proj"];
    if c.is_moe(i) {
        names.extend([
            "mlp.gate.weight".to_owned(),
            "mlp.gate.e_score_correction_bias".to_owned(),
        ]);
        for e in 0..c.n_routed_experts {
            names.extend(mlp.iter().map(|p| format!("mlp.experts.{e}.{p}.weight")));
        }
        names.extend(mlp.iter().map(|p| format!("mlp.shared_experts.{p}.weight")));
    } else {
        names.extend(mlp.iter().map(|p| format!("mlp.{p}.weight")));
    }
    names
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use tch::{Device, Kind};

    use super::*;
    use crate::model::glm5_next::Glm5Next;

    /// A one-layer checkpoint (an MLA layer with its indexer, dense MLP) holding
    /// every tensor the layer needs but `missing`, each a placeholder: only the
    /// names are read before a forward pass.
    fn checkpoint(dir: &Path, missing: &str) {
        let config = serde_json::json!({
            "model_type": "glm5_next",
            "text_config": {
                "vocab_size": 8, "hidden_size": 4, "num_hidden_layers": 1,
                "num_attention_heads": 1, "kv_lora_rank": 2, "q_lora_rank": 2,
                "v_head_dim": 2, "qk_nope_head_dim": 2, "index_topk": 16, "index_head_dim": 2,
                "index_n_heads": 1, "intermediate_size": 4, "moe_intermediate_size": 2,
                "n_shared_experts": 1, "n_routed_experts": 2, "routed_scaling_factor": 1.0,
                "num_experts_per_tok": 1, "layer_types": ["indexed_attention"],
                "mlp_layer_types": ["dense"]
            }
        });
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let (c, _) = Glm5NextConfig::read(&dir.join("config.json")).unwrap();
        let mut names: Vec<String> = required(&c, 0)
            .into_iter()
            .map(|n| format!("model.language_model.layers.0.{n}"))
            .collect();
        names.extend(["model.language_model.embed_tokens.weight".to_owned()]);
        let tensors: Vec<(String, Tensor)> = names
            .into_iter()
            .filter(|n| !n.ends_with(missing))
            .map(|n| (n, Tensor::zeros([1], (Kind::Float, Device::Cpu))))
            .collect();
        Tensor::write_safetensors(&tensors, dir.join("model.safetensors")).unwrap();
    }

    #[test]
    fn a_layer_missing_a_tensor_its_structure_needs_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        checkpoint(dir.path(), "indexer.index_kpool_compress_gate");
        let model = Glm5Next::open(dir.path(), Device::Cpu).unwrap();
        let err = model.load_layer(0).unwrap_err().to_string();
        assert!(
            err.contains(
                "model.language_model.layers.0.self_attn.indexer.index_kpool_compress_gate"
            ) && err.contains("needed by layer 0 (MLA, dense)"),
            "{err}"
        );
    }

    #[test]
    fn a_checkpoint_without_the_decoder_embeddings_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        checkpoint(dir.path(), "embed_tokens.weight");
        let err = Glm5Next::open(dir.path(), Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no model.language_model.embed_tokens.weight"),
            "{err}"
        );
    }
}
