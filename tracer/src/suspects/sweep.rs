//! The sweep: every path (the clean production path and each deviation) on
//! every prompt, layer by layer in lockstep. Each layer's weights are loaded
//! once and applied to every path's hidden state and to the fp32 reference
//! chain of every prompt, so a sweep costs about one read of the weights plus
//! compute, whatever the number of deviations.
//!
//! Work that does not depend on the path is done once per layer and prompt:
//! a path whose layer input is bit-identical to an earlier path's (every
//! path at layer 0; a deviation's path before its layer, or while it has
//! changed nothing) shares that path's fp32 reference selection, and, where
//! the same deviations act in the layer, its output: the numbers of
//! computing every path on its own, since a layer is a deterministic function
//! of its input, its top-k and the deviations acting in it.

use std::rc::Rc;
use std::time::Instant;

use serde::Serialize;
use shadowtrace_schemas::stats::{TopN, agreement};
use tch::{Kind, Tensor};

use super::profile::{
    Cell, LayerMetrics, Onset, Rows, first_nonfinite, hidden_p95, mean_jaccard, selection_rows,
};
use crate::indexer::Fp8Indexer;
use crate::model::deviation::{AtLayer, Deviation, DeviationKind, Effect};
use crate::model::rope::Rope;
use crate::model::{Layer, LayerOutput, Model, Numerics};
use crate::trace::{TraceRunError, stats};

/// Tokens at the end of each prompt whose logits are compared: every logits
/// row of a real vocabulary is 0.6 MB, and the last tokens are those the
/// corruption reports read (the first generated token follows the last).
pub const LOGITS_TOKENS: i64 = 256;

/// One production path: the clean one (no deviation) or deviations run together.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PathSpec {
    /// `clean`, a deviation's name, or names joined by `+`.
    pub name: String,
    /// The deviations it runs.
    #[serde(skip)]
    pub deviations: Vec<Deviation>,
}

impl PathSpec {
    /// The clean production path.
    #[must_use]
    pub fn clean() -> PathSpec {
        PathSpec {
            name: "clean".to_owned(),
            deviations: Vec::new(),
        }
    }

    /// Every deviation, each alone at every layer, in the order `--list` gives.
    #[must_use]
    pub fn every_deviation() -> Vec<PathSpec> {
        DeviationKind::ALL
            .iter()
            .map(|&kind| PathSpec::of(vec![Deviation::everywhere(kind)]))
            .collect()
    }

    /// Deviations run together as one path.
    #[must_use]
    pub fn of(deviations: Vec<Deviation>) -> PathSpec {
        PathSpec {
            name: deviations
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("+"),
            deviations,
        }
    }
}

/// One prompt at one length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SweepPrompt {
    /// `tool`, `no_tool`, or a user word.
    pub kind: String,
    /// Token ids.
    pub ids: Vec<i64>,
}

/// Production's linear layers in the sweep: what the observed runs ran, so
/// that a deviation is ranked against a clean path of the same precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProdLinears {
    /// FP8 block-scaled ([`Numerics::Fp8`]).
    Fp8,
    /// bf16, as transformers runs a bf16 checkpoint.
    Bf16,
}

impl ProdLinears {
    /// The linears a manifest's `dtypes.prod` names: `fp8*` or `bf16`;
    /// `None` for any other (the sweep runs no such production).
    #[must_use]
    pub fn of_dtype(dtype: &str) -> Option<ProdLinears> {
        match dtype {
            d if d.starts_with("fp8") => Some(ProdLinears::Fp8),
            "bf16" | "bfloat16" => Some(ProdLinears::Bf16),
            _ => None,
        }
    }

    /// The layer numerics that run them.
    #[must_use]
    pub fn numerics(self) -> Numerics {
        match self {
            ProdLinears::Fp8 => Numerics::Fp8,
            ProdLinears::Bf16 => Numerics::Plain(Kind::BFloat16),
        }
    }

    /// As the report names them.
    #[must_use]
    pub fn describe(self) -> &'static str {
        match self {
            ProdLinears::Fp8 => "FP8 block-scaled linears (e4m3, 1x128 and 128x128 blocks, ue8m0)",
            ProdLinears::Bf16 => "bf16 linears, no FP8",
        }
    }
}

/// How to sweep.
#[derive(Debug, Clone)]
pub struct SweepOptions {
    /// Production's linear layers.
    pub prod: ProdLinears,
    /// Production's FP8 indexer; `None`: no FP8 in the indexer.
    pub base: Option<Fp8Indexer>,
    /// Its name, for the report.
    pub base_name: String,
    /// Boundary band around the k-th score, relative to each row's score
    /// scale (as `SHADOWTRACE_BOUNDARY_BAND`): churn within it is excluded.
    pub band: f32,
    /// Top-N of each logits row.
    pub top_n: i64,
}

impl Default for SweepOptions {
    fn default() -> SweepOptions {
        SweepOptions {
            prod: ProdLinears::Fp8,
            base: None,
            base_name: "none".to_owned(),
            band: 1e-4,
            top_n: 20,
        }
    }
}

/// What one layer of the sweep took.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LayerTiming {
    /// Layer.
    pub layer: i64,
    /// Seconds reading its weights.
    pub load_s: f64,
    /// Seconds of compute: every path, the reference chain and the metrics.
    pub compute_s: f64,
}

/// Progress of a sweep, after each layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Layers done.
    pub done: i64,
    /// Layers in all.
    pub layers: i64,
    /// Seconds since the sweep began.
    pub elapsed_s: f64,
    /// The last layer's timing.
    pub last: LayerTiming,
}

impl Progress {
    /// Seconds left at the pace so far.
    #[must_use]
    pub fn remaining_s(&self) -> f64 {
        if self.done == 0 {
            return f64::NAN;
        }
        self.elapsed_s / self.done as f64 * (self.layers - self.done) as f64
    }
}

/// A deviation the sweep did not run because it changes nothing here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NotRun {
    /// The path's name.
    pub path: String,
    /// Why the mathematics says it changes nothing.
    pub reason: String,
}

/// Everything a sweep measured.
#[derive(Debug, Clone, Serialize)]
pub struct Sweep {
    /// The model's `model_type`.
    pub architecture: String,
    /// index_topk.
    pub index_topk: i64,
    /// Decoder layers.
    pub layers: i64,
    /// Production's linear layers.
    pub prod: ProdLinears,
    /// Production's FP8 indexer.
    pub base: String,
    /// The band churn was excluded within.
    pub band: f32,
    /// Paths run, clean first.
    pub paths: Vec<String>,
    /// Paths not run, and why.
    pub not_run: Vec<NotRun>,
    /// One per (path, prompt).
    pub cells: Vec<Cell>,
    /// Per layer.
    pub timings: Vec<LayerTiming>,
    /// Tokens swept per layer, summed over prompts.
    pub tokens: i64,
    /// Device the sweep ran on.
    pub device: String,
}

impl Sweep {
    /// Seconds of compute per layer per 1k tokens per path (the paths run,
    /// the reference chain's cost spread over them).
    #[must_use]
    pub fn seconds_per_layer_per_1k_tokens_per_path(&self) -> f64 {
        let compute: f64 = self.timings.iter().map(|t| t.compute_s).sum();
        let layers = self.timings.len().max(1) as f64;
        compute / layers / (self.tokens as f64 / 1000.0) / self.paths.len().max(1) as f64
    }

    /// Seconds per layer spent reading weights.
    #[must_use]
    pub fn load_seconds_per_layer(&self) -> f64 {
        self.timings.iter().map(|t| t.load_s).sum::<f64>() / self.timings.len().max(1) as f64
    }
}

/// The paths of `requested` that change production of `model` (clean first),
/// and those that do not, with the reason.
#[must_use]
pub fn plan(
    model: &Model,
    base: Option<Fp8Indexer>,
    prod: ProdLinears,
    requested: &[PathSpec],
) -> (Vec<PathSpec>, Vec<NotRun>) {
    let mut run = vec![PathSpec::clean()];
    let mut not_run = Vec::new();
    for path in requested {
        let reasons: Vec<String> = path
            .deviations
            .iter()
            .filter_map(|d| {
                match d.effect(
                    &model.config,
                    base,
                    prod == ProdLinears::Fp8,
                    &path.deviations,
                ) {
                    // The path's name is the deviation's when it runs alone.
                    Effect::None(why) if path.deviations.len() == 1 => Some(why),
                    Effect::None(why) => Some(format!("{d}: {why}")),
                    Effect::Changes => None,
                }
            })
            .collect();
        if !path.deviations.is_empty() && reasons.len() == path.deviations.len() {
            not_run.push(NotRun {
                path: path.name.clone(),
                reason: reasons.join("; "),
            });
        } else if !run.iter().any(|p| p.name == path.name) {
            run.push(path.clone());
        }
    }
    (run, not_run)
}

struct PathState {
    h: Tensor,
    prev: Option<Tensor>,
    cell: Cell,
}

struct PromptState {
    ids: Vec<i64>,
    rope: Rope,
    h: Tensor,
    prev: Option<Tensor>,
    paths: Vec<PathState>,
}

/// One path's layer as the sweep computed it, for the paths after it.
struct Computed {
    /// The layer's input.
    input: Tensor,
    /// The top-k it was given (a layer that shares the previous one's).
    prev: Option<Tensor>,
    /// The deviations acting in the layer.
    at: AtLayer,
    out: LayerOutput,
    prod_rows: Option<Rc<Rows>>,
    ref_rows: Option<Rc<Rows>>,
}

/// Whether two tensors hold the same values bit for bit (same shape and kind).
fn same_tensor(a: &Tensor, b: &Tensor) -> bool {
    a.kind() == b.kind() && a.size() == b.size() && a.equal(b)
}

fn same_topk(a: Option<&Tensor>, b: Option<&Tensor>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => same_tensor(a, b),
        _ => false,
    }
}

/// `out` again, its tensors shared.
fn share(out: &LayerOutput) -> LayerOutput {
    LayerOutput {
        attn_out: out.attn_out.shallow_clone(),
        mlp_out: out.mlp_out.shallow_clone(),
        layer_out: out.layer_out.shallow_clone(),
        topk: out.topk.shallow_clone(),
        own_topk: out.own_topk.as_ref().map(Tensor::shallow_clone),
        experts: out.experts.as_ref().map(Tensor::shallow_clone),
        kv_latent: out.kv_latent.shallow_clone(),
        index_scores: out.index_scores.as_ref().map(Tensor::shallow_clone),
    }
}

/// Runs `paths` (clean first, as [`plan`] returns them) on every prompt,
/// layer by layer; `progress` is called after each layer.
///
/// # Errors
/// A weight that cannot be loaded, or a libtorch failure in the metrics.
pub fn sweep(
    model: &Model,
    prompts: &[SweepPrompt],
    paths: &[PathSpec],
    opts: &SweepOptions,
    mut progress: impl FnMut(Progress),
) -> Result<Sweep, TraceRunError> {
    let c = &model.config;
    let k = c.index_topk;
    let started = Instant::now();
    let mut states: Vec<PromptState> = Vec::with_capacity(prompts.len());
    for p in prompts {
        let emb = model.embed(&p.ids)?;
        let s = p.ids.len() as i64;
        states.push(PromptState {
            ids: p.ids.clone(),
            rope: model.rope(s),
            h: emb.to_kind(Kind::Float),
            prev: None,
            paths: paths
                .iter()
                .map(|path| PathState {
                    h: emb.to_kind(Kind::BFloat16),
                    prev: None,
                    cell: Cell {
                        path: path.name.clone(),
                        kind: p.kind.clone(),
                        length: s,
                        layers: Vec::new(),
                        onset: None,
                        logits: None,
                        logits_vs_clean: None,
                    },
                })
                .collect(),
        });
    }
    let mut timings = Vec::new();
    for i in 0..c.num_hidden_layers {
        let load = Instant::now();
        let weights = model.load(&format!("model.layers.{i}."))?;
        let load_s = load.elapsed().as_secs_f64();
        let compute = Instant::now();
        let layer = |numerics, deviations| Layer {
            config: c,
            arch: model.arch,
            index: i,
            weights: &weights,
            numerics,
            fp8_indexer: opts.base,
            faults: &[],
            deviations,
            fallbacks: None,
            graft: None,
        };
        let reference = layer(Numerics::Plain(Kind::Float), &[]);
        for state in &mut states {
            let shadow = reference.forward(&state.h, &state.rope, state.prev.as_ref());
            // What this layer computed for earlier paths of this prompt: a
            // path whose input (and shared top-k) is bit-identical to an
            // earlier one's shares its reference selection, and, when the
            // same deviations act in this layer, its output too. At layer 0
            // every path starts from the same embeddings; a deviation planted
            // at a later layer leaves its path identical to the clean one
            // until there.
            let mut computed: Vec<Computed> = Vec::with_capacity(paths.len());
            for (path, p) in paths.iter().zip(state.paths.iter_mut()) {
                let at = AtLayer::of(&path.deviations, i, c);
                // Bit-identical input and shared top-k (torch's `equal`: a NaN
                // anywhere makes two tensors differ, so such inputs recompute).
                let same: Vec<bool> = computed
                    .iter()
                    .map(|d| {
                        same_tensor(&d.input, &p.h) && same_topk(d.prev.as_ref(), p.prev.as_ref())
                    })
                    .collect();
                let same_input = same.iter().position(|&s| s);
                let same_layer = (0..computed.len()).find(|&j| same[j] && computed[j].at == at);
                let (out, prod_rows) = if let Some(j) = same_layer {
                    (share(&computed[j].out), computed[j].prod_rows.clone())
                } else {
                    let out = layer(opts.prod.numerics(), &path.deviations).forward(
                        &p.h,
                        &state.rope,
                        p.prev.as_ref(),
                    );
                    let rows = match out.index_scores.as_ref() {
                        Some(scores) => {
                            Some(Rc::new(selection_rows(scores, &out.topk, k, opts.band)?))
                        }
                        None => None,
                    };
                    (out, rows)
                };
                let ref_rows = match same_input.and_then(|j| computed[j].ref_rows.clone()) {
                    Some(rows) => Some(rows),
                    None if prod_rows.is_some() => reference
                        .indexer_on(&p.h.to_kind(Kind::Float), &state.rope)
                        .map(|(topk, scores)| selection_rows(&scores, &topk, k, opts.band))
                        .transpose()?
                        .map(Rc::new),
                    None => None,
                };
                // The clean path runs first.
                let clean_done = computed.first();
                let mut metrics = LayerMetrics {
                    layer: i,
                    topk_jaccard: None,
                    topk_jaccard_with_churn: None,
                    informative_rows: 0,
                    dense_rows: 0,
                    topk_jaccard_vs_clean: None,
                    hidden_p95: None,
                    hidden_nonfinite_tokens: 0,
                    hidden_p95_vs_clean: None,
                };
                if let (Some(prod), Some(reference)) = (&prod_rows, &ref_rows) {
                    let (j, j_all, informative, dense) = mean_jaccard(prod, reference, opts.band);
                    metrics.topk_jaccard = j;
                    metrics.topk_jaccard_with_churn = j_all;
                    metrics.informative_rows = informative;
                    metrics.dense_rows = dense;
                    if let Some(clean_rows) = clean_done.and_then(|d| d.prod_rows.as_ref()) {
                        metrics.topk_jaccard_vs_clean = mean_jaccard(prod, clean_rows, opts.band).0;
                    }
                }
                let (p95, nonfinite) = hidden_p95(&out.layer_out, &shadow.layer_out);
                metrics.hidden_p95 = p95;
                metrics.hidden_nonfinite_tokens = nonfinite;
                if let Some(clean_done) = clean_done {
                    metrics.hidden_p95_vs_clean =
                        hidden_p95(&out.layer_out, &clean_done.out.layer_out).0;
                }
                if p.cell.onset.is_none() {
                    let mut sites: Vec<(&str, &Tensor)> = Vec::new();
                    if let Some(scores) = out.index_scores.as_ref() {
                        sites.push(("indexer", scores));
                    }
                    sites.extend([
                        ("attn_out", &out.attn_out),
                        ("mlp_out", &out.mlp_out),
                        ("layer_out", &out.layer_out),
                    ]);
                    p.cell.onset = first_nonfinite(&sites).map(|(site, token)| Onset {
                        layer: i,
                        site,
                        token,
                    });
                }
                p.cell.layers.push(metrics);
                let input = std::mem::replace(&mut p.h, out.layer_out.shallow_clone());
                let prev = p.prev.replace(out.topk.shallow_clone());
                computed.push(Computed {
                    input,
                    prev,
                    at,
                    out,
                    prod_rows,
                    ref_rows,
                });
            }
            state.h = shadow.layer_out;
            state.prev = Some(shadow.topk);
        }
        let last = LayerTiming {
            layer: i,
            load_s,
            compute_s: compute.elapsed().as_secs_f64(),
        };
        timings.push(last);
        progress(Progress {
            done: i + 1,
            layers: c.num_hidden_layers,
            elapsed_s: started.elapsed().as_secs_f64(),
            last,
        });
    }
    let head = model.head()?;
    let mut cells = Vec::new();
    for state in states {
        let s = state.ids.len() as i64;
        let rows = Tensor::arange_start((s - LOGITS_TOKENS).max(0), s, (Kind::Int64, model.device));
        let first = (s - LOGITS_TOKENS).max(0) as i32;
        let top = |h: &Tensor, kind: Kind| -> TopN {
            stats::top_logits(&head.logits(&h.index_select(0, &rows), kind), opts.top_n)
                .into_iter()
                .enumerate()
                .map(|(j, t)| ((0, first + j as i32), (t.ids, t.logprobs)))
                .collect()
        };
        let reference = top(&state.h, Kind::Float);
        let clean = state.paths.first().map(|p| top(&p.h, Kind::BFloat16));
        for p in state.paths {
            let prod = top(&p.h, Kind::BFloat16);
            let mut cell = p.cell;
            cell.logits = agreement(&prod, &reference);
            cell.logits_vs_clean = clean.as_ref().and_then(|c| agreement(&prod, c));
            cells.push(cell);
        }
    }
    Ok(Sweep {
        architecture: c.model_type.clone(),
        index_topk: k,
        layers: c.num_hidden_layers,
        prod: opts.prod,
        base: opts.base_name.clone(),
        band: opts.band,
        paths: paths.iter().map(|p| p.name.clone()).collect(),
        not_run: Vec::new(),
        cells,
        timings,
        tokens: prompts.iter().map(|p| p.ids.len() as i64).sum(),
        device: format!("{:?}", model.device),
    })
}
