//! Manifold-constrained hyper-connections (`Glm5NextTextHyperConnection`):
//! the residual stream is `hc_mult` streams per token `[S, N, D]`. Before a
//! block they are collapsed into its input by `pre` weights; after it, the
//! block's output is expanded back by `post` weights and added to the
//! streams mixed by `comb`, a matrix made doubly stochastic by Sinkhorn
//! iterations. All weights come from one projection of the normalised,
//! flattened streams and are computed in fp32 in every path, as transformers
//! does (its `base` and `scale` are kept in fp32; the projection runs on
//! `.float()` operands).

use tch::{Kind, Tensor};

use super::config::Glm5NextConfig;
use super::ops::Ops;

/// One hyper-connection's weights for a block, computed from its input streams.
#[derive(Debug)]
pub struct Mixing {
    /// `[S, N]` fp32: how the block's output is spread over the streams.
    pub post: Tensor,
    /// `[S, N, N]` fp32, doubly stochastic: how the input streams are mixed.
    pub comb: Tensor,
    /// The block's input `[S, D]`, in the streams' kind.
    pub collapsed: Tensor,
}

/// The hyper-connection `hc_{name}` (`attn` or `ffn`) on `streams` `[S, N, D]`.
#[must_use]
pub fn mixing(ops: &Ops<'_>, name: &str, streams: &Tensor) -> Mixing {
    let c: &Glm5NextConfig = ops.config;
    let (s, n) = (streams.size()[0], c.hc_mult);
    let flat = streams.reshape([s, -1]).to_kind(Kind::Float);
    // Unweighted RMSNorm over all streams together.
    let flat = &flat * (flat.square().mean_dim(-1, true, Kind::Float) + c.rms_norm_eps).rsqrt();
    let mixed = flat.matmul(&ops.w(&format!("hc_{name}_fn")).tr()); // [S, (2 + N) * N]
    let base = ops.w(&format!("hc_{name}_base"));
    let scale = ops.w(&format!("hc_{name}_scale"));
    let part = |t: &Tensor, start: i64, len: i64| t.narrow(-1, start, len);
    let (pre_scale, post_scale, comb_scale) = (scale.get(0), scale.get(1), scale.get(2));
    let pre = (part(&mixed, 0, n) * pre_scale + part(base, 0, n)).sigmoid() + c.hc_eps;
    let post = (part(&mixed, n, n) * post_scale + part(base, n, n)).sigmoid() * 2.0;
    let comb_logits = part(&mixed, 2 * n, n * n).view([s, n, n]) * comb_scale
        + part(base, 2 * n, n * n).view([n, n]);
    let comb = sinkhorn(
        &(comb_logits.softmax(-1, Kind::Float) + c.hc_eps),
        c.hc_sinkhorn_iters,
        c.hc_eps,
    );
    let collapsed = (pre.unsqueeze(-1) * streams)
        .sum_dim_intlist(1, false, Kind::Float)
        .to_kind(streams.kind());
    Mixing {
        post,
        comb,
        collapsed,
    }
}

/// Sinkhorn-Knopp as transformers runs it: a column normalisation, then
/// `iters - 1` row-then-column rounds, each sum offset by `eps`.
fn sinkhorn(comb: &Tensor, iters: i64, eps: f64) -> Tensor {
    let cols = |m: &Tensor| m / (m.sum_dim_intlist(-2, true, Kind::Float) + eps);
    let rows = |m: &Tensor| m / (m.sum_dim_intlist(-1, true, Kind::Float) + eps);
    let mut m = cols(comb);
    for _ in 1..iters {
        m = cols(&rows(&m));
    }
    m
}

/// The streams after a block: `post * out + comb^T @ streams`, in the
/// streams' kind (transformers casts `post` and `comb` to it first).
pub fn expand(mixing: &Mixing, out: &Tensor, streams: &Tensor) -> Tensor {
    let kind = streams.kind();
    mixing.post.to_kind(kind).unsqueeze(-1) * out.to_kind(kind).unsqueeze(-2)
        + mixing.comb.to_kind(kind).transpose(-1, -2).matmul(streams)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinkhorn_makes_a_positive_matrix_doubly_stochastic() {
        let m = Tensor::from_slice(&[5.0_f32, 1.0, 0.1, 2.0, 3.0, 0.5, 0.2, 0.3, 7.0]).view([3, 3]);
        let d = sinkhorn(&m, 50, 0.0);
        let ones = Tensor::ones([3], (Kind::Float, tch::Device::Cpu));
        for dim in [0, 1] {
            let sums = d.sum_dim_intlist(dim, false, Kind::Float);
            assert!(sums.allclose(&ones, 1e-5, 1e-5, false), "{sums}");
        }
    }
}
