//! What a trace records, from the `SHADOWTRACE_*` environment
//! (`schemas/v1/env.json`, read once) or set by the demo.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use serde_json::Value;
use shadowtrace_schemas::env::{EnvError, resolve};
use tch::Kind;

use crate::indexer::Fp8Indexer;
use crate::model::deviation::Deviation;
use crate::model::fault::Fault;
use crate::model::graft::Grafted;
use crate::model::graft::{Graft, GraftSite};
use crate::model::layer::{Fallbacks, Weights};
use crate::model::{Layer, Model, Numerics};
use crate::writer::TopkLists;
use crate::{QueueMode, WriterOptions};

/// A shadow mode (DESIGN.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Each layer re-run in the shadow precision on production's input.
    Local,
    /// The shadow's own chain from the embeddings.
    Free,
}

impl Mode {
    /// Its vocabulary word.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Mode::Local => "local",
            Mode::Free => "free",
        }
    }
}

/// The settings of one trace.
#[derive(Debug, Clone)]
pub struct TraceOptions {
    /// Shadow modes; empty records production only.
    pub modes: Vec<Mode>,
    /// Shadow precision: fp32 or bf16.
    pub precision: Kind,
    /// Layers recorded: inclusive ranges; `None` for all.
    pub layers: Option<Vec<(i64, i64)>>,
    /// Sites recorded; `None` for all.
    pub sites: Option<Vec<String>>,
    /// Token sampling as the environment spells it (`{"kind": "all"}`, ...).
    pub tokens_setting: Value,
    /// Boundary band around the k-th indexer score.
    pub band: f32,
    /// Top-N of each logits row.
    pub top_n: i64,
    /// Production's numerics: [`Numerics::Fp8`] (every linear's weight
    /// re-quantized in 128x128 blocks, ue8m0 scales) or
    /// [`Numerics::Fp8Checkpoint`] (the linears an FP8 checkpoint stores in
    /// FP8 on their stored codes and scales, the rest in bf16, as transformers
    /// runs it).
    pub prod: Numerics,
    /// The production FP8 indexer; `None`: no FP8 in the indexer (q and k
    /// in bf16, scores in fp32, as transformers computes it).
    pub fp8_indexer: Option<Fp8Indexer>,
    /// Its name (trtllm, sglang, vllm, deepseek_reference, none).
    pub fp8_indexer_name: String,
    /// Faults planted in production.
    pub faults: Vec<Fault>,
    /// Engine behaviours production runs on purpose.
    pub deviations: Vec<Deviation>,
    /// Where production takes the local shadow's value (`tags.graft`;
    /// [`crate::model::graft`]).
    pub grafts: Vec<Graft>,
    /// Run tags.
    pub tags: BTreeMap<String, String>,
    /// `tool`, `no_tool` or a user word.
    pub prompt_kind: Option<String>,
    /// The model's name in the manifest.
    pub model_name: String,
    /// How the run is written: queue mode and bound, deadlines.
    pub writer: WriterOptions,
    /// Set (by a SIGTERM handler) to end the trace at the next layer: the run
    /// is closed `incomplete` with `counters.interrupted`, every row it sent
    /// written or counted.
    pub stop: Option<Arc<AtomicBool>>,
}

impl TraceOptions {
    /// Defaults: local fp32 shadow, everything recorded, TensorRT-LLM's FP8 indexer.
    #[must_use]
    pub fn new(model_name: &str) -> TraceOptions {
        TraceOptions {
            modes: vec![Mode::Local],
            precision: Kind::Float,
            layers: None,
            sites: None,
            tokens_setting: serde_json::json!({"kind": "all"}),
            band: 1e-4,
            top_n: 20,
            prod: Numerics::Fp8,
            fp8_indexer: Some(Fp8Indexer::trtllm()),
            fp8_indexer_name: "trtllm".to_owned(),
            faults: Vec::new(),
            deviations: Vec::new(),
            grafts: Vec::new(),
            tags: BTreeMap::new(),
            prompt_kind: None,
            model_name: model_name.to_owned(),
            writer: WriterOptions::default(),
            stop: None,
        }
    }

    /// The options the `SHADOWTRACE_*` variables ask for, and whether
    /// `SHADOWTRACE` is on, and the output directory.
    ///
    /// # Errors
    /// A variable whose value does not read as its type.
    pub fn from_env(
        model_name: &str,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<(TraceOptions, bool, String), EnvError> {
        let v = resolve(lookup)?;
        let mut o = TraceOptions::new(model_name);
        let text = |name: &str| {
            v.get(name)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        // The reference engine re-runs whole layers: an indexer-only shadow
        // asked of it is refused, never traced as something else.
        if text("SHADOWTRACE_SHADOW_SCOPE") == "indexer" {
            return Err(EnvError {
                name: "SHADOWTRACE_SHADOW_SCOPE".to_owned(),
                got: "indexer".to_owned(),
                expected: "layer (the reference engine re-runs each layer; the indexer-only \
                           scope is the HF hooks')"
                    .to_owned(),
            });
        }
        match text("SHADOWTRACE_SHADOW").as_str() {
            "none" => o.modes.clear(),
            "bf16" => o.precision = Kind::BFloat16,
            _ => o.precision = Kind::Float,
        }
        if !o.modes.is_empty()
            && let Some(modes) = v.get("SHADOWTRACE_MODE").and_then(Value::as_array)
        {
            o.modes = modes
                .iter()
                .filter_map(Value::as_str)
                .map(|m| if m == "free" { Mode::Free } else { Mode::Local })
                .collect();
        }
        o.layers = v
            .get("SHADOWTRACE_LAYERS")
            .and_then(Value::as_array)
            .map(|ranges| {
                ranges
                    .iter()
                    .filter_map(|r| Some((r.get(0)?.as_i64()?, r.get(1)?.as_i64()?)))
                    .collect()
            });
        o.sites = v
            .get("SHADOWTRACE_SITES")
            .and_then(Value::as_array)
            .map(|s| {
                s.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            });
        o.tokens_setting = v
            .get("SHADOWTRACE_TOKENS")
            .cloned()
            .unwrap_or(o.tokens_setting);
        o.band = v
            .get("SHADOWTRACE_BOUNDARY_BAND")
            .and_then(Value::as_f64)
            .unwrap_or(1e-4) as f32;
        o.top_n = v
            .get("SHADOWTRACE_LOGITS_TOP_N")
            .and_then(Value::as_i64)
            .unwrap_or(20);
        if let Some(tags) = v.get("SHADOWTRACE_TAGS").and_then(Value::as_object) {
            for (k, val) in tags {
                o.tags
                    .insert(k.clone(), val.as_str().unwrap_or_default().to_owned());
            }
        }
        o.prompt_kind = o.tags.get("prompt_kind").cloned();
        if let Some(lists) = v
            .get("SHADOWTRACE_TOPK_LISTS")
            .and_then(TopkLists::from_setting)
        {
            o.writer.topk_lists = lists;
        }
        if text("SHADOWTRACE_QUEUE") == "lossy" {
            o.writer.queue_mode = QueueMode::Lossy;
        }
        let number = |name: &str| v.get(name).and_then(Value::as_f64);
        if let Some(mb) = v.get("SHADOWTRACE_QUEUE_MB").and_then(Value::as_u64) {
            o.writer.queue_bytes =
                usize::try_from(mb.saturating_mul(1 << 20)).unwrap_or(usize::MAX);
        }
        if let Some(s) = number("SHADOWTRACE_QUEUE_TIMEOUT_S") {
            o.writer.queue_timeout = seconds(s);
        }
        if let Some(s) = number("SHADOWTRACE_FLUSH_TIMEOUT_S") {
            o.writer.flush_timeout = seconds(s);
        }
        if let Some(grafts) = v.get("SHADOWTRACE_GRAFT").and_then(Value::as_array) {
            o.grafts = grafts
                .iter()
                .map(|g| {
                    // resolve() read it: one that does not read back is a defect, said loudly.
                    graft_of(g).ok_or_else(|| EnvError {
                        name: "SHADOWTRACE_GRAFT".to_owned(),
                        got: g.to_string(),
                        expected: "{site, layers} as env.json's grafts type reads it (a defect \
                                   between the schema's reader and the tracer's)"
                            .to_owned(),
                    })
                })
                .collect::<Result<_, _>>()?;
        }
        let on = v
            .get("SHADOWTRACE")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok((o, on, text("SHADOWTRACE_DIR")))
    }

    /// Layer `index` of `model` on `weights` as this trace runs it: production
    /// (`planted`: with its faults and deviations, its fallbacks counted in
    /// `fallbacks`) or a shadow (nothing planted), taking `graft`'s values
    /// where given.
    #[must_use]
    #[allow(
        clippy::too_many_arguments,
        reason = "one layer of one path: each setting is needed"
    )]
    pub fn decoder_layer<'a>(
        &'a self,
        model: &'a Model,
        index: i64,
        weights: &'a Weights,
        numerics: Numerics,
        planted: bool,
        fallbacks: Option<&'a Fallbacks>,
        graft: Option<Grafted<'a>>,
    ) -> Layer<'a> {
        let (faults, deviations): (&[Fault], &[Deviation]) = if planted {
            (&self.faults, &self.deviations)
        } else {
            (&[], &[])
        };
        Layer {
            config: &model.config,
            arch: model.arch,
            index,
            weights,
            numerics,
            fp8_indexer: self.fp8_indexer,
            faults,
            deviations,
            fallbacks,
            graft,
        }
    }

    /// `fp32` or `bf16`.
    #[must_use]
    pub fn precision_name(&self) -> &'static str {
        if self.precision == Kind::BFloat16 {
            "bf16"
        } else {
            "fp32"
        }
    }

    /// Whether layer `i` is recorded.
    #[must_use]
    pub fn layer(&self, i: i64) -> bool {
        self.layers
            .as_ref()
            .is_none_or(|r| r.iter().any(|(a, b)| (*a..=*b).contains(&i)))
    }

    /// Whether `site` is recorded.
    #[must_use]
    pub fn site(&self, site: &str) -> bool {
        self.sites
            .as_ref()
            .is_none_or(|s| s.iter().any(|x| x == site))
    }

    /// The token positions of an `s`-token prompt whose statistics are recorded.
    #[must_use]
    pub fn token_rows(&self, s: i64) -> Vec<i64> {
        let n = self
            .tokens_setting
            .get("n")
            .and_then(Value::as_i64)
            .unwrap_or(1)
            .max(1);
        match self.tokens_setting.get("kind").and_then(Value::as_str) {
            Some("every") => (0..s).step_by(n as usize).collect(),
            Some("last") => ((s - n).max(0)..s).collect(),
            _ => (0..s).collect(),
        }
    }
}

/// A non-negative number of seconds as a duration, at most a year (a deadline
/// past that is no deadline in practice, and `Instant + Duration` must not
/// overflow).
fn seconds(s: f64) -> Duration {
    const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);
    Duration::try_from_secs_f64(s).map_or(YEAR, |d| d.min(YEAR))
}

/// One graft as `SHADOWTRACE_GRAFT` reads it: `{"site", "layers": [N, M] | "all"}`.
fn graft_of(v: &Value) -> Option<Graft> {
    let site = GraftSite::named(v.get("site")?.as_str()?)?;
    let layers = match v.get("layers")?.as_array() {
        Some(r) => Some((r.first()?.as_i64()?, r.get(1)?.as_i64()?)),
        None => None,
    };
    Some(Graft { site, layers })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_indexer_only_shadow_scope_is_refused_by_the_reference_engine_naming_the_variable() {
        let env = |scope: &'static str| {
            move |k: &str| (k == "SHADOWTRACE_SHADOW_SCOPE").then(|| scope.to_owned())
        };
        let Err(e) = TraceOptions::from_env("m", env("indexer")) else {
            panic!("SHADOWTRACE_SHADOW_SCOPE=indexer accepted");
        };
        assert_eq!(
            (e.name.as_str(), e.got.as_str()),
            ("SHADOWTRACE_SHADOW_SCOPE", "indexer")
        );
        assert!(e.expected.contains("re-runs each layer"), "{e}");
        assert!(TraceOptions::from_env("m", env("layer")).is_ok());
    }

    #[test]
    fn shadowtrace_graft_reads_as_the_grafts_run_graft_takes() {
        let env = |k: &str| (k == "SHADOWTRACE_GRAFT").then(|| "indexer@1-2, layer_out".to_owned());
        let (o, ..) = TraceOptions::from_env("m", env).unwrap();
        assert_eq!(o.grafts, Graft::parse_all("indexer@1-2,layer_out").unwrap());
        let (o, ..) = TraceOptions::from_env("m", |_| None).unwrap();
        assert!(o.grafts.is_empty());
    }
}
