//! The operations every GLM-5.3-Flash block is made of, in a path's
//! numerics: linears (FP8 block-scaled in production, counted as the GLM-5
//! layers count theirs), RMSNorms, the clamped SwiGLU MLP and the MoE block.

use tch::{Kind, Tensor};

use super::config::Glm5NextConfig;
use crate::model::fault::Fault;
use crate::model::layer::{Fallbacks, Numerics, Weights, linear_in, rms_norm};
use crate::model::router::Router;

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
        let scale_inv = self.weights.get(&format!("{name}.weight_scale_inv"));
        linear_in(self.numerics, self.fallbacks, x, weight, scale_inv)
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
