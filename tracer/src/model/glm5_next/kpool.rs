//! The DSA indexer with k-pool compression (`Glm5NextTextIndexer`, one
//! sequence without padding or cache). Keys are grouped into pools of
//! `index_kpool` consecutive tokens from the first; each complete pool's
//! key is a softmax-weighted mean of its tokens' keys (the weights from a
//! gate projection plus a learned per-position offset, per channel). A
//! query scores the complete pools whose last token it sees, keeps the top
//! `index_topk / index_kpool`, expands them to their tokens, and appends its
//! own incomplete pool's tokens (`index_kpool_always_select_tail`).

use tch::{Kind, Tensor};

use super::ops::Ops;

/// One layer's indexer output.
#[derive(Debug)]
pub struct KpoolSelection {
    /// The tokens each query attends to `[S, index_topk + index_kpool - 1]`
    /// (int64, -1 for an unused entry), as transformers returns them.
    pub tokens: Tensor,
    /// The pools each query selected `[S, min(k, pools)]` (int64, k =
    /// `index_topk / index_kpool`, -1 for a pool it could not see), in score order.
    pub pools: Tensor,
    /// Scores of every complete pool `[S, pools]` (fp32, -inf where the
    /// query cannot see the pool's last token).
    pub scores: Tensor,
}

/// The indexer on the block input `x` `[S, hidden]` and MLA's query
/// residual `q_resid` `[S, q_lora_rank]`.
#[must_use]
pub fn select(ops: &Ops<'_>, x: &Tensor, q_resid: &Tensor) -> KpoolSelection {
    let c = ops.config;
    let s = x.size()[0];
    let (heads, dim, pool) = (c.index_n_heads, c.index_head_dim, c.index_kpool);
    let device = x.device();
    let kind = ops.kind();
    let q = ops
        .linear(q_resid, "self_attn.indexer.wq_b")
        .view([s, heads, dim]);
    let k = ops.linear(x, "self_attn.indexer.wk");
    let k = k.layer_norm(
        [dim],
        Some(ops.w("self_attn.indexer.k_norm.weight").to_kind(k.kind())),
        Some(ops.w("self_attn.indexer.k_norm.bias").to_kind(k.kind())),
        1e-6,
        false,
    );
    // A plain parameter in transformers (F.linear), not an FP8 linear.
    let gate = x.to_kind(kind).matmul(
        &ops.w("self_attn.indexer.index_kpool_compress_gate")
            .to_kind(kind)
            .tr(),
    );
    let complete = s / pool;
    let scores = if complete == 0 {
        Tensor::zeros([s, 0], (Kind::Float, device))
    } else {
        // Complete pools only: transformers drops the rest (`keep`).
        let used = complete * pool;
        let grouped_k = k.narrow(0, 0, used).view([complete, pool, dim]);
        let logits = gate
            .narrow(0, 0, used)
            .view([complete, pool, dim])
            .to_kind(Kind::Float)
            + ops
                .w("self_attn.indexer.index_kpool_compress_ape")
                .unsqueeze(0);
        let probs = logits.softmax(1, Kind::Float).to_kind(grouped_k.kind());
        let pool_keys = (probs * &grouped_k).sum_dim_intlist(1, false, grouped_k.kind()); // [P, D]
        let dots = q
            .to_kind(Kind::Float)
            .matmul(&pool_keys.to_kind(Kind::Float).tr().unsqueeze(0)); // [S, H, P]
        let dots = (dots * (dim as f64).powf(-0.5)).relu();
        // Unlike GLM-5's, this weights_proj is not kept in fp32 by
        // transformers: a GEMM in the activations' kind, then fp32.
        let w = x
            .to_kind(kind)
            .matmul(
                &ops.w("self_attn.indexer.weights_proj.weight")
                    .to_kind(kind)
                    .tr(),
            )
            .to_kind(Kind::Float)
            * (heads as f64).powf(-0.5); // [S, H]
        let scores = w.unsqueeze(1).matmul(&dots).squeeze_dim(1); // [S, P]
        // A pool is visible once the query sees its last token.
        let last = Tensor::arange(complete, (Kind::Int64, device)) * pool + (pool - 1);
        let query = Tensor::arange(s, (Kind::Int64, device)).unsqueeze(1);
        scores.masked_fill(&last.unsqueeze(0).gt_tensor(&query), f64::NEG_INFINITY)
    };
    let take = c.pools_per_query().min(complete);
    let pools = if take == 0 {
        Tensor::zeros([s, 0], (Kind::Int64, device))
    } else {
        // transformers fills hidden pools with finfo.min, not -inf: their
        // order among themselves is immaterial, as they are dropped below.
        let (top_scores, top) = scores.topk(take, -1, true, true);
        top.masked_fill(&top_scores.isinf(), -1)
    };
    let tokens = expand(
        &pools,
        s,
        pool,
        c.index_topk,
        c.index_kpool_always_select_tail,
    );
    KpoolSelection {
        tokens,
        pools,
        scores,
    }
}

/// Selected pools `[S, K]` (-1 unused) to tokens, plus each query's
/// incomplete pool (its visible tokens past the last complete pool), padded
/// with -1 to `index_topk + index_kpool - 1` as transformers pads.
fn expand(pools: &Tensor, s: i64, pool: i64, index_topk: i64, tail: bool) -> Tensor {
    let device = pools.device();
    let k = pools.size()[1];
    let offsets = Tensor::arange(pool, (Kind::Int64, device));
    let tokens = (pools.unsqueeze(-1) * pool + offsets.view([1, 1, pool]))
        .masked_fill(&pools.lt(0).unsqueeze(-1), -1)
        .reshape([s, k * pool]);
    let mut parts = vec![tokens];
    let mut width = index_topk;
    if tail && pool > 1 {
        let visible = Tensor::arange_start(1, s + 1, (Kind::Int64, device)).unsqueeze(1);
        let count = visible.remainder(pool); // tokens in the query's own pool
        let start = &visible - &count;
        let offsets = Tensor::arange(pool - 1, (Kind::Int64, device)).unsqueeze(0);
        let tail = (&start + &offsets).masked_fill(&offsets.ge_tensor(&count), -1);
        parts.push(tail);
        width += pool - 1;
    }
    let joined = Tensor::cat(&parts, 1);
    let have = joined.size()[1];
    if have >= width {
        joined.narrow(1, 0, width)
    } else {
        Tensor::cat(
            &[
                joined,
                Tensor::full([s, width - have], -1, (Kind::Int64, device)),
            ],
            1,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_expand_to_their_tokens_and_the_query_keeps_its_incomplete_pool() {
        // Pool size 4, k = 2 pools, two queries: the first row's pools (1 then 0)
        // expand in that order, the second row selected none.
        let pools = Tensor::from_slice(&[1_i64, 0, -1, -1]).view([2, 2]);
        let t = expand(&pools, 2, 4, 8, true);
        let rows: Vec<Vec<i64>> = (0..2).map(|r| Vec::try_from(t.get(r)).unwrap()).collect();
        // Query 0 has seen 1 token: its incomplete pool is token 0.
        assert_eq!(rows[0], [4, 5, 6, 7, 0, 1, 2, 3, 0, -1, -1]);
        // Query 1 has seen 2 tokens: its incomplete pool is tokens 0 and 1.
        assert_eq!(rows[1], [-1, -1, -1, -1, -1, -1, -1, -1, 0, 1, -1]);
    }
}
