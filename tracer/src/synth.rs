//! Synthetic runs with contents known by construction: the demo's data until
//! the reference engine exists, and the input of round-trip tests and the
//! storage benchmark. Nothing here is a model; the weights behind these
//! numbers do not exist, and the manifest says so (`engine.name = synthetic`).

use std::collections::BTreeMap;
use std::path::Path;

use shadowtrace_schemas::Manifest;
use shadowtrace_schemas::manifest::{
    Dtypes, Engine, Model, Parallelism, Prompt, RunIdentity, Shadow,
};

use crate::identity::{config_hash, default_device, salt_id, token_hash};
use crate::record::{
    Boundary, Comparison, EventRow, HiddenRow, HiddenShadow, LogitsRow, Record, Selection,
    SelectionUnit, TopLogits, TopkRow, VectorStats,
};
use crate::{RunWriter, TraceError, WriterOptions};

/// The hidden-state sites a synthetic layer records, in execution order.
pub const HIDDEN_SITES: [&str; 4] = ["layer_in", "attn_out", "mlp_out", "layer_out"];

/// Band around the k-th score within which synthetic boundary keys lie, as
/// recorded in the manifest settings (f64, so it prints as written).
const BOUNDARY_BAND_F64: f64 = 1e-3;
/// The same band as stored in the `topk` table.
pub const BOUNDARY_BAND: f32 = BOUNDARY_BAND_F64 as f32;

/// What to synthesise. Every knob plants something whose answer is known:
/// the analyzer's tests and the demo rely on it.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSpec {
    /// Run id.
    pub run_id: String,
    /// Model name in the manifest (a grid groups by it).
    pub model: String,
    /// Decoder layers.
    pub layers: i32,
    /// Prompt length: tokens in the prefill.
    pub tokens: i32,
    /// Hidden size: elements per token vector.
    pub hidden_size: i64,
    /// index_topk.
    pub k: i32,
    /// Query tokens with a `topk` row per layer, evenly spaced over the prompt.
    pub topk_queries: i32,
    /// Share of the k selected keys that prod and shadow swap among keys tied
    /// at the k-th score: boundary churn, not divergence.
    pub churn: f64,
    /// From this layer on, the shadow keeps only 40% of prod's selection and
    /// the swapped keys are far from the k-th score: a selection collapse.
    pub collapse_from_layer: Option<i32>,
    /// From this layer on, the hidden-state error is `divergence_scale`
    /// times its healthy size (about 1e-3): a divergence.
    pub divergence_from_layer: Option<i32>,
    /// How many times the healthy error a divergence is (200 in the demo:
    /// about 0.1 to 0.6 relative L2).
    pub divergence_scale: f32,
    /// Positions with a `logits` row (the last ones of the prompt).
    pub logits_positions: i32,
    /// Top-N of each `logits` row.
    pub logits_top_n: i32,
    /// A NaN planted in prod at (layer, site, token); it spreads to every
    /// later site of that token, as a NaN does through a residual stream.
    pub planted_nan: Option<(i32, &'static str, i32)>,
    /// A failed KV sentinel check (check name) at the start of this layer:
    /// the poisoned slot an onset may come from.
    pub failed_sentinel: Option<(i32, &'static str)>,
    /// Prompt kind tag.
    pub prompt_kind: String,
    /// Seed of every random choice.
    pub seed: u64,
    /// Numerics conventions recorded in the manifest, engine beside model.
    pub conventions: Vec<shadowtrace_schemas::Convention>,
}

impl SynthSpec {
    /// A small GLM-5-shaped run: k = 2048 over a 3072-token prompt, so the
    /// later queries are in the sparse regime and the early ones dense, with
    /// a NaN planted at layer 3.
    #[must_use]
    pub fn demo(run_id: &str) -> SynthSpec {
        SynthSpec {
            run_id: run_id.to_owned(),
            model: "synthetic/glm5-shaped".to_owned(),
            layers: 6,
            tokens: 3072,
            hidden_size: 6144,
            k: 2048,
            topk_queries: 48,
            churn: 0.02,
            collapse_from_layer: None,
            divergence_from_layer: None,
            divergence_scale: 200.0,
            logits_positions: 16,
            logits_top_n: 20,
            planted_nan: Some((3, "mlp_out", 2500)),
            failed_sentinel: None,
            prompt_kind: "tool".to_owned(),
            seed: 7,
            conventions: Vec::new(),
        }
    }

    /// The run's identity, tagged as synthetic.
    #[must_use]
    pub fn identity(&self) -> RunIdentity {
        let config = format!(
            r#"{{"model_type":"synthetic","num_hidden_layers":{},"hidden_size":{},"index_topk":{}}}"#,
            self.layers, self.hidden_size, self.k
        );
        let salt = b"shadowtrace-synthetic";
        // Stand-in token ids: a different prompt kind is a different prompt.
        let kind_offset = self.prompt_kind.bytes().map(u32::from).sum::<u32>() << 16;
        let ids: Vec<u32> = (0..self.tokens.unsigned_abs())
            .map(|i| i + kind_offset)
            .collect();
        let mut settings = serde_json::Map::new();
        settings.insert("synthetic_seed".to_owned(), self.seed.into());
        settings.insert("boundary_band".to_owned(), BOUNDARY_BAND_F64.into());
        let mut injections: Vec<serde_json::Value> = self
            .planted_nan
            .iter()
            .map(|(layer, site, token)| {
                serde_json::json!({"kind": "nan", "path": "prod", "layer": layer, "site": site, "token": token})
            })
            .collect();
        if let Some(layer) = self.collapse_from_layer {
            injections.push(serde_json::json!({"kind": "selection_collapse", "from_layer": layer}));
        }
        if let Some(layer) = self.divergence_from_layer {
            injections.push(serde_json::json!({"kind": "hidden_divergence", "from_layer": layer}));
        }
        RunIdentity {
            run_id: self.run_id.clone(),
            model: Model {
                name: self.model.clone(),
                architecture: "synthetic".to_owned(),
                config_hash: config_hash(config.as_bytes()),
                revision: None,
                num_layers: self.layers.unsigned_abs(),
                index_topk: Some(self.k.unsigned_abs()),
            },
            engine: Engine {
                name: "synthetic".to_owned(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
                commit: None,
                variant: None,
            },
            device: default_device(),
            dtypes: Dtypes {
                prod: "fp8_e4m3".to_owned(),
                shadow: Some("fp32".to_owned()),
                other: BTreeMap::new(),
            },
            parallelism: Parallelism::SINGLE,
            shadow: Shadow {
                precision: Some("fp32".to_owned()),
                modes: vec!["local".to_owned()],
            },
            prompt: Prompt {
                kind: Some(self.prompt_kind.clone()),
                length: u64::from(self.tokens.unsigned_abs()),
                token_hash: token_hash(salt, &ids),
                salt_id: Some(salt_id(salt)),
            },
            settings,
            tags: BTreeMap::from([("synthetic".to_owned(), "true".to_owned())]),
            injections,
            conventions: self.conventions.clone(),
            deviations: Vec::new(),
        }
    }

    /// Every row of the run, in capture order.
    #[must_use]
    pub fn records(&self) -> Vec<Record> {
        let mut rng = SplitMix64(self.seed);
        let mut out = Vec::new();
        let mut seq = 0_i64;
        for layer in 0..self.layers {
            if let Some((_, check)) = self.failed_sentinel.filter(|(l, _)| *l == layer) {
                out.push(Record::Event(EventRow {
                    seq,
                    step: 0,
                    layer,
                    site: "layer_in".to_owned(),
                    path: "prod".to_owned(),
                    kind: "sentinel".to_owned(),
                    token: Some(0),
                    channel: None,
                    count: 1,
                    shadow_finite: None,
                    check: Some(check.to_owned()),
                    passed: Some(false),
                    value: Some(1.0),
                    detail: Some("slot 0: first non-finite at slot 0".to_owned()),
                }));
                seq += 1;
            }
            for (site_rank, site) in HIDDEN_SITES.iter().enumerate() {
                // The indexer runs inside attention, before its output.
                if *site == "attn_out" {
                    out.extend(
                        self.topk_rows(layer, &mut rng)
                            .into_iter()
                            .map(Record::Topk),
                    );
                }
                for token in 0..self.tokens {
                    let poisoned = self.is_poisoned(layer, site_rank, token);
                    out.push(Record::Hidden(
                        self.hidden_row(seq, layer, site, token, poisoned, &mut rng),
                    ));
                    seq += 1;
                }
                if let Some(first) =
                    (0..self.tokens).find(|&t| self.is_poisoned(layer, site_rank, t))
                {
                    out.push(Record::Event(EventRow {
                        seq: seq - 1,
                        step: 0,
                        layer,
                        site: (*site).to_owned(),
                        path: "prod".to_owned(),
                        kind: "nan".to_owned(),
                        token: Some(first),
                        channel: Some(0),
                        count: 1,
                        shadow_finite: Some(true),
                        check: None,
                        passed: None,
                        value: None,
                        detail: None,
                    }));
                }
            }
        }
        out.extend(self.logits_rows(&mut rng).into_iter().map(Record::Logits));
        out
    }

    /// Writes the run through a [`RunWriter`] and returns its manifest.
    ///
    /// # Errors
    /// As [`RunWriter::create`] and [`RunWriter::close`].
    pub fn write(&self, dir: &Path, options: WriterOptions) -> Result<Manifest, TraceError> {
        let writer = RunWriter::create(dir, self.identity(), options)?;
        for record in self.records() {
            let _ = writer.send(record);
        }
        writer.close()
    }

    fn is_poisoned(&self, layer: i32, site_rank: usize, token: i32) -> bool {
        self.planted_nan.is_some_and(|(l, s, t)| {
            let planted_rank = HIDDEN_SITES
                .iter()
                .position(|x| *x == s)
                .unwrap_or(usize::MAX);
            token == t && (layer > l || (layer == l && site_rank >= planted_rank))
        })
    }

    fn hidden_row(
        &self,
        seq: i64,
        layer: i32,
        site: &str,
        token: i32,
        poisoned: bool,
        rng: &mut SplitMix64,
    ) -> HiddenRow {
        let scale = 1.0 + 0.25 * layer as f32;
        let prod = VectorStats {
            nan: i64::from(poisoned),
            pos_inf: 0,
            neg_inf: 0,
            max_abs: scale * (4.0 + rng.next_f32()),
            l2: scale * (70.0 + 10.0 * rng.next_f32()),
        };
        let shadow = VectorStats { nan: 0, ..prod };
        let diverged = self.divergence_from_layer.is_some_and(|l| layer >= l);
        let err = 1e-3
            * (1.0 + 0.1 * layer as f32)
            * (0.5 + rng.next_f32())
            * if diverged { self.divergence_scale } else { 1.0 };
        let comparison = if poisoned {
            Comparison {
                rel_l2_err: f32::NAN,
                cosine: f32::NAN,
                max_abs_diff: f32::NAN,
            }
        } else {
            Comparison {
                rel_l2_err: err,
                cosine: 1.0 - err * err / 2.0,
                max_abs_diff: err * prod.max_abs,
            }
        };
        HiddenRow {
            seq,
            step: 0,
            layer,
            site: site.to_owned(),
            token,
            numel: self.hidden_size,
            prod,
            shadow: Some(HiddenShadow {
                mode: "local".to_owned(),
                stats: shadow,
                comparison,
            }),
        }
    }

    fn topk_rows(&self, layer: i32, rng: &mut SplitMix64) -> Vec<TopkRow> {
        let queries = self.topk_queries.max(1);
        let collapsed = self.collapse_from_layer.is_some_and(|l| layer >= l);
        (0..queries)
            .map(|q| {
                let token =
                    (i64::from(self.tokens - 1) * i64::from(q + 1) / i64::from(queries)) as i32;
                let visible = token + 1;
                let recall = if collapsed { 0.4 } else { 1.0 - self.churn };
                let (prod, shadow) = realistic_selection_pair(visible, self.k, recall, rng);
                let (prod, shadow, boundary_band) = if visible <= self.k {
                    let dense = |indices| Selection {
                        indices,
                        kth_score: None,
                        kth_margin: None,
                        boundary: None,
                    };
                    (dense(prod), dense(shadow), None)
                } else {
                    // Keys one path took and the other did not. Churn: all of
                    // them scored within the band of the k-th score, in both
                    // paths. Collapse: far from it, so the boundary lists hold
                    // none of them.
                    let swapped: Vec<i32> = symmetric_difference(&prod, &shadow);
                    let kth = 1.0 + rng.next_f32();
                    let boundary = |rng: &mut SplitMix64| {
                        let indices = if collapsed {
                            Vec::new()
                        } else {
                            swapped.clone()
                        };
                        let scores = indices
                            .iter()
                            .map(|_| kth + BOUNDARY_BAND * (rng.next_f32() - 0.5))
                            .collect();
                        Boundary { indices, scores }
                    };
                    let selection = |indices, rng: &mut SplitMix64| Selection {
                        indices,
                        kth_score: Some(kth),
                        kth_margin: Some(BOUNDARY_BAND * 1e-2 * rng.next_f32()),
                        boundary: Some(boundary(rng)),
                    };
                    (
                        selection(prod, rng),
                        selection(shadow, rng),
                        Some(BOUNDARY_BAND),
                    )
                };
                TopkRow {
                    step: 0,
                    layer,
                    token,
                    indexer_layer: layer,
                    unit: SelectionUnit::TOKEN,
                    k: self.k,
                    visible,
                    prod,
                    shadow: Some(("raw".to_owned(), shadow)),
                    boundary_band,
                }
            })
            .collect()
    }

    fn logits_rows(&self, rng: &mut SplitMix64) -> Vec<LogitsRow> {
        let first = (self.tokens - self.logits_positions).max(0);
        (first..self.tokens)
            .map(|token| {
                let n = self.logits_top_n.max(0);
                let ids: Vec<i32> = (0..n).map(|_| (rng.next_u64() % 150_000) as i32).collect();
                let logprobs: Vec<f32> = (0..n)
                    .map(|i| -0.1 - i as f32 * (0.5 + rng.next_f32()))
                    .collect();
                // The shadow ranks the same tokens with logprobs a little off.
                let shadow = TopLogits {
                    ids: ids.clone(),
                    logprobs: logprobs.iter().map(|l| l - 0.01 * rng.next_f32()).collect(),
                };
                LogitsRow {
                    step: 0,
                    token,
                    prod: TopLogits { ids, logprobs },
                    shadow: Some(shadow),
                }
            })
            .collect()
    }
}

/// Keys in exactly one of two sorted selections, ascending: the keys two
/// paths disagree on.
#[must_use]
pub fn symmetric_difference(a: &[i32], b: &[i32]) -> Vec<i32> {
    let mut out: Vec<i32> = a
        .iter()
        .filter(|x| b.binary_search(x).is_err())
        .chain(b.iter().filter(|x| a.binary_search(x).is_err()))
        .copied()
        .collect();
    out.sort_unstable();
    out
}

/// A prod selection of `k` among `visible` keys, sorted, and a shadow
/// selection that keeps `round(recall * k)` of its members and swaps the rest
/// for unselected keys. With `visible <= k` both select every key (dense).
#[must_use]
pub fn realistic_selection_pair(
    visible: i32,
    k: i32,
    recall: f64,
    rng: &mut SplitMix64,
) -> (Vec<i32>, Vec<i32>) {
    if visible <= k {
        let all: Vec<i32> = (0..visible).collect();
        return (all.clone(), all);
    }
    let mut keys: Vec<i32> = (0..visible).collect();
    let k_us = k.unsigned_abs() as usize;
    partial_shuffle(&mut keys, k_us, rng);
    let (selected, rest) = keys.split_at_mut(k_us);
    let swaps = (((1.0 - recall) * f64::from(k)).round() as usize).min(rest.len());
    partial_shuffle(selected, selected.len(), rng);
    partial_shuffle(rest, swaps, rng);
    let mut prod = selected.to_vec();
    let mut shadow: Vec<i32> = selected[swaps..]
        .iter()
        .chain(&rest[..swaps])
        .copied()
        .collect();
    prod.sort_unstable();
    shadow.sort_unstable();
    (prod, shadow)
}

/// Moves a uniform random sample of `n` elements to the front (Fisher-Yates, first n steps).
fn partial_shuffle(v: &mut [i32], n: usize, rng: &mut SplitMix64) {
    for i in 0..n.min(v.len()) {
        let j = i + (rng.next_u64() % (v.len() - i) as u64) as usize;
        v.swap(i, j);
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): a small, seedable generator; the
/// synthetic data needs reproducibility, not cryptographic strength.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A float uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1_u64 << 24) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_pair_has_the_requested_recall() {
        let mut rng = SplitMix64(1);
        let (prod, shadow) = realistic_selection_pair(8192, 2048, 0.95, &mut rng);
        assert_eq!(prod.len(), 2048);
        assert_eq!(shadow.len(), 2048);
        assert!(
            prod.windows(2).all(|w| w[0] < w[1]),
            "prod sorted and distinct"
        );
        assert!(
            shadow.windows(2).all(|w| w[0] < w[1]),
            "shadow sorted and distinct"
        );
        let shared = prod
            .iter()
            .filter(|i| shadow.binary_search(i).is_ok())
            .count();
        assert_eq!(shared, 2048 - 102, "round(0.05 * 2048) = 102 swapped");
        assert!(prod.iter().chain(&shadow).all(|&i| (0..8192).contains(&i)));
    }

    #[test]
    fn dense_rows_select_every_visible_key() {
        let mut rng = SplitMix64(1);
        let (prod, shadow) = realistic_selection_pair(100, 2048, 0.5, &mut rng);
        assert_eq!(prod, (0..100).collect::<Vec<_>>());
        assert_eq!(prod, shadow);
    }

    #[test]
    fn planted_nan_spreads_to_later_sites_of_its_token_only() {
        let spec = SynthSpec {
            tokens: 8,
            layers: 3,
            planted_nan: Some((1, "mlp_out", 5)),
            ..SynthSpec::demo("t")
        };
        let nan_rows: Vec<(i32, String, i32)> = spec
            .records()
            .into_iter()
            .filter_map(|r| match r {
                Record::Hidden(h) if h.prod.nan > 0 => Some((h.layer, h.site, h.token)),
                _ => None,
            })
            .collect();
        let expected: Vec<(i32, String, i32)> = [
            (1, "mlp_out"),
            (1, "layer_out"),
            (2, "layer_in"),
            (2, "attn_out"),
            (2, "mlp_out"),
            (2, "layer_out"),
        ]
        .into_iter()
        .map(|(l, s)| (l, s.to_owned(), 5))
        .collect();
        assert_eq!(nan_rows, expected);
    }
}
