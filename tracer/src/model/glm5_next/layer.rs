//! One `Glm5NextTextDecoderLayer`: hyper-connection collapse, RMSNorm,
//! KDA or MLA, expansion back into the streams; then the same around the
//! dense MLP or the MoE block (`mlp_layer_types`).

use tch::Tensor;

use super::config::Mixer;
use super::hyper;
use super::kda;
use super::kpool::KpoolSelection;
use super::mla;
use super::ops::Ops;
use crate::model::fault::Fault;

/// What one layer hands to the tracer.
#[derive(Debug)]
pub struct LayerOutput {
    /// The token mixer's output, before expansion into the streams `[S, hidden]`.
    pub attn_out: Tensor,
    /// The MLP or MoE output, before expansion `[S, hidden]`.
    pub mlp_out: Tensor,
    /// The streams leaving the layer, a token's `hc_mult` streams as one
    /// vector `[S, hc_mult * hidden]`.
    pub layer_out: Tensor,
    /// MLA layers: the tokens each query attended `[S, W]` (-1 unused).
    pub tokens: Option<Tensor>,
    /// MLA layers running their own indexer: its selection.
    pub selection: Option<KpoolSelection>,
    /// MLA layers: the KV latent each token caches `[S, kv_lora_rank]`.
    pub kv_latent: Option<Tensor>,
}

/// Layer `index` on the streams `[S, hc_mult, hidden]`. `shared` is the
/// previous layer's attended tokens (a `shared` indexer layer reuses them).
pub fn forward(
    ops: &Ops<'_>,
    index: i64,
    streams: &Tensor,
    shared: Option<&Tensor>,
) -> (Tensor, LayerOutput) {
    let c = ops.config;
    let streams = streams.to_kind(ops.kind());
    let mixing = hyper::mixing(ops, "attn", &streams);
    let normed = ops.rms_norm(&mixing.collapsed, "input_layernorm");
    let (attn_out, tokens, selection, kv_latent) = match c.mixer(index) {
        Mixer::Kda => (kda::forward(ops, &normed), None, None, None),
        Mixer::Mla => {
            let out = mla::forward(ops, index, &normed, shared);
            (
                out.out,
                Some(out.tokens),
                out.selection,
                Some(out.kv_latent),
            )
        }
    };
    let attn_out = plant(ops, index, "attn_out", attn_out);
    let streams = hyper::expand(&mixing, &attn_out, &streams);
    let mixing = hyper::mixing(ops, "ffn", &streams);
    let normed = ops.rms_norm(&mixing.collapsed, "post_attention_layernorm");
    let mlp_out = if c.is_moe(index) {
        ops.moe(&normed)
    } else {
        ops.mlp(&normed, "mlp")
    };
    let mlp_out = plant(ops, index, "mlp_out", mlp_out);
    let streams = hyper::expand(&mixing, &mlp_out, &streams);
    let size = streams.size();
    let layer_out = plant(ops, index, "layer_out", streams.reshape([size[0], -1]));
    let streams = layer_out.view(size.as_slice());
    let out = LayerOutput {
        attn_out,
        mlp_out,
        layer_out,
        tokens,
        selection,
        kv_latent,
    };
    (streams, out)
}

/// Writes the non-finite values planted at `site` of layer `index` into `x`
/// `[S, width]` (a copy: the caller's tensor is left alone).
fn plant(ops: &Ops<'_>, index: i64, site: &str, x: Tensor) -> Tensor {
    let mut x = x;
    for fault in ops.faults.iter().filter(|f| f.layer() == index) {
        if let Fault::NonFinite {
            site: at,
            token,
            channel,
            value,
            ..
        } = fault
            && at == site
            && *token < x.size()[0]
        {
            x = x.copy();
            let _ = x.get(*token).get(*channel).fill_(value.value());
        }
    }
    x
}
