//! MLA without RoPE (`Glm5NextTextAttention`, `qk_rope_head_dim = 0`):
//! low-rank queries and a compressed KV latent, each query attending only
//! to the tokens its k-pool indexer selected, or to those of the previous
//! layer's indexer where this layer's is `shared`.

use tch::{Kind, Tensor};

use super::kpool::{self, KpoolSelection};
use super::ops::Ops;

/// What an MLA block hands back.
#[derive(Debug)]
pub struct MlaOutput {
    /// `[S, hidden]`.
    pub out: Tensor,
    /// The tokens attended `[S, W]` (int64, -1 unused).
    pub tokens: Tensor,
    /// This layer's own indexer selection (`None` where shared).
    pub selection: Option<KpoolSelection>,
    /// The normalised KV latent each token caches `[S, kv_lora_rank]`.
    pub kv_latent: Tensor,
}

/// MLA on the normalised block input `x` `[S, hidden]`; `shared` is the
/// previous layer's attended tokens, used where this layer's indexer is
/// `shared`.
#[must_use]
pub fn forward(ops: &Ops<'_>, index: i64, x: &Tensor, shared: Option<&Tensor>) -> MlaOutput {
    let c = ops.config;
    let s = x.size()[0];
    let (heads, nope, v_dim) = (c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim);
    let q_resid = ops.rms_norm(
        &ops.linear(x, "self_attn.q_a_proj"),
        "self_attn.q_a_layernorm",
    );
    let query = ops
        .linear(&q_resid, "self_attn.q_b_proj")
        .view([s, heads, c.qk_head_dim()])
        .transpose(0, 1); // [H, S, qk]
    let latent = ops.linear(x, "self_attn.kv_a_proj_with_mqa");
    let kv_latent = ops.rms_norm(
        &latent.narrow(-1, 0, c.kv_lora_rank),
        "self_attn.kv_a_layernorm",
    );
    let kv = ops
        .linear(&kv_latent, "self_attn.kv_b_proj")
        .view([s, heads, nope + v_dim]);
    let key = kv.narrow(-1, 0, nope).transpose(0, 1);
    let value = kv.narrow(-1, nope, v_dim).transpose(0, 1);

    let (tokens, selection) = if c.runs_indexer(index) {
        let selection = kpool::select(ops, x, &q_resid);
        (selection.tokens.shallow_clone(), Some(selection))
    } else {
        // The configuration check guarantees a previous MLA layer.
        let tokens = shared.map_or_else(
            || Tensor::full([s, 1], -1, (Kind::Int64, x.device())),
            Tensor::shallow_clone,
        );
        (tokens, None)
    };
    let allowed = attended_mask(&tokens, s);
    let kind = query.kind();
    let min = if kind == Kind::Float {
        f64::from(f32::MIN)
    } else {
        -3.389_531_389_251_535_5e38
    };
    let mask = Tensor::zeros([s, s], (kind, x.device())).masked_fill(&allowed.logical_not(), min);
    let scaling = (c.qk_head_dim() as f64).powf(-0.5);
    let scores = query.matmul(&key.transpose(1, 2)) * scaling + mask.unsqueeze(0);
    let probs = scores.softmax(-1, Kind::Float).to_kind(kind);
    let attn = probs
        .matmul(&value)
        .transpose(0, 1)
        .reshape([s, heads * v_dim]);
    MlaOutput {
        out: ops.linear(&attn, "self_attn.o_proj"),
        tokens,
        selection,
        kv_latent,
    }
}

/// `[S, S]` bool: which keys each query attends to (the -1 entries ignored).
fn attended_mask(tokens: &Tensor, s: i64) -> Tensor {
    let valid = tokens.ge(0);
    let safe = tokens.clamp(0, s - 1);
    Tensor::zeros([s, s], (Kind::Int64, tokens.device()))
        .scatter_add(1, &safe, &valid.to_kind(Kind::Int64))
        .ne(0)
}
