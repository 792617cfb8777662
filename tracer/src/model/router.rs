//! The MoE router GLM-5, DeepSeek-V3.2 and GLM-5.3-Flash share.

use tch::{Kind, Tensor};

/// The sigmoid router of the GLM-5 / DeepSeek-V3.2 family and GLM-5.3-Flash
/// (`GlmMoeDsaTopkRouter`, `Glm5NextTextTopkRouter`), all in fp32: scores
/// with the correction bias choose, group-limited (the best `topk_group`
/// groups by the sum of their two best scores), and the scores without the
/// bias weigh, normalised if asked and scaled.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Router {
    pub(crate) experts: i64,
    pub(crate) groups: i64,
    pub(crate) topk_group: i64,
    pub(crate) per_token: i64,
    pub(crate) norm_topk_prob: bool,
    pub(crate) scaling: f64,
}

impl Router {
    /// `(experts [S, per_token], weights [S, per_token] fp32)` of `x` `[S, hidden]`.
    pub(crate) fn route(self, x: &Tensor, gate: &Tensor, bias: &Tensor) -> (Tensor, Tensor) {
        let (s, e, groups) = (x.size()[0], self.experts, self.groups);
        let scores = x.to_kind(Kind::Float).matmul(&gate.tr()).sigmoid();
        let choice = &scores + bias.to_kind(Kind::Float);
        let group_scores = choice
            .view([s, groups, e / groups])
            .topk(2.min(e / groups), -1, true, true)
            .0
            .sum_dim_intlist(-1, false, Kind::Float);
        let (_, group_idx) = group_scores.topk(self.topk_group, -1, true, false);
        let group_mask =
            Tensor::zeros([s, groups], (Kind::Float, x.device())).scatter_value(1, &group_idx, 1.0);
        let score_mask = group_mask
            .unsqueeze(-1)
            .expand([s, groups, e / groups], false)
            .reshape([s, e]);
        let choice = choice.masked_fill(&score_mask.logical_not(), f64::NEG_INFINITY);
        let (_, top) = choice.topk(self.per_token, -1, true, false);
        let mut weights = scores.gather(1, &top, false);
        if self.norm_topk_prob {
            weights = &weights / (weights.sum_dim_intlist(-1, true, Kind::Float) + 1e-20);
        }
        (top, weights * self.scaling)
    }
}
