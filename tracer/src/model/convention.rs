//! The conventions of a reference-engine run (DESIGN.md, convention): each
//! numerics choice the model defines, the value production ran beside the
//! model's, and where each was read. The shadow always takes the model's;
//! production takes them too unless a deviation changes one, so a run with
//! `--deviation indexer_rope_neox` on GLM records the mismatch that
//! `shadowtrace analyze` names before any metric.
//!
//! The shape and the `indexer_rope` spelling are shared with the Python
//! hooks (`hooks/src/shadowtrace_hooks/adapters/engine.py`, `convention`),
//! so a mismatch reads the same whichever producer wrote the run.

use serde_json::Value;
use shadowtrace_schemas::Convention;

use super::config::{Architecture, ModelConfig};
use super::deviation::{AtLayer, Deviation, DeviationKind, IndexerQuant};
use crate::indexer::Fp8Indexer;

/// The indexer RoPE's layout: `interleaved` or `neox`.
pub const INDEXER_ROPE: &str = "indexer_rope";
/// The RoPE base.
pub const ROPE_THETA: &str = "rope_theta";
/// `default` or `yarn` with its factor, for example `yarn x40`.
pub const ROPE_SCALING: &str = "rope_scaling";
/// Whether q and k are Hadamard-rotated before FP8 quantization.
pub const INDEXER_HADAMARD: &str = "indexer_hadamard";
/// The factor folded into the head weights: `index_head_dim^-1/2 x index_n_heads^-1/2`.
pub const INDEXER_HEAD_WEIGHT_SCALE: &str = "indexer_head_weight_scale";
/// The dtype `weights_proj(x)` is computed and rounded in.
pub const INDEXER_WEIGHTS_PROJ_DTYPE: &str = "indexer_weights_proj_dtype";

/// The model family's reference for the indexer RoPE layout, and where it is
/// defined.
#[must_use]
pub fn model_indexer_rope(arch: Architecture) -> (&'static str, &'static str) {
    match arch {
        Architecture::Glm => (
            "interleaved",
            "transformers glm_moe_dsa GlmMoeDsaIndexer: apply_rotary_pos_emb_interleave",
        ),
        Architecture::DeepSeek => (
            "neox",
            "transformers deepseek_v32 DeepseekV32Indexer: half-split apply_rotary_pos_emb",
        ),
    }
}

/// The model's `rope_scaling` convention in its spelling: `default`, or
/// `yarn x<factor>`.
#[must_use]
pub fn rope_scaling(config: &ModelConfig) -> String {
    let rope = config.rope();
    match (rope.rope_type.as_str(), rope.factor) {
        ("yarn", Some(f)) => format!("yarn x{f}"),
        (other, _) => other.to_owned(),
    }
}

/// The head-weight scale the model defines: `D^-1/2 * H^-1/2`, computed as
/// the hooks compute it (`dim ** -0.5 * heads ** -0.5` in doubles).
#[must_use]
pub fn head_weight_scale(config: &ModelConfig) -> f64 {
    head_weight_scale_of(config.index_head_dim, config.index_n_heads)
}

/// `index_head_dim^-1/2 x index_n_heads^-1/2`, for any family's config.
#[must_use]
pub fn head_weight_scale_of(index_head_dim: i64, index_n_heads: i64) -> f64 {
    (index_head_dim as f64).powf(-0.5) * (index_n_heads as f64).powf(-0.5)
}

/// The conventions of a run of `config` whose production indexer is `base`
/// (`None`: no FP8) with `deviations`.
#[must_use]
pub fn reference_conventions(
    config: &ModelConfig,
    arch: Architecture,
    base: Option<Fp8Indexer>,
    deviations: &[Deviation],
) -> Vec<Convention> {
    const ENGINE: &str = "shadowtrace-reference production";
    let acting = |kinds: &[DeviationKind]| -> Vec<String> {
        deviations
            .iter()
            .filter(|d| kinds.contains(&d.kind))
            .map(ToString::to_string)
            .collect()
    };
    let source = |names: Vec<String>, otherwise: &str| {
        if names.is_empty() {
            format!("{ENGINE}: {otherwise}")
        } else {
            format!("{ENGINE}: --deviation {}", names.join(","))
        }
    };
    let mut out = Vec::new();

    let (model_rope, model_rope_source) = model_indexer_rope(arch);
    let rope_devs = acting(&[
        DeviationKind::IndexerRopeNeox,
        DeviationKind::IndexerRopeInterleaved,
    ]);
    // The last layout a deviation sets wins, as in AtLayer::of.
    let engine_rope = deviations
        .iter()
        .rev()
        .find_map(|d| match d.kind {
            DeviationKind::IndexerRopeNeox => Some("neox"),
            DeviationKind::IndexerRopeInterleaved => Some("interleaved"),
            _ => None,
        })
        .unwrap_or(model_rope);
    out.push(Convention {
        name: INDEXER_ROPE.to_owned(),
        engine: engine_rope.into(),
        model: model_rope.into(),
        engine_source: source(rope_devs, "the model's layout"),
        model_source: model_rope_source.to_owned(),
        engine_assumed: false,
    });

    let theta = config.rope().rope_theta;
    out.push(Convention {
        name: ROPE_THETA.to_owned(),
        engine: theta.into(),
        model: theta.into(),
        engine_source: format!("{ENGINE}: config.json"),
        model_source: "config.json rope_parameters.rope_theta (or rope_theta)".to_owned(),
        engine_assumed: false,
    });
    let scaling = rope_scaling(config);
    out.push(Convention {
        name: ROPE_SCALING.to_owned(),
        engine: scaling.clone().into(),
        model: scaling.into(),
        engine_source: format!("{ENGINE}: config.json"),
        model_source: "config.json rope_parameters (or rope_scaling)".to_owned(),
        engine_assumed: false,
    });

    // Hadamard: what the layers' quantization does, over every layer.
    let quant_devs = acting(&[
        DeviationKind::IndexerFp8,
        DeviationKind::HadamardDropped,
        DeviationKind::IndexerKCacheFp8,
    ]);
    let hadamard: Vec<Option<bool>> = (0..config.num_hidden_layers)
        .map(
            |i| match AtLayer::of(deviations, i, config).indexer_quant(base) {
                IndexerQuant::None => None,
                IndexerQuant::Keys(v) | IndexerQuant::QueriesAndKeys(v) => Some(v.hadamard),
            },
        )
        .collect();
    // A layer-scoped deviation shows where it departs; the engine value is
    // the departing one.
    let engine_hadamard = hadamard
        .iter()
        .flatten()
        .copied()
        .find(|h| !h)
        .or_else(|| hadamard.iter().flatten().copied().next());
    let (model_hadamard, model_hadamard_source) = match arch {
        Architecture::DeepSeek => (
            Value::from(true),
            "DeepSeek-V3.2 reference inference/model.py Indexer.forward: rotate_activation before act_quant",
        ),
        Architecture::Glm => (
            Value::Null,
            "none: no reference FP8 indexer is published for glm_moe_dsa (transformers scores \
             without FP8, where the rotation changes nothing)",
        ),
    };
    out.push(Convention {
        name: INDEXER_HADAMARD.to_owned(),
        engine: engine_hadamard.map_or(Value::Null, Value::from),
        model: model_hadamard,
        engine_source: if engine_hadamard.is_none() {
            format!("{ENGINE}: no FP8 in the indexer, where the rotation is exact")
        } else {
            source(quant_devs, "the --fp8-indexer variant")
        },
        model_source: model_hadamard_source.to_owned(),
        engine_assumed: false,
    });

    let scale = head_weight_scale(config);
    out.push(Convention {
        name: INDEXER_HEAD_WEIGHT_SCALE.to_owned(),
        engine: scale.into(),
        model: scale.into(),
        engine_source: format!("{ENGINE}: index_head_dim and index_n_heads of config.json"),
        model_source: "transformers GlmMoeDsaIndexer / DeepseekV32Indexer: softmax_scale = \
                       head_dim^-0.5, weights * n_heads^-0.5"
            .to_owned(),
        engine_assumed: false,
    });
    let proj_devs = acting(&[DeviationKind::WeightsProjBf16]);
    out.push(Convention {
        name: INDEXER_WEIGHTS_PROJ_DTYPE.to_owned(),
        engine: if proj_devs.is_empty() { "fp32" } else { "bf16" }.into(),
        model: "fp32".into(),
        engine_source: source(proj_devs, "fp32 GEMM on x.float()"),
        model_source: "transformers _keep_in_fp32_modules weights_proj; DeepSeek-V3.2 reference \
                       fp32 weights_proj on x.float()"
            .to_owned(),
        engine_assumed: false,
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synthetic;

    fn config(value: &serde_json::Value) -> ModelConfig {
        serde_json::from_value(value.clone()).unwrap()
    }

    fn find<'a>(c: &'a [Convention], name: &str) -> &'a Convention {
        c.iter().find(|c| c.name == name).unwrap()
    }

    #[test]
    fn a_clean_run_agrees_with_the_model_everywhere_it_is_known() {
        for (value, arch) in [
            (synthetic::glm51_config(2), Architecture::Glm),
            (synthetic::deepseek_v32_config(2), Architecture::DeepSeek),
        ] {
            let c = reference_conventions(&config(&value), arch, None, &[]);
            assert!(c.iter().all(|c| !c.mismatch()), "{c:?}");
        }
    }

    #[test]
    fn a_rope_deviation_is_a_mismatch_on_glm_and_not_on_deepseek() {
        let neox = [Deviation::parse("indexer_rope_neox").unwrap()];
        let glm = reference_conventions(
            &config(&synthetic::glm51_config(2)),
            Architecture::Glm,
            None,
            &neox,
        );
        let rope = find(&glm, INDEXER_ROPE);
        assert_eq!(
            (rope.engine.as_str(), rope.model.as_str()),
            (Some("neox"), Some("interleaved"))
        );
        assert!(rope.engine_source.contains("indexer_rope_neox"));
        let ds = reference_conventions(
            &config(&synthetic::deepseek_v32_config(2)),
            Architecture::DeepSeek,
            None,
            &neox,
        );
        assert!(!find(&ds, INDEXER_ROPE).mismatch());
    }

    #[test]
    fn dropping_the_hadamard_departs_from_deepseeks_reference() {
        let c = reference_conventions(
            &config(&synthetic::deepseek_v32_config(2)),
            Architecture::DeepSeek,
            Some(Fp8Indexer::trtllm()),
            &[],
        );
        let h = find(&c, INDEXER_HADAMARD);
        assert_eq!(
            (h.engine.as_bool(), h.model.as_bool()),
            (Some(false), Some(true))
        );
        let scoped = reference_conventions(
            &config(&synthetic::deepseek_v32_config(3)),
            Architecture::DeepSeek,
            Some(Fp8Indexer::deepseek_reference()),
            &[Deviation::parse("hadamard_dropped@1").unwrap()],
        );
        assert_eq!(
            find(&scoped, INDEXER_HADAMARD).engine.as_bool(),
            Some(false)
        );
    }
}
