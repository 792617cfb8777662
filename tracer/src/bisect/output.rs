//! The output a bisection judges: production's logits (grafted or not), the
//! reference's, and how far apart they are.
//!
//! The ungrafted production chain is run once and its input to every layer
//! kept: a graft whose first layer is L changes nothing before L, so its
//! forward starts there instead of at the embeddings.

use tch::{Kind, Tensor};

use crate::model::graft::{Graft, GraftSites, Grafted};
use crate::model::rope::Rope;
use crate::model::{Head, Model, ModelError, Numerics};
use crate::trace::TraceOptions;

/// How far production's output is from the reference's, over the compared
/// token rows.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct OutputMetrics {
    /// The share of rows whose argmax token is the reference's. A row with a
    /// non-finite logit (in either) never agrees.
    pub argmax_agreement: f64,
    /// Mean Jensen-Shannon divergence of the next-token distributions, in
    /// bits (0 identical, 1 disjoint). A row with a non-finite logit counts 1.
    pub js_bits: f64,
    /// Rows with a non-finite logit.
    pub nonfinite_rows: i64,
    /// Rows compared.
    pub rows: i64,
}

/// `prod` against `reference`, both `[rows, vocab]` logits.
#[must_use]
pub fn compare(prod: &Tensor, reference: &Tensor) -> OutputMetrics {
    let finite = prod
        .isfinite()
        .all_dim(1, false)
        .logical_and(&reference.isfinite().all_dim(1, false));
    let rows = finite.size()[0];
    let bad = finite.logical_not();
    let agree = prod
        .argmax(1, false)
        .eq_tensor(&reference.argmax(1, false))
        .logical_and(&finite);
    // log-probabilities in fp64, non-finite rows zeroed (their divergence is
    // set to its maximum below); the mixture's log from both by logaddexp,
    // so a token both give ~0 weighs 0 and never 0 * -inf.
    let log_probs = |t: &Tensor| {
        t.to_kind(Kind::Double)
            .masked_fill(&bad.unsqueeze(1), 0.0)
            .log_softmax(1, Kind::Double)
    };
    let (lp, lq) = (log_probs(prod), log_probs(reference));
    let lm = lp.logaddexp(&lq) - std::f64::consts::LN_2;
    let kl = |l: &Tensor| (l.exp() * (l - &lm)).sum_dim_intlist(1, false, Kind::Double);
    let js = ((kl(&lp) + kl(&lq)) * (0.5 / std::f64::consts::LN_2))
        .clamp(0.0, 1.0)
        .masked_fill(&bad, 1.0);
    let mean = |t: &Tensor| {
        if rows == 0 {
            0.0
        } else {
            t.to_kind(Kind::Double).mean(Kind::Double).double_value(&[])
        }
    };
    OutputMetrics {
        argmax_agreement: mean(&agree),
        js_bits: mean(&js),
        nonfinite_rows: bad.sum(Kind::Int64).int64_value(&[]),
        rows,
    }
}

/// Production's chain on one prompt, as a traced run's production runs it
/// (numerics, FP8 indexer, planted faults and deviations), kept layer by
/// layer for grafted forwards; and the reference it is judged against.
pub struct Chains<'a> {
    model: &'a Model,
    opts: &'a TraceOptions,
    rope: Rope,
    rows: Tensor,
    head: Head,
    /// Production's input to each layer, and after the last.
    inputs: Vec<Tensor>,
    /// The selection layer i reuses (layers without their own indexer).
    prev_topk: Vec<Option<Tensor>>,
    /// Production's logits at the compared rows, ungrafted.
    pub before: Tensor,
}

impl std::fmt::Debug for Chains<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chains")
            .field("layers", &(self.inputs.len().saturating_sub(1)))
            .finish_non_exhaustive()
    }
}

impl<'a> Chains<'a> {
    /// Runs production ungrafted over `ids`, compared at the rows
    /// `opts.token_rows` samples.
    ///
    /// # Errors
    /// A weight that cannot be loaded.
    pub fn new(model: &'a Model, ids: &[i64], opts: &'a TraceOptions) -> Result<Self, ModelError> {
        let s = ids.len() as i64;
        let rows = Tensor::from_slice(&opts.token_rows(s)).to_device(model.device);
        let mut chains = Chains {
            model,
            opts,
            rope: model.rope(s),
            rows,
            head: model.head()?,
            inputs: Vec::new(),
            prev_topk: Vec::new(),
            before: Tensor::new(),
        };
        let emb = model.embed(ids)?.to_kind(Kind::BFloat16);
        let (before, inputs, prev_topk) =
            chains.run_from(0, opts.prod, true, emb, None, &[], true)?;
        chains.before = before;
        chains.inputs = inputs;
        chains.prev_topk = prev_topk;
        Ok(chains)
    }

    /// The model's layer count.
    #[must_use]
    pub fn layers(&self) -> i64 {
        self.model.config.num_hidden_layers
    }

    /// The shadow's precision: what a graft takes its values in.
    #[must_use]
    pub fn shadow_kind(&self) -> Kind {
        self.opts.precision
    }

    /// The compared rows.
    #[must_use]
    pub fn rows(&self) -> i64 {
        self.rows.size()[0]
    }

    /// Production's logits with `grafts`, started at the first grafted
    /// layer from the ungrafted chain's input there.
    ///
    /// # Errors
    /// A weight that cannot be loaded.
    pub fn grafted(&self, grafts: &[Graft]) -> Result<Tensor, ModelError> {
        let layers = self.model.config.num_hidden_layers;
        let first = (0..layers)
            .find(|&i| GraftSites::at(grafts, i).any())
            .unwrap_or(layers);
        let start = self.inputs[first as usize].shallow_clone();
        let prev = self
            .prev_topk
            .get(first as usize)
            .and_then(|p| p.as_ref().map(Tensor::shallow_clone));
        self.run_from(first, self.opts.prod, true, start, prev, grafts, false)
            .map(|(logits, ..)| logits)
    }

    /// Production's logits with nothing planted (no fault, no deviation),
    /// from the embeddings.
    ///
    /// # Errors
    /// A weight that cannot be loaded.
    pub fn unplanted(&self, ids: &[i64]) -> Result<Tensor, ModelError> {
        let emb = self.model.embed(ids)?.to_kind(Kind::BFloat16);
        self.run_from(0, self.opts.prod, false, emb, None, &[], false)
            .map(|(logits, ..)| logits)
    }

    /// The reference: the shadow's own chain from the embeddings, in the
    /// shadow's precision (the free shadow of a traced run).
    ///
    /// # Errors
    /// A weight that cannot be loaded.
    pub fn reference(&self, ids: &[i64]) -> Result<Tensor, ModelError> {
        let kind = self.opts.precision;
        let emb = self.model.embed(ids)?.to_kind(kind);
        self.run_from(0, Numerics::Plain(kind), false, emb, None, &[], false)
            .map(|(logits, ..)| logits)
    }

    /// One chain from layer `first` on `h`; with `keep`, every layer's input
    /// and reused selection too.
    #[allow(
        clippy::too_many_arguments,
        clippy::type_complexity,
        reason = "one chain's settings, each needed"
    )]
    fn run_from(
        &self,
        first: i64,
        numerics: Numerics,
        planted: bool,
        mut h: Tensor,
        mut prev: Option<Tensor>,
        grafts: &[Graft],
        keep: bool,
    ) -> Result<(Tensor, Vec<Tensor>, Vec<Option<Tensor>>), ModelError> {
        let c = &self.model.config;
        let (mut inputs, mut prev_topk) = (Vec::new(), Vec::new());
        let shadow = Numerics::Plain(self.opts.precision);
        for i in first..c.num_hidden_layers {
            let weights = self.model.load(&format!("model.layers.{i}."))?;
            if keep {
                inputs.push(h.shallow_clone());
                prev_topk.push(
                    prev.as_ref()
                        .filter(|_| !c.runs_indexer(i))
                        .map(Tensor::shallow_clone),
                );
            }
            let sites = GraftSites::at(grafts, i);
            let local = sites.any().then(|| {
                self.opts
                    .decoder_layer(self.model, i, &weights, shadow, false, None, None)
                    .forward(&h.to_kind(self.opts.precision), &self.rope, prev.as_ref())
            });
            let graft = local.as_ref().map(|source| Grafted { source, sites });
            let out = self
                .opts
                .decoder_layer(self.model, i, &weights, numerics, planted, None, graft)
                .forward(&h, &self.rope, prev.as_ref());
            prev = Some(out.topk);
            h = out.layer_out;
        }
        if keep {
            inputs.push(h.shallow_clone());
        }
        let logits = self
            .head
            .logits(&h.index_select(0, &self.rows), numerics.kind());
        Ok((logits, inputs, prev_topk))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(rows: &[&[f64]]) -> Tensor {
        let flat: Vec<f64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_slice(&flat)
            .view([rows.len() as i64, -1])
            .to_kind(Kind::Float)
    }

    #[test]
    fn identical_outputs_agree_everywhere_with_zero_divergence() {
        let a = logits(&[&[1.0, 2.0, 3.0], &[0.5, -1.0, 0.0]]);
        let m = compare(&a, &a);
        assert!((m.argmax_agreement - 1.0).abs() < f64::EPSILON);
        assert!(m.js_bits.abs() < 1e-12, "{}", m.js_bits);
        assert_eq!((m.nonfinite_rows, m.rows), (0, 2));
    }

    #[test]
    fn the_divergence_is_the_hand_computed_one_and_near_one_bit_for_disjoint_outputs() {
        // p = (3/4, 1/4), q = (1/4, 3/4): JS = H(m) - (H(p) + H(q)) / 2 with m uniform,
        // = 1 - H(3/4) = 1 - (0.75 log2(4/3) + 0.25 log2 4) bits.
        let ln3 = 3.0_f64.ln();
        let p = logits(&[&[ln3, 0.0]]);
        let q = logits(&[&[0.0, ln3]]);
        let h = 0.75 * (4.0_f64 / 3.0).log2() + 0.25 * 2.0;
        let m = compare(&p, &q);
        assert!((m.js_bits - (1.0 - h)).abs() < 1e-6, "{}", m.js_bits);
        assert!(m.argmax_agreement.abs() < f64::EPSILON);
        // Nearly disjoint: all mass on different tokens.
        let m = compare(&logits(&[&[100.0, 0.0]]), &logits(&[&[0.0, 100.0]]));
        assert!((m.js_bits - 1.0).abs() < 1e-9, "{}", m.js_bits);
    }

    #[test]
    fn a_non_finite_row_disagrees_at_the_largest_divergence_and_is_counted() {
        let prod = logits(&[&[1.0, 2.0], &[f64::NAN, 2.0], &[0.0, 5.0]]);
        let reference = logits(&[&[1.0, 2.0], &[0.0, 5.0], &[0.0, 5.0]]);
        let m = compare(&prod, &reference);
        assert_eq!(m.nonfinite_rows, 1);
        assert!((m.argmax_agreement - 2.0 / 3.0).abs() < 1e-12);
        assert!((m.js_bits - 1.0 / 3.0).abs() < 1e-9, "{}", m.js_bits);
    }
}
