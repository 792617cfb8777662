"""SGLang's DSA (formerly NSA) indexer, for GLM-5 and DeepSeek-V3.2.

Written against sgl-project/sglang `python/sglang/srt/layers/attention/dsa/dsa_indexer.py` at
commit 00d38808c8e941737ed0b6122faf54e1cc56c69a (the nsa/ path re-exports it; 0.5.x):

- `Indexer.forward_cuda(x, q_lora, positions, forward_batch, layer_id, return_indices)` ->
  top-k [T, index_topk] int32, -1 padded, or None. The indices are request-local positions
  only with SGLANG_DSA_FUSE_TOPK=0 (older name SGLANG_NSA_FUSE_TOPK); by default they are
  KV-pool slots, which this adapter refuses to record (counted as `topk_fused_not_recorded`);
- `Indexer._get_q_k_bf16(q_lora, x, positions, enable_dual_stream, forward_batch)` -> (query
  [T,H,128], key [T,128], ...) after RoPE and the Hadamard rotation, and
  `Indexer._get_logits_head_gate(x, q_scale)` -> weights [T,H,1] fp32 with H^-0.5, q_scale
  and D^-0.5 folded in: the `dequant` shadow quantizes q and k as `act_quant(., 128,
  "ue8m0")` does (amax clamp 1e-4) and scores them with the engine's own gates. The fused
  interleaved-RoPE path builds neither and has no Hadamard: there only `raw` runs.

`MultiPlatformOp` binds `forward_cuda` when an Indexer is built, so the adapter patches the
class as soon as the module is imported, before any model exists. Requests come from
`forward_batch.extend_seq_lens_cpu` / `extend_prefix_lens_cpu` (extend) or
`forward_batch.seq_lens_cpu` (decode), keyed by `forward_batch.req_pool_indices`. Run with
`--disable-cuda-graph`: captured steps are skipped and counted.
"""

import functools
import os
from typing import Any

import torch

from shadowtrace_hooks import numerics, session
from shadowtrace_hooks.adapters.engine import IndexerCall, Request, bind, check_signature, tracer_for

NAME = "sglang"
SUPPORTED = "SGLang with dsa/dsa_indexer.py as at 00d38808 (0.5.x; the nsa/ path re-exports it)"
MODULES = ("sglang.srt.layers.attention.dsa.dsa_indexer", "sglang.srt.layers.attention.nsa.nsa_indexer")
SIGNATURES = {
    "forward_cuda": ["self", "x", "q_lora", "positions", "forward_batch", "layer_id", "return_indices"],
    "_get_q_k_bf16": ["self", "q_lora", "x", "positions", "enable_dual_stream", "forward_batch"],
    "_get_logits_head_gate": ["self", "x", "q_scale"],
}
_STASH = "_shadowtrace_qk"


def fused_topk() -> bool:
    """Whether SGLang returns KV-pool slots instead of positions (its default)."""
    for name in ("SGLANG_DSA_FUSE_TOPK", "SGLANG_NSA_FUSE_TOPK"):
        if name in os.environ:
            return os.environ[name].strip().lower() not in ("0", "false", "no", "off")
    return True


def install(module: Any) -> None:
    cls = module.Indexer
    if getattr(cls, "_shadowtrace_patched", False):
        return
    for method, expected in SIGNATURES.items():
        check_signature(cls, method, expected, SUPPORTED)
    forward_cuda, get_q_k, head_gate = cls.forward_cuda, cls._get_q_k_bf16, cls._get_logits_head_gate

    @functools.wraps(get_q_k)
    def traced_get_q_k(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = get_q_k(self, *args, **kwargs)
        if session.current() is not None and not session.capturing():
            self.__dict__[_STASH] = {"query": out[0].detach().clone(), "key": out[1].detach().clone()}
        return out

    @functools.wraps(head_gate)
    def traced_head_gate(self: Any, x: Any, q_scale: Any) -> Any:
        out = head_gate(self, x, q_scale)
        stash = self.__dict__.get(_STASH)
        if stash is not None and session.current() is not None:
            stash["weights"] = out.detach().clone()
        return out

    @functools.wraps(forward_cuda)
    def traced_forward_cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.__dict__.pop(_STASH, None)
        out = forward_cuda(self, *args, **kwargs)
        sess = session.current()
        if sess is not None and out is not None:
            if session.capturing():
                sess.count("captures_skipped_cuda_graph")
            elif fused_topk():
                sess.count("topk_fused_not_recorded")
            else:
                bound = bind(forward_cuda, (self, *args), kwargs)
                sess.guarded("sglang:indexer", None, _record, sess, self, bound, out)
        return out

    cls.forward_cuda, cls._get_q_k_bf16, cls._get_logits_head_gate = (
        traced_forward_cuda,
        traced_get_q_k,
        traced_head_gate,
    )
    cls._shadowtrace_patched = True


def _requests(batch: Any) -> list[Request]:
    keys = [f"sglang-{int(i)}" for i in batch.req_pool_indices.tolist()]
    if batch.forward_mode.is_decode():
        totals = [int(v) for v in batch.seq_lens_cpu]
        return [Request(k, i, 1, t - 1, t) for i, (k, t) in enumerate(zip(keys, totals, strict=True))]
    out, start = [], 0
    for key, new, prefix in zip(keys, batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu, strict=True):
        out.append(Request(key, start, int(new), int(prefix), int(new) + int(prefix)))
        start += int(new)
    return out


def _record(sess: session.Session, indexer: Any, bound: dict, out: torch.Tensor) -> None:
    requests = _requests(bound["forward_batch"])
    rows = sum(r.rows for r in requests)
    x = bound["x"][0] if isinstance(bound["x"], tuple) else bound["x"]
    x, q_lora, positions = x[:rows].detach(), bound["q_lora"][:rows].detach(), bound["positions"][:rows]
    fp8 = None
    stash = indexer.__dict__.pop(_STASH, None)
    if stash is not None and "weights" in stash:
        q8, _ = numerics.quantize_rows(stash["query"][:rows], scale_format="ue8m0", amax_clamp=1e-4)
        k8, k_scale = numerics.quantize_rows(stash["key"][:rows], scale_format="ue8m0", amax_clamp=1e-4)
        fp8 = (q8, k8, k_scale.reshape(-1), stash["weights"][:rows].reshape(rows, -1))
    call = IndexerCall(
        layer=bound["layer_id"],
        k=indexer.index_topk,
        prod_topk=out[:rows].clone(),
        requests=requests,
        fp8=fp8,
        raw=functools.partial(_raw, indexer, x, q_lora, positions),
    )
    tracer_for(sess, NAME, "sglang", indexer.index_topk).record(call)


def _project(indexer: Any, which: str, x: torch.Tensor) -> torch.Tensor:
    """wk(x) or weights_proj(x) in fp32, from the separate layers or the fused one."""
    fused = getattr(indexer, "wk_weights_proj", None)
    if fused is not None:
        weight = numerics.dense_weight(fused)
        weight = weight[: indexer.head_dim] if which == "wk" else weight[indexer.head_dim :]
    else:
        weight = numerics.dense_weight(indexer.wk if which == "wk" else indexer.weights_proj)
    return torch.nn.functional.linear(x.float(), weight)


def _raw(indexer: Any, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor) -> tuple:
    heads, dim, rope_dim = indexer.n_heads, indexer.head_dim, indexer.rope_head_dim
    q = torch.nn.functional.linear(q_lora.float(), numerics.dense_weight(indexer.wq_b)).view(-1, heads, dim)
    norm = indexer.k_norm
    key = _project(indexer, "wk", x)
    if hasattr(norm, "bias") and norm.bias is not None:
        k = torch.nn.functional.layer_norm(key, (dim,), norm.weight.float(), norm.bias.float(), norm.eps)
    else:  # RMSNorm when config.index_k_norm_type == "rms"
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        k = key * torch.rsqrt(key.pow(2).mean(-1, keepdim=True) + eps) * norm.weight.float()
    q_pe, k_pe = indexer.rotary_emb.forward_native(
        positions, q[..., :rope_dim].contiguous(), k[..., :rope_dim].contiguous()
    )
    q = torch.cat([q_pe.reshape(-1, heads, rope_dim), q[..., rope_dim:]], -1)
    k = torch.cat([k_pe.reshape(-1, rope_dim), k[..., rope_dim:]], -1)
    w = _project(indexer, "weights", x) * heads**-0.5
    return q, k, w
