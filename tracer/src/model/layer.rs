//! One decoder layer of `glm_moe_dsa` / `deepseek_v32`, as transformers 5.17
//! computes it: RMSNorm, MLA attention restricted to the indexer's top-k,
//! then a dense MLP or a MoE block (sigmoid router with correction bias,
//! group-limited top-k, shared experts). Weights are fp32; `Numerics` says in
//! which precision each matmul runs.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use tch::{Kind, Tensor};

use super::config::{Architecture, ModelConfig};
use super::deviation::{self, AtLayer, Deviation, IndexerQuant};
use super::fault::Fault;
use super::graft::{GraftSites, Grafted};
use super::kernel_deviation;
use super::rope::Rope;
use super::router::Router;
use crate::fp8::{ScaleFormat, gemm};
use crate::indexer::{Fp8Indexer, Precision, index_scores};

/// How a path computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Numerics {
    /// Every tensor in this kind (fp32 or bf16), reductions as transformers does them.
    Plain(Kind),
    /// Production FP8: bf16 activations; every linear layer quantizes its
    /// input per 1x128 block (dynamic, ue8m0 scales) and its weight per
    /// 128x128 block. On CUDA the GEMM runs on the tensor cores
    /// (`torch._scaled_mm`, block-wise scales, as production kernels do); on
    /// the CPU as [`Numerics::Fp8Emulated`].
    Fp8,
    /// The same quantization, the dequantized values multiplied in fp32
    /// everywhere: an exact emulation of a block-scaled FP8 GEMM with plain
    /// fp32 accumulation.
    Fp8Emulated,
    /// Production as an FP8 checkpoint's loader runs it (transformers'
    /// fine-grained FP8, `FP8Linear` and `FP8Experts`): a linear whose weight
    /// the checkpoint stores in FP8 multiplies its stored codes and 128x128
    /// block scales, never re-quantized, by its input quantized per token in
    /// 1x128 groups with scales of the format `scales` ([`gemm::stored`]);
    /// every other linear (the indexer's `weights_proj` among them) is a GEMM
    /// in `activations`, the kind the load holds the model in (bf16 in
    /// serving; fp32 where the FP8 GEMMs are checked alone). On CUDA the FP8
    /// GEMM runs on the tensor cores, elsewhere emulated.
    Fp8Checkpoint {
        /// The kind activations and unquantized weights are held in.
        activations: Kind,
        /// The activations' scale format.
        scales: ScaleFormat,
    },
}

impl Numerics {
    /// The kind activations are held in.
    #[must_use]
    pub fn kind(self) -> Kind {
        match self {
            Numerics::Plain(kind) => kind,
            Numerics::Fp8 | Numerics::Fp8Emulated => Kind::BFloat16,
            Numerics::Fp8Checkpoint { activations, .. } => activations,
        }
    }
}

/// A layer's weights by their name within the layer (`self_attn.q_a_proj.weight`, ...).
pub type Weights = BTreeMap<String, Tensor>;

/// What one layer hands to the tracer.
#[derive(Debug)]
pub struct LayerOutput {
    /// Attention block output before the residual add `[S, hidden]`.
    pub attn_out: Tensor,
    /// MLP or MoE output before the residual add `[S, hidden]`.
    pub mlp_out: Tensor,
    /// The residual stream leaving the layer `[S, hidden]`.
    pub layer_out: Tensor,
    /// The indexer's top-k `[S, min(k, S)]` (int64), own or shared: the
    /// selection attention read (the shadow's, under an indexer graft).
    pub topk: Tensor,
    /// Under an indexer graft, the selection this layer's own indexer made
    /// (what production would have attended): the one a trace records.
    pub own_topk: Option<Tensor>,
    /// The routed experts each token went to `[S, num_experts_per_tok]`
    /// (int64), for MoE layers: comparing two paths' routing.
    pub experts: Option<Tensor>,
    /// What an MLA KV cache holds for each token `[S, kv_lora_rank + rope]`:
    /// the normalized compressed latent, then the rotated key part (empty for
    /// a `qk_rope_head_dim = 0` model). The KV sentinel watch reads it.
    pub kv_latent: Tensor,
    /// The indexer's scores `[S, S]` (fp32, -inf where masked), when this
    /// layer ran its own indexer.
    pub index_scores: Option<Tensor>,
}

/// One decoder layer.
#[derive(Debug)]
pub struct Layer<'a> {
    /// The model's configuration.
    pub config: &'a ModelConfig,
    /// Which model.
    pub arch: Architecture,
    /// Layer index.
    pub index: i64,
    /// Its weights, fp32.
    pub weights: &'a Weights,
    /// The path's numerics.
    pub numerics: Numerics,
    /// The FP8 indexer variant production runs (`None`: the indexer in the
    /// path's own numerics, as transformers computes it).
    pub fp8_indexer: Option<Fp8Indexer>,
    /// Faults planted in this pass (production only).
    pub faults: &'a [Fault],
    /// Engine behaviours production runs on purpose (production only).
    pub deviations: &'a [Deviation],
    /// Where production's fallbacks are counted (`None`: not counted).
    pub fallbacks: Option<&'a Fallbacks>,
    /// What production takes from the shadow at this layer (`None`: nothing;
    /// [`super::graft`]).
    pub graft: Option<Grafted<'a>>,
}

/// What production computed instead of what it was asked to, per linear or
/// indexer call, for the manifest (`counters`): a path that falls back must
/// say so, or a broken one looks healthy. Shared by every layer of a pass.
#[derive(Debug, Default)]
pub struct Fallbacks {
    /// FP8 linears computed on the tensor cores (`_scaled_mm`).
    pub linears_tensor_cores: AtomicU64,
    /// FP8 linears computed by the exact fp32 emulation (the CPU, or
    /// [`Numerics::Fp8Emulated`]).
    pub linears_emulated: AtomicU64,
    /// FP8 linears asked for on the tensor cores whose `_scaled_mm` failed,
    /// emulated instead.
    pub scaled_mm_failed: AtomicU64,
    /// FP8 linears whose quantization failed, computed in fp32 unquantized.
    pub quantize_failed: AtomicU64,
    /// Indexer calls whose production FP8 variant failed, or could not run
    /// (an index_head_dim other than 128), scored in fp32.
    pub fp8_indexer_failed: AtomicU64,
}

impl Fallbacks {
    fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts as manifest counters (non-zero ones).
    #[must_use]
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        [
            ("fp8_linears_tensor_cores", &self.linears_tensor_cores),
            ("fp8_linears_emulated", &self.linears_emulated),
            ("fp8_scaled_mm_fallbacks", &self.scaled_mm_failed),
            ("fp8_quantize_fallbacks", &self.quantize_failed),
            ("fp8_indexer_fallbacks", &self.fp8_indexer_failed),
        ]
        .into_iter()
        .map(|(name, c)| (name, c.load(Ordering::Relaxed)))
        .filter(|&(_, n)| n > 0)
        .collect()
    }
}

/// Query rows scored at once by [`causal_scores`]: its `[H, rows, keys]`
/// intermediates stay within 16 MiB.
fn causal_chunk_rows(heads: i64, keys: i64) -> i64 {
    (((4 << 20) / (heads * keys).max(1)) / 16 * 16).max(16)
}

/// The fp32 indexer scores `[S, T]` of q `[S, H, D]` and k `[T, D]` with
/// head weights w `[S, H]`, as transformers computes them (relu of the
/// scaled dot products, summed over heads with the weights), for the keys
/// each query row can see when query i sits at position i; keys past a
/// row's chunk are -inf, the caller masks the rest. Computed in chunks of
/// query rows against the keys up to the chunk's last: half the work and a
/// sliver of the memory of the full `[H, S, T]` product, and on the CPU the
/// same bits (a test compares it with the full product).
fn causal_scores(q: &Tensor, k: &Tensor, w: &Tensor) -> Tensor {
    let (s, heads, dim) = (q.size()[0], q.size()[1], q.size()[2]);
    let t = k.size()[0];
    let scores = Tensor::full([s, t], f64::NEG_INFINITY, (Kind::Float, q.device()));
    let rows = causal_chunk_rows(heads, t);
    let mut start = 0;
    while start < s {
        let n = rows.min(s - start);
        let keys = (start + n).min(t);
        let dots = q
            .narrow(0, start, n)
            .transpose(0, 1)
            .matmul(&k.narrow(0, 0, keys).tr().unsqueeze(0));
        let dots = (dots * (dim as f64).powf(-0.5)).relu(); // [H, n, keys]
        let part = w
            .narrow(0, start, n)
            .unsqueeze(1)
            .matmul(&dots.transpose(0, 1))
            .squeeze_dim(1); // [n, keys]
        let mut view = scores.narrow(0, start, n).narrow(1, 0, keys);
        view.copy_(&part);
        start += n;
    }
    scores
}

/// transformers' RMSNorm: fp32 statistics, the weight times the result in
/// the input's kind.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let kind = x.kind();
    let xf = x.to_kind(Kind::Float);
    let var = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    let normed = (xf * (var + eps).rsqrt()).to_kind(kind);
    weight.to_kind(kind) * normed
}

/// `x @ W.T` in `numerics`: the plain kind's matmul, or the FP8 linear (on
/// the tensor cores when `numerics` is [`Numerics::Fp8`] or
/// [`Numerics::Fp8Checkpoint`] on CUDA, emulated otherwise) with its result
/// in the path's activation kind; every FP8 fallback counted in `fallbacks`. `scale_inv`: the
/// checkpoint's block scales where it stores the weight in FP8, which
/// [`Numerics::Fp8Checkpoint`] multiplies as stored (without them, a bf16
/// GEMM). The GLM-5 layers and GLM-5.3-Flash's share it.
pub(crate) fn linear_in(
    numerics: Numerics,
    fallbacks: Option<&Fallbacks>,
    x: &Tensor,
    weight: &Tensor,
    scale_inv: Option<&Tensor>,
) -> Tensor {
    match (numerics, scale_inv) {
        (Numerics::Plain(kind), _) => x.to_kind(kind).matmul(&weight.to_kind(kind).tr()),
        (Numerics::Fp8Checkpoint { activations, .. }, None) => x
            .to_kind(activations)
            .matmul(&weight.to_kind(activations).tr()),
        (Numerics::Fp8 | Numerics::Fp8Emulated | Numerics::Fp8Checkpoint { .. }, _) => {
            let shape = x.size();
            let x2 = x.reshape([-1, shape[shape.len() - 1]]);
            let y = fp8_linear(numerics, fallbacks, &x2, weight, scale_inv);
            let mut out = shape.clone();
            let last = out.len() - 1;
            out[last] = weight.size()[0];
            y.view(out.as_slice()).to_kind(numerics.kind())
        }
    }
}

fn fp8_linear(
    numerics: Numerics,
    fallbacks: Option<&Fallbacks>,
    x: &Tensor,
    weight: &Tensor,
    scale_inv: Option<&Tensor>,
) -> Tensor {
    let count = |f: fn(&Fallbacks) -> &AtomicU64| {
        if let Some(fallbacks) = fallbacks {
            Fallbacks::add(f(fallbacks));
        }
    };
    let unquantized = || {
        x.to_kind(Kind::Float)
            .matmul(&weight.to_kind(Kind::Float).tr())
    };
    let operands = match (numerics, scale_inv) {
        (Numerics::Fp8Checkpoint { scales, .. }, Some(scale_inv)) => {
            gemm::stored(x, weight, scale_inv, gemm::checkpoint_activations(scales))
        }
        _ => gemm::quantize(x, weight),
    };
    let Ok(operands) = operands else {
        count(|f| &f.quantize_failed);
        return unquantized();
    };
    let tensor_cores = matches!(numerics, Numerics::Fp8 | Numerics::Fp8Checkpoint { .. });
    if tensor_cores && x.device().is_cuda() {
        if let Ok(y) = gemm::scaled_mm(&operands) {
            count(|f| &f.linears_tensor_cores);
            return y;
        }
        count(|f| &f.scaled_mm_failed);
    }
    count(|f| &f.linears_emulated);
    gemm::emulate(&operands).unwrap_or_else(|_| {
        count(|f| &f.quantize_failed);
        unquantized()
    })
}

impl Layer<'_> {
    fn w(&self, name: &str) -> &Tensor {
        &self.weights[name]
    }

    fn faults(&self) -> impl Iterator<Item = &Fault> {
        self.faults.iter().filter(|f| f.layer() == self.index)
    }

    /// Writes planted non-finite values of `site` into `x` `[S, N]`.
    fn plant(&self, site: &str, x: Tensor) -> Tensor {
        let mut x = x;
        for f in self.faults() {
            if let Fault::NonFinite {
                site: s,
                token,
                channel,
                value,
                ..
            } = f
                && s == site
                && *token < x.size()[0]
            {
                x = x.copy();
                let _ = x.get(*token).get(*channel).fill_(value.value());
            }
        }
        x
    }

    /// `x @ W.T` in the path's numerics, with the checkpoint's FP8 scales
    /// where it stores the weight in FP8.
    fn linear(&self, x: &Tensor, name: &str) -> Tensor {
        let mut weight = self.w(&format!("{name}.weight")).shallow_clone();
        let mut scale_inv = self
            .weights
            .get(&format!("{name}.weight_scale_inv"))
            .map(Tensor::shallow_clone);
        for f in self.faults() {
            if let Fault::Fp8Scale { linear, factor, .. } = f
                && linear == name
            {
                // A wrong scale: the codes as stored, their product moved. Never in
                // place: the tensors are the layer's own weights.
                let scaled = &weight * *factor;
                weight = scaled;
                scale_inv = scale_inv.map(|s| s * *factor);
                break;
            }
        }
        let block_scaled = match self.numerics {
            Numerics::Plain(_) => false,
            Numerics::Fp8 | Numerics::Fp8Emulated => true,
            Numerics::Fp8Checkpoint { .. } => scale_inv.is_some(),
        };
        let y = linear_in(
            self.numerics,
            self.fallbacks,
            x,
            &weight,
            scale_inv.as_ref(),
        );
        if block_scaled && self.at_layer().mtile_rows {
            // The GEMM's M is the rows it was given: tokens, or an expert's.
            let n = y.size()[y.dim() - 1];
            return kernel_deviation::mtile_rows(&y.reshape([-1, n])).view_as(&y);
        }
        y
    }

    /// transformers' RMSNorm: fp32 statistics, weight times the input-kind result.
    fn rms_norm(&self, x: &Tensor, name: &str, eps: f64) -> Tensor {
        rms_norm(x, self.w(&format!("{name}.weight")), eps)
    }

    fn act_kind(&self) -> Kind {
        self.numerics.kind()
    }

    /// `own`, or the shadow's `pick` where this layer grafts the site `on`
    /// selects (after any planted fault: a graft replaces what production had).
    fn take(
        &self,
        on: fn(&GraftSites) -> bool,
        own: Tensor,
        pick: fn(&LayerOutput) -> &Tensor,
    ) -> Tensor {
        match &self.graft {
            Some(g) if on(&g.sites) => pick(g.source).to_kind(own.kind()),
            _ => own,
        }
    }

    /// The layer on the residual stream `x` `[S, hidden]` at `positions`.
    /// `prev_topk` is the previous full layer's selection, for shared layers.
    #[must_use]
    pub fn forward(&self, x: &Tensor, rope: &Rope, prev_topk: Option<&Tensor>) -> LayerOutput {
        let c = self.config;
        let mut h = x.to_kind(self.act_kind());
        for f in self.faults() {
            if let Fault::Outlier {
                channel, factor, ..
            } = f
            {
                h = h.copy();
                let mut column = h.narrow(1, *channel, 1);
                let _ = column.g_mul_scalar_(*factor);
            }
        }
        let normed = self.rms_norm(&h, "input_layernorm", c.rms_norm_eps);
        let (attn_out, (topk, own_topk), index_scores, kv_latent) =
            self.attention(&normed, rope, prev_topk);
        let attn_out = self.plant("attn_out", attn_out);
        let attn_out = self.take(|g| g.attn_out, attn_out, |o| &o.attn_out);
        let h = &h + &attn_out;
        let normed = self.rms_norm(&h, "post_attention_layernorm", c.rms_norm_eps);
        let (mlp_out, experts) = if c.is_moe(self.index) {
            let (out, experts) = self.moe(&normed);
            (out, Some(experts))
        } else {
            (self.mlp(&normed, "mlp"), None)
        };
        let mlp_out = self.plant("mlp_out", mlp_out);
        let mlp_out = self.take(|g| g.mlp_out, mlp_out, |o| &o.mlp_out);
        let layer_out = self.plant("layer_out", &h + &mlp_out);
        let layer_out = self.take(|g| g.layer_out, layer_out, |o| &o.layer_out);
        LayerOutput {
            attn_out,
            mlp_out,
            layer_out,
            topk,
            own_topk,
            experts,
            kv_latent,
            index_scores,
        }
    }

    /// The layer's indexer alone on the residual stream `x` `[S, hidden]`:
    /// top-k and fp32 scores exactly as [`Layer::forward`] computes them
    /// (no planted fault), for a shadow that needs the selection and not the
    /// rest of the layer. `None` where the layer reuses the previous top-k.
    #[must_use]
    pub fn indexer_on(&self, x: &Tensor, rope: &Rope) -> Option<(Tensor, Tensor)> {
        let c = self.config;
        if !c.runs_indexer(self.index) {
            return None;
        }
        let normed = self.rms_norm(
            &x.to_kind(self.act_kind()),
            "input_layernorm",
            c.rms_norm_eps,
        );
        let q_resid = self.rms_norm(
            &self.linear(&normed, "self_attn.q_a_proj"),
            "self_attn.q_a_layernorm",
            1e-6,
        );
        Some(self.indexer(&normed, &q_resid, rope))
    }

    fn attention(
        &self,
        x: &Tensor,
        rope: &Rope,
        prev_topk: Option<&Tensor>,
    ) -> (Tensor, (Tensor, Option<Tensor>), Option<Tensor>, Tensor) {
        let c = self.config;
        let s = x.size()[0];
        let heads = c.num_attention_heads;
        let (nope, rot, v_dim, kv_rank) = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        let q_resid = self.rms_norm(
            &self.linear(x, "self_attn.q_a_proj"),
            "self_attn.q_a_layernorm",
            1e-6,
        );
        let q = self
            .linear(&q_resid, "self_attn.q_b_proj")
            .view([s, heads, nope + rot]);
        let (q_pass, q_rot) = (q.narrow(-1, 0, nope), q.narrow(-1, nope, rot));
        let compressed = self.linear(x, "self_attn.kv_a_proj_with_mqa");
        let kv_pass = compressed.narrow(-1, 0, kv_rank);
        let k_rot = compressed.narrow(-1, kv_rank, rot);
        let mut k_pass = self.rms_norm(&kv_pass, "self_attn.kv_a_layernorm", 1e-6);
        for f in self.faults() {
            if let Fault::KvSlot { token, .. } = f
                && *token < s
            {
                k_pass = k_pass.copy();
                let _ = k_pass.get(*token).fill_(f64::NAN);
            }
        }
        let q_rot = rope.apply(&q_rot, 0, true);
        let k_rot = rope.apply(&k_rot.unsqueeze(1), 0, true);
        let kv_latent = Tensor::cat(&[k_pass.shallow_clone(), k_rot.squeeze_dim(1)], -1);
        let query = Tensor::cat(&[q_pass, q_rot], -1).transpose(0, 1); // [H, S, qk]
        let kv = self
            .linear(&k_pass, "self_attn.kv_b_proj")
            .view([s, heads, nope + v_dim]);
        let k_nope = kv.narrow(-1, 0, nope);
        let value = kv.narrow(-1, nope, v_dim).transpose(0, 1); // [H, S, v]
        let key = Tensor::cat(&[k_nope, k_rot.expand([s, heads, rot], false)], -1).transpose(0, 1);

        let (topk, index_scores) = if c.runs_indexer(self.index) {
            let (topk, scores) = self.indexer(x, &q_resid, rope);
            (topk, Some(scores))
        } else {
            let shared = prev_topk.map_or_else(
                || {
                    Tensor::arange(s, (Kind::Int64, x.device()))
                        .unsqueeze(0)
                        .expand([s, s], false)
                },
                Tensor::shallow_clone,
            );
            (shared, None)
        };
        // An indexer graft: production attends over the shadow's selection;
        // its own selection and scores are kept for the capture.
        let (topk, own_topk) = match &self.graft {
            Some(g) if g.sites.indexer => (g.source.topk.shallow_clone(), Some(topk)),
            _ => (topk, None),
        };
        let kind = query.kind();
        let positions = Tensor::arange(s, (Kind::Int64, x.device()));
        let causal = positions.unsqueeze(0).le_tensor(&positions.unsqueeze(1)); // [S, T]
        let selected = Tensor::zeros([s, s], (Kind::Bool, x.device())).scatter_value(1, &topk, 1);
        let allowed = causal.logical_and(&selected);
        let min = if kind == Kind::Float {
            f64::from(f32::MIN)
        } else {
            -3.389_531_389_251_535_5e38
        };
        let mask =
            Tensor::zeros([s, s], (kind, x.device())).masked_fill(&allowed.logical_not(), min);
        let scaling = self.softmax_scale();
        let attend = |key: &Tensor, value: &Tensor| {
            let scores = query.matmul(&key.transpose(1, 2)) * scaling + mask.unsqueeze(0);
            let probs = scores.softmax(-1, Kind::Float).to_kind(kind);
            probs
                .matmul(value)
                .transpose(0, 1)
                .reshape([s, heads * v_dim])
        };
        let mut attn = attend(&key, &value);
        let dev = self.at_layer();
        if dev.stale_prefix
            && let Some(p) = deviation::reuse_prefix(s)
        {
            // The queries past the hit read the stale block; those before it
            // were computed by the earlier request.
            let index = deviation::stale_index(s, p, x.device());
            let stale = attend(&key.index_select(1, &index), &value.index_select(1, &index));
            attn = deviation::splice_tail(&attn, &stale, p);
        }
        let mut kv_latent = kv_latent;
        if dev.pad_slot_nan {
            // A query whose index list has unused entries reads the reserved
            // slot: its score against a NaN key is NaN whatever the mask adds,
            // and so is its softmax.
            let reads_pad = positions.lt(c.index_topk - 1).view([s, 1]);
            attn = attn.masked_fill(&reads_pad, f64::NAN);
            // The padding row's NaN lies in the cache's reserved slot 0, where
            // the bug writes it and the KV sentinel reads. This engine's cache
            // keeps token 0 there too; its attention reads the slot only
            // through the queries above, as an engine whose token 0 lives in
            // another slot would.
            kv_latent = kv_latent.copy();
            let _ = kv_latent.get(0).fill_(f64::NAN);
        }
        (
            self.linear(&attn, "self_attn.o_proj"),
            (topk, own_topk),
            index_scores,
            kv_latent,
        )
    }

    /// The deviations acting in this layer.
    fn at_layer(&self) -> AtLayer {
        AtLayer::of(self.deviations, self.index, self.config)
    }

    fn softmax_scale(&self) -> f64 {
        let c = self.config;
        let base = (c.qk_head_dim() as f64).powf(-0.5);
        let rope = c.rope();
        match (rope.rope_type.as_str(), rope.mscale_all_dim, rope.factor) {
            ("yarn", Some(m), Some(f)) if m != 0.0 && f > 1.0 => {
                let mscale = 0.1 * m * f.ln() + 1.0;
                base * mscale * mscale
            }
            _ => base,
        }
    }

    /// The DSA indexer: top-min(k, S) keys per query and the fp32 scores,
    /// computed as transformers does (fp32 products after the projections).
    fn indexer(&self, x: &Tensor, q_resid: &Tensor, rope: &Rope) -> (Tensor, Tensor) {
        let c = self.config;
        let s = x.size()[0];
        let (heads, dim, rot) = (c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim);
        let q = self
            .linear(q_resid, "self_attn.indexer.wq_b")
            .view([s, heads, dim]);
        let k = self.linear(x, "self_attn.indexer.wk");
        let k = k.layer_norm(
            [dim],
            Some(self.w("self_attn.indexer.k_norm.weight").to_kind(k.kind())),
            Some(self.w("self_attn.indexer.k_norm.bias").to_kind(k.kind())),
            1e-6,
            false,
        );
        let mut k = k;
        for f in self.faults() {
            if let Fault::IndexerKey { scale, .. } = f {
                let noise = super::fault::seeded_normal(&k.size(), self.index, k.device());
                k = &k + (noise * (k.to_kind(Kind::Float).std(true) * *scale)).to_kind(k.kind());
            }
        }
        let dev = self.at_layer();
        let interleaved = dev.indexer_rope_interleaved(self.arch);
        let q = Tensor::cat(
            &[
                rope.apply(&q.narrow(-1, 0, rot), 0, interleaved),
                q.narrow(-1, rot, dim - rot),
            ],
            -1,
        );
        let k = Tensor::cat(
            &[
                rope.apply(&k.narrow(-1, 0, rot), 0, interleaved),
                k.narrow(-1, rot, dim - rot),
            ],
            -1,
        );
        let weights_proj = self.w("self_attn.indexer.weights_proj.weight");
        let w = if matches!(self.numerics, Numerics::Fp8Checkpoint { .. }) {
            // As the load holds it (bf16 in serving: a bf16 output), or its FP8.
            self.linear(x, "self_attn.indexer.weights_proj")
                .to_kind(Kind::Float)
        } else if dev.weights_proj_bf16 {
            // A bf16 GEMM: bf16 operands, fp32 accumulation, bf16 output.
            x.to_kind(Kind::BFloat16)
                .matmul(&weights_proj.to_kind(Kind::BFloat16).tr())
                .to_kind(Kind::Float)
        } else {
            // weights_proj is kept in fp32 by transformers (_keep_in_fp32_modules).
            x.to_kind(Kind::Float).matmul(&weights_proj.tr())
        } * (heads as f64).powf(-0.5);
        let positions = Tensor::arange(s, (Kind::Int64, x.device()));
        // Production's FP8 indexer, as the chosen engine variant and the
        // deviations make it.
        let fp8_path = matches!(
            self.numerics,
            Numerics::Fp8 | Numerics::Fp8Emulated | Numerics::Fp8Checkpoint { .. }
        );
        // The engine's FP8 indexer belongs to an FP8 production path (a shadow
        // in plain numerics is built with the same variant and must not run
        // it); a deviation acts on whatever production it is given, bf16
        // linears included, as an FP8 indexer patched into a bf16 transformers
        // model runs. Shadows are given no deviation.
        let quant = dev.indexer_quant(if fp8_path { self.fp8_indexer } else { None });
        let score =
            |k: &Tensor| self.index_scores(&q, k, &w, &positions, quant, dev.logits_lowprec);
        let mut scores = score(&k);
        if dev.reuses_prefix()
            && let Some(p) = deviation::reuse_prefix(s)
        {
            // The queries past the hit score the cached keys as the cache
            // holds and gathers them.
            let mut cached = k.shallow_clone();
            if dev.stale_prefix {
                cached = cached.index_select(0, &deviation::stale_index(s, p, x.device()));
            }
            if dev.wrong_gather {
                cached = cached.index_select(0, &deviation::wrong_gather_index(s, p, x.device()));
            }
            scores = deviation::splice_tail(&scores, &score(&cached), p);
        }
        if let Some(length) = dev.paged_past {
            scores = kernel_deviation::paged_past_len(&scores, length, self.index);
        }
        if dev.logits_bf16 {
            scores = deviation::bf16_round(&scores);
        }
        let take = c.index_topk.min(s);
        if dev.zeros_past.is_some_and(|length| s > length) {
            // The reduction returned zeros: those are the scores, and a top-k
            // over equal values kept the trailing keys.
            let zeros = kernel_deviation::zeroed(&scores);
            return (kernel_deviation::trailing_topk(&zeros, take), zeros);
        }
        // What the top-k kernel ranks: the scores, less the candidates an
        // overflowing buffer dropped; the scores recorded are the logits'.
        let ranked = match dev.topk_buffer {
            Some(capacity) => kernel_deviation::drop_overflowed_candidates(&scores, take, capacity),
            None => scores.shallow_clone(),
        };
        let topk = if dev.ties_reversed {
            deviation::topk_ties_reversed(&ranked, take)
        } else {
            // Unsorted: attention and every reader use the set, and torch
            // picks the same set either way (sorting is a pass after the
            // selection that costs more than the selection at k = 2048).
            ranked.topk(take, -1, true, false).1
        };
        (topk, scores)
    }

    /// Indexer scores `[S, T]` (fp32, -inf where masked) of q `[S, H, D]` and
    /// k `[T, D]` after RoPE, with head weights `w` `[S, H]` (H^-1/2 folded
    /// in), quantized as `quant` says; a quantization that cannot run (an
    /// index_head_dim other than 128) or fails is scored in fp32 and counted.
    /// `lowprec`: the head terms and their sum held in that precision
    /// ([`kernel_deviation::lowprec_scores`]), on the operands as `quant`
    /// dequantizes them.
    fn index_scores(
        &self,
        q: &Tensor,
        k: &Tensor,
        w: &Tensor,
        positions: &Tensor,
        quant: IndexerQuant,
        lowprec: Option<kernel_deviation::LowPrecision>,
    ) -> Tensor {
        if let Some(low) = lowprec {
            let (qf, kf) = (q.to_kind(Kind::Float), k.to_kind(Kind::Float));
            let operands = match quant {
                IndexerQuant::None => Ok((qf, kf)),
                _ if q.size()[2] != 128 => Err(()),
                _ => deviation::dequantized_operands(&qf, &kf, quant).map_err(|_| ()),
            };
            let (qd, kd) = operands.unwrap_or_else(|()| {
                if let Some(fallbacks) = self.fallbacks {
                    Fallbacks::add(&fallbacks.fp8_indexer_failed);
                }
                (q.to_kind(Kind::Float), k.to_kind(Kind::Float))
            });
            return kernel_deviation::lowprec_scores(&qd, &kd, w, positions, low);
        }
        let dim = q.size()[2];
        let fallback = || {
            if let Some(fallbacks) = self.fallbacks {
                Fallbacks::add(&fallbacks.fp8_indexer_failed);
            }
        };
        let (qf, kf) = (q.to_kind(Kind::Float), k.to_kind(Kind::Float));
        let quantized = match quant {
            IndexerQuant::None => None,
            // The FP8 indexer variants quantize one 128-wide block per head.
            _ if dim != 128 => {
                fallback();
                None
            }
            IndexerQuant::QueriesAndKeys(variant) => {
                index_scores(&qf, &kf, w, positions, Precision::Fp8(variant)).ok()
            }
            IndexerQuant::Keys(variant) => {
                deviation::keys_fp8_scores(&qf, &kf, w, positions, variant).ok()
            }
        };
        if quantized.is_none() && quant != IndexerQuant::None && dim == 128 {
            fallback();
        }
        quantized.unwrap_or_else(|| {
            let causal = positions.unsqueeze(0).le_tensor(&positions.unsqueeze(1));
            causal_scores(&qf, &kf, w).masked_fill(&causal.logical_not(), f64::NEG_INFINITY)
        })
    }

    fn mlp(&self, x: &Tensor, prefix: &str) -> Tensor {
        let gate = self.linear(x, &format!("{prefix}.gate_proj"));
        let up = self.linear(x, &format!("{prefix}.up_proj"));
        self.linear(&(gate.silu() * up), &format!("{prefix}.down_proj"))
    }

    /// transformers' GlmMoeDsaMoE: routing in fp32, experts in the path's numerics.
    /// The MoE block's output and the experts each token was routed to.
    fn moe(&self, x: &Tensor) -> (Tensor, Tensor) {
        let c = self.config;
        let (s, e) = (x.size()[0], c.n_routed_experts);
        let router = Router {
            experts: e,
            groups: c.n_group,
            topk_group: c.topk_group,
            per_token: c.num_experts_per_tok,
            norm_topk_prob: c.norm_topk_prob,
            scaling: c.routed_scaling_factor,
        };
        let (top, weights) = router.route(
            x,
            self.w("mlp.gate.weight"),
            self.w("mlp.gate.e_score_correction_bias"),
        );
        // transformers' FP8Experts weighs each expert's output in its own kind and sums
        // them in fp32, cast once (its eager loop and its grouped_mm path alike); the
        // bf16 experts promote to fp32 per product and sum in the activations' kind.
        let fp8_experts = matches!(self.numerics, Numerics::Fp8Checkpoint { .. });
        let sum_kind = if fp8_experts {
            Kind::Float
        } else {
            self.act_kind()
        };
        let mut out = Tensor::zeros([s, c.hidden_size], (sum_kind, x.device()));
        for expert in 0..e {
            let hits = top.eq(expert).nonzero();
            if hits.size()[0] == 0 {
                continue;
            }
            let (tokens, slots) = (hits.select(1, 0), hits.select(1, 1));
            let xe = x.index_select(0, &tokens);
            let ye = self.mlp(&xe, &format!("mlp.experts.{expert}"));
            let w = weights
                .index(&[Some(tokens.shallow_clone()), Some(slots)])
                .unsqueeze(1);
            let ye = if fp8_experts {
                (&ye * w.to_kind(ye.kind())).to_kind(Kind::Float)
            } else {
                // bf16 output times fp32 routing weight promotes to fp32, as in transformers.
                (ye.to_kind(Kind::Float) * w).to_kind(out.kind())
            };
            out = out.index_add(0, &tokens, &ye);
        }
        let out = out.to_kind(self.act_kind());
        (out + self.mlp(x, "mlp.shared_experts"), top)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The product over every key, as the layer computed it before chunking.
    fn full_scores(q: &Tensor, k: &Tensor, w: &Tensor) -> Tensor {
        let dim = q.size()[2] as f64;
        let dots = (q.transpose(0, 1).matmul(&k.tr().unsqueeze(0)) * dim.powf(-0.5)).relu();
        w.unsqueeze(1).matmul(&dots.transpose(0, 1)).squeeze_dim(1)
    }

    #[test]
    fn chunked_causal_scores_are_the_full_products_bits_where_keys_are_visible() {
        tch::manual_seed(3);
        // GLM's and DeepSeek's demo indexer heads; several chunks each.
        for (s, heads) in [(2100_i64, 4_i64), (1100, 8)] {
            let q = Tensor::randn([s, heads, 128], (Kind::Float, tch::Device::Cpu));
            let k = Tensor::randn([s, 128], (Kind::Float, tch::Device::Cpu));
            let w = Tensor::randn([s, heads], (Kind::Float, tch::Device::Cpu));
            assert!(causal_chunk_rows(heads, s) * 2 < s, "more than two chunks");
            let positions = Tensor::arange(s, (Kind::Int64, tch::Device::Cpu));
            let hidden = positions
                .unsqueeze(0)
                .le_tensor(&positions.unsqueeze(1))
                .logical_not();
            let want = full_scores(&q, &k, &w).masked_fill(&hidden, f64::NEG_INFINITY);
            let got = causal_scores(&q, &k, &w).masked_fill(&hidden, f64::NEG_INFINITY);
            assert!(got.equal(&want), "s {s}, heads {heads}: not bit-identical");
        }
    }
}
