"""SGLang stand-in, written from the released wheels 0.5.8, 0.5.15, 0.5.22 and 0.5.23 (paths under
`python/sglang/srt/`):

- `layers/attention/nsa/nsa_indexer.py` (0.5.8) and `dsa/dsa_indexer.py` (0.5.13+, with the
  nsa path re-exporting it): `Indexer` with the exact signatures of `__init__`,
  `forward_cuda` (`use_cuda_graph` from 0.5.23), `_get_q_k_bf16` (a third element from 0.5.15),
  `_get_logits_head_gate` and `_fused_q_prepare_and_store` (0.5.15+), its attributes and
  its eager call sequence: the K-only short path, the fused GLM-5 path (0.5.15+: no Hadamard,
  neither helper), or `_get_q_k_bf16` -> `act_quant` -> K-cache store -> `_get_logits_head_gate`
  -> ragged (extend) or paged (decode) logits -> top-k transform;
- dispatch: `MultiPlatformOp` binds `forward_cuda` at construction (<= 0.5.15),
  `BaseFusedOp` on the first call (0.5.18+);
- `layers/layernorm.py` `LayerNorm` (only `variance_epsilon`, `use_bias`) and `RMSNorm`;
  `layers/rotary_embedding` `RotaryEmbedding` and `DeepseekScalingRotaryEmbedding`, whose
  `forward_native` broadcasts a 2-D key to [1, T, T, R] as upstream's does;
- `environ.py` `envs`: `SGLANG_NSA_FUSE_TOPK` (0.5.8), `SGLANG_DSA_FUSE_TOPK` with the old
  name as an alias (0.5.13-0.5.20), the new name alone (0.5.22+), parsed as `EnvBool`;
- `model_executor/forward_batch_info.py` `ForwardMode`, `ForwardBatch.init_new` (`rids`
  from 0.5.10; 0.5.8 builds from a ModelWorkerBatch holding `reqs`); `forward_context`
  (0.5.15+) or `forward_batch.attn_backend` (0.5.8);
- `models/deepseek_v2.py` `DeepseekV2ForCausalLM(config, quant_config, prefix)` building
  `layers.<i>.self_attn.indexer` (mutating the config's rope_scaling to `deepseek_yarn`), and
  the NextN draft model built as layer 0 under `model.decoder` without that __init__
  (`models/deepseek_nextn.py`); on 0.5.23 a prefill of at most index_topk keys runs dense MHA
  and asks the indexer for the K cache only (`forward_mha.py`, `return_indices=False`).

Production numerics are computed here from SGLang's algorithm, not from the hooks: block-FP8
weights, `act_quant` (amax clamp 1e-4, ue8m0 as exp2(ceil(log2(amax / 448)))), the
Hadamard of `sgl_kernel.hadamard_transform` (scale D^-0.5) as a butterfly, head gates
weights_proj(x) * H^-0.5 * q_scale * D^-0.5, DeepGEMM logits (`common.mqa_logits`) over the
request's keys read back from the FP8 index-K cache, and the top-k transform: request-local
positions, or KV-pool slots (`req_to_token`) when the top-k is fused.

`Engine` drives a scheduler's calls: requests with ids, `req_pool_indices` rows handed out
again after a request finishes, KV slots from a shuffled free list, EXTEND (chunked with
`extend_prefix_lens`), DECODE and MIXED batches, each a new ForwardBatch.
"""

import math
import os
import warnings
from dataclasses import dataclass, field, make_dataclass
from enum import Enum, auto
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from torch import nn

from standins.common import E4M3_MAX, mqa_logits, register, topk_positions

HEADS, HEAD_DIM, ROPE_DIM, HIDDEN, Q_LORA, TOPK, BLOCK = 4, 128, 64, 256, 128, 2048, 128
INDEXER_MODULES = {
    "dsa": "sglang.srt.layers.attention.dsa.dsa_indexer",
    "nsa": "sglang.srt.layers.attention.nsa.nsa_indexer",
}


@dataclass(frozen=True)
class Release:
    """What differs between the releases the stand-in reproduces."""

    version: str
    module: str  # where Indexer is defined ("nsa" up to 0.5.10, "dsa" after)
    fuse_topk: str  # "nsa" | "dsa_alias" | "dsa"
    rids: bool  # ForwardBatch.rids (0.5.10+)
    fusion: bool  # use_dsa_indexer_fusion, the fused GLM-5 path, 3-tuple _get_q_k_bf16 (0.5.15+)
    neox_param: bool  # Indexer(is_neox_style=...) (0.5.10+); 0.5.8 hard-codes NeoX
    config_param: bool  # Indexer(config=...) and RMSNorm k_norm (0.5.18+)
    lazy_dispatch: bool  # BaseFusedOp (0.5.18+)
    use_cuda_graph: bool  # forward_cuda(..., use_cuda_graph) (0.5.23)
    dense_mha_prefill: bool  # short prefills ask the indexer for K only (0.5.23 on H200)


RELEASES = {
    "0.5.8": Release("0.5.8", "nsa", "nsa", False, False, False, False, False, False, False),
    "0.5.15": Release("0.5.15", "dsa", "dsa_alias", True, True, True, False, False, False, False),
    "0.5.22": Release("0.5.22", "dsa", "dsa", True, True, True, True, True, False, False),
    "0.5.23": Release("0.5.23", "dsa", "dsa", True, True, True, True, True, True, True),
}


# --- environ.py ------------------------------------------------------------------------


class EnvField:
    def __init__(self, default: Any) -> None:
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def parse(self, value: str) -> Any:
        raise NotImplementedError

    def get(self) -> Any:
        value = os.getenv(self.name)
        if value is None:
            return self.default
        try:
            return self.parse(value)
        except ValueError as e:
            warnings.warn(f'Invalid value for {self.name}: {e}, using default "{self.default}"', stacklevel=2)
            return self.default

    def __bool__(self) -> bool:
        raise RuntimeError("Please use `envs.YOUR_FLAG.get()` instead of `envs.YOUR_FLAG`")


class EnvBool(EnvField):
    def parse(self, value: str) -> bool:
        value = value.lower()
        if value in ["true", "1", "yes", "y"]:
            return True
        if value in ["false", "0", "no", "n"]:
            return False
        raise ValueError(f'"{value}" is not a valid boolean value')


class EnvBoolWithAlias(EnvBool):
    """0.5.13-0.5.20: the old name is read (and copied to the new one) only when the new
    one is unset."""

    def __init__(self, default: Any, deprecated_name: str) -> None:
        super().__init__(default)
        self.deprecated_name = deprecated_name

    def get(self) -> Any:
        if os.getenv(self.name) is None:
            fallback = os.getenv(self.deprecated_name)
            if fallback is not None:
                os.environ[self.name] = fallback
        return super().get()


def _envs(kind: str) -> Any:
    if kind == "nsa":

        class Envs:
            SGLANG_NSA_FUSE_TOPK = EnvBool(True)

    elif kind == "dsa_alias":

        class Envs:  # type: ignore[no-redef]
            SGLANG_DSA_FUSE_TOPK = EnvBoolWithAlias(True, deprecated_name="SGLANG_NSA_FUSE_TOPK")
            SGLANG_DISABLE_DSA_INDEXER_FUSION = EnvBool(False)

    else:

        class Envs:  # type: ignore[no-redef]
            SGLANG_DSA_FUSE_TOPK = EnvBool(True)
            SGLANG_DISABLE_DSA_INDEXER_FUSION = EnvBool(False)

    return Envs()


# --- numerics written from SGLang's kernels ---------------------------------------------


def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt: str | None = None) -> tuple:
    """`act_quant_triton.act_quant`: per 1 x block amax clamped to 1e-4; with a scale format,
    the scale is exp2(ceil(log2(amax / 448))); codes clamp(x / scale) in e4m3."""
    *lead, n = x.shape
    blocks = x.float().reshape(*lead, n // block_size, block_size)
    amax = blocks.abs().amax(dim=-1).clamp_min(1e-4)
    if scale_fmt is not None:
        scale = torch.exp2(torch.ceil(torch.log2(amax * (1.0 / E4M3_MAX))))
    else:
        scale = amax * (1.0 / E4M3_MAX)
    y = (blocks / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return y.reshape(*lead, n), scale


def hadamard_transform(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`sgl_kernel.hadamard_transform`: the Walsh-Hadamard butterfly over the last
    dimension in fp32, times `scale`, back in the input's dtype."""
    n = x.shape[-1]
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.reshape(-1, n // (2 * h), 2, h)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        y = y.reshape(-1, n)
        h *= 2
    return (y * scale).reshape(x.shape).to(x.dtype)


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    assert x.dtype == torch.bfloat16
    return hadamard_transform(x, scale=x.size(-1) ** -0.5)


def _block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's 128 x 128 block-FP8 weight and its `weight_scale_inv`."""
    out, inp = weight.shape
    blocks = weight.reshape(out // BLOCK, BLOCK, inp // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    codes = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(out, inp), scale


class ReplicatedLinear(nn.Module):
    """`layers/linear.py` ReplicatedLinear: returns (output, bias). With the FP8 block
    quant config the weight is e4m3 with `weight_scale_inv`; the product is taken on the
    dequantized weight in the activation's dtype."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, quant_config: Any = None,
        params_dtype: torch.dtype | None = None, prefix: str = "",
    ) -> None:  # fmt: skip
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        dtype = params_dtype or torch.bfloat16
        self.weight = nn.Parameter(torch.zeros(output_size, input_size, dtype=dtype), requires_grad=False)
        self.quant = quant_config == "fp8"
        if self.quant:
            self.weight = nn.Parameter(
                torch.zeros(output_size, input_size, dtype=torch.float8_e4m3fn), requires_grad=False
            )
            self.weight_scale_inv = nn.Parameter(
                torch.ones(output_size // BLOCK, input_size // BLOCK), requires_grad=False
            )

    def load(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            if self.quant:
                codes, scale = _block_fp8(weight)
                self.weight.copy_(codes)
                self.weight_scale_inv.copy_(scale)
            else:
                self.weight.copy_(weight.to(self.weight.dtype))

    def dense(self) -> torch.Tensor:
        if not self.quant:
            return self.weight
        scale = self.weight_scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        return self.weight.float() * scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x, self.dense().to(x.dtype)), None


class LayerNorm(nn.Module):
    """`layers/layernorm.py` LayerNorm: `variance_epsilon` and `use_bias`, no `eps`; a bias
    parameter exists whether or not it applies. A bf16 input with fp32 parameters goes
    through flashinfer's layernorm: fp32 math, bf16 out."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, elementwise_affine: bool = True, bias: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.elementwise_affine = elementwise_affine
        self.use_bias = bias
        self.dtype = dtype
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.elementwise_affine else None
        bias = self.bias if self.use_bias else None
        out = torch.nn.functional.layer_norm(
            x.to(self.dtype), (self.hidden_size,), weight, bias, self.variance_epsilon
        )
        return out.to(x.dtype)


class RMSNorm(nn.Module):
    """`layers/layernorm.py` RMSNorm (the indexer's k_norm when index_k_norm_type == "rms",
    0.5.18+): `weight`, `variance_epsilon`, no bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps
        self.hidden_size = hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (y * self.weight.float()).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    if neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


class RotaryEmbedding(nn.Module):
    """`rotary_embedding/base.py`: an fp32 cos/sin cache [max_pos, R] = cat(cos, sin).
    `forward` is the CUDA kernel's contract (q [T, H, R], k [T, R] or [T, 1, R], rotated in
    fp32 and returned in their dtype)."""

    def __init__(
        self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
        is_neox_style: bool, dtype: torch.dtype,
    ) -> None:  # fmt: skip
        super().__init__()
        self.head_size, self.rotary_dim = head_size, rotary_dim
        self.max_position_embeddings, self.base = max_position_embeddings, base
        self.is_neox_style, self.dtype = is_neox_style, dtype
        self.native_calls = 0
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(), persistent=False)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        return 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        t = torch.arange(self.max_position_embeddings, dtype=torch.float)
        freqs = torch.einsum("i,j -> ij", t, self._compute_inv_freq(self.base))
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        out = []
        for x in (query, key):
            shape = x.shape
            y = x.reshape(shape[0], -1, self.rotary_dim).float()
            y = _rotate(y, cos[:, None, :], sin[:, None, :], self.is_neox_style)
            out.append(y.reshape(shape).to(x.dtype))
        return out[0], out[1]

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, offsets: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.native_calls += 1
        return self.forward(positions, query, key)


class DeepseekScalingRotaryEmbedding(RotaryEmbedding):
    """`rope_variant.py` DeepseekScalingRotaryEmbedding (YaRN): the cache spans
    max_position_embeddings * factor positions, cos and sin times mscale."""

    def __init__(
        self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
        is_neox_style: bool, scaling_factor: float, dtype: torch.dtype, *, extrapolation_factor: float = 1,
        attn_factor: float = 1, beta_fast: int = 32, beta_slow: int = 1, mscale: float = 1,
        mscale_all_dim: float = 0,
    ) -> None:  # fmt: skip
        self.scaling_factor, self.extrapolation_factor = scaling_factor, extrapolation_factor
        self.beta_fast, self.beta_slow = beta_fast, beta_slow

        def get_mscale(scale: float, m: float) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        self.mscale = (
            float(
                get_mscale(scaling_factor, float(mscale)) / get_mscale(scaling_factor, float(mscale_all_dim))
            )
            * attn_factor
        )
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self, scaling_factor: float) -> torch.Tensor:
        dim, base, original = self.rotary_dim, self.base, self.max_position_embeddings
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)

        def correction(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(correction(self.beta_fast)), 0)
        high = min(math.ceil(correction(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
        mask = (1 - ramp) * self.extrapolation_factor
        return (1.0 / (scaling_factor * pos_freqs)) * (1 - mask) + (1.0 / pos_freqs) * mask

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(self.scaling_factor)
        t = torch.arange(self.max_position_embeddings * self.scaling_factor, dtype=torch.float32)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        return torch.cat((freqs.cos() * self.mscale, freqs.sin() * self.mscale), dim=-1)

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, offsets: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Upstream's native path: cos/sin broadcast as [1, T, 1, R], fine for a 3-D q but a
        2-D key [T, R] becomes [1, T, T, R]."""
        self.native_calls += 1
        dtype = query.dtype
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        if self.is_neox_style:
            cos, sin = cos.repeat(1, 1, 2).unsqueeze(-2), sin.repeat(1, 1, 2).unsqueeze(-2)

            def rotate(x: torch.Tensor) -> torch.Tensor:
                x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
                return torch.cat((-x2, x1), dim=-1)
        else:
            cos = cos.repeat_interleave(2, dim=-1).unsqueeze(-2)
            sin = sin.repeat_interleave(2, dim=-1).unsqueeze(-2)

            def rotate(x: torch.Tensor) -> torch.Tensor:
                return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

        query = query * cos + rotate(query) * sin
        key = key * cos + rotate(key) * sin
        return query.to(dtype), key.to(dtype)


def get_rope_wrapper(
    head_size: int, rotary_dim: int, max_position: int, base: float, rope_scaling: dict | None,
    is_neox_style: bool,
) -> RotaryEmbedding:  # fmt: skip
    """`get_rope`: YaRN (`deepseek_yarn`, as DeepseekV2AttentionMLA renamed it) or plain."""
    if rope_scaling is None or rope_scaling.get("rope_type") in (None, "default"):
        return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style, torch.bfloat16)
    assert rope_scaling["rope_type"] == "deepseek_yarn", rope_scaling
    extra = {
        k: rope_scaling[k]
        for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        if k in rope_scaling
    }
    return DeepseekScalingRotaryEmbedding(
        head_size, rotary_dim, rope_scaling["original_max_position_embeddings"], base, is_neox_style,
        rope_scaling["factor"], torch.bfloat16, **extra,
    )  # fmt: skip


# --- platform dispatch ------------------------------------------------------------------


class MultiPlatformOp(nn.Module):
    """`layers/utils/multi_platform.py` (<= 0.5.15): forward_cuda is bound at construction."""

    def __init__(self) -> None:
        super().__init__()
        self._forward_method = self.dispatch_forward()

    def dispatch_forward(self) -> Any:
        return self.forward_cuda  # type: ignore[attr-defined]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)


class BaseFusedOp(nn.Module):
    """`sglang/kernels/fused_op.py` (0.5.18+): forward_cuda is looked up on the first call."""

    def __init__(self) -> None:
        super().__init__()
        self._forward_method = None

    def forward(self, *args: Any, backend: Any = None, **kwargs: Any) -> Any:
        if self._forward_method is None:
            self._forward_method = self.forward_cuda  # type: ignore[attr-defined]
        return self._forward_method(*args, **kwargs)


# --- the indexer ------------------------------------------------------------------------


class IndexKPool:
    """The index-K cache of `DSATokenToKVPool`: per layer an FP8 key and its fp32 scale per
    KV slot."""

    def __init__(self, layers: int, slots: int) -> None:
        self.k = torch.zeros(layers, slots, HEAD_DIM, dtype=torch.float8_e4m3fn)
        self.scale = torch.zeros(layers, slots)

    def set_index_k_scale_buffer(
        self, layer_id: int, loc: torch.Tensor, index_k: torch.Tensor, index_k_scale: torch.Tensor
    ) -> None:
        self.k[layer_id, loc] = index_k
        self.scale[layer_id, loc] = index_k_scale.reshape(-1)


@dataclass
class IndexerMetadata:
    """What `get_indexer_metadata` hands the indexer: the batch's page table and, 0.5.15+,
    `force_unfused_topk`."""

    req_to_token: torch.Tensor
    fuse: Any  # the release's envs variable
    force_unfused_topk: bool = False

    def topk_transform(self, positions: torch.Tensor, pool_rows: torch.Tensor) -> torch.Tensor:
        """Request-local positions as they are (unfused), or the KV-pool slots holding them
        (fused: `fast_topk_transform_fused` over page_table_1)."""
        if not self.fuse.get() or self.force_unfused_topk:
            return positions
        slots = self.req_to_token[pool_rows.long()[:, None], positions.clamp_min(0).long()]
        return torch.where(positions >= 0, slots, -1).to(torch.int32)


class AttnBackend:
    """The DSA attention backend's `get_indexer_metadata(layer_id, forward_batch)`."""

    def __init__(self, release: Release, envs: Any, req_to_token: torch.Tensor) -> None:
        self.release, self.envs, self.req_to_token = release, envs, req_to_token
        self.hisparse = False  # 0.5.15+: decode forces unfused top-k when hisparse is on

    def get_indexer_metadata(self, layer_id: int, forward_batch: Any) -> Any:
        name = "SGLANG_NSA_FUSE_TOPK" if self.release.fuse_topk == "nsa" else "SGLANG_DSA_FUSE_TOPK"
        meta = IndexerMetadata(self.req_to_token, getattr(self.envs, name))
        if self.release.fusion:  # the field exists from 0.5.15
            meta.force_unfused_topk = self.hisparse and forward_batch.forward_mode.is_decode_or_idle()
        return meta


class _IndexerImpl:
    """The indexer's code shared by every release; the classes below give it each
    release's signatures and dispatch base."""

    release: Release
    envs: Any
    pools: Any  # how the release reaches the pools and the backend

    def _build(
        self, hidden_size: int, index_n_heads: int, index_head_dim: int, rope_head_dim: int, index_topk: int,
        q_lora_rank: int, max_position_embeddings: int, rope_theta: float, layer_id: int,
        scale_fmt: str | None, block_size: int, rope_scaling: dict | None, is_neox_style: bool, config: Any,
    ) -> None:  # fmt: skip
        self.hidden_size, self.n_heads, self.head_dim = hidden_size, index_n_heads, index_head_dim
        self.rope_head_dim, self.index_topk, self.q_lora_rank = rope_head_dim, index_topk, q_lora_rank
        self.layer_id, self.block_size, self.scale_fmt = layer_id, block_size, scale_fmt
        self.alt_stream = None
        if self.release.version in ("0.5.22", "0.5.23"):
            self.is_neox_style = is_neox_style
        if self.release.fusion:
            self.use_dsa_indexer_fusion = (
                not self.envs.SGLANG_DISABLE_DSA_INDEXER_FUSION.get() and not is_neox_style
            )
        fused = getattr(self, "use_dsa_indexer_fusion", False)
        gen = torch.Generator().manual_seed(1000 + layer_id)

        def randn(*shape: int, scale: float) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * scale

        wq_b = randn(index_n_heads * index_head_dim, q_lora_rank, scale=2.0 / q_lora_rank**0.5)
        wk = randn(index_head_dim, hidden_size, scale=2.0 / hidden_size**0.5)
        weights_proj = randn(index_n_heads, hidden_size, scale=2.0 / hidden_size**0.5)
        self.wq_b = ReplicatedLinear(q_lora_rank, index_n_heads * index_head_dim, quant_config="fp8")
        self.wq_b.load(wq_b)
        if fused:
            # deepseek_weight_loader._load_fused_indexer_wk: block-FP8 wk dequantized into the
            # first head_dim rows, weights_proj below, bf16.
            codes, scale = _block_fp8(wk)
            wk = codes.float() * scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            self.wk_weights_proj = ReplicatedLinear(
                hidden_size, index_head_dim + index_n_heads, params_dtype=torch.bfloat16
            )
            self.wk_weights_proj.load(torch.cat([wk, weights_proj]))
        else:
            self.wk = ReplicatedLinear(hidden_size, index_head_dim, quant_config="fp8")
            self.wk.load(wk)
            self.weights_proj = ReplicatedLinear(hidden_size, index_n_heads, params_dtype=torch.bfloat16)
            self.weights_proj.load(weights_proj)
        if config is not None and getattr(config, "index_k_norm_type", "layer") == "rms":
            self.k_norm: nn.Module = RMSNorm(index_head_dim)
        else:
            self.k_norm = LayerNorm(index_head_dim, dtype=torch.float32)
        with torch.no_grad():
            self.k_norm.weight.copy_(1.0 + randn(index_head_dim, scale=0.2))
            if hasattr(self.k_norm, "bias"):
                self.k_norm.bias.copy_(randn(index_head_dim, scale=0.2))
        self.rotary_emb = get_rope_wrapper(
            rope_head_dim, rope_head_dim, max_position_embeddings, rope_theta, rope_scaling, is_neox_style
        )
        self.softmax_scale = self.head_dim**-0.5

    # helpers

    def _maybe_rotate(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "use_dsa_indexer_fusion", False):  # the fused writers omit Hadamard
            return x
        return rotate_activation(x)

    def _q_k(self, q_lora: torch.Tensor, x: torch.Tensor, positions: torch.Tensor) -> tuple:
        query, _ = self.wq_b(q_lora)
        query = query.view(-1, self.n_heads, self.head_dim)
        weights_raw = None
        if getattr(self, "use_dsa_indexer_fusion", False):
            kw, _ = self.wk_weights_proj(x)
            key, weights_raw = kw.split([self.head_dim, self.n_heads], dim=-1)
            key = key.contiguous()
        else:
            key, _ = self.wk(x)
        key = self.k_norm(key)
        r = self.rope_head_dim
        q_rope, k_rope = self.rotary_emb(positions, query[..., :r], key[..., :r])
        query[..., :r] = q_rope
        key[..., :r] = k_rope
        if self.release.fusion:
            return self._maybe_rotate(query), self._maybe_rotate(key), weights_raw
        return rotate_activation(query), rotate_activation(key)

    def _gate(self, x: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
        if self.release.version == "0.5.23":  # torch.mm(x, W.t(), out_dtype=torch.float32)
            weights = x.float() @ self.weights_proj.weight.float().t()
        else:
            weights, _ = self.weights_proj(x)
            weights = weights.float()
        weights = weights * self.n_heads**-0.5
        return weights.unsqueeze(-1) * q_scale * self.softmax_scale

    def _fused_q(
        self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, batch: Any, layer_id: int
    ):
        kw, _ = self.wk_weights_proj(x)
        key, weights_raw = kw.split([self.head_dim, self.n_heads], dim=-1)
        key = self.k_norm(key.contiguous())
        q = self.wq_b(q_lora)[0].view(-1, self.n_heads, self.head_dim)
        r = self.rope_head_dim
        q_rope, k_rope = self.rotary_emb(positions, q[..., :r], key[..., :r])
        q[..., :r] = q_rope
        key[..., :r] = k_rope
        self._store(batch, layer_id, key)
        q_fp8, q_scale = act_quant(q, self.block_size, self.scale_fmt)
        weights = weights_raw.float() * (self.softmax_scale * self.n_heads**-0.5)
        return q_fp8, weights.unsqueeze(-1) * q_scale

    def _store(self, batch: Any, layer_id: int, key: torch.Tensor) -> None:
        k_fp8, k_scale = act_quant(key, self.block_size, self.scale_fmt)
        self.pools.kv(batch).set_index_k_scale_buffer(layer_id, batch.out_cache_loc, k_fp8, k_scale)

    def _forward(
        self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
        layer_id: int,
        return_indices: bool,
    ) -> torch.Tensor | None:  # fmt: skip
        mode = forward_batch.forward_mode
        if self.release.version == "0.5.23" and mode.is_idle():
            return torch.full((x.shape[0], self.index_topk), -1, dtype=torch.int32)
        metadata = self.pools.backend(forward_batch).get_indexer_metadata(layer_id, forward_batch)
        if metadata is None:
            return None
        if mode.is_extend_without_speculative() and int(forward_batch.seq_lens_cpu.max()) <= self.index_topk:
            return self._forward_k_only(x, positions, forward_batch, layer_id, metadata, return_indices)
        if getattr(self, "use_dsa_indexer_fusion", False):
            q_fp8, weights = self._fused_q_prepare_and_store(  # type: ignore[attr-defined]
                x, q_lora, positions, forward_batch, layer_id, act_quant
            )
        else:
            out = self._get_q_k_bf16(q_lora, x, positions, False, forward_batch=forward_batch)  # type: ignore[attr-defined]
            query, key = out[0], out[1]
            q_fp8, q_scale = act_quant(query, self.block_size, self.scale_fmt)
            self._store(forward_batch, layer_id, key)
            weights = self._get_logits_head_gate(x, q_scale)  # type: ignore[attr-defined]
        return self._topk(forward_batch, layer_id, q_fp8, weights.squeeze(-1), metadata)

    def _forward_k_only(
        self, x: torch.Tensor, positions: torch.Tensor, batch: Any, layer_id: int, metadata: Any,
        return_indices: bool,
    ) -> torch.Tensor | None:  # fmt: skip
        if getattr(self, "use_dsa_indexer_fusion", False):
            kw, _ = self.wk_weights_proj(x)
            key = self.k_norm(kw[:, : self.head_dim].contiguous())
        else:
            key = self.k_norm(self.wk(x)[0])
        r = self.rope_head_dim
        _, k_rope = self.rotary_emb(positions, key[..., :r], key[..., :r])
        key[..., :r] = k_rope
        self._store(batch, layer_id, self._maybe_rotate(key))
        if not return_indices:
            return None
        # topk_transform of all-zero logits: every visible key
        rows = []
        for pool_row, prefix, new in _row_blocks(batch):
            q_pos = torch.arange(prefix, prefix + new)
            keys = torch.arange(self.index_topk)
            pos = torch.where(keys[None, :] <= q_pos[:, None], keys[None, :], -1).to(torch.int32)
            rows.append(metadata.topk_transform(pos, torch.full((new,), pool_row)))
        return torch.cat(rows)

    def _topk(self, batch: Any, layer_id: int, q_fp8: torch.Tensor, weights: torch.Tensor, metadata: Any):
        """DeepGEMM's ragged (extend) or paged (decode) logits over each request's keys in the
        index-K cache, then the top-k transform."""
        out = [
            metadata.topk_transform(positions, torch.full((new,), pool_row))
            for pool_row, _, new, positions in self._request_positions(batch, layer_id, q_fp8, weights)
        ]
        return torch.cat(out)

    def _request_positions(
        self, batch: Any, layer_id: int, q_fp8: torch.Tensor, weights: torch.Tensor
    ) -> Any:
        """Per request of the batch (pool row, prefix, new rows): its rows' top-k positions
        over its own keys in the index-K cache, request-local, -1 padded."""
        pool = self.pools.kv(batch)
        req_to_token = self.pools.req_to_token(batch)
        row = 0
        for pool_row, prefix, new in _row_blocks(batch):
            rows = slice(row, row + new)
            slots = req_to_token[pool_row, : prefix + new].long()
            k8, k_scale = pool.k[layer_id, slots], pool.scale[layer_id, slots]
            q_pos = torch.arange(prefix, prefix + new)
            zero = torch.zeros(new, dtype=torch.long)
            logits = mqa_logits(q_fp8[rows], weights[rows], k8, k_scale, zero, q_pos + 1)
            yield pool_row, prefix, new, topk_positions(logits, zero, self.index_topk)
            row += new


def _row_blocks(batch: Any) -> list[tuple[int, int, int]]:
    """(req_pool_index, prefix, new rows) per request, in the batch's order."""
    pool_rows = batch.req_pool_indices.tolist()
    if batch.extend_seq_lens_cpu is not None:
        return list(zip(pool_rows, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu, strict=True))
    return [(p, int(s) - 1, 1) for p, s in zip(pool_rows, batch.seq_lens_cpu.tolist(), strict=True)]


class Indexer058(MultiPlatformOp, _IndexerImpl):
    """0.5.8 / 0.5.10 (nsa_indexer.py L127)."""

    def __init__(
        self, hidden_size: int, index_n_heads: int, index_head_dim: int, rope_head_dim: int, index_topk: int,
        q_lora_rank: int, max_position_embeddings: int, rope_theta: float, layer_id: int,
        scale_fmt: str | None, block_size: int = 128, rope_scaling: dict | None = None, prefix: str = "",
        quant_config: Any = None, alt_stream: Any = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self._build(
            hidden_size, index_n_heads, index_head_dim, rope_head_dim, index_topk, q_lora_rank,
            max_position_embeddings, rope_theta, layer_id, scale_fmt, block_size, rope_scaling, True, None,
        )  # fmt: skip

    def _get_logits_head_gate(self, x: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
        return self._gate(x, q_scale)

    def _get_q_k_bf16(
        self, q_lora: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, enable_dual_stream: bool,
        forward_batch: Any,
    ) -> tuple:  # fmt: skip
        return self._q_k(q_lora, x, positions)

    def forward_cuda(
        self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
        layer_id: int, return_indices: bool = True,
    ) -> torch.Tensor | None:  # fmt: skip
        return self._forward(x, q_lora, positions, forward_batch, layer_id, return_indices)


class Indexer0515(MultiPlatformOp, _IndexerImpl):
    """0.5.15 (dsa_indexer.py L343)."""

    def __init__(
        self, hidden_size: int, index_n_heads: int, index_head_dim: int, rope_head_dim: int, index_topk: int,
        q_lora_rank: int, max_position_embeddings: int, rope_theta: float, layer_id: int,
        scale_fmt: str | None, block_size: int = 128, rope_scaling: dict | None = None,
        is_neox_style: bool = True, prefix: str = "", quant_config: Any = None, alt_stream: Any = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self._build(
            hidden_size, index_n_heads, index_head_dim, rope_head_dim, index_topk, q_lora_rank,
            max_position_embeddings, rope_theta, layer_id, scale_fmt, block_size, rope_scaling,
            is_neox_style, None,
        )  # fmt: skip

    def _get_logits_head_gate(self, x: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
        return self._gate(x, q_scale)

    def _get_q_k_bf16(
        self, q_lora: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, enable_dual_stream: bool,
        forward_batch: Any,
    ) -> tuple:  # fmt: skip
        return self._q_k(q_lora, x, positions)

    def _fused_q_prepare_and_store(
        self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
        layer_id: int,
        act_quant: Any, *, num_tokens: int | None = None, enable_dual_stream: bool = True,
    ) -> tuple:  # fmt: skip
        return self._fused_q(x, q_lora, positions, forward_batch, layer_id)

    def forward_cuda(
        self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
        layer_id: int, return_indices: bool = True,
    ) -> torch.Tensor | None:  # fmt: skip
        return self._forward(x, q_lora, positions, forward_batch, layer_id, return_indices)


class Indexer0522(BaseFusedOp, _IndexerImpl):
    """0.5.18 to 0.5.22 (dsa_indexer.py L256 in 0.5.22)."""

    def __init__(
        self, hidden_size: int, index_n_heads: int, index_head_dim: int, rope_head_dim: int, index_topk: int,
        q_lora_rank: int, max_position_embeddings: int, rope_theta: float, layer_id: int,
        scale_fmt: str | None, block_size: int = 128, rope_scaling: dict | None = None,
        is_neox_style: bool = True, prefix: str = "", quant_config: Any = None, alt_stream: Any = None,
        config: Any = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self._build(
            hidden_size, index_n_heads, index_head_dim, rope_head_dim, index_topk, q_lora_rank,
            max_position_embeddings, rope_theta, layer_id, scale_fmt, block_size, rope_scaling,
            is_neox_style, config,
        )  # fmt: skip

    def _get_logits_head_gate(self, x: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
        return self._gate(x, q_scale)

    def _get_q_k_bf16(
        self, q_lora: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, enable_dual_stream: bool,
        forward_batch: Any,
    ) -> tuple:  # fmt: skip
        return self._q_k(q_lora, x, positions)

    def _fused_q_prepare_and_store(
        self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
        layer_id: int,
        act_quant: Any, *, num_tokens: int | None = None, enable_dual_stream: bool = True,
    ) -> tuple:  # fmt: skip
        return self._fused_q(x, q_lora, positions, forward_batch, layer_id)

    def forward_cuda(
        self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
        layer_id: int, return_indices: bool = True,
    ) -> torch.Tensor | None:  # fmt: skip
        return self._forward(x, q_lora, positions, forward_batch, layer_id, return_indices)


class Indexer0523(Indexer0522):
    """0.5.23 (dsa_indexer.py L267): forward_cuda gains use_cuda_graph."""

    def forward_cuda(
        self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
        layer_id: int, return_indices: bool = True, use_cuda_graph: bool = True,
    ) -> torch.Tensor | None:  # fmt: skip
        return self._forward(x, q_lora, positions, forward_batch, layer_id, return_indices)


class IndexerLiteTopK(Indexer0522):
    """main after 0.5.23 (dsa_indexer.py @3f53245f), LiteTopK path A: with
    SGLANG_ENABLE_DSA_LITETOPK (and SM100 there; any device here), an extend batch's top-k
    comes from `_get_topk_ragged_litetopk` over the whole batch: "gathered-KV absolute
    positions, padded with -1", request i's positions offset by the keys of the requests
    before it, and no top-k transform (so whatever SGLANG_DSA_FUSE_TOPK says)."""

    def _build(self, *args: Any) -> None:
        super()._build(*args)
        self.use_dsa_litetopk = os.environ.get("SGLANG_ENABLE_DSA_LITETOPK") == "1"

    def _topk(self, batch: Any, layer_id: int, q_fp8: torch.Tensor, weights: torch.Tensor, metadata: Any):
        if self.use_dsa_litetopk and batch.extend_seq_lens_cpu is not None:
            return self._get_topk_ragged_litetopk(
                forward_batch=batch, q_fp8=q_fp8, weights=weights, layer_id=layer_id
            )
        return super()._topk(batch, layer_id, q_fp8, weights, metadata)

    def _get_topk_ragged_litetopk(
        self, *, forward_batch: Any, q_fp8: torch.Tensor, weights: torch.Tensor, layer_id: int
    ) -> torch.Tensor:
        out, kv0 = [], 0
        for _, prefix, new, positions in self._request_positions(forward_batch, layer_id, q_fp8, weights):
            out.append(torch.where(positions >= 0, positions + kv0, -1).to(torch.int32))
            kv0 += prefix + new
        return torch.cat(out)


_INDEXERS = {"0.5.8": Indexer058, "0.5.15": Indexer0515, "0.5.22": Indexer0522, "0.5.23": Indexer0523}


# --- forward_batch_info.py ----------------------------------------------------------------


class ForwardMode(Enum):
    EXTEND = auto()
    DECODE = auto()
    MIXED = auto()
    IDLE = auto()
    TARGET_VERIFY = auto()
    DRAFT_EXTEND_V2 = auto()

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend_v2(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND_V2

    def is_extend_without_speculative(self) -> bool:
        return self.is_extend() and not self.is_target_verify()


class SpeculativeAlgorithm(Enum):
    NONE = auto()

    def is_none(self) -> bool:
        return self == SpeculativeAlgorithm.NONE


@dataclass
class Req:
    """`managers/schedule_batch.py` Req, as far as the batches read it."""

    rid: str
    prompt: int
    seed: int
    processed: int = 0  # tokens in the KV cache
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None


@dataclass
class WorkerBatch:
    """The ScheduleBatch (ModelWorkerBatch on 0.5.8) ForwardBatch.init_new reads."""

    forward_mode: ForwardMode
    reqs: list[Req]
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    extend_prefix_lens: list[int] | None
    extend_seq_lens: list[int] | None


def _forward_batch_class(release: Release) -> type:
    fields: list[tuple[str, Any, Any]] = [
        ("forward_mode", Any), ("batch_size", int), ("req_pool_indices", torch.Tensor),
        ("seq_lens", torch.Tensor),
        ("out_cache_loc", torch.Tensor), ("seq_lens_cpu", Any), ("positions", torch.Tensor),
        ("extend_prefix_lens_cpu", Any), ("extend_seq_lens_cpu", Any),
        ("spec_algorithm", Any, field(default=SpeculativeAlgorithm.NONE)),
        ("spec_info", Any, field(default=None)),
        ("tbo_parent_token_range", Any, field(default=None)),
    ]  # fmt: skip
    if release.rids:
        fields.append(("rids", Any, field(default=None)))
        fields.append(("attn_cp_metadata", Any, field(default=None)))
    else:
        fields += [
            ("nsa_cp_metadata", Any, field(default=None)), ("attn_backend", Any, field(default=None)),
            ("token_to_kv_pool", Any, field(default=None)), ("req_to_token_pool", Any, field(default=None)),
        ]  # fmt: skip

    def build(cls: type, batch: WorkerBatch, model_runner: Any) -> Any:
        extend = batch.extend_seq_lens is not None
        seq_lens = batch.seq_lens
        if extend:
            positions = torch.cat(
                [
                    torch.arange(p, p + n)
                    for p, n in zip(batch.extend_prefix_lens, batch.extend_seq_lens, strict=True)
                ]
            )
        else:
            positions = seq_lens - 1
        kwargs = dict(
            forward_mode=batch.forward_mode, batch_size=len(batch.reqs),
            req_pool_indices=batch.req_pool_indices, seq_lens=seq_lens, out_cache_loc=batch.out_cache_loc,
            seq_lens_cpu=seq_lens.clone(), positions=positions,
            extend_prefix_lens_cpu=batch.extend_prefix_lens if extend else None,
            extend_seq_lens_cpu=batch.extend_seq_lens if extend else None,
        )  # fmt: skip
        if release.rids:
            kwargs["rids"] = [req.rid for req in batch.reqs]
        else:
            kwargs.update(
                attn_backend=model_runner.attn_backend, token_to_kv_pool=model_runner.token_to_kv_pool,
                req_to_token_pool=model_runner.req_to_token_pool,
            )  # fmt: skip
        return cls(**kwargs)

    if release.version == "0.5.23":

        def init_new(
            cls: type, batch: WorkerBatch, model_runner: Any, *, capture_hidden_mode: Any = None
        ) -> Any:
            return build(cls, batch, model_runner)

    else:

        def init_new(cls: type, batch: WorkerBatch, model_runner: Any) -> Any:  # type: ignore[misc]
            return build(cls, batch, model_runner)

    return make_dataclass("ForwardBatch", fields, namespace={"init_new": classmethod(init_new)})


# --- models/deepseek_v2.py ----------------------------------------------------------------


def _model_classes(release: Release, indexer_cls: type) -> SimpleNamespace:
    class DeepseekV2AttentionMLA(nn.Module):
        def __init__(self, config: Any, layer_id: int, prefix: str) -> None:
            super().__init__()
            params = getattr(config, "rope_parameters", None)
            if params is not None:
                rope_theta = params["rope_theta"]
                rope_scaling = params if params.get("rope_type") != "default" else None
            else:
                rope_theta, rope_scaling = (
                    getattr(config, "rope_theta", 10000),
                    getattr(config, "rope_scaling", None),
                )
            if rope_scaling:
                rope_scaling["rope_type"] = "deepseek_yarn"  # upstream mutates the HF config's dict
            kwargs = dict(
                hidden_size=config.hidden_size, index_n_heads=config.index_n_heads,
                index_head_dim=config.index_head_dim, rope_head_dim=config.qk_rope_head_dim,
                index_topk=config.index_topk, q_lora_rank=config.q_lora_rank,
                max_position_embeddings=config.max_position_embeddings, rope_theta=rope_theta,
                scale_fmt="ue8m0",
                block_size=128, rope_scaling=rope_scaling, prefix=f"{prefix}.indexer", quant_config="fp8",
                layer_id=layer_id, alt_stream=None,
            )  # fmt: skip
            if release.neox_param:
                kwargs["is_neox_style"] = not getattr(config, "indexer_rope_interleave", False)
            if release.config_param:
                kwargs["config"] = config
            self.layer_id = layer_id
            self.indexer = indexer_cls(**kwargs)

        def forward(
            self, hidden: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, batch: Any
        ) -> Any:
            dense = (
                release.dense_mha_prefill
                and batch.forward_mode.is_extend_without_speculative()
                and int(batch.seq_lens_cpu.max()) <= self.indexer.index_topk
            )
            if dense:  # forward_mha.forward_dsa_indexer_for_mha: the K cache only
                return self.indexer(
                    x=hidden, q_lora=q_lora, positions=positions, forward_batch=batch, layer_id=self.layer_id,
                    return_indices=False,
                )  # fmt: skip
            return self.indexer(
                x=hidden, q_lora=q_lora, positions=positions, forward_batch=batch, layer_id=self.layer_id
            )

    class DeepseekV2DecoderLayer(nn.Module):
        def __init__(self, config: Any, layer_id: int, prefix: str) -> None:
            super().__init__()
            self.layer_id = layer_id
            self.self_attn = DeepseekV2AttentionMLA(config, layer_id, f"{prefix}.self_attn")

    class DeepseekV2ForCausalLM(nn.Module):
        def __init__(self, config: Any, quant_config: Any = None, prefix: str = "") -> None:
            super().__init__()
            self.config = config
            self.layers = nn.ModuleList(
                [
                    DeepseekV2DecoderLayer(config, i, f"model.layers.{i}")
                    for i in range(config.num_hidden_layers)
                ]
            )
            self.topk: list[Any] = []

        def forward(
            self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
            input_embeds: Any = None, pp_proxy_tensors: Any = None,
        ) -> torch.Tensor:  # fmt: skip
            return _run_layers(self, input_ids, positions, forward_batch)

    class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
        pass

    class DeepseekV32ForCausalLM(DeepseekV2ForCausalLM):
        pass

    class GlmMoeDsaForCausalLM(DeepseekV2ForCausalLM):
        pass

    class DeepseekV3ForCausalLMNextN(DeepseekV3ForCausalLM):
        """`deepseek_nextn.py`: nn.Module.__init__ only, one decoder layer built as layer 0
        under `model.decoder`."""

        def __init__(self, config: Any, quant_config: Any = None, prefix: str = "") -> None:
            nn.Module.__init__(self)
            self.config = config
            self.layers = nn.ModuleList([DeepseekV2DecoderLayer(config, 0, "model.decoder")])
            self.topk = []

        def forward(
            self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
            input_embeds: Any = None, pp_proxy_tensors: Any = None,
        ) -> torch.Tensor:  # fmt: skip
            return _run_layers(self, input_ids, positions, forward_batch)

    return SimpleNamespace(
        DeepseekV2ForCausalLM=DeepseekV2ForCausalLM, DeepseekV3ForCausalLM=DeepseekV3ForCausalLM,
        DeepseekV32ForCausalLM=DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM=GlmMoeDsaForCausalLM,
        DeepseekV3ForCausalLMNextN=DeepseekV3ForCausalLMNextN,
    )  # fmt: skip


def _run_layers(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any) -> torch.Tensor:
    model.topk = []
    for layer in model.layers:
        hidden, q_lora = model.activations(layer.layer_id, batch)
        model.topk.append(layer.self_attn(hidden, q_lora, positions, batch))
    return torch.zeros(len(input_ids))


# --- the stand-in installed -------------------------------------------------------------


@dataclass
class Installed:
    """One release's modules in sys.modules, with classes of their own (the adapter patches
    them in place)."""

    release: Release
    modules: dict[str, ModuleType]
    envs: Any
    Indexer: type
    ForwardBatch: type
    models: SimpleNamespace
    context: SimpleNamespace  # forward_context's current backend and pools (0.5.15+)

    @property
    def indexer_module(self) -> ModuleType:
        return self.modules[INDEXER_MODULES[self.release.module]]


def install(monkeypatch: Any, version: str, *, indexer: type | None = None) -> Installed:
    """Registers sglang `version`'s modules; `indexer` replaces the Indexer class (a layout
    the adapter was not written for)."""
    release = RELEASES[version]
    envs = _envs(release.fuse_topk)
    indexer_cls = type("Indexer", (indexer or _INDEXERS[version],), {"release": release, "envs": envs})
    forward_batch = _forward_batch_class(release)
    models = _model_classes(release, indexer_cls)
    context = SimpleNamespace(backend=None, kv=None, req_to_token=None)

    class Pools:
        """How the release's indexer reaches the pools: the batch (0.5.8) or the forward
        context (0.5.15+)."""

        @staticmethod
        def backend(batch: Any) -> Any:
            return batch.attn_backend if not release.rids else context.backend

        @staticmethod
        def kv(batch: Any) -> Any:
            return batch.token_to_kv_pool if not release.rids else context.kv

        @staticmethod
        def req_to_token(batch: Any) -> Any:
            return batch.req_to_token_pool if not release.rids else context.req_to_token

    indexer_cls.pools = Pools
    register(monkeypatch, "sglang", __version__=version)
    modules = {"sglang.srt.environ": register(monkeypatch, "sglang.srt.environ", envs=envs)}
    modules["sglang.srt.layers.layernorm"] = register(
        monkeypatch, "sglang.srt.layers.layernorm", LayerNorm=LayerNorm, RMSNorm=RMSNorm
    )
    modules["sglang.srt.model_executor.forward_batch_info"] = register(
        monkeypatch, "sglang.srt.model_executor.forward_batch_info", ForwardBatch=forward_batch,
        ForwardMode=ForwardMode,
    )  # fmt: skip
    getter = {"get_attn_backend": lambda: context.backend} if release.rids else {}
    main = INDEXER_MODULES[release.module]
    modules[main] = register(
        monkeypatch, main, Indexer=indexer_cls, rotate_activation=rotate_activation, **getter
    )
    if release.module == "dsa":  # nsa/nsa_indexer.py re-exports dsa_indexer from 0.5.13
        modules[INDEXER_MODULES["nsa"]] = register(
            monkeypatch,
            INDEXER_MODULES["nsa"],
            Indexer=indexer_cls,
            rotate_activation=rotate_activation,
            **getter,
        )
    modules["sglang.srt.models.deepseek_v2"] = register(
        monkeypatch, "sglang.srt.models.deepseek_v2", **vars(models)
    )
    return Installed(release, modules, envs, indexer_cls, forward_batch, models, context)


# --- model configs ----------------------------------------------------------------------


def glm5_config(layers: int = 1, **extra: Any) -> SimpleNamespace:
    """A GLM-5-shaped HF config (interleaved indexer RoPE, default rope type)."""
    return SimpleNamespace(
        architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", num_hidden_layers=layers,
        hidden_size=HIDDEN, q_lora_rank=Q_LORA, qk_rope_head_dim=ROPE_DIM, index_n_heads=HEADS,
        index_head_dim=HEAD_DIM, index_topk=TOPK, max_position_embeddings=8192,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}, indexer_rope_interleave=True,
        **extra,
    )  # fmt: skip


def deepseek_v32_config(layers: int = 1, **extra: Any) -> SimpleNamespace:
    """A DeepSeek-V3.2-shaped HF config (NeoX indexer RoPE, YaRN in config.json spelling)."""
    return SimpleNamespace(
        architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", num_hidden_layers=layers,
        hidden_size=HIDDEN, q_lora_rank=Q_LORA, qk_rope_head_dim=ROPE_DIM, index_n_heads=HEADS,
        index_head_dim=HEAD_DIM, index_topk=TOPK, max_position_embeddings=16384, rope_theta=10000.0,
        rope_scaling={
            "type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
        **extra,
    )  # fmt: skip


# --- the scheduler's side ---------------------------------------------------------------


class Engine:
    """A scheduler and model runner over the installed stand-in: each call is one engine
    step, built by ForwardBatch.init_new and run through the model's forward."""

    def __init__(
        self, sg: Installed, model: nn.Module, *, pool_rows: int = 2, slots: int = 12000, seed: int = 0,
        draft: nn.Module | None = None,
    ) -> None:  # fmt: skip
        self.sg, self.model, self.draft_model = sg, model, draft
        layers = len(model.layers)
        self.kv = IndexKPool(layers, slots)
        self.draft_kv = IndexKPool(1, slots)
        self.req_to_token = torch.zeros(pool_rows, 8192, dtype=torch.int32)
        self.backend = AttnBackend(sg.release, sg.envs, self.req_to_token)
        self.free_rows = list(range(pool_rows))
        gen = torch.Generator().manual_seed(seed)
        self.free_slots = torch.randperm(slots, generator=gen).tolist()
        self.inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._current: list[tuple[Req, int, int]] = []  # the running step's (request, prefix, rows)
        for m in (model, draft):
            if m is not None:
                m.activations = self._activations  # type: ignore[assignment]

    def request(self, rid: str, prompt: int, seed: int) -> Req:
        return Req(rid, prompt, seed)

    def _activations(self, layer: int, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's normalized hidden states and q LoRA rows of every request in the
        batch: a fixed random sequence per request and layer."""
        xs, qs = [], []
        for req, prefix, new in self._current:
            key = (req.seed, layer)
            if key not in self.inputs:
                gen = torch.Generator().manual_seed(req.seed * 1000 + layer)
                total = req.prompt + 64
                self.inputs[key] = (
                    torch.randn(total, HIDDEN, generator=gen).to(torch.bfloat16),
                    torch.randn(total, Q_LORA, generator=gen).to(torch.bfloat16),
                )
            x, q = self.inputs[key]
            xs.append(x[prefix : prefix + new])
            qs.append(q[prefix : prefix + new])
        return torch.cat(xs), torch.cat(qs)

    def extend(self, chunks: list[tuple[Req, int]], running: tuple[Req, ...] | list[Req] = ()) -> Any:
        """A prefill step (chunks of prompts, `extend_prefix_lens` > 0 for later chunks),
        MIXED with the running requests' decode rows when there are any."""
        items = [(req, req.processed, n) for req, n in chunks] + [(req, req.processed, 1) for req in running]
        mode = ForwardMode.MIXED if running else ForwardMode.EXTEND
        return self._step(mode, items, extend=True)

    def decode(self, reqs: list[Req], replayed: bool = False) -> Any:
        """A decode step; `replayed`: the model runner replays its captured CUDA graph, so
        none of the model's Python runs (the batch is built all the same)."""
        items = [(req, req.processed, 1) for req in reqs]
        return self._step(ForwardMode.DECODE, items, extend=False, replayed=replayed)

    def draft(self, reqs: list[Req]) -> Any:
        """A NextN draft forward over the running requests (its own model and KV pool)."""
        assert self.draft_model is not None
        items = [(req, req.processed - 1, 1) for req in reqs]
        return self._step(ForwardMode.DECODE, items, extend=False, draft=True)

    def finish(self, req: Req) -> None:
        """The request finished: its pool row and KV slots go back to the free lists."""
        assert req.req_pool_idx is not None
        self.free_slots += self.req_to_token[req.req_pool_idx, : req.processed].tolist()
        self.free_rows.insert(0, req.req_pool_idx)
        req.req_pool_idx = None

    def _step(
        self, mode: ForwardMode, items: list[tuple[Req, int, int]], extend: bool, draft: bool = False,
        replayed: bool = False,
    ) -> Any:  # fmt: skip
        locs = []
        for req, prefix, new in items:
            if req.req_pool_idx is None:
                req.req_pool_idx = self.free_rows.pop(0)
            if not draft:
                slots = [self.free_slots.pop(0) for _ in range(new)]
                self.req_to_token[req.req_pool_idx, prefix : prefix + new] = torch.tensor(
                    slots, dtype=torch.int32
                )
            locs.append(self.req_to_token[req.req_pool_idx, prefix : prefix + new].long())
        batch = WorkerBatch(
            forward_mode=mode, reqs=[req for req, _, _ in items],
            req_pool_indices=torch.tensor([req.req_pool_idx for req, _, _ in items]),
            seq_lens=torch.tensor([prefix + new for _, prefix, new in items]), out_cache_loc=torch.cat(locs),
            extend_prefix_lens=[prefix for _, prefix, _ in items] if extend else None,
            extend_seq_lens=[new for _, _, new in items] if extend else None,
        )  # fmt: skip
        kv = self.draft_kv if draft else self.kv
        runner = SimpleNamespace(
            attn_backend=self.backend, token_to_kv_pool=kv, req_to_token_pool=self.req_to_token
        )
        fb = self.sg.ForwardBatch.init_new(batch, runner)
        self.sg.context.backend, self.sg.context.kv, self.sg.context.req_to_token = (
            self.backend, kv, self.req_to_token,
        )  # fmt: skip
        self._current = items
        model = self.draft_model if draft else self.model
        if not replayed:
            model(torch.zeros(len(fb.positions), dtype=torch.long), fb.positions, fb)
        if not draft:
            for req, prefix, new in items:
                req.processed = prefix + new
                if req.processed > req.prompt:
                    req.output_ids.append(0)
        return fb
