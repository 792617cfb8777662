//! GLM-5.3-Flash's text configuration (`Glm5NextTextConfig`, transformers
//! 5.24): read from `config.json`'s nested `text_config` (what
//! `Glm5NextForConditionalGeneration.save_pretrained` writes) or from the top
//! level of a flat text-only checkpoint. The per-layer schedules are filled
//! in as transformers' `__post_init__` fills them when they are absent.

use std::path::Path;

use serde::Deserialize;

use crate::model::ModelError;

/// What a layer's token mixer is (`layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mixer {
    /// `linear_attention`: Kimi delta attention (KDA), recurrent state.
    Kda,
    /// `indexed_attention` (or `full_attention`): MLA restricted to the
    /// k-pool indexer's selection.
    Mla,
}

/// The fields of `text_config` the forward pass reads; defaults are
/// transformers 5.24's.
#[derive(Debug, Clone, Deserialize)]
#[allow(
    missing_docs,
    reason = "HF config field names, documented by transformers"
)]
pub struct Glm5NextConfig {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    #[serde(default = "d_rms_eps")]
    pub rms_norm_eps: f64,
    // MLA
    pub kv_lora_rank: i64,
    pub q_lora_rank: i64,
    #[serde(default)]
    pub qk_rope_head_dim: i64,
    pub v_head_dim: i64,
    pub qk_nope_head_dim: i64,
    // The DSA indexer over k-pools
    pub index_topk: i64,
    pub index_head_dim: i64,
    pub index_n_heads: i64,
    #[serde(default = "d_kpool")]
    pub index_kpool: i64,
    #[serde(default = "d_true")]
    pub index_kpool_always_select_tail: bool,
    // Feed-forward
    pub intermediate_size: i64,
    pub moe_intermediate_size: i64,
    pub n_shared_experts: i64,
    pub n_routed_experts: i64,
    pub routed_scaling_factor: f64,
    #[serde(default = "d_one")]
    pub n_group: i64,
    #[serde(default = "d_one")]
    pub topk_group: i64,
    pub num_experts_per_tok: i64,
    #[serde(default = "d_true")]
    pub norm_topk_prob: bool,
    #[serde(default = "d_swiglu_limit")]
    pub swiglu_limit: f64,
    // KDA
    #[serde(default = "d_linear_dim")]
    pub linear_head_dim: i64,
    #[serde(default = "d_linear_heads")]
    pub linear_num_heads: i64,
    #[serde(default = "d_conv")]
    pub linear_conv_kernel_dim: i64,
    #[serde(default = "d_lower_bound")]
    pub linear_lower_bound: Option<f64>,
    // Hyper-connections
    #[serde(default = "d_hc_mult")]
    pub hc_mult: i64,
    #[serde(default = "d_hc_eps")]
    pub hc_eps: f64,
    #[serde(default = "d_sinkhorn")]
    pub hc_sinkhorn_iters: i64,
    // Schedules
    #[serde(default)]
    pub mlp_layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub indexer_types: Option<Vec<String>>,
}

fn d_rms_eps() -> f64 {
    1e-5
}
fn d_kpool() -> i64 {
    16
}
fn d_true() -> bool {
    true
}
fn d_one() -> i64 {
    1
}
fn d_swiglu_limit() -> f64 {
    10.0
}
fn d_linear_dim() -> i64 {
    128
}
fn d_linear_heads() -> i64 {
    64
}
fn d_conv() -> i64 {
    4
}
#[allow(clippy::unnecessary_wraps, reason = "serde default of an Option field")]
fn d_lower_bound() -> Option<f64> {
    Some(-5.0)
}
fn d_hc_mult() -> i64 {
    4
}
fn d_hc_eps() -> f64 {
    1e-6
}
fn d_sinkhorn() -> i64 {
    20
}

/// The `model_type`s this module runs: the multimodal wrapper (its text
/// decoder) and the text model alone.
pub const MODEL_TYPES: [&str; 2] = ["glm5_next", "glm5_next_text"];

/// Whether `config.json`'s bytes name a GLM-5.3-Flash model.
#[must_use]
pub fn is_glm5_next(config_bytes: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(config_bytes)
        .ok()
        .and_then(|v| v.get("model_type")?.as_str().map(str::to_owned))
        .is_some_and(|t| MODEL_TYPES.contains(&t.as_str()))
}

impl Glm5NextConfig {
    /// Reads `config.json` (nested `text_config`, or flat) and checks what
    /// transformers' `validate_architecture` checks.
    ///
    /// # Errors
    /// An unreadable file, invalid JSON, a missing field, another
    /// `model_type`, or a configuration transformers refuses.
    pub fn read(path: &Path) -> Result<(Glm5NextConfig, Vec<u8>), ModelError> {
        let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
            path: path.to_owned(),
            source,
        })?;
        let config = Glm5NextConfig::parse(&bytes).map_err(|e| match e {
            ParseError::Json(source) => ModelError::Config {
                path: path.to_owned(),
                source,
            },
            ParseError::ModelType(got) => ModelError::Unsupported {
                path: path.to_owned(),
                got,
            },
            ParseError::Invalid(what) => ModelError::Weights {
                path: path.to_owned(),
                what,
            },
        })?;
        Ok((config, bytes))
    }

    fn parse(bytes: &[u8]) -> Result<Glm5NextConfig, ParseError> {
        let doc: serde_json::Value = serde_json::from_slice(bytes).map_err(ParseError::Json)?;
        let model_type = doc
            .get("model_type")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default();
        if !MODEL_TYPES.contains(&model_type) {
            return Err(ParseError::ModelType(model_type.to_owned()));
        }
        // A flat (text-only) checkpoint keeps the text fields at the top level.
        let text = doc
            .get("text_config")
            .filter(|t| t.is_object())
            .unwrap_or(&doc);
        let mut config: Glm5NextConfig =
            serde_json::from_value(text.clone()).map_err(ParseError::Json)?;
        config.post_init(text).map_err(ParseError::Invalid)?;
        config.validate().map_err(ParseError::Invalid)?;
        Ok(config)
    }

    /// What transformers' `__post_init__` reads from keys that are not
    /// fields: the indexer schedule from `index_topk_pattern` (`"FSSF…"` or a
    /// list) or else `index_topk_freq` / `index_skip_topk_offset`, and the
    /// KDA sizes and gate bound from `linear_attn_config`. A hub checkpoint
    /// may carry these instead of the fields `save_pretrained` writes.
    fn post_init(&mut self, text: &serde_json::Value) -> Result<(), String> {
        let n = self.num_hidden_layers.max(0);
        if self.indexer_types.is_none() {
            self.indexer_types = Some(match text.get("index_topk_pattern") {
                Some(serde_json::Value::String(pattern)) => pattern
                    .chars()
                    .map(|c| match c {
                        'F' => Ok("full".to_owned()),
                        'S' => Ok("shared".to_owned()),
                        other => Err(format!(
                            "index_topk_pattern {pattern:?}: {other:?} is neither F (full) nor S (shared)"
                        )),
                    })
                    .collect::<Result<_, _>>()?,
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .map(|v| {
                        v.as_str().map(str::to_owned).ok_or_else(|| {
                            format!("index_topk_pattern entry {v}: expected \"full\" or \"shared\"")
                        })
                    })
                    .collect::<Result<_, _>>()?,
                Some(serde_json::Value::Null) | None => {
                    let int = |key: &str, default: i64| {
                        text.get(key).and_then(serde_json::Value::as_i64).unwrap_or(default)
                    };
                    let freq = int("index_topk_freq", 1).max(1);
                    let offset = int("index_skip_topk_offset", 2);
                    (0..n)
                        .map(|i| {
                            let full = (i - offset + 1).max(0) % freq == 0;
                            (if full { "full" } else { "shared" }).to_owned()
                        })
                        .collect()
                }
                Some(other) => {
                    return Err(format!(
                        "index_topk_pattern {other}: expected a string of F and S or a list"
                    ));
                }
            });
        }
        if let Some(linear) = text.get("linear_attn_config").filter(|v| v.is_object()) {
            let int = |key: &str| linear.get(key).and_then(serde_json::Value::as_i64);
            self.linear_head_dim = int("head_dim").unwrap_or(self.linear_head_dim);
            self.linear_num_heads = int("num_heads").unwrap_or(self.linear_num_heads);
            self.linear_conv_kernel_dim =
                int("short_conv_kernel_size").unwrap_or(self.linear_conv_kernel_dim);
            if let Some(bound) = linear.get("gate_lower_bound") {
                self.linear_lower_bound = bound.as_f64();
            }
            let safe_gate = linear
                .get("safe_gate")
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(true);
            if safe_gate && self.linear_lower_bound.is_none() {
                self.linear_lower_bound = d_lower_bound();
            }
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), String> {
        let n = self.num_hidden_layers as usize;
        if self.qk_rope_head_dim != 0 {
            return Err(format!(
                "qk_rope_head_dim {}, expected 0 (GLM-5.3-Flash's MLA has no RoPE)",
                self.qk_rope_head_dim
            ));
        }
        if self.index_kpool < 1 || self.index_topk % self.index_kpool != 0 {
            return Err(format!(
                "index_topk {} must be a multiple of index_kpool {} (>= 1)",
                self.index_topk, self.index_kpool
            ));
        }
        if self.n_group < 1 || self.n_routed_experts % self.n_group != 0 {
            return Err(format!(
                "n_routed_experts {} must be a multiple of n_group {}",
                self.n_routed_experts, self.n_group
            ));
        }
        for (name, list) in [
            ("mlp_layer_types", &self.mlp_layer_types),
            ("layer_types", &self.layer_types),
            ("indexer_types", &self.indexer_types),
        ] {
            if let Some(list) = list
                && list.len() < n
            {
                return Err(format!(
                    "{name} has {} entries, expected num_hidden_layers = {n}",
                    list.len()
                ));
            }
        }
        // transformers hands a shared layer the selection of the layer just
        // before it, and only a full MLA layer hands one on: a shared layer
        // after a KDA layer, after another shared layer or first of all
        // raises there at the first forward.
        for i in 0..self.num_hidden_layers {
            if self.mixer(i) != Mixer::Mla || self.runs_indexer(i) {
                continue;
            }
            if i == 0 {
                return Err(
                    "layer 0 shares the indexer selection of a previous layer, and \
                     there is none (transformers raises at the first forward)"
                        .to_owned(),
                );
            }
            let before = i - 1;
            if self.mixer(before) != Mixer::Mla || !self.runs_indexer(before) {
                let what = if self.mixer(before) == Mixer::Mla {
                    "a shared MLA layer"
                } else {
                    "a KDA layer"
                };
                return Err(format!(
                    "layer {i} shares the indexer selection of layer {before}, {what} that hands \
                     on none (transformers raises at the first forward)"
                ));
            }
        }
        Ok(())
    }

    /// Layer `i`'s token mixer; transformers' default schedule is KDA with
    /// an MLA layer every fourth (`i % 4 == 3`).
    #[must_use]
    pub fn mixer(&self, i: i64) -> Mixer {
        match self.layer_types.as_ref().and_then(|t| t.get(i as usize)) {
            Some(t) if t == "linear_attention" => Mixer::Kda,
            Some(_) => Mixer::Mla,
            None if i % 4 != 3 => Mixer::Kda,
            None => Mixer::Mla,
        }
    }

    /// Whether layer `i` has a MoE block (`mlp_layer_types` "sparse"); the
    /// default is three dense layers, then MoE.
    #[must_use]
    pub fn is_moe(&self, i: i64) -> bool {
        match &self.mlp_layer_types {
            Some(types) => types.get(i as usize).is_some_and(|t| t == "sparse"),
            None => i >= 3,
        }
    }

    /// Whether MLA layer `i` runs its own indexer (`full`) rather than
    /// reusing the previous layer's selection (`shared`). transformers'
    /// default (no `indexer_types`, no pattern in the checkpoint) is `full`
    /// everywhere.
    #[must_use]
    pub fn runs_indexer(&self, i: i64) -> bool {
        self.indexer_types
            .as_ref()
            .and_then(|t| t.get(i as usize))
            .is_none_or(|t| t != "shared")
    }

    /// Query/key head size of MLA (NoPE: the nope part alone).
    #[must_use]
    pub fn qk_head_dim(&self) -> i64 {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Pools the indexer keeps per query (`index_topk // index_kpool`).
    #[must_use]
    pub fn pools_per_query(&self) -> i64 {
        self.index_topk / self.index_kpool
    }
}

enum ParseError {
    Json(serde_json::Error),
    ModelType(String),
    Invalid(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(extra: &str) -> String {
        format!(
            r#"{{"vocab_size": 8, "hidden_size": 4, "num_hidden_layers": 4,
            "num_attention_heads": 1, "kv_lora_rank": 2, "q_lora_rank": 2, "v_head_dim": 2,
            "qk_nope_head_dim": 2, "index_topk": 32, "index_head_dim": 2, "index_n_heads": 1,
            "intermediate_size": 4, "moe_intermediate_size": 2, "n_shared_experts": 1,
            "n_routed_experts": 2, "routed_scaling_factor": 1.0, "num_experts_per_tok": 1{extra}}}"#
        )
    }

    #[test]
    fn a_nested_text_config_and_a_flat_one_read_the_same_schedules() {
        let nested = format!(
            r#"{{"model_type": "glm5_next", "text_config": {}}}"#,
            text("")
        );
        let flat = text(r#", "model_type": "glm5_next""#);
        for bytes in [nested, flat] {
            let c = Glm5NextConfig::parse(bytes.as_bytes()).ok().unwrap();
            let mixers: Vec<Mixer> = (0..4).map(|i| c.mixer(i)).collect();
            assert_eq!(mixers, [Mixer::Kda, Mixer::Kda, Mixer::Kda, Mixer::Mla]);
            let moe: Vec<bool> = (0..4).map(|i| c.is_moe(i)).collect();
            assert_eq!(moe, [false, false, false, true]);
            assert_eq!((c.index_kpool, c.pools_per_query(), c.hc_mult), (16, 2, 4));
        }
    }

    #[test]
    fn a_rope_dimension_a_topk_off_the_pool_grid_and_an_orphan_shared_layer_are_refused() {
        for (extra, needle) in [
            (r#", "qk_rope_head_dim": 64"#, "qk_rope_head_dim 64"),
            (r#", "index_kpool": 5"#, "multiple of index_kpool 5"),
            (
                r#", "indexer_types": ["full", "full", "full", "shared"]"#,
                "layer 3 shares",
            ),
        ] {
            let bytes = text(&format!(r#", "model_type": "glm5_next"{extra}"#));
            match Glm5NextConfig::parse(bytes.as_bytes()) {
                Err(ParseError::Invalid(what)) => assert!(what.contains(needle), "{what}"),
                _ => panic!("{extra} accepted"),
            }
        }
        let mla = r#", "layer_types": ["indexed_attention", "indexed_attention", "linear_attention", "indexed_attention"]"#;
        for (extra, needle) in [
            (
                r#", "indexer_types": ["shared", "full", "full", "full"]"#,
                "layer 0 shares",
            ),
            (
                r#", "indexer_types": ["full", "shared", "shared", "full"]"#,
                "",
            ),
            (
                r#", "indexer_types": ["full", "full", "full", "shared"]"#,
                "a KDA layer",
            ),
        ] {
            let bytes = text(&format!(r#", "model_type": "glm5_next"{mla}{extra}"#));
            let parsed = Glm5NextConfig::parse(bytes.as_bytes());
            match (parsed, needle) {
                (Ok(_), "") => {}
                (Err(ParseError::Invalid(what)), needle) if !needle.is_empty() => {
                    assert!(what.contains(needle), "{what}");
                }
                _ => panic!("{extra}: not as expected"),
            }
        }
        let consecutive = r#", "layer_types": ["indexed_attention", "indexed_attention", "indexed_attention", "linear_attention"], "indexer_types": ["full", "shared", "shared", "full"]"#;
        let bytes = text(&format!(r#", "model_type": "glm5_next"{consecutive}"#));
        match Glm5NextConfig::parse(bytes.as_bytes()) {
            Err(ParseError::Invalid(what)) => {
                assert!(
                    what.contains("layer 2 shares") && what.contains("a shared MLA layer"),
                    "{what}"
                );
            }
            _ => panic!("two shared layers in a row accepted"),
        }
        let other = text(r#", "model_type": "glm_moe_dsa""#);
        assert!(matches!(
            Glm5NextConfig::parse(other.as_bytes()),
            Err(ParseError::ModelType(t)) if t == "glm_moe_dsa"
        ));
    }

    /// transformers 5.24's `Glm5NextTextConfig.__post_init__` on the same
    /// keys (read there): a pattern string, the freq/offset schedule, and a
    /// `linear_attn_config` dict with an unbounded and a safe gate.
    #[test]
    fn hub_keys_transformers_reads_in_post_init_set_the_schedule_and_the_kda_gate() {
        let parse = |extra: &str| {
            let bytes = text(&format!(r#", "model_type": "glm5_next"{extra}"#));
            Glm5NextConfig::parse(bytes.as_bytes()).ok().unwrap()
        };
        let schedule = |c: &Glm5NextConfig| (0..4).map(|i| c.runs_indexer(i)).collect::<Vec<_>>();
        // layers 0-2 KDA, 3 MLA by default: only layer 3's entry matters to
        // the forward, but every layer's is read as transformers reads it
        let c = parse(r#", "index_topk_pattern": "FSFF""#);
        assert_eq!(
            c.indexer_types.as_deref().unwrap(),
            ["full", "shared", "full", "full"]
        );
        assert_eq!(schedule(&c), [true, false, true, true]);
        // freq 2, offset 2: full where max(i - 1, 0) % 2 == 0, i.e. 0, 1, 3
        let c = parse(r#", "index_topk_freq": 2, "index_skip_topk_offset": 2"#);
        assert_eq!(schedule(&c), [true, true, false, true]);
        assert_eq!(schedule(&parse("")), [true; 4]);
        let c = parse(
            r#", "linear_attn_config": {"head_dim": 64, "num_heads": 8, "short_conv_kernel_size": 3,
                "gate_lower_bound": null, "safe_gate": false}"#,
        );
        assert_eq!(
            (
                c.linear_head_dim,
                c.linear_num_heads,
                c.linear_conv_kernel_dim
            ),
            (64, 8, 3)
        );
        assert_eq!(c.linear_lower_bound, None);
        let c = parse(r#", "linear_attn_config": {"gate_lower_bound": null}"#);
        assert_eq!(
            c.linear_lower_bound,
            Some(-5.0),
            "safe_gate defaults to true"
        );
        let c = parse(r#", "linear_attn_config": {"gate_lower_bound": -3.0}"#);
        assert_eq!(c.linear_lower_bound, Some(-3.0));
        let bytes = text(r#", "model_type": "glm5_next", "index_topk_pattern": "FX""#);
        match Glm5NextConfig::parse(bytes.as_bytes()) {
            Err(ParseError::Invalid(what)) => assert!(what.contains("'X'"), "{what}"),
            _ => panic!("a pattern letter other than F and S accepted"),
        }
    }
}
