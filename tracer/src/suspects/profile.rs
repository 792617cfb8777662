//! What a sweep measures per path, prompt and layer, and how one layer's
//! tensors become those numbers. Every number is the analyzer's definition,
//! through the shared functions (`shadowtrace_schemas::selection`,
//! `shadowtrace_schemas::stats`, the tracer's `trace::stats`):
//!
//! - top-k: per query row with more visible keys than k, the Jaccard of
//!   production's selection against the fp32 reference indexer's on the
//!   same layer input (the `local` shadow's, as a traced run records it),
//!   boundary churn within the band excluded (relative: the band times the
//!   reference row's score scale, as a trace records it); per layer the mean over those
//!   rows ([`crate::indexer::TopkSelection::rows`],
//!   [`shadowtrace_schemas::selection::row_overlap`]);
//! - hidden: per token the relative L2 error of the layer output against the
//!   fp32 reference chain from the embeddings (the `free` shadow), its p95
//!   over the tokens whose vectors are finite on both sides; tokens where
//!   production is non-finite are counted, as the analyzer counts them;
//! - the same two against the clean production path, for what a deviation
//!   moves beyond the FP8 path it departs from;
//! - logits: argmax agreement and Jensen-Shannon divergence over the top-N
//!   of the last tokens ([`shadowtrace_schemas::stats::agreement`]).

use serde::Serialize;
use shadowtrace_schemas::selection::{BAND_STORED, RowSide, row_overlap};
use shadowtrace_schemas::stats::{Agreement, Summary};
use tch::{Kind, Tensor};

use crate::TraceError;
use crate::indexer::topk_with_margin;
use crate::record::Selection;
use crate::trace::stats;

/// One layer of one path on one prompt.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerMetrics {
    /// Layer.
    pub layer: i64,
    /// Mean churn-free Jaccard against the reference indexer, over the
    /// informative rows; `None` without an indexer or informative rows.
    pub topk_jaccard: Option<f64>,
    /// The same with churn counted.
    pub topk_jaccard_with_churn: Option<f64>,
    /// Rows with more than k visible keys.
    pub informative_rows: usize,
    /// Rows with at most k visible keys (not averaged).
    pub dense_rows: usize,
    /// Mean churn-free Jaccard against the clean production path.
    pub topk_jaccard_vs_clean: Option<f64>,
    /// p95 relative L2 error of `layer_out` against the reference chain.
    pub hidden_p95: Option<f64>,
    /// Tokens whose production `layer_out` is non-finite.
    pub hidden_nonfinite_tokens: usize,
    /// p95 relative L2 error of `layer_out` against the clean path's.
    pub hidden_p95_vs_clean: Option<f64>,
}

/// The first non-finite production value of a path, in execution order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Onset {
    /// Layer.
    pub layer: i64,
    /// Site: `indexer`, `attn_out`, `mlp_out` or `layer_out`.
    pub site: String,
    /// The first token holding it.
    pub token: i64,
}

/// One path on one prompt.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cell {
    /// The path's name (`clean`, a deviation, or `a+b`).
    pub path: String,
    /// `tool`, `no_tool` or a user word.
    pub kind: String,
    /// Prompt length in tokens.
    pub length: i64,
    /// Per layer.
    pub layers: Vec<LayerMetrics>,
    /// First non-finite production value.
    pub onset: Option<Onset>,
    /// Logits against the reference chain's.
    pub logits: Option<Agreement>,
    /// Logits against the clean path's.
    pub logits_vs_clean: Option<Agreement>,
}

impl Cell {
    /// The first layer whose hidden p95 exceeds `threshold`.
    #[must_use]
    pub fn hidden_divergence(&self, threshold: f64) -> Option<i64> {
        self.layers
            .iter()
            .find(|l| l.hidden_p95.is_some_and(|p| p > threshold))
            .map(|l| l.layer)
    }

    /// The first layer whose mean churn-free Jaccard falls below `threshold`.
    #[must_use]
    pub fn topk_divergence(&self, threshold: f64) -> Option<i64> {
        self.layers
            .iter()
            .find(|l| l.topk_jaccard.is_some_and(|j| j < threshold))
            .map(|l| l.layer)
    }

    /// The first-divergence layer: the earliest of the non-finite onset, the
    /// hidden and the top-k divergence.
    #[must_use]
    pub fn first_divergence(&self, hidden: f64, topk: f64) -> Option<i64> {
        [
            self.onset.as_ref().map(|o| o.layer),
            self.hidden_divergence(hidden),
            self.topk_divergence(topk),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The lowest layer mean churn-free Jaccard.
    #[must_use]
    pub fn min_topk_jaccard(&self) -> Option<f64> {
        self.layers
            .iter()
            .filter_map(|l| l.topk_jaccard)
            .min_by(f64::total_cmp)
    }
}

/// One layer's selection in the rows the top-k metric reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Rows {
    /// Rows with at most k visible keys (row t sees t + 1): counted, never
    /// averaged, so never built.
    pub dense: usize,
    /// The informative rows, from row k on, in order.
    pub informative: Vec<Selection>,
    /// Their score scales (mean |score| of the row's top-k), what a relative
    /// band multiplies.
    pub scales: Vec<f32>,
}

/// One layer's selection as rows: keys, k-th scores and the boundary keys
/// within `band` (relative to each row's own score scale; the lists reach
/// [`BAND_STORED`] times it), for the rows with more than `k` visible keys (the
/// others select everything and carry no information). `scores` `[S, S]`
/// (fp32, -inf masked) and the keys the layer attended to, `topk`
/// `[S, min(k, S)]`. Each row is what the whole layer's selection gives
/// it: a row's top-k and boundary depend on that row alone.
///
/// # Errors
/// A libtorch failure.
pub fn selection_rows(
    scores: &Tensor,
    topk: &Tensor,
    k: i64,
    band: f32,
) -> Result<Rows, TraceError> {
    let s = scores.size()[0];
    let dense = s.min(k);
    if dense == s {
        return Ok(Rows {
            dense: s as usize,
            informative: Vec::new(),
            scales: Vec::new(),
        });
    }
    let (scores, topk) = (scores.narrow(0, k, s - k), topk.narrow(0, k, s - k));
    let visible = Tensor::arange_start(k + 1, s + 1, (Kind::Int64, scores.device()));
    let selection = topk_with_margin(&scores, k, &visible)?.attended(&topk);
    let torch = |source| TraceError::Torch {
        op: "selection_rows",
        source,
    };
    let reach = selection
        .score_scale
        .f_mul_scalar(f64::from(band * BAND_STORED))
        .map_err(torch)?;
    let scales = Vec::<f32>::try_from(
        selection
            .score_scale
            .f_to_device(tch::Device::Cpu)
            .map_err(torch)?,
    )
    .map_err(torch)?;
    Ok(Rows {
        dense: dense as usize,
        informative: selection.rows(&scores, Some(&reach))?,
        scales,
    })
}

fn side(row: &Selection) -> RowSide<'_> {
    RowSide {
        indices: &row.indices,
        kth_score: row.kth_score,
        boundary: row
            .boundary
            .as_ref()
            .map(|b| (b.indices.as_slice(), b.scores.as_slice())),
    }
}

/// Mean churn-free and churn-included Jaccard of `prod` against `reference`
/// over the informative rows, and the informative and dense row counts.
/// Churn lies within `band` times the reference row's score scale, as a
/// trace's churn does (production's lists reach that wherever its own scale
/// is at least half the reference's).
#[must_use]
pub fn mean_jaccard(
    prod: &Rows,
    reference: &Rows,
    band: f32,
) -> (Option<f64>, Option<f64>, usize, usize) {
    let mut scratch = Vec::new();
    let (mut clean, mut all) = (Vec::new(), Vec::new());
    for ((p, r), scale) in prod
        .informative
        .iter()
        .zip(&reference.informative)
        .zip(&reference.scales)
    {
        let (with, without) = row_overlap(side(p), side(r), band * scale, &mut scratch);
        all.push(with.jaccard());
        clean.push(without.jaccard());
    }
    let n = clean.len();
    (
        Summary::of(clean).map(|s| s.mean),
        Summary::of(all).map(|s| s.mean),
        n,
        prod.dense,
    )
}

/// p95 relative L2 error of `prod` against `reference` `[S, hidden]` over
/// the tokens finite on both sides, and the tokens where `prod` is not finite.
#[must_use]
pub fn hidden_p95(prod: &Tensor, reference: &Tensor) -> (Option<f64>, usize) {
    let finite = |x: &Tensor| -> Vec<bool> {
        Vec::<bool>::try_from(x.isfinite().all_dim(-1, false).to_device(tch::Device::Cpu))
            .unwrap_or_default()
    };
    let (p_ok, r_ok) = (finite(prod), finite(reference));
    let rel: Vec<f64> = stats::comparisons(prod, reference)
        .iter()
        .enumerate()
        .filter(|&(t, _)| p_ok.get(t) == Some(&true) && r_ok.get(t) == Some(&true))
        .map(|(_, c)| f64::from(c.rel_l2_err))
        .collect();
    (
        Summary::of(rel).map(|s| s.p95),
        p_ok.iter().filter(|ok| !**ok).count(),
    )
}

/// The first (site, token) of a non-finite value among `sites` in execution
/// order; the indexer's scores count over the keys each query sees.
#[must_use]
pub fn first_nonfinite(sites: &[(&str, &Tensor)]) -> Option<(String, i64)> {
    for (site, x) in sites {
        let found = if *site == "indexer" {
            stats::indexer_nonfinite(x)
        } else {
            stats::nonfinite(x)
        };
        if let Some(token) = found.iter().map(|&(_, token, _, _)| token).min() {
            return Some(((*site).to_owned(), token));
        }
    }
    None
}
