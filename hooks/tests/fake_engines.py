"""Stand-ins for the serving engines' DSA indexers, for the adapters' tests.

Each reproduces, from the upstream source the adapter names, the module path, the class,
the hooked methods' signatures, the attributes the adapter reads and the shapes, dtypes
and layout of what flows through them (FP8 q/k with ue8m0 scales, weights with q_scale,
D^-0.5 and H^-0.5 folded in, int32 top-k with -1 padding, request-local positions). The
production math is the engines' definition on CPU: FP8 codes from PyTorch's casts, the
folded logits product in fp32, torch.topk per request.
"""

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from shadowtrace_hooks import numerics
from torch import nn

D, H, HIDDEN, Q_LORA, ROPE, TOPK = 128, 4, 64, 32, 64, 2048


class Rope(nn.Module):
    """The engines' rotary module: `forward_native(positions, q, k)` (vLLM, SGLang) and
    TensorRT-LLM's `forward(position_ids, [q, k])`; NeoX or interleaved pairs."""

    def __init__(self, neox: bool) -> None:
        super().__init__()
        self.is_neox_style = self.is_neox = neox
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, ROPE, 2).float() / ROPE))

    def cos_sin(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        shape = [angles.shape[0]] + [1] * (x.dim() - 2) + [ROPE // 2]
        return angles.cos().reshape(shape), angles.sin().reshape(shape)

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple:
        out = []
        for x in (q, k):
            cos, sin = self.cos_sin(positions, x)
            out.append(numerics.rope(x.float(), cos, sin, neox=self.is_neox).to(x.dtype))
        return out[0], out[1]

    def forward(self, position_ids: torch.Tensor, targets: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(self.forward_native(position_ids, targets[0], targets[1]))


def init_weights(module: nn.Module, seed: int) -> None:
    """Weights that spread the indexer's scores as a trained model's are."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0 / p.shape[1] ** 0.5)


def inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    qr = torch.randn(tokens, Q_LORA, generator=gen).to(torch.bfloat16)
    return x, qr


def topk_rows(scores: torch.Tensor, first_pos: int, out: torch.Tensor) -> None:
    """Production top-k of one request's rows into `out` (-1 padded), causal."""
    q_pos = torch.arange(first_pos, first_pos + scores.shape[0])
    scores = scores.masked_fill(~numerics.causal_mask(q_pos, scores.shape[1]), float("-inf"))
    take = min(TOPK, scores.shape[1])
    values, idx = scores.topk(take, dim=-1)
    out[:, :take] = torch.where(torch.isfinite(values), idx, -1).to(torch.int32)


def register(monkeypatch: Any, name: str, **attrs: Any) -> ModuleType:
    """Puts a module and its parent packages into sys.modules for the test's duration."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            monkeypatch.setitem(sys.modules, parent, ModuleType(parent))
    module = ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


# --- TensorRT-LLM: tensorrt_llm/_torch/attention_backend/sparse/dsa/indexer.py @ 047098b7 ---------


class TrtllmIndexer(nn.Module):
    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.n_heads, self.head_dim, self.rope_dim, self.index_topk = (
            layer_idx,
            H,
            D,
            ROPE,
            TOPK,
        )
        self.wq_b = nn.Linear(Q_LORA, H * D, bias=False)
        self.wk = nn.Linear(HIDDEN, D, bias=False)  # fp32, as TensorRT-LLM keeps it
        self.k_norm = nn.LayerNorm(D, eps=1e-6)
        self.weights_proj = nn.Linear(HIDDEN, H, bias=False)
        self.rotary_emb = Rope(neox=False)
        init_weights(self, seed=100 + layer_idx)
        self.wq_b.to(torch.bfloat16)
        self.k_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def pre_indexer_proj(self, qr, hidden_states, position_ids):
        q = self.wq_b(qr).view(-1, H, D)
        k = self.k_norm(self.wk(hidden_states.float())).to(torch.bfloat16)
        q_pe, q_nope = q.split([ROPE, D - ROPE], dim=-1)
        k_pe, k_nope = k.split([ROPE, D - ROPE], dim=-1)
        q_pe, k_pe = self.rotary_emb(position_ids, [q_pe, k_pe.unsqueeze(1)])
        q8, q_scale = numerics.quantize_rows(torch.cat([q_pe, q_nope], -1), amax_clamp=1e-12)
        k8, k_scale = numerics.quantize_rows(torch.cat([k_pe[:, 0], k_nope], -1), amax_clamp=1e-12)
        weights = self.weights_proj(hidden_states.float()) * q_scale.squeeze(-1) * D**-0.5 * H**-0.5
        return q8, k8, k_scale, weights, q_scale.unsqueeze(-1)

    def forward_from_projected(self, metadata, hidden_states, indexer_intermediates, is_generation=None):
        q8, k8, k_scale, weights, _ = indexer_intermediates
        first = metadata.num_contexts if is_generation else 0
        out = torch.full((hidden_states.shape[0], TOPK), -1, dtype=torch.int32)
        row = 0
        for i in range(first, metadata.num_seqs if is_generation is not False else metadata.num_contexts):
            rid, n = metadata.request_ids[i], int(metadata.seq_lens[i])
            cached = metadata.kv_cache_params.num_cached_tokens_per_seq[i]
            prev8, prev_s = self.k_cache.get(rid, (k8[:0], k_scale[:0]))
            keys8, keys_s = torch.cat([prev8, k8[row : row + n]]), torch.cat([prev_s, k_scale[row : row + n]])
            self.k_cache[rid] = (keys8, keys_s)
            q_pos = torch.arange(cached, cached + n)
            scores = numerics.folded_scores(
                q8[row : row + n], keys8, keys_s.reshape(-1), weights[row : row + n], q_pos
            )
            topk_rows(scores, cached, out[row : row + n])
            row += n
        return out


def trtllm_metadata(requests: list[tuple[int, int, int]], contexts: int) -> SimpleNamespace:
    """requests: (request id, new tokens, cached tokens), context requests first."""
    seq_lens = torch.tensor([n for _, n, _ in requests])
    return SimpleNamespace(
        num_contexts=contexts,
        num_seqs=len(requests),
        num_ctx_tokens=int(seq_lens[:contexts].sum()),
        num_tokens=int(seq_lens.sum()),
        seq_lens=seq_lens,
        request_ids=[r for r, _, _ in requests],
        kv_cache_params=SimpleNamespace(num_cached_tokens_per_seq=[c for _, _, c in requests]),
    )


# --- SGLang: python/sglang/srt/layers/attention/dsa/dsa_indexer.py @ 00d38808 -----------------------


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    return (x.float() @ numerics.hadamard(D)).to(x.dtype)


class SglangIndexer(nn.Module):
    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id, self.n_heads, self.head_dim, self.rope_head_dim, self.index_topk = (
            layer_id,
            H,
            D,
            ROPE,
            TOPK,
        )
        self.softmax_scale = D**-0.5
        self.wq_b = nn.Linear(Q_LORA, H * D, bias=False)
        self.wk = nn.Linear(HIDDEN, D, bias=False)
        self.weights_proj = nn.Linear(HIDDEN, H, bias=False)
        self.k_norm = nn.LayerNorm(D, eps=1e-6)
        self.rotary_emb = Rope(neox=True)
        init_weights(self, seed=200 + layer_id)
        for m in (self.wq_b, self.wk, self.weights_proj):
            m.to(torch.bfloat16)

    def _get_q_k_bf16(self, q_lora, x, positions, enable_dual_stream, forward_batch):
        query = self.wq_b(q_lora).view(-1, H, D)
        key = self.k_norm(self.wk(x).float()).to(torch.bfloat16)
        q_rope, k_rope = self.rotary_emb.forward_native(positions, query[..., :ROPE], key[..., :ROPE])
        query = torch.cat([q_rope, query[..., ROPE:]], -1)
        key = torch.cat([k_rope, key[..., ROPE:]], -1)
        return hadamard_rotate(query), hadamard_rotate(key), None

    def _get_logits_head_gate(self, x, q_scale):
        weights = self.weights_proj(x).float() * H**-0.5
        return weights.unsqueeze(-1) * q_scale * self.softmax_scale

    def forward_cuda(self, x, q_lora, positions, forward_batch, layer_id, return_indices=True):
        query, key, _ = self._get_q_k_bf16(q_lora, x, positions, False, forward_batch)
        q8, q_scale = numerics.quantize_rows(query, amax_clamp=1e-4)
        k8, k_scale = numerics.quantize_rows(key, amax_clamp=1e-4)
        weights = self._get_logits_head_gate(x, q_scale).squeeze(-1)
        out = torch.full((x.shape[0], TOPK), -1, dtype=torch.int32)
        row = 0
        for n in forward_batch.extend_seq_lens_cpu:
            rows = slice(row, row + n)
            q_pos = torch.arange(n)
            scores = numerics.folded_scores(
                q8[rows], k8[rows], k_scale[rows].reshape(-1), weights[rows], q_pos
            )
            topk_rows(scores, 0, out[rows])
            row += n
        return out


def sglang_batch(lengths: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        req_pool_indices=torch.arange(len(lengths)) + 7,
        forward_mode=SimpleNamespace(is_decode=lambda: False),
        extend_seq_lens_cpu=lengths,
        extend_prefix_lens_cpu=[0] * len(lengths),
        seq_lens_cpu=torch.tensor(lengths),
    )


# --- vLLM: deepseek_v2.py @ 002d6073, sparse_attn_indexer.py @ 006475fe ----------------------------

FORWARD_CONTEXT = SimpleNamespace(attn_metadata=None)


class SparseAttnIndexer(nn.Module):
    def __init__(self, k_cache: Any, topk_indices_buffer: torch.Tensor) -> None:
        super().__init__()
        self.k_cache, self.topk_indices_buffer = k_cache, topk_indices_buffer

    def forward(self, hidden_states, q_quant, k, weights):
        return self.forward_cuda(hidden_states, q_quant, k, weights)

    def forward_cuda(self, hidden_states, q_quant, k, weights):
        meta = FORWARD_CONTEXT.attn_metadata[self.k_cache.prefix]
        k8, k_scale = numerics.quantize_rows(k, amax_clamp=1e-4)
        out = self.topk_indices_buffer
        out[: hidden_states.shape[0]] = -1
        for chunk in meta.prefill.chunks:
            ks = chunk.cu_seqlen_ks
            for start in torch.unique(ks).tolist():
                rows = (ks == start).nonzero().flatten()
                r0, n = int(rows[0]), len(rows)
                keys = slice(start, start + n)  # prefix-free prefill: a request's keys are its rows
                scores = numerics.folded_scores(
                    q_quant[r0 : r0 + n],
                    k8[keys],
                    k_scale[keys].reshape(-1),
                    weights[r0 : r0 + n],
                    torch.arange(n),
                )
                topk_rows(scores, 0, out[r0 : r0 + n])
        return out


class VllmIndexer(nn.Module):
    def __init__(self, layer: int, buffer: torch.Tensor) -> None:
        super().__init__()
        self.prefix = f"model.layers.{layer}.self_attn.indexer"
        self.n_head, self.head_dim, self.rope_dim, self.topk_tokens = H, D, ROPE, TOPK
        self.wq_b = nn.Linear(Q_LORA, H * D, bias=False)
        self.wk_weights_proj = nn.Linear(HIDDEN, D + H, bias=False)
        self.k_norm = nn.LayerNorm(D, eps=1e-6)
        init_weights(self, seed=300 + layer)
        for m in (self.wq_b, self.wk_weights_proj):
            m.to(torch.bfloat16)
        self.k_cache = SimpleNamespace(prefix=f"{self.prefix}.k_cache")
        self.indexer_op = SparseAttnIndexer(self.k_cache, buffer)

    def forward(self, hidden_states, qr, positions, rotary_emb):
        q = self.wq_b(qr).view(-1, H, D)
        kw = self.wk_weights_proj(hidden_states)
        k, weights = self.k_norm(kw[:, :D].float()).to(torch.bfloat16), kw[:, D:]
        q_pe, k_pe = rotary_emb.forward_native(positions, q[..., :ROPE], k[..., :ROPE].unsqueeze(1))
        q = torch.cat([q_pe, q[..., ROPE:]], -1)
        k = torch.cat([k_pe[:, 0], k[..., ROPE:]], -1)
        q8, q_scale = numerics.quantize_rows(q, amax_clamp=1e-10)
        weights = weights.float() * q_scale.squeeze(-1) * D**-0.5 * H**-0.5
        return self.indexer_op(hidden_states, q8, k, weights)


def vllm_metadata(prefix: str, lengths: list[int]) -> dict:
    ks = torch.cat([torch.full((n,), sum(lengths[:i])) for i, n in enumerate(lengths)])
    ke = torch.cat([torch.arange(1, n + 1) + sum(lengths[:i]) for i, n in enumerate(lengths)])
    chunk = SimpleNamespace(cu_seqlen_ks=ks, cu_seqlen_ke=ke)
    meta = SimpleNamespace(
        num_decodes=0, num_decode_tokens=0, num_prefills=len(lengths), num_prefill_tokens=sum(lengths),
        prefill=SimpleNamespace(chunks=[chunk]),
    )  # fmt: skip
    return {prefix: meta}
