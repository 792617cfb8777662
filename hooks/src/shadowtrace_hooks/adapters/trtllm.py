"""TensorRT-LLM's DSA indexer (PyTorch backend), for GLM-5 and DeepSeek-V3.2.

Written against NVIDIA/TensorRT-LLM `tensorrt_llm/_torch/attention_backend/sparse/dsa/indexer.py`
at commit 047098b74c51f488abcfcd72f7d4a988a56442f6 (2026, the 1.3 release candidates), where
production never calls `Indexer.forward`; `dsa/module.py` calls, per layer:

- `Indexer.pre_indexer_proj(qr, hidden_states, position_ids)` -> (q_fp8 [T,H,128] e4m3,
  k_fp8 [T,128], k_scale [T,1] fp32, weights [T,H] fp32 = weights_proj(x) * q_scale *
  D^-0.5 * H^-0.5, q_scale [T,H,1]); no Hadamard rotation (dropped by PR #11899);
- `Indexer.forward_from_projected(metadata, hidden_states, indexer_intermediates,
  is_generation)` once per phase -> top-k [rows, index_topk] int32 in a buffer reused across
  layers, request-local positions, -1 padded; context requests first.

Both signatures are checked at install: another layout is refused with the difference.
The `raw` shadow recomputes q, k, w in fp32 from qr and hidden_states with `wq_b` (FP8
weights dequantized), `wk`, `k_norm`, `weights_proj` and the module's own `rotary_emb`
(whose `is_neox` comes from DeepSeekSparseAttentionConfig.indexer_rope_interleave: GLM-5
needs it true). Requests are `metadata.request_ids`, new tokens `metadata.seq_lens`, cached
tokens `metadata.kv_cache_params.num_cached_tokens_per_seq`. Run with CUDA graphs off
(`cuda_graph_config=None`) and without torch.compile: captured steps are skipped and counted.
"""

import functools
from typing import Any

import torch

from shadowtrace_hooks import numerics, session
from shadowtrace_hooks.adapters.engine import (
    IndexerCall,
    bind,
    check_signature,
    requests_from_lengths,
    tracer_for,
)

NAME = "tensorrt_llm"
SUPPORTED = "TensorRT-LLM with sparse/dsa/indexer.py as at 047098b7 (1.3 release candidates)"
MODULE = "tensorrt_llm._torch.attention_backend.sparse.dsa.indexer"
SIGNATURES = {
    "pre_indexer_proj": ["self", "qr", "hidden_states", "position_ids"],
    "forward_from_projected": ["self", "metadata", "hidden_states", "indexer_intermediates", "is_generation"],
}
_STASH = "_shadowtrace_projected"


def install(module: Any) -> None:
    cls = module.Indexer
    if getattr(cls, "_shadowtrace_patched", False):
        return
    for method, expected in SIGNATURES.items():
        check_signature(cls, method, expected, SUPPORTED)
    project, from_projected = cls.pre_indexer_proj, cls.forward_from_projected

    @functools.wraps(project)
    def traced_project(self: Any, qr: Any, hidden_states: Any, position_ids: Any) -> Any:
        out = project(self, qr, hidden_states, position_ids)
        sess = session.current()
        if sess is not None and not session.capturing():
            sess.guarded("trtllm:pre_indexer_proj", None, _stash, self, qr, hidden_states, position_ids, out)
        return out

    @functools.wraps(from_projected)
    def traced_from_projected(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = from_projected(self, *args, **kwargs)
        sess = session.current()
        if sess is not None:
            if session.capturing():
                sess.count("captures_skipped_cuda_graph")
            else:
                bound = bind(from_projected, (self, *args), kwargs)
                sess.guarded("trtllm:indexer", None, _record, sess, self, bound, out)
        return out

    cls.pre_indexer_proj, cls.forward_from_projected = traced_project, traced_from_projected
    cls._shadowtrace_patched = True


def _stash(indexer: Any, qr: torch.Tensor, hidden: Any, position_ids: torch.Tensor, out: tuple) -> None:
    hidden = getattr(hidden, "unquantized_hidden_states", hidden)
    indexer.__dict__[_STASH] = (qr.detach(), hidden.detach(), position_ids.detach())


def _record(sess: session.Session, indexer: Any, bound: dict, out: torch.Tensor) -> None:
    metadata, phase = bound["metadata"], bound["is_generation"]
    q8, k8, k_scale, weights, _ = bound["indexer_intermediates"]
    n_ctx, n_tokens, n_req = metadata.num_contexts, metadata.num_tokens, metadata.num_seqs
    first, last = {None: (0, n_req), False: (0, n_ctx), True: (n_ctx, n_req)}[phase]
    seq_lens = [int(v) for v in metadata.seq_lens[first:last]]
    cached = [int(v) for v in metadata.kv_cache_params.num_cached_tokens_per_seq[first:last]]
    keys = [f"trtllm-{r}" for r in list(metadata.request_ids)[first:last]]
    rows = sum(seq_lens)
    row_offset = metadata.num_ctx_tokens if phase else 0
    del n_tokens
    stash = indexer.__dict__.get(_STASH)
    call = IndexerCall(
        layer=indexer.layer_idx,
        k=indexer.index_topk,
        prod_topk=out[:rows].clone(),
        requests=requests_from_lengths(keys, seq_lens, cached),
        fp8=(q8[:rows], k8[:rows], k_scale[:rows].reshape(-1), weights[:rows]),
        raw=None if stash is None else functools.partial(_raw, indexer, stash, row_offset, rows),
    )
    tracer_for(sess, NAME, "trtllm", indexer.index_topk).record(call)


def _raw(
    indexer: Any, stash: tuple, offset: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qr, hidden, position_ids = (t[offset : offset + rows] for t in stash)
    heads, dim, rope_dim = indexer.n_heads, indexer.head_dim, indexer.rope_dim
    x = hidden.float()
    q = torch.nn.functional.linear(qr.float(), numerics.dense_weight(indexer.wq_b)).view(-1, heads, dim)
    norm = indexer.k_norm
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6))
    key = torch.nn.functional.linear(x, indexer.wk.weight.float())
    k = torch.nn.functional.layer_norm(key, (dim,), norm.weight.float(), norm.bias.float(), eps)
    w = torch.nn.functional.linear(x, indexer.weights_proj.weight.float()) * heads**-0.5
    q_pe, q_nope = q.split([rope_dim, dim - rope_dim], dim=-1)
    k_pe, k_nope = k.split([rope_dim, dim - rope_dim], dim=-1)
    q_pe, k_pe = indexer.rotary_emb(position_ids, [q_pe.contiguous(), k_pe.unsqueeze(1).contiguous()])
    return torch.cat([q_pe, q_nope], -1), torch.cat([k_pe[:, 0, :], k_nope], -1), w
