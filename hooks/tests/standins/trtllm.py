"""TensorRT-LLM stand-in: the PyTorch backend's DSA indexer and the model around it, written
from NVIDIA/TensorRT-LLM as stored copies of these files show it:

- `_torch/attention_backend/sparse/dsa/indexer.py` @047098b74c51f488abcfcd72f7d4a988a56442f6
  and `_torch/attention/backends/sparse/dsa/indexer.py` @0b228a79d04ae2f7de4b79db495f82dd8e3f7ee0:
  `Indexer` (attributes, `pre_indexer_proj`, `_qk_projection_and_rope`, `_prep_q_or_k`,
  `_weight_scale`, `_update_k_cache`, `forward_from_projected`, `sparse_attn_indexer` with
  its phase rows and dense short-sequence skip); `wk`/`weights_proj` fp32, or the model
  dtype under TRTLLM_DSA_INDEXER_BF16=1 on the new path only;
- `dsa/module.py` @047098b7 / @2d7f402e: `forward_dsa_proj` (the whole padded batch, Op 1)
  and `_forward_dsa_attn` (slices to num_tokens, `_update_k_cache` once, then the context
  and the generation prediction); `dsa/backend.py` @00be09f7 `sparse_attn_predict`;
- `attention/rotary_embedding.py` @047098b7: `RotaryEmbedding`, whose two-target call is
  flashinfer's in-place RoPE on `position_ids.view(-1)` (here refusing fp32, as a half-only
  kernel does); `RopeEmbeddingUtils.create_sinusoidal_positions_yarn` for YaRN tables;
- `modules/layer_norm.py` @0a871d39: `LayerNorm` (`variance_epsilon`, no `eps`);
- `modules/linear.py` `FP8BlockScalesLinearMethod` (SM90): `weight` e4m3 with `weight_scale`
  [ceil(N/128), ceil(K/128)] fp32 (no `weight_scale_inv`), activations quantized 1x128;
- `models/modeling_deepseekv3.py` @047098b7: `DeepseekV3ForCausalLM(model_config)` (which
  rewrites GLM's model_type to deepseek_v32) and `GlmMoeDsaForCausalLM`, the registry;
- `attention/backends/interface.py` @1262edbc (`AttentionMetadata`) and `_torch/metadata.py`
  (`KVCacheParams`): the model engine keeps one metadata object, assigns a new
  `KVCacheParams` and calls `prepare()` every step; position_ids are `[1, T_pad]` int32.

Production numerics are written here from those definitions: `fused_cat_fp8` (cat pe|nope,
amax clamped at 1e-12, ue8m0 by adding one to the exponent when the mantissa is non-zero,
codes from multiplying by the reciprocal scale), weights = (x.W_wp in fp32) * q_scale *
D^-0.5 * H^-0.5, DeepGEMM logits (`common.mqa_logits`) and the request-local top-k
(`common.topk_positions`). Not reproduced: TF32 GEMMs (fp32 here), the exact kernel of
`fp8_quantize_1x128` (fp32 scales amax/448 assumed), the radix top-k's tie order.

Register the stand-in before tracing starts (`register`, then `traced.start`): its modules
go straight into sys.modules, as if the engine had imported them.
"""

import enum
import math
import os
import sys
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from standins import common

H, D, ROPE, HIDDEN, Q_LORA, TOPK = 4, 128, 64, 256, 256, 2048
VOCAB, MAX_POSITIONS, BLOCK = 4096, 8192, 128
VERSION = "1.3.0rc0+standin"
OLD = "tensorrt_llm._torch.attention_backend.sparse.dsa.indexer"
NEW = "tensorrt_llm._torch.attention.backends.sparse.dsa.indexer"
MODELING = "tensorrt_llm._torch.models.modeling_deepseekv3"
CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 1


def glm5_config(layers: int = 2) -> SimpleNamespace:
    """A GLM-5 config.json as TensorRT-LLM's loader holds it (indexer RoPE interleaved)."""
    return SimpleNamespace(
        architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", num_hidden_layers=layers,
        hidden_size=HIDDEN, q_lora_rank=Q_LORA, qk_rope_head_dim=ROPE, index_n_heads=H,
        index_head_dim=D, index_topk=TOPK, indexer_rope_interleave=True,
        max_position_embeddings=202752, rope_theta=1_000_000.0, rope_scaling=None,
        _name_or_path="standin/GLM-5",
    )  # fmt: skip


def deepseek_v32_config(layers: int = 1) -> SimpleNamespace:
    """A DeepSeek-V3.2 config.json (indexer RoPE half-split, YaRN)."""
    return SimpleNamespace(
        architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", num_hidden_layers=layers,
        hidden_size=HIDDEN, q_lora_rank=Q_LORA, qk_rope_head_dim=ROPE, index_n_heads=H,
        index_head_dim=D, index_topk=TOPK, max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        _name_or_path="standin/DeepSeek-V3.2",
    )  # fmt: skip


# --- _torch/metadata.py, attention/backends/interface.py, dsa/metadata.py --------------------


@dataclass
class KVCacheParams:
    use_cache: bool
    num_cached_tokens_per_seq: list[int] | None = None
    block_ids_per_seq: list | None = None
    host_max_attention_window_sizes: torch.Tensor | None = None
    host_sink_token_length: torch.Tensor | None = None
    num_extra_kv_tokens: int | None = 0


class KCache:
    """The indexer's FP8 K cache of every layer, by sequence (the engine's block tables)."""

    def __init__(self) -> None:
        self.layers: dict[int, dict[Any, tuple[torch.Tensor, torch.Tensor]]] = {}

    def layer(self, index: int) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
        return self.layers.setdefault(index, {})

    def fork(self, source: Any, target: Any) -> None:
        for cache in self.layers.values():
            cache[target] = cache[source]


class DSAtrtllmAttentionMetadata:
    """One object for every step, as the model engine keeps it."""

    def __init__(self, kv_cache_manager: KCache, sparse_params: SimpleNamespace) -> None:
        self.kv_cache_manager, self.sparse_params = kv_cache_manager, sparse_params
        self._seq_lens: torch.Tensor | None = None
        self._num_contexts = 0
        self.request_ids: list[int] | None = None
        self.prompt_lens: list[int] | None = None
        self.kv_cache_params: KVCacheParams | None = None
        self.is_cuda_graph = False
        self.in_mtp_draft_loop = False
        self.cuda_graph_buffers: dict | None = None
        self.enable_indexer_skip = sparse_params.skip_indexer_for_short_seqs
        self.skip_indexer_for_ctx_reqs = self.skip_indexer_for_gen_reqs = False
        self.sequences: list[Any] = []  # the cache's keys per sequence (block tables, here)
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def seq_lens(self) -> torch.Tensor | None:
        return self._seq_lens

    @seq_lens.setter
    def seq_lens(self, value: torch.Tensor) -> None:
        self._seq_lens = value

    @property
    def num_contexts(self) -> int:
        return self._num_contexts

    @num_contexts.setter
    def num_contexts(self, value: int) -> None:
        self._num_contexts = value

    @property
    def num_seqs(self) -> int:
        assert self._seq_lens is not None
        return self._seq_lens.shape[0]

    @property
    def num_generations(self) -> int:
        return self.num_seqs - self._num_contexts

    @property
    def num_ctx_tokens(self) -> int:
        assert self._seq_lens is not None
        return int(self._seq_lens[: self._num_contexts].sum())

    @property
    def num_tokens(self) -> int:
        assert self._seq_lens is not None
        return int(self._seq_lens.sum())

    def prepare(self) -> None:
        """DSAtrtllmAttentionMetadata.prepare_for_skip_indexer: dense top-k for a phase whose
        longest KV fits in index_topk."""
        assert self._seq_lens is not None
        assert self.kv_cache_params is not None
        cached = torch.tensor(self.kv_cache_params.num_cached_tokens_per_seq, dtype=torch.int32)
        kv_lens = cached + self._seq_lens
        ctx, gen = kv_lens[: self.num_contexts], kv_lens[self.num_contexts :]
        topk = self.sparse_params.index_topk
        self.skip_indexer_for_ctx_reqs = bool(self.enable_indexer_skip and len(ctx) and ctx.max() <= topk)
        self.skip_indexer_for_gen_reqs = bool(self.enable_indexer_skip and len(gen) and gen.max() <= topk)

    def get_empty(
        self, buffers: Any, shape: tuple[int, int], cache_name: str, dtype: torch.dtype, capture_graph: bool
    ) -> torch.Tensor:
        """A buffer kept by name and reused for every layer, as the engine's is."""
        buffer = self._buffers.get(cache_name)
        if buffer is None or buffer.shape[0] < shape[0]:
            buffer = self._buffers[cache_name] = torch.empty(max(shape[0], 1), shape[1], dtype=dtype)
        return buffer[: shape[0]]


# --- flashinfer and attention/rotary_embedding.py ---------------------------------------------


def flashinfer_apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
    cos_sin_cache: torch.Tensor, is_neox: bool,
) -> None:  # fmt: skip
    """flashinfer's RoPE: rotates query [nnz, heads, R] and key [nnz, 1, R] in place, pairs
    (i, i + R/2) when is_neox, else (2i, 2i + 1); a half-precision-only kernel."""
    for name, x in (("query", query), ("key", key)):
        if x.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(f"flashinfer apply_rope: {name} must be float16 or bfloat16, got {x.dtype}")
        if x.shape[0] != positions.shape[0]:
            raise RuntimeError(
                f"flashinfer apply_rope: {name} has {x.shape[0]} rows, positions {positions.shape[0]}"
            )
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [nnz, R/2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (query, key):
        v = x.float()
        if is_neox:
            x1, x2 = v.chunk(2, dim=-1)
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = v[..., 0::2], v[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        x.copy_(out.to(x.dtype))


@dataclass
class RopeParams:
    """RopeParams.from_config, for default and YaRN rope."""

    dim: int
    theta: float
    scale_type: str
    scale: float = 1.0
    original_max_positions: int = 4096
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    max_positions: int = MAX_POSITIONS

    @classmethod
    def from_config(cls, config: SimpleNamespace) -> "RopeParams":
        scaling = getattr(config, "rope_scaling", None) or {}
        kind = scaling.get("type") or scaling.get("rope_type") or "none"
        params = cls(dim=config.qk_rope_head_dim, theta=config.rope_theta, scale_type=kind)
        if kind == "yarn":
            params.scale = scaling["factor"]
            params.original_max_positions = scaling["original_max_position_embeddings"]
            params.beta_fast, params.beta_slow = scaling["beta_fast"], scaling["beta_slow"]
            params.mscale, params.mscale_all_dim = scaling["mscale"], scaling.get("mscale_all_dim", 0.0)
        return params

    def table(self) -> torch.Tensor:
        """[max_positions, 2, dim/2] fp32: cos, then sin (computed in fp32, as the engine does)."""
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)
        factor = 1.0
        if self.scale_type == "yarn":
            inv_freq, factor = self._yarn()
        angles = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        return torch.stack([angles.cos() * factor, angles.sin() * factor], dim=1)

    def _yarn(self) -> tuple[torch.Tensor, float]:
        """RopeEmbeddingUtils.create_sinusoidal_positions_yarn."""

        def correction(rotations: float) -> float:
            return (self.dim * math.log(self.original_max_positions / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        def mscale(scale: float, m: float) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        low = max(math.floor(correction(self.beta_fast)), 0)
        high = min(math.ceil(correction(self.beta_slow)), self.dim - 1)
        high = high + 0.001 if low == high else high
        pos_freqs = self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)
        ramp = ((torch.arange(self.dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp
        inv_freq = 1.0 / (self.scale * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
        return inv_freq, mscale(self.scale, self.mscale) / mscale(self.scale, self.mscale_all_dim)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, rope_params: RopeParams, *, head_dim: int, is_neox: bool = True, inverse: bool = False
    ):
        super().__init__()
        self.rope_params, self.head_dim, self.is_neox, self.inverse = rope_params, head_dim, is_neox, inverse
        self.max_positions = rope_params.max_positions
        self.rotary_cos_sin = rope_params.table()
        self.calls = 0  # the test's count: the engine's own calls only, never the tracer's

    def forward(self, position_ids: torch.Tensor, targets: list[torch.Tensor]) -> list[torch.Tensor]:
        self.calls += 1
        q, k = targets
        flashinfer_apply_rope_with_cos_sin_cache_inplace(
            position_ids.view(-1), q, k, self.head_dim, self.rotary_cos_sin.view(self.max_positions, -1),
            self.is_neox,
        )  # fmt: skip
        return [q, k]


# --- modules/layer_norm.py, modules/linear.py, the fused FP8 kernels --------------------------


class LayerNorm(nn.Module):
    def __init__(
        self, *, hidden_size: int, eps: float, dtype: torch.dtype | None = None, device: Any = None,
        has_weights: bool = True, has_bias: bool = True, residual_in_fp32: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.variance_epsilon = eps
        self.residual_in_fp32 = residual_in_fp32

    def forward(self, hidden_states: torch.Tensor, residual: Any = ...) -> torch.Tensor:
        assert residual is ..., "the indexer's k_norm takes no residual"
        dtype = hidden_states.dtype
        out = F.layer_norm(hidden_states.float(), (hidden_states.shape[-1],), self.weight, self.bias,
                           self.variance_epsilon)  # fmt: skip
        return out.to(dtype)


def fp8_quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation codes and fp32 scales per 1x128 block (scale amax/448: assumed)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-10) / common.E4M3_MAX
    codes = (blocks / scale).clamp(-common.E4M3_MAX, common.E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(x.shape), scale.squeeze(-1)


class Linear(nn.Module):
    """modules/linear.py Linear: unquantized, or FP8 block scales (`weight_scale`)."""

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype, fp8: bool, seed: int):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        gen = torch.Generator().manual_seed(seed)
        dense = torch.randn(out_features, in_features, generator=gen) * 2.0 / in_features**0.5
        if not fp8:
            self.weight = nn.Parameter(dense.to(dtype), requires_grad=False)
            return
        blocks = dense.reshape(out_features // BLOCK, BLOCK, in_features // BLOCK, BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)) / common.E4M3_MAX  # [N/128, K/128]
        codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(dense.shape)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.input_scale = nn.Parameter(torch.tensor(1.0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != torch.float8_e4m3fn:
            return F.linear(x, self.weight)
        codes, scale = fp8_quantize_1x128(x)
        act = (codes.float().reshape(*x.shape[:-1], -1, BLOCK) * scale[..., None]).reshape(x.shape)
        w = self.weight.float().reshape(self.out_features // BLOCK, BLOCK, -1, BLOCK)
        w = (w * self.weight_scale[:, None, :, None]).reshape(self.weight.shape)
        return F.linear(act, w).to(torch.bfloat16)


def fused_cat_fp8(pe: torch.Tensor, nope: torch.Tensor, use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.ops.trtllm.fused_cat_fp8: [M, 128] e4m3 codes and [M, 1] fp32 scales."""
    x = torch.cat([pe, nope], dim=-1).float().reshape(-1, pe.shape[-1] + nope.shape[-1])
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / common.E4M3_MAX
    if use_ue8m0:
        bits = scale.view(torch.int32)
        exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        scale = ((exponent + (mantissa != 0).to(torch.int32)) << 23).view(torch.float32)
    codes = (x * scale.reciprocal()).clamp(-common.E4M3_MAX, common.E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


# --- dsa/indexer.py ----------------------------------------------------------------------------


class IndexerBase(nn.Module):
    """Indexer as at both commits; the two paths differ in `sparse_attn_indexer`'s
    parameters and the TRTLLM_DSA_INDEXER_BF16 switch (new path)."""

    bf16_switch = False

    def __init__(
        self, quant_config: Any, pos_embd_params: Any, mla_params: Any, skip_create_weights_in_init: bool,
        sparse_params: Any, dtype: torch.dtype | None, compress_ratio: int = 1, layer_idx: int = 0,
        aux_stream: Any = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.hidden_size, self.q_lora_rank = mla_params.hidden_size, mla_params.q_lora_rank
        self.rope_dim = mla_params.qk_rope_head_dim
        self.n_heads, self.head_dim = sparse_params.index_n_heads, sparse_params.index_head_dim
        self.index_topk = sparse_params.index_topk
        self.layer_idx, self.compress_ratio = layer_idx, compress_ratio
        seed = 100 * (layer_idx + 1)
        self.wq_b = Linear(
            self.q_lora_rank, self.n_heads * self.head_dim, dtype=torch.bfloat16, fp8=True, seed=seed
        )
        self._indexer_bf16 = self.bf16_switch and os.environ.get("TRTLLM_DSA_INDEXER_BF16", "0") == "1"
        wk_dtype = dtype if self._indexer_bf16 else torch.float32
        self.wk = Linear(self.hidden_size, self.head_dim, dtype=wk_dtype, fp8=False, seed=seed + 1)
        self.k_norm = LayerNorm(hidden_size=self.head_dim, eps=1e-6)
        gen = torch.Generator().manual_seed(seed + 2)
        with torch.no_grad():
            self.k_norm.weight.copy_(1 + 0.1 * torch.randn(self.head_dim, generator=gen))
            self.k_norm.bias.copy_(0.1 * torch.randn(self.head_dim, generator=gen))
        self.weights_proj = Linear(self.hidden_size, self.n_heads, dtype=wk_dtype, fp8=False, seed=seed + 3)
        self._fused_wk_wp_weight: torch.Tensor | None = None
        self.rotary_emb = RotaryEmbedding(
            pos_embd_params.rope, head_dim=self.rope_dim, is_neox=not sparse_params.indexer_rope_interleave
        )
        self.softmax_scale = self.head_dim**-0.5
        self.scale_fmt = "ue8m0"
        self.use_fp4 = sparse_params.indexer_k_dtype == "fp4"
        self.weight_scale_factor = self.softmax_scale * self.n_heads**-0.5
        self.mtp_index_share = sparse_params.mtp_index_share
        self.log: dict[tuple[Any, int], tuple[int, int, int]] = {}  # the test's record of production
        self.intermediates: list[torch.Tensor] = []

    def cache_derived_state(self) -> None:
        self._fused_wk_wp_weight = torch.cat([self.wk.weight.data, self.weights_proj.weight.data], dim=0)

    def post_load_weights(self) -> None:
        self.cache_derived_state()

    def _qk_projection_and_rope(
        self, qr: torch.Tensor, indexer_k: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        q = self.wq_b(qr)
        k = self.k_norm(indexer_k)
        q = q.view(-1, self.n_heads, self.head_dim)
        q_pe, q_nope = q.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k_pe, k_nope = k.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        q_pe, k_pe = self.rotary_emb(position_ids, [q_pe, k_pe.unsqueeze(1)])
        return q_pe, q_nope, k_pe[:, 0, :], k_nope

    def _prep_q_or_k(self, qk_pe: torch.Tensor, qk_nope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_cat_fp8(qk_pe, qk_nope, self.scale_fmt == "ue8m0")

    def _weight_scale(self, weights: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
        return weights * q_scale.squeeze(-1) * self.weight_scale_factor

    def pre_indexer_proj(
        self, qr: torch.Tensor, hidden_states: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        assert self._fused_wk_wp_weight is not None, "cache_derived_state() must be called before forward()"
        hidden_bf = getattr(hidden_states, "unquantized_hidden_states", hidden_states)
        if self._indexer_bf16:
            fused_out = F.linear(hidden_bf, self._fused_wk_wp_weight)
        else:
            fused_out = F.linear(hidden_bf.float(), self._fused_wk_wp_weight)
        indexer_k, weights = fused_out.split([self.head_dim, self.n_heads], dim=-1)
        indexer_k = indexer_k.to(hidden_bf.dtype)
        q_pe, q_nope, k_pe, k_nope = self._qk_projection_and_rope(qr, indexer_k, position_ids)
        q_fp8, q_scale = self._prep_q_or_k(q_pe, q_nope)
        k_fp8, k_scale = self._prep_q_or_k(k_pe, k_nope)
        q_fp8 = q_fp8.view(-1, self.n_heads, self.head_dim)
        q_scale = q_scale.view(-1, self.n_heads, 1)
        return q_fp8, k_fp8, k_scale, self._weight_scale(weights, q_scale), q_scale

    def _update_k_cache(
        self, k_fp8: torch.Tensor, k_scale: torch.Tensor, metadata: DSAtrtllmAttentionMetadata
    ) -> None:
        if metadata.kv_cache_manager is None:
            return
        cache = metadata.kv_cache_manager.layer(self.layer_idx)
        assert metadata.seq_lens is not None
        assert metadata.kv_cache_params is not None
        cached = metadata.kv_cache_params.num_cached_tokens_per_seq
        start = 0
        for key, n, past in zip(metadata.sequences, metadata.seq_lens.tolist(), cached, strict=True):
            old8, olds = cache.get(key, (k_fp8[:0], k_scale[:0]))
            assert old8.shape[0] >= past, f"the cache of {key} holds {old8.shape[0]} keys, not {past}"
            cache[key] = (
                torch.cat([old8[:past], k_fp8[start : start + n]]),
                torch.cat([olds[:past], k_scale[start : start + n]]),
            )
            start += n

    def _predict(
        self, metadata: DSAtrtllmAttentionMetadata, q_fp8: torch.Tensor, weights: torch.Tensor,
        seqs: range, out: torch.Tensor, dense: bool,
    ) -> None:  # fmt: skip
        """Rows of sequences `seqs` (q_fp8, weights and out start at the first one): DeepGEMM
        logits over each sequence's cached + new keys, top-k as request-local positions."""
        assert metadata.seq_lens is not None
        assert metadata.kv_cache_params is not None
        cache = metadata.kv_cache_manager.layer(self.layer_idx)
        row = 0
        for i in seqs:
            n, past = int(metadata.seq_lens[i]), metadata.kv_cache_params.num_cached_tokens_per_seq[i]
            key = metadata.sequences[i]
            q_pos = torch.arange(past, past + n)
            if dense:  # metadata.topk_indices_buffer: every visible key
                cols = torch.arange(self.index_topk)[None, :]
                rows = torch.where(cols <= q_pos[:, None], cols, -1).to(torch.int32)
            else:
                keys8, keys_scale = cache[key]
                ks, ke = torch.zeros(n, dtype=torch.long), q_pos + 1
                logits = common.mqa_logits(
                    q_fp8[row : row + n], weights[row : row + n], keys8[: past + n],
                    keys_scale[: past + n].reshape(-1), ks, ke,
                )  # fmt: skip
                rows = common.topk_positions(logits, ks, self.index_topk)
            out[row : row + n] = rows
            valid = rows.long().clamp(min=0) * (rows >= 0)
            prints = zip((rows >= 0).sum(1).tolist(), valid.sum(1).tolist(), (valid * valid).sum(1).tolist(),
                         strict=True)  # fmt: skip
            self.log.update(zip(((key, p) for p in q_pos.tolist()), prints, strict=True))
            row += n

    def _sparse_attn_indexer(
        self, metadata: DSAtrtllmAttentionMetadata, hidden_states: torch.Tensor, q_fp8: torch.Tensor,
        weights: torch.Tensor, is_generation: bool | None,
    ) -> torch.Tensor:  # fmt: skip
        contexts, gens = metadata.num_contexts, metadata.num_generations
        ctx_tokens = metadata.num_ctx_tokens
        gen_tokens = metadata.num_tokens - ctx_tokens
        if is_generation is None:
            has_prefill, has_decode = contexts > 0, gens > 0
            offset, name = ctx_tokens, "indexer_topk_out_buffer"
        else:
            has_prefill, has_decode = not is_generation and contexts > 0, is_generation and gens > 0
            offset = 0
            expected = gen_tokens if is_generation else ctx_tokens
            assert hidden_states.shape[0] == expected, f"{hidden_states.shape[0]} tokens, expected {expected}"
            name = "indexer_topk_out_buffer_gen" if is_generation else "indexer_topk_out_buffer_ctx"
        out = metadata.get_empty(
            metadata.cuda_graph_buffers, (hidden_states.shape[0], self.index_topk), cache_name=name,
            dtype=torch.int32, capture_graph=metadata.is_cuda_graph,
        )  # fmt: skip
        if has_prefill:
            self._predict(metadata, q_fp8, weights, range(contexts), out, metadata.skip_indexer_for_ctx_reqs)
        if has_decode:
            self._predict(
                metadata, q_fp8[offset:], weights[offset:], range(contexts, contexts + gens), out[offset:],
                metadata.skip_indexer_for_gen_reqs,
            )  # fmt: skip
        return out

    def forward_from_projected(
        self, metadata: DSAtrtllmAttentionMetadata, hidden_states: torch.Tensor,
        indexer_intermediates: list[torch.Tensor], is_generation: bool | None = None,
    ) -> torch.Tensor:  # fmt: skip
        if is_generation is None:
            phase_start, phase_end = 0, metadata.num_tokens
        elif is_generation:
            phase_start, phase_end = metadata.num_ctx_tokens, metadata.num_tokens
        else:
            phase_start, phase_end = 0, metadata.num_ctx_tokens
        self.intermediates = indexer_intermediates  # the test's view of what this step predicted from
        q_fp8, k_fp8, k_scale, weights, q_scale = indexer_intermediates
        return self.sparse_attn_indexer(
            metadata, hidden_states, q_fp8[phase_start:phase_end], k_fp8, k_scale,
            weights[phase_start:phase_end], q_scale=q_scale[phase_start:phase_end],
            is_generation=is_generation,
        )  # fmt: skip

    def forward(
        self, qr: torch.Tensor, hidden_states: torch.Tensor, metadata: DSAtrtllmAttentionMetadata,
        position_ids: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        q_fp8, k_fp8, k_scale, weights, q_scale = self.pre_indexer_proj(qr, hidden_states, position_ids)
        intermediates = [q_fp8, k_fp8, k_scale, weights, q_scale]
        self._update_k_cache(k_fp8, k_scale, metadata)
        return self.forward_from_projected(metadata, hidden_states, intermediates)


class IndexerOld(IndexerBase):
    """attention_backend/sparse/dsa/indexer.py @047098b7."""

    def sparse_attn_indexer(
        self, metadata: DSAtrtllmAttentionMetadata, hidden_states: torch.Tensor, q_fp8: torch.Tensor,
        k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor, use_custom_topk: bool = True,
        q_scale: torch.Tensor | None = None, is_generation: bool | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return self._sparse_attn_indexer(metadata, hidden_states, q_fp8, weights, is_generation)


class TopKImplementation(enum.StrEnum):
    """dsa/indexer.py @0b228a79: the top-k kernels `TopK` dispatches to."""

    CUDA_RADIX = "cuda_radix"
    CUTE_DSL_GVR = "cute_dsl_gvr"


class IndexerNew(IndexerBase):
    """attention/backends/sparse/dsa/indexer.py @0b228a79: with `Indexer.top_k`, whose decode
    and (with self-sampling) prefill implementation is Guess-Verify-Refine when
    `enable_heuristic_topk` is on (SM100 there; any device here), radix otherwise. The
    stand-in's selection is exact either way."""

    bf16_switch = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sparse_params = kwargs["sparse_params"] if "sparse_params" in kwargs else args[4]
        self._enable_heuristic_topk = bool(getattr(sparse_params, "enable_heuristic_topk", False))
        impl = (
            TopKImplementation.CUTE_DSL_GVR if self._enable_heuristic_topk else TopKImplementation.CUDA_RADIX
        )
        self.top_k = SimpleNamespace(prefill_implementation=impl, decode_implementation=impl)

    def sparse_attn_indexer(
        self, metadata: DSAtrtllmAttentionMetadata, hidden_states: torch.Tensor, q_fp8: torch.Tensor,
        k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
        q_scale: torch.Tensor | None = None, is_generation: bool | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return self._sparse_attn_indexer(metadata, hidden_states, q_fp8, weights, is_generation)


# --- dsa/backend.py, dsa/module.py, the MLA layer --------------------------------------------


class DSATrtllmAttention(nn.Module):
    """dsa/backend.py @29c0516a: a shared layer (`is_full_indexer_layer` False, GLM-5.2's
    `index_topk_pattern` "S") has no indexer and takes the top-k the last full layer left in
    the metadata (`shared_topk_indices`)."""

    def __init__(self, indexer: IndexerBase | None) -> None:
        super().__init__()
        self.indexer = indexer
        self.is_full_indexer_layer = indexer is not None

    def sparse_attn_predict(
        self, q: torch.Tensor, k: torch.Tensor | None, metadata: DSAtrtllmAttentionMetadata,
        forward_args: SimpleNamespace,
    ) -> tuple[torch.Tensor, None]:  # fmt: skip
        is_generation = forward_args.attention_input_type == "generation_only"
        shared = metadata.__dict__.setdefault("shared_topk_indices", {})
        if self.indexer is None:
            return shared[is_generation], None
        topk = self.indexer.forward_from_projected(
            metadata, q, forward_args.indexer_intermediates, is_generation=is_generation
        )
        shared[is_generation] = topk
        return topk, None


class MLA(nn.Module):
    """The DSA layer around the indexer: its normalized input (embedding rows standing in for
    the decoder's RMSNorm output) and q LoRA (a bf16 projection of it, RMS-normalized)."""

    def __init__(self, model_config: SimpleNamespace, layer_idx: int, indexer_cls: type) -> None:
        super().__init__()
        cfg, sparse = model_config.pretrained_config, model_config.sparse_attention_config
        self.layer_idx = layer_idx
        gen = torch.Generator().manual_seed(7000 + layer_idx)
        self.embed = torch.randn(VOCAB, cfg.hidden_size, generator=gen).to(torch.bfloat16)
        self.q_a = (torch.randn(cfg.q_lora_rank, cfg.hidden_size, generator=gen) / cfg.hidden_size**0.5).to(
            torch.bfloat16
        )
        mla_params = SimpleNamespace(hidden_size=cfg.hidden_size, q_lora_rank=cfg.q_lora_rank,
                                     qk_rope_head_dim=cfg.qk_rope_head_dim)  # fmt: skip
        indexer = None
        if getattr(cfg, "index_topk_pattern", "F" * (layer_idx + 1))[layer_idx] != "S":
            rope = SimpleNamespace(rope=RopeParams.from_config(cfg))
            indexer = indexer_cls(
                model_config.quant_config,
                rope,
                mla_params,
                False,
                sparse,
                torch.bfloat16,
                layer_idx=layer_idx,
            )
            indexer.post_load_weights()
        self.mqa = DSATrtllmAttention(indexer)
        self.proj_replayed = False  # Op 1 replayed from a captured graph: no Python hook runs

    def forward(
        self, position_ids: torch.Tensor, input_ids: torch.Tensor, attn_metadata: DSAtrtllmAttentionMetadata
    ) -> list[torch.Tensor]:
        hidden_states = self.embed[input_ids.long()]
        proj = forward_dsa_proj(self, position_ids, hidden_states, attn_metadata)
        return _forward_dsa_attn(self, proj[0], proj[4:], position_ids, attn_metadata)


def forward_dsa_proj(
    mla: MLA,
    position_ids: torch.Tensor,
    hidden_states: torch.Tensor,
    attn_metadata: DSAtrtllmAttentionMetadata,
) -> list[torch.Tensor]:
    """Op 1, on the whole padded batch: never sliced to num_tokens."""
    q = torch.zeros(hidden_states.shape[0], 8, dtype=torch.bfloat16)  # the MLA query: its rows matter here
    x = F.linear(hidden_states, mla.q_a).float()
    qr = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    indexer = mla.mqa.indexer
    if indexer is None:  # module.py @2d7f402e: a DSA "shared" layer projects no indexer q or k
        return [q, q, q, q]
    project = IndexerBase.pre_indexer_proj if mla.proj_replayed else indexer.pre_indexer_proj
    if mla.proj_replayed:
        intermediates = project(indexer, qr, hidden_states, position_ids)
    else:
        intermediates = project(qr, hidden_states, position_ids)
    return [q, q, q, q, *intermediates]


def _forward_dsa_attn(
    mla: MLA, q: torch.Tensor, indexer_intermediates: list[torch.Tensor], position_ids: torch.Tensor,
    attn_metadata: DSAtrtllmAttentionMetadata,
) -> list[torch.Tensor]:  # fmt: skip
    """Op 2: slices to num_tokens, writes the K cache once, then predicts the context rows
    and the generation rows in calls of their own. Returns copies of both outputs."""
    contexts, gens = attn_metadata.num_contexts, attn_metadata.num_generations
    ctx_tokens, tokens = attn_metadata.num_ctx_tokens, attn_metadata.num_tokens
    q = q[:tokens]
    intermediates = [t[:tokens] for t in indexer_intermediates]
    if mla.mqa.indexer is not None:  # a shared layer writes no index K
        mla.mqa.indexer._update_k_cache(intermediates[1], intermediates[2], attn_metadata)
    outputs = []
    for phase, rows, present in (("context_only", q[:ctx_tokens], contexts > 0),
                                 ("generation_only", q[ctx_tokens:], gens > 0)):  # fmt: skip
        if present:
            args = SimpleNamespace(attention_input_type=phase, indexer_intermediates=intermediates)
            topk, _ = mla.mqa.sparse_attn_predict(rows, None, attn_metadata, args)
            outputs.append(topk.clone())
    return outputs


# --- models/modeling_deepseekv3.py --------------------------------------------------------------


class CausalLMBase(nn.Module):
    """DeepseekV3ForCausalLM: its constructor and forward signatures @047098b7."""

    indexer_module = NEW

    def __init__(self, model_config: SimpleNamespace) -> None:
        super().__init__()
        if model_config.pretrained_config.model_type == "glm_moe_dsa":
            model_config.pretrained_config.model_type = "deepseek_v32"
        self.model_config, self.config = model_config, model_config.pretrained_config
        indexer_cls = model_config.indexer_cls or sys.modules[self.indexer_module].Indexer
        self.layers = nn.ModuleList(
            MLA(model_config, i, indexer_cls) for i in range(self.config.num_hidden_layers)
        )

    def forward(
        self, attn_metadata: DSAtrtllmAttentionMetadata, input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
        return_context_logits: bool = False, spec_metadata: Any = None, resource_manager: Any = None,
        **kwargs: Any,
    ) -> list[list[torch.Tensor]]:  # fmt: skip
        assert input_ids is not None
        assert position_ids is not None
        return [layer(position_ids, input_ids, attn_metadata) for layer in self.layers]


class DSAVanillaIndexer(IndexerNew):
    """vanilla_backend.py's standalone indexer: not an `Indexer`, so not hooked."""


def model_config(
    config: SimpleNamespace, *, interleave: bool | None = None, indexer_cls: type | None = None,
    heuristic_topk: bool = False,
) -> SimpleNamespace:  # fmt: skip
    """ModelConfig.from_pretrained: DeepSeekSparseAttentionConfig takes indexer_rope_interleave
    from config.json; `interleave` stands for an engine that gets it wrong."""
    rope_interleave = getattr(config, "indexer_rope_interleave", False) if interleave is None else interleave
    sparse = SimpleNamespace(
        index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim,
        index_topk=config.index_topk, indexer_rope_interleave=rope_interleave, indexer_k_dtype="fp8",
        skip_indexer_for_short_seqs=True, mtp_index_share=False, enable_heuristic_topk=heuristic_topk,
    )  # fmt: skip
    return SimpleNamespace(
        pretrained_config=config, sparse_attention_config=sparse,
        quant_config=SimpleNamespace(quant_algo="FP8_BLOCK_SCALES"), indexer_cls=indexer_cls,
    )  # fmt: skip


@dataclass
class StandIn:
    """The registered modules and their classes (fresh subclasses per test, so the adapter's
    patches never outlive it)."""

    indexer_module: ModuleType
    modeling: ModuleType
    path: str

    def build(self, config: SimpleNamespace, **options: Any) -> nn.Module:
        """The model the registry names for config.architectures[0]."""
        cls = self.modeling.MODEL_CLASS_MAPPING[config.architectures[0]]
        return cls(model_config(config, **options))


def register(monkeypatch: Any, path: str = NEW) -> StandIn:
    """Puts the indexer module (`path`: OLD or NEW) and the model module in sys.modules."""
    common.register(monkeypatch, "tensorrt_llm", __version__=VERSION)
    base = IndexerNew if path == NEW else IndexerOld
    indexer_cls = type("Indexer", (base,), {"__module__": path})
    indexer_module = common.register(
        monkeypatch, path, Indexer=indexer_cls, DSAtrtllmAttentionMetadata=DSAtrtllmAttentionMetadata
    )
    ds = type("DeepseekV3ForCausalLM", (CausalLMBase,), {"__module__": MODELING, "indexer_module": path})
    glm = type("GlmMoeDsaForCausalLM", (ds,), {"__module__": MODELING})
    mapping = {"DeepseekV3ForCausalLM": ds, "DeepseekV32ForCausalLM": ds, "GlmMoeDsaForCausalLM": glm}
    modeling = common.register(
        monkeypatch, MODELING, DeepseekV3ForCausalLM=ds, GlmMoeDsaForCausalLM=glm, MODEL_CLASS_MAPPING=mapping
    )
    return StandIn(indexer_module, modeling, path)


# --- the model engine -------------------------------------------------------------------------


@dataclass
class Executor:
    """The PyTorch backend's model engine, step by step: scheduled context chunks first, then
    generation requests; one metadata object reused, a new KVCacheParams per step."""

    model: nn.Module
    seed: int = 0
    pad_to: int = 8
    done: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    steps: int = 0  # engine steps run so far

    def __post_init__(self) -> None:
        sparse = self.model.model_config.sparse_attention_config
        self.metadata = DSAtrtllmAttentionMetadata(KCache(), sparse)
        self.gen = torch.Generator().manual_seed(self.seed)

    def add(self, request_id: int, length: int) -> None:
        """A request whose tokens (prompt and generated) are `length` distinct ids."""
        self.tokens[request_id] = torch.randperm(VOCAB, generator=self.gen)[:length]
        self.done[request_id] = 0

    def step(
        self, context: list[tuple[int, int]] = (), generation: list[int] = (), *,  # type: ignore[assignment]
        beams: int = 1, dummies: int = 0, replay_proj: bool = False, cuda_graph: bool = False,
    ) -> list[list[torch.Tensor]]:  # fmt: skip
        """One engine step: `context` (request id, chunk length), then `generation` request
        ids (each with `beams` sequences), then `dummies` CUDA-graph padding sequences."""
        md = self.metadata
        seqs: list[tuple[Any, int, int, int]] = [(rid, rid, n, self.done[rid]) for rid, n in context]
        request_ids = [rid for rid, _ in context]
        for rid in generation:
            # One id per request, not per beam, as the engine's generation loop appends them.
            request_ids.append(rid)
            for beam in range(beams):
                key = rid if beam == 0 else (rid, beam)
                if beam:
                    md.kv_cache_manager.fork(rid, key)
                seqs.append((rid, key, 1, self.done[rid]))
        seqs += [(CUDA_GRAPH_DUMMY_REQUEST_ID, ("dummy", i), 1, 0) for i in range(dummies)]
        request_ids += [CUDA_GRAPH_DUMMY_REQUEST_ID] * dummies
        md.seq_lens = torch.tensor([n for _, _, n, _ in seqs], dtype=torch.int32)
        md.request_ids = request_ids
        md.num_contexts = len(context)
        md.sequences = [key for _, key, _, _ in seqs]
        md.kv_cache_params = KVCacheParams(use_cache=True, num_cached_tokens_per_seq=[c for *_, c in seqs])
        md.is_cuda_graph = cuda_graph
        md.prepare()
        ids, positions = [], []
        for rid, _, n, past in seqs:
            source = self.tokens.get(rid, torch.zeros(n + past, dtype=torch.long))
            assert source.numel() >= past + n, f"request {rid} has {source.numel()} tokens, not {past + n}"
            ids.append(source[past : past + n])
            positions.append(torch.arange(past, past + n))
        pad = -len(torch.cat(ids)) % self.pad_to
        input_ids = torch.cat([*ids, torch.zeros(pad, dtype=torch.long)]).to(torch.int32)
        position_ids = torch.cat([*positions, torch.zeros(pad, dtype=torch.long)]).to(torch.int32)[None, :]
        for layer in self.model.layers:
            layer.proj_replayed = replay_proj
        with torch.inference_mode():
            out = self.model.forward(attn_metadata=md, input_ids=input_ids, position_ids=position_ids)
        for rid, n in context:
            self.done[rid] += n
        for rid in generation:
            self.done[rid] += 1
        self.steps += 1
        return out
