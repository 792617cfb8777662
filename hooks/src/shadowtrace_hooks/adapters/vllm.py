"""vLLM's sparse attention indexer, for GLM-5 (`GlmMoeDsaForCausalLM`) and DeepSeek-V3.2.

Written against vllm-project/vllm `vllm/model_executor/models/deepseek_v2.py` at commit
002d6073aa034d4f5545d45021b0e56d1f3c3593 and `vllm/model_executor/layers/sparse_attn_indexer.py`
at 006475fe481a855ea61dd7aafc3722458fcbbeea:

- `Indexer.forward(hidden_states, qr, positions, rotary_emb, ...)` returns the top-k buffer
  shared by every layer ([max_num_batched_tokens, topk] int32; rows [:T] are this call's,
  request-local positions, -1 padded); decode tokens come first, then prefill tokens;
- `SparseAttnIndexer.forward_cuda(hidden_states, q_quant, k, weights)` receives the FP8
  query [T,H,128], the bf16 key [T,128] before its quantization into the cache, and fp32
  weights with q_scale * D^-0.5 * H^-0.5 folded in. The `dequant` shadow quantizes k as
  `indexer_k_quant_and_cache` does (amax clamp 1e-4, ue8m0) and scores these operands.

Requests come from the indexer's metadata, `get_forward_context().attn_metadata[
"<indexer prefix>.k_cache"]` (`num_decodes`, `num_decode_tokens`, `prefill.chunks` with
per-token `cu_seqlen_ks` / `cu_seqlen_ke`). vLLM's indexer sees no request ids: each prefill
request of a step is its own run, and decode rows are counted (`decode_rows_not_recorded`),
not recorded. Run with `--enforce-eager`; the newer `vllm/models/deepseek_v32/` layout, which
calls neither hooked method, is not supported.
"""

import functools
from typing import Any

import torch

from shadowtrace_hooks import numerics, session
from shadowtrace_hooks.adapters.engine import IndexerCall, Request, check_signature, tracer_for

NAME = "vllm"
SUPPORTED = "vLLM with deepseek_v2.py as at 002d6073 and sparse_attn_indexer.py as at 006475fe"
MODEL_MODULE = "vllm.model_executor.models.deepseek_v2"
OP_MODULE = "vllm.model_executor.layers.sparse_attn_indexer"
SIGNATURES = {
    (MODEL_MODULE, "Indexer", "forward"): ["self", "hidden_states", "qr", "positions", "rotary_emb"],
    (OP_MODULE, "SparseAttnIndexer", "forward_cuda"): ["self", "hidden_states", "q_quant", "k", "weights"],
}
_STASH = "_shadowtrace_operands"
_LAST_OP = "_shadowtrace_last_op"


def install(module: Any) -> None:
    for (module_name, cls_name, method), expected in SIGNATURES.items():
        if module.__name__ != module_name:
            continue
        cls = getattr(module, cls_name)
        if getattr(cls, "_shadowtrace_patched", False):
            return
        # Indexer.forward grew keyword arguments after 002d6073 (attn_layer_name): the
        # leading parameters are what the adapter reads.
        check_signature(cls, method, expected, SUPPORTED, leading=True)
        if method == "forward":
            cls.forward = _wrap_indexer(cls.forward)
        else:
            cls.forward_cuda = _wrap_op(cls.forward_cuda)
        cls._shadowtrace_patched = True


def _wrap_op(forward_cuda: Any) -> Any:
    @functools.wraps(forward_cuda)
    def traced(
        self: Any, hidden_states: Any, q_quant: Any, k: Any, weights: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if session.current() is not None and not session.capturing() and isinstance(q_quant, torch.Tensor):
            _LAST[0] = (q_quant.detach().clone(), k.detach().clone(), weights.detach().clone())
        return forward_cuda(self, hidden_states, q_quant, k, weights, *args, **kwargs)

    return traced


_LAST: list[Any] = [None]  # the operands of the op the current Indexer.forward called


def _wrap_indexer(forward: Any) -> Any:
    @functools.wraps(forward)
    def traced(
        self: Any, hidden_states: Any, qr: Any, positions: Any, rotary_emb: Any, *args: Any, **kw: Any
    ) -> Any:
        _LAST[0] = None
        out = forward(self, hidden_states, qr, positions, rotary_emb, *args, **kw)
        sess = session.current()
        if sess is not None:
            if session.capturing():
                sess.count("captures_skipped_cuda_graph")
            else:
                operands, _LAST[0] = _LAST[0], None
                inputs = (hidden_states, qr, positions, rotary_emb, operands)
                sess.guarded("vllm:indexer", None, _record, sess, self, *inputs, out)
        return out

    return traced


def _metadata(indexer: Any) -> Any:
    from vllm.forward_context import get_forward_context

    attn = get_forward_context().attn_metadata
    return attn.get(indexer.k_cache.prefix) if isinstance(attn, dict) else None


def _prefill_requests(meta: Any, step: int) -> list[Request]:
    """Prefill requests from the chunks' per-token K ranges: a request is a run of tokens
    sharing `cu_seqlen_ks`; a token's position is ke - ks - 1 (causal, self included)."""
    out: list[Request] = []
    row = meta.num_decode_tokens
    for chunk in meta.prefill.chunks:
        ks, ke = chunk.cu_seqlen_ks.tolist(), chunk.cu_seqlen_ke.tolist()
        start = 0
        for i in range(1, len(ks) + 1):
            if i == len(ks) or ks[i] != ks[start]:
                first_pos = ke[start] - ks[start] - 1
                key = f"vllm-step{step}-req{len(out)}"
                out.append(Request(key, row + start, i - start, first_pos, first_pos + i - start))
                start = i
        row += len(ks)
    return out


def _record(
    sess: session.Session, indexer: Any, hidden: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
    rotary_emb: Any, operands: tuple | None, out: torch.Tensor,
) -> None:  # fmt: skip
    meta = _metadata(indexer)
    if meta is None:  # profiling and dummy runs
        return
    tracer = tracer_for(sess, NAME, "vllm", indexer.topk_tokens)
    step = indexer.__dict__.get("_shadowtrace_calls", 0)
    indexer.__dict__["_shadowtrace_calls"] = step + 1
    requests = _prefill_requests(meta, step) if meta.num_prefills else []
    if meta.num_decode_tokens:
        sess.count("decode_rows_not_recorded", meta.num_decode_tokens)
    if not requests:
        return
    total = meta.num_decode_tokens + meta.num_prefill_tokens
    fp8 = None
    if operands is not None:
        q8, k, weights = (t[:total] for t in operands)
        k8, k_scale = numerics.quantize_rows(k, scale_format="ue8m0", amax_clamp=1e-4)
        fp8 = (q8, k8, k_scale.reshape(-1), weights)
    layer = int(indexer.prefix.split("layers.")[1].split(".")[0]) if "layers." in indexer.prefix else 0
    call = IndexerCall(
        layer=layer,
        k=indexer.topk_tokens,
        prod_topk=out[:total].clone(),
        requests=requests,
        fp8=fp8,
        raw=functools.partial(
            _raw, indexer, hidden[:total].detach(), qr[:total].detach(), positions[:total], rotary_emb
        ),
    )
    tracer.record(call)


def _raw(indexer: Any, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rotary_emb: Any) -> tuple:
    heads, dim, rope_dim = indexer.n_head, indexer.head_dim, indexer.rope_dim
    q = torch.nn.functional.linear(qr.float(), numerics.dense_weight(indexer.wq_b)).view(-1, heads, dim)
    fused = getattr(indexer, "wk_weights_proj", None)
    if fused is not None:
        kw = torch.nn.functional.linear(x.float(), numerics.dense_weight(fused))
        key, w = kw[:, :dim], kw[:, dim:]
    else:
        key = torch.nn.functional.linear(x.float(), numerics.dense_weight(indexer.wk))
        w = torch.nn.functional.linear(x.float(), numerics.dense_weight(indexer.weights_proj))
    norm = indexer.k_norm
    k = torch.nn.functional.layer_norm(key, (dim,), norm.weight.float(), norm.bias.float(), norm.eps)
    q_pe, k_pe = rotary_emb.forward_native(
        positions, q[..., :rope_dim].contiguous(), k[..., :rope_dim].unsqueeze(1).contiguous()
    )
    q = torch.cat([q_pe.reshape(-1, heads, rope_dim), q[..., rope_dim:]], -1)
    k = torch.cat([k_pe.reshape(-1, rope_dim), k[..., rope_dim:]], -1)
    return q, k, w * heads**-0.5
