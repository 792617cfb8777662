//! The operations every GLM-5.3-Flash block is made of, in a path's
//! numerics: linears (FP8 block-scaled in production, counted as the GLM-5
//! layers count theirs), RMSNorms, the clamped SwiGLU MLP and the MoE block.

use tch::{Kind, Tensor};

use super::config::Glm5NextConfig;
use crate::model::fault::Fault;
use crate::model::layer::{Fallbacks, Numerics, Weights, linear_in, rms_norm};

/// One layer's weights in one path's numerics.
#[derive(Debug, Clone, Copy)]
pub struct Ops<'a> {
    /// The text configuration.
    pub config: &'a Glm5NextConfig,
    /// The layer's weights (fp32), by their name within the layer.
    pub weights: &'a Weights,
    /// The path's numerics.
    pub numerics: Numerics,
    /// Where production's FP8 linears are counted.
    pub fallbacks: Option<&'a Fallbacks>,
    /// Faults planted in this pass (production only).
    pub faults: &'a [Fault],
}

impl Ops<'_> {
    /// The weight `name`. Every name is checked present when the layer is
    /// loaded ([`super::Glm5Next::load_layer`]), so this never misses.
    pub fn w(&self, name: &str) -> &Tensor {
        &self.weights[name]
    }

    /// The kind activations are held in.
    pub fn kind(&self) -> Kind {
        self.numerics.kind()
    }

    /// `x @ W.T` for the linear `name` (`{name}.weight`) in the path's numerics.
    pub fn linear(&self, x: &Tensor, name: &str) -> Tensor {
        let weight = self.w(&format!("{name}.weight"));
        linear_in(self.numerics, self.fallbacks, x, weight)
    }

    /// transformers' RMSNorm with the weight `{name}.weight`.
    pub fn rms_norm(&self, x: &Tensor, name: &str) -> Tensor {
        rms_norm(
            x,
            self.w(&format!("{name}.weight")),
            self.config.rms_norm_eps,
        )
    }

    /// `Glm5NextTextMLP` (dense layers and the shared experts) and one
    /// routed expert alike: the gate clamped from above and the up
    /// projection on both sides at `swiglu_limit`, then SiLU(gate) * up.
    pub fn mlp(&self, x: &Tensor, prefix: &str) -> Tensor {
        let limit = self.config.swiglu_limit;
        let gate = self
            .linear(x, &format!("{prefix}.gate_proj"))
            .clamp_max(limit);
        let up = self
            .linear(x, &format!("{prefix}.up_proj"))
            .clamp(-limit, limit);
        self.linear(&(gate.silu() * up), &format!("{prefix}.down_proj"))
    }

    /// One routed expert as `Glm5NextTextExperts` runs it: one fused
    /// gate-and-up GEMM (`gate_up_proj`, fused at load), split, the same
    /// clamp as [`Ops::mlp`], then the down projection.
    fn routed_expert(&self, x: &Tensor, expert: i64) -> Tensor {
        let limit = self.config.swiglu_limit;
        let prefix = format!("mlp.experts.{expert}");
        let gate_up = self.linear(x, &format!("{prefix}.gate_up_proj"));
        let half = gate_up.size()[1] / 2;
        let gate = gate_up.narrow(1, 0, half).clamp_max(limit);
        let up = gate_up.narrow(1, half, half).clamp(-limit, limit);
        self.linear(&(gate.silu() * up), &format!("{prefix}.down_proj"))
    }

    /// `Glm5NextTextMoE`: the sigmoid router with correction bias and
    /// group-limited top-k in fp32, the routed experts in the path's
    /// numerics (their weighted outputs summed in fp32), plus the shared
    /// experts.
    pub fn moe(&self, x: &Tensor) -> Tensor {
        let c = self.config;
        let (s, e, groups) = (x.size()[0], c.n_routed_experts, c.n_group);
        let scores = x
            .to_kind(Kind::Float)
            .matmul(&self.w("mlp.gate.weight").tr())
            .sigmoid();
        let choice = &scores + self.w("mlp.gate.e_score_correction_bias");
        let group_scores = choice
            .view([s, groups, e / groups])
            .topk(2.min(e / groups), -1, true, true)
            .0
            .sum_dim_intlist(-1, false, Kind::Float);
        let (_, group_idx) = group_scores.topk(c.topk_group, -1, true, false);
        let group_mask =
            Tensor::zeros([s, groups], (Kind::Float, x.device())).scatter_value(1, &group_idx, 1.0);
        let score_mask = group_mask
            .unsqueeze(-1)
            .expand([s, groups, e / groups], false)
            .reshape([s, e]);
        let choice = choice.masked_fill(&score_mask.logical_not(), f64::NEG_INFINITY);
        let (_, top) = choice.topk(c.num_experts_per_tok, -1, true, false);
        let mut weights = scores.gather(1, &top, false);
        if c.norm_topk_prob {
            weights = &weights / (weights.sum_dim_intlist(-1, true, Kind::Float) + 1e-20);
        }
        let weights = weights * c.routed_scaling_factor;
        // One row per (token, slot), weighted in fp32 and summed over the slots
        // in fp32 before one cast: transformers 5.24's default experts path
        // (`grouped_mm_experts_forward`), not its eager loop's bf16 index_add.
        let k = c.num_experts_per_tok;
        let mut rows = Tensor::zeros([s * k, c.hidden_size], (Kind::Float, x.device()));
        for expert in 0..e {
            let hits = top.eq(expert).nonzero();
            if hits.size()[0] == 0 {
                continue;
            }
            let (tokens, slots) = (hits.select(1, 0), hits.select(1, 1));
            let ye = self.routed_expert(&x.index_select(0, &tokens), expert);
            let w = weights
                .index(&[Some(tokens.shallow_clone()), Some(slots.shallow_clone())])
                .unsqueeze(1);
            rows = rows.index_copy(0, &(tokens * k + slots), &(ye.to_kind(Kind::Float) * w));
        }
        let out = rows
            .view([s, k, c.hidden_size])
            .sum_dim_intlist(1, false, Kind::Float)
            .to_kind(self.kind());
        out + self.mlp(x, "mlp.shared_experts")
    }
}
