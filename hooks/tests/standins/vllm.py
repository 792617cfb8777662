"""A vLLM stand-in, written from the released wheels (read with upstream.Source or unpacked):

- the `deepseek_v32` path of vLLM 0.29.0 / 0.33.0 (the CUDA route of GlmMoeDsaForCausalLM and
  DeepseekV32ForCausalLM): models/deepseek_v32/attention.py `DeepseekV32Attention.forward`
  (positions, hidden_states), passed by keyword from nvidia/model.py's decoder layer, the
  fused kernels of common/kernels.py (`fused_norm_rope`: q-LoRA RMSNorm, the top-k buffer
  cleared to -1, index K LayerNorm + RoPE + ue8m0 FP8 quantization straight into the paged
  cache; `fused_q`: index q RoPE + ue8m0 FP8 with the weights folded), then
  `_sparse_indexer_and_attn` (`@eager_break_during_capture`) calling the module-global
  function `sparse_attn_indexer`;
- the `deepseek_v2` path of vLLM 0.28.0: models/deepseek_v2.py `Indexer.forward` (the fused
  CUDA branch: `fused_indexer_q_rope_quant` with its bf16 rounding and amax clamp 1e-10,
  k_norm, k RoPE by the rotary module, in bf16) calling `SparseAttnIndexer`, a CustomOp whose
  `_forward_method` is bound to `forward_cuda` at construction (model_executor/custom_op.py);
- layers/sparse_attn_indexer.py `sparse_attn_indexer` (0.29 signature): K insert with
  `indexer_k_quant_and_cache` when asked, the short-prefill dense-MHA early return (buffer
  untouched), prefill chunks gathered from the paged FP8 cache and scored with DeepGEMM's
  `fp8_mqa_logits` (standins/common.mqa_logits), decode rows first with paged logits, top-k
  as request-local positions, -1 padded;
- the model runners: v1/worker/gpu_model_runner.py `GPUModelRunner` (reorders the batch
  decode -> extend -> prefill in `_update_states`, calls `_model_forward` inside
  `set_forward_context`) and v1/worker/gpu/model_runner.py `GPUModelRunner` (0.33: sorts with
  `sort_batch_req_ids`, `prepare_inputs` returns the step's InputBatch, padded positions,
  dummy runs without `prepare_inputs`); vllm/forward_context.py (a new ForwardContext per
  forward); compilation/breakable_cudagraph.py (eager breaks; a replay calls what the
  decorator wrapped).

Production numerics are written here from those kernels (rotations, quantizers with the
engine's clamps and exp2(ceil(log2)) ue8m0 scales, the cache's byte layout), never taken
from shadowtrace_hooks. Weights are random, scaled so that the indexer's scores spread as a
trained model's do. Sizes are small (4 heads of 128, hidden 64, q LoRA 128) but index_topk
is the models' 2048.
"""

import contextlib
import enum
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from standins.common import E4M3_MAX, mqa_logits, topk_positions
from standins.common import register as register_module

D, H, HIDDEN, Q_LORA, ROPE, TOPK = 128, 4, 64, 128, 64, 2048
BLOCK = 64  # tokens per KV-cache block
NUM_BLOCKS = 160
MAX_TOKENS = 4608  # max_num_batched_tokens: the rows of the shared top-k buffer
MAX_POSITION = 8192
VOCAB = 512
PAD = 8  # the v2 runner pads a step's rows to a multiple of this (CUDA-graph sizes)

V2_MODULE = "vllm.model_executor.models.deepseek_v2"
OP_MODULE = "vllm.model_executor.layers.sparse_attn_indexer"
V32_MODULE = "vllm.models.deepseek_v32.attention"
NVIDIA_MODULE = "vllm.models.deepseek_v32.nvidia.model"
RUNNER_V1_MODULE = "vllm.v1.worker.gpu_model_runner"
RUNNER_V2_MODULE = "vllm.v1.worker.gpu.model_runner"


def hf_config(
    architecture: str = "DeepseekV32ForCausalLM", interleave: bool | None = None, layers: int = 2
) -> Any:
    """The model's HF config as vLLM holds it (transformers' PretrainedConfig attributes)."""
    config = SimpleNamespace(
        architectures=[architecture],
        model_type="glm_moe_dsa" if architecture == "GlmMoeDsaForCausalLM" else "deepseek_v32",
        _name_or_path=f"standin/{architecture}",
        num_hidden_layers=layers, hidden_size=HIDDEN, q_lora_rank=Q_LORA, qk_rope_head_dim=ROPE,
        index_topk=TOPK, index_n_heads=H, index_head_dim=D, rms_norm_eps=1e-6,
        max_position_embeddings=MAX_POSITION, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    if interleave is not None:
        config.indexer_rope_interleave = interleave
    return config


def vllm_config(
    config: Any,
    force_mqa: bool = False,
    shardq: tuple[int, int] | None = None,
    logits_dtype: str | None = None,
) -> Any:
    """VllmConfig as the model code reads it. `shardq` (rank, world size): this process is
    one tensor-parallel rank of a 0.34 engine with ShardQ on (`sparse_mla_shard_q`, its
    default, on a backend that supports it). `logits_dtype`: 0.34's resolved
    `indexer_logits_dtype` ("bfloat16" for DeepSeek-V3.2 on SM100, else "float32"); None
    for releases before it, whose indexer op has no logits dtype."""
    rank, world = shardq or (0, 1)
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=config, max_model_len=MAX_POSITION),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=MAX_TOKENS),
        cache_config=SimpleNamespace(block_size=BLOCK),
        # AttentionConfig.sparse_mla_force_mqa: no dense-MHA prefill for short batches.
        attention_config=SimpleNamespace(
            sparse_mla_force_mqa=force_mqa,
            sparse_mla_shard_q=shardq is not None,
            sparse_mla_shard_q_min_tokens=1024,
            indexer_logits_dtype=logits_dtype,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=world, rank=rank),
    )


def zigzag_split(query_lens: list[int], world: int) -> list[list[int]]:
    """v1/attention/ops/shardq.py (0.34.0): each prefill request's tokens cut into 2 W
    chunks, [floor(i L / 2W), floor((i + 1) L / 2W)); rank r owns chunks r and 2W - 1 - r;
    grouped by rank over the whole prefill batch, each rank's ids ascending (ids count from
    the first token after the decodes). Per rank, its ids."""
    groups: list[list[int]] = [[] for _ in range(world)]
    base = 0
    for length in query_lens:
        for p in range(length):
            c = ((p + 1) * 2 * world - 1) // length
            groups[min(c, 2 * world - 1 - c)].append(base + p)
        base += length
    return groups


def shardq_gather(
    vllm_config: Any, counts: list[int], decodes: int, seq_lens: list[int], topk: int
) -> list[int] | None:
    """`shardq_gather_indices` of this rank for a step (indexer.py build(), 0.34.0): the
    decode rows in place, then this rank's zigzag tokens; None where ShardQ does not apply
    (build_shardq_split: one rank, no prefill, fewer than the minimum tokens after the
    decodes, no prefill longer than index_topk, a rank left without tokens)."""
    attention, parallel = vllm_config.attention_config, vllm_config.parallel_config
    world = parallel.tensor_parallel_size
    prefill = counts[decodes:]
    if not attention.sparse_mla_shard_q or world < 2 or not prefill:
        return None
    if sum(prefill) < attention.sparse_mla_shard_q_min_tokens or max(seq_lens[decodes:]) <= topk:
        return None
    groups = zigzag_split(prefill, world)
    if min(len(g) for g in groups) == 0:
        return None
    d = sum(counts[:decodes])
    return list(range(d)) + [d + t for t in groups[parallel.rank]]


# === vllm.forward_context and vllm.compilation.breakable_cudagraph =====================


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2


@dataclass
class ForwardContext:
    """vllm/forward_context.py: a plain dataclass, made anew by every set_forward_context."""

    no_compile_layers: dict
    attn_metadata: Any
    slot_mapping: Any
    dp_metadata: Any = None
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: Any = None
    ubatch_slices: Any = None
    is_padding: Any = None
    skip_compiled: bool = False
    additional_kwargs: dict = field(default_factory=dict)


_forward_context: list[ForwardContext | None] = [None]


def get_forward_context() -> ForwardContext:
    context = _forward_context[0]
    assert context is not None, "Forward context is not set. Please use `set_forward_context`."
    return context


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: Any, vllm_config: Any, slot_mapping: Any = None,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
) -> Iterator[None]:  # fmt: skip
    previous = _forward_context[0]
    _forward_context[0] = ForwardContext(
        no_compile_layers={}, attn_metadata=attn_metadata, slot_mapping=slot_mapping or {},
        cudagraph_runtime_mode=cudagraph_runtime_mode,
    )  # fmt: skip
    try:
        yield
    finally:
        _forward_context[0] = previous


class BreakableCUDAGraphCapture:
    """compilation/breakable_cudagraph.py: a thread-local capture; `add_eager` ends the graph
    segment, runs the eager callable once and keeps it; `replay` calls every segment in
    order. Graph segments are not re-executed here: the tests replay the very batch they
    captured, whose static buffers already hold its values."""

    _local = threading.local()

    def __init__(self) -> None:
        self.segments: list[Callable[[], Any]] = []
        self._capturing = False

    @classmethod
    def current(cls) -> "BreakableCUDAGraphCapture | None":
        return getattr(cls._local, "capture", None)

    def __enter__(self) -> "BreakableCUDAGraphCapture":
        self._local.capture, self._capturing = self, True
        return self

    def __exit__(self, *exc: object) -> None:
        self._local.capture, self._capturing = None, False

    def add_eager(self, fn: Callable[[], Any]) -> Any:
        out = fn()
        self.segments.append(fn)
        return out

    def replay(self) -> None:
        for segment in self.segments:
            segment()


def eager_break_during_capture(fn: Callable) -> Callable:
    """0.33: always wraps. Under a capture the call becomes an eager segment holding `fn`,
    the undecorated function, which is what every replay calls."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        capture = BreakableCUDAGraphCapture.current()
        if capture is None or not capture._capturing:
            return fn(*args, **kwargs)
        if get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL:
            return fn(*args, **kwargs)
        return capture.add_eager(lambda: fn(*args, **kwargs))

    return wrapper


# === layers ===========================================================================


def _init(module: nn.Module, seed: int) -> None:
    """Weights that spread the indexer's scores as a trained model's are."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0 / p.shape[1] ** 0.5)


class LayerNorm(nn.Module):
    """layers/layernorm.py (0.24-0.29): fp32 parameters, computed in fp32, cast back."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x.float(), (self.dim,), self.weight, self.bias, self.eps).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (xf * self.weight.float()).to(x.dtype)


class MergedColumnParallelLinear(nn.Module):
    """Unquantized bf16 linear, returning (output, bias) as vLLM's linear layers do."""

    def __init__(self, in_features: int, out_features: int, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        _init(self, seed)
        self.weight.data = self.weight.data.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return nn.functional.linear(x, self.weight), None


class ReplicatedLinear(nn.Module):
    """An FP8 block-quantized linear (DeepSeek checkpoints): e4m3 weight with one fp32
    `weight_scale_inv` per 128x128 block; the GEMM quantizes the activation per 1x128 group
    (per_token_group_quant_fp8, amax clamp 1e-10) and accumulates in fp32, output bf16."""

    def __init__(self, in_features: int, out_features: int, seed: int) -> None:
        super().__init__()
        dense = nn.Linear(in_features, out_features, bias=False)
        _init(dense, seed)
        w = dense.weight.detach().reshape(out_features // 128, 128, in_features // 128, 128)
        scale = w.abs().amax(dim=(1, 3)) / E4M3_MAX
        codes = (w / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(out_features, in_features)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        rows, cols = self.weight.shape
        scale = self.weight_scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
        weight = self.weight.float() * scale[:rows, :cols]
        groups = x.float().reshape(x.shape[0], -1, 128)
        a_scale = groups.abs().amax(-1, keepdim=True).clamp_min(1e-10) * (1.0 / E4M3_MAX)
        a8 = (groups / a_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        activation = (a8.float() * a_scale).reshape(x.shape[0], -1)
        return (activation @ weight.t()).to(torch.bfloat16), None


class RotaryEmbedding(nn.Module):
    """layers/rotary_embedding/base.py: the cos/sin table in the model dtype, shared through
    get_rope's cache. Its forward methods match the table's dtype to the query's and keep
    the converted table (`_match_cos_sin_cache_dtype`)."""

    def __init__(self, rotary_dim: int, max_position: int, base: float, is_neox_style: bool) -> None:
        super().__init__()
        self.rotary_dim, self.is_neox_style = rotary_dim, is_neox_style
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        freqs = torch.einsum("i,j -> ij", torch.arange(max_position, dtype=torch.float), inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.bfloat16)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _match_cos_sin_cache_dtype(self, query: torch.Tensor) -> torch.Tensor:
        cache = self.cos_sin_cache
        if cache.device == query.device and cache.dtype == query.dtype:
            return cache
        self.cos_sin_cache = cache.to(query.device, dtype=query.dtype)
        return self.cos_sin_cache

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = self._match_cos_sin_cache_dtype(query)
        cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            shape = [cos.shape[0]] + [1] * (x.dim() - 2) + [cos.shape[1]]
            c, s = cos.reshape(shape), sin.reshape(shape)
            rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
            if self.is_neox_style:
                x1, x2 = rot.chunk(2, dim=-1)
                rot = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
            else:
                x1, x2 = rot[..., 0::2], rot[..., 1::2]
                rot = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
            return torch.cat([rot, rest], dim=-1)

        return rotate(query), None if key is None else rotate(key)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.forward_native(positions, query, key)


_ROPE_DICT: dict[tuple, RotaryEmbedding] = {}


def get_rope(
    rotary_dim: int, max_position: int, rope_parameters: dict, is_neox_style: bool
) -> RotaryEmbedding:
    """One module per configuration, shared by every layer (and, for an interleaved indexer,
    by the MLA and the indexer)."""
    key = (rotary_dim, max_position, rope_parameters["rope_theta"], is_neox_style)
    if key not in _ROPE_DICT:
        _ROPE_DICT[key] = RotaryEmbedding(
            rotary_dim, max_position, rope_parameters["rope_theta"], is_neox_style
        )
    return _ROPE_DICT[key]


# === the indexer kernels, from vLLM's source ===========================================


def _ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """exp2(ceil(log2(s))), as the kernels round a scale to a power of two."""
    return torch.exp2(torch.ceil(torch.log2(scale)))


def ue8m0_quantize(values: torch.Tensor, amax_clamp: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """`_fp8_ue8m0_quantize` (deepseek_v32/common/kernels.py) and `indexer_k_quant_and_cache`:
    one scale per 128 values, max(amax, clamp) / 448 rounded up to a power of two; the cast
    saturates (cvt.rn.satfinite)."""
    amax = values.abs().amax(-1, keepdim=True).clamp_min(amax_clamp)
    scale = _ue8m0(amax / E4M3_MAX)
    codes = (values / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale.squeeze(-1)


def _rotate_fp32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The kernels' in-register RoPE of the first 2 * cos.shape[-1] dims: x * cos + sign *
    partner * sin, interleaved pairs (2i, 2i+1) or NeoX halves (i, i + R/2)."""
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    if interleave:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rot, rest], dim=-1)


def _cos_sin(table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = table.index_select(0, positions).float()
    half = rows.shape[-1] // 2
    return rows[:, :half], rows[:, half:]


def fused_indexer_q_rope_quant(
    positions: torch.Tensor, q: torch.Tensor, cos_sin_cache: torch.Tensor, weights: torch.Tensor,
    softmax_scale: float, head_scale: float, is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """layers/sparse_attn_indexer.py 0.28 `_fused_indexer_q_rope_quant_kernel`: RoPE in fp32,
    rotated values rounded to bf16, one scale per (token, head) from max(amax, 1e-10) * (1 /
    448) rounded to a power of two, weights * q_scale * softmax_scale * head_scale."""
    cos, sin = _cos_sin(cos_sin_cache, positions)
    cos, sin = cos[:, None, :], sin[:, None, :]
    qf = q.float()
    if is_neox:
        x0, x1 = qf[..., :32], qf[..., 32:64]
    else:
        x0, x1 = qf[..., 0:64:2], qf[..., 1:64:2]
    r0 = (x0 * cos - x1 * sin).to(torch.bfloat16).float()
    r1 = (x1 * cos + x0 * sin).to(torch.bfloat16).float()
    nope = qf[..., 64:]
    amax = torch.maximum(torch.maximum(r0.abs().amax(-1), r1.abs().amax(-1)), nope.abs().amax(-1))
    scale = _ue8m0(amax.clamp_min(1e-10) * (1.0 / E4M3_MAX))[..., None]
    rot = torch.cat([r0, r1], -1) if is_neox else torch.stack([r0, r1], -1).flatten(-2)
    codes = (torch.cat([rot, nope], -1) / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, weights.float() * scale.squeeze(-1) * softmax_scale * head_scale


def cache_write(
    kv_cache: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
) -> None:
    """`_fp8_quant_and_cache_write`: block b holds its tokens' 128 code bytes, then their fp32
    scales (4 bytes each); negative slots (padding, other ranks) are not written."""
    keep = slots >= 0
    slots, codes, scales = slots[keep], codes[keep], scales[keep]
    flat = kv_cache.view(kv_cache.shape[0], -1)
    block, offset = slots // BLOCK, slots % BLOCK
    values = offset[:, None] * D + torch.arange(D)
    flat[block[:, None], values] = codes.contiguous().view(torch.uint8)
    scale_bytes = BLOCK * D + offset[:, None] * 4 + torch.arange(4)
    flat[block[:, None], scale_bytes] = scales.float().contiguous().view(torch.uint8).view(-1, 4)


def cache_gather(
    kv_cache: torch.Tensor, block_table: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cp_gather_indexer_k_quant_cache`: the first n keys of one request, codes and scales."""
    flat = kv_cache.view(kv_cache.shape[0], -1)
    pos = torch.arange(n)
    block, offset = block_table[pos // BLOCK].long(), pos % BLOCK
    codes = flat[block[:, None], offset[:, None] * D + torch.arange(D)].view(torch.float8_e4m3fn)
    scales = flat[block[:, None], BLOCK * D + offset[:, None] * 4 + torch.arange(4)].contiguous()
    return codes, scales.view(torch.float32).reshape(n)


def indexer_k_quant_and_cache(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    codes, scales = ue8m0_quantize(k.float(), amax_clamp=1e-4)
    cache_write(kv_cache, slot_mapping, codes, scales)


# What each sparse_attn_indexer call left in the shared buffer: (k-cache prefix, rows [:T]).
# The engine's own record, against which the tests check what the hooks recorded.
PRODUCTION: list[tuple[str, torch.Tensor]] = []


def sparse_attn_indexer(
    hidden_states: torch.Tensor, k_cache_prefix: str, kv_cache: torch.Tensor, q_quant: torch.Tensor,
    q_scale: torch.Tensor | None, k: torch.Tensor | None, weights: torch.Tensor, quant_block_size: int,
    scale_fmt: str | None, topk_tokens: int, head_dim: int, max_model_len: int, total_seq_lens: int,
    topk_indices_buffer: torch.Tensor, skip_k_cache_insert: bool, use_pcp: bool,
    dense_mha_metadata_layer_name: str, use_fp4_cache: bool = False, dcp_rank: int = 0,
    dcp_world_size: int = 1, cp_kv_cache_interleave_size: int = 1, skip_topk_buffer_clear: bool = False,
    topk_backend: str = "auto", logits_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # fmt: skip
    forward_context = get_forward_context()
    attn_metadata = forward_context.attn_metadata
    if not isinstance(attn_metadata, dict):  # profile run: workspace reservation only
        return topk_indices_buffer
    meta = attn_metadata[k_cache_prefix]
    num_tokens = meta.slot_mapping.shape[0]
    if not skip_k_cache_insert:
        assert k is not None
        indexer_k_quant_and_cache(k[:num_tokens], kv_cache, meta.slot_mapping)
    if forward_context.cudagraph_runtime_mode != CUDAGraphMode.FULL and dense_mha_metadata_layer_name:
        mla = attn_metadata.get(dense_mha_metadata_layer_name)
        if getattr(getattr(mla, "prefill", None), "use_dense_mha", False) and mla.num_decode_tokens == 0:
            PRODUCTION.append((k_cache_prefix, topk_indices_buffer[:num_tokens, :topk_tokens].clone()))
            return topk_indices_buffer  # "Deliberately leave the buffer untouched."
    if not skip_topk_buffer_clear:
        topk_indices_buffer[: hidden_states.shape[0]] = -1
    if meta.prefill is not None:
        # Under ShardQ the chunks index the shardq_gather_indices tokens (0.34.0
        # sparse_attn_indexer.py): q and weights gathered, the rows written packed.
        indices = getattr(meta.prefill, "shardq_gather_indices", None)
        if indices is not None:
            q_quant, weights = q_quant[indices.long()], weights[indices.long()]
        for chunk in meta.prefill.chunks:
            ks, ke = chunk.cu_seqlen_ks, chunk.cu_seqlen_ke
            for r in range(chunk.num_reqs):
                # The kernel scores the chunk's rows against all its gathered keys within
                # [ks, ke); one request at a time here, the same numbers.
                keys = int(chunk.cu_seq_lens[r + 1] - chunk.cu_seq_lens[r])
                k8, k_scale = cache_gather(kv_cache, chunk.block_table[r], keys)
                rows = (ks == chunk.cu_seq_lens[r]).nonzero().flatten() + chunk.token_start
                local = rows - chunk.token_start
                starts = torch.zeros_like(local)  # the request's keys were gathered from 0
                logits = mqa_logits(
                    q_quant[rows], weights[rows], k8, k_scale, starts, ke[local] - ks[local], logits_dtype
                )
                topk_indices_buffer[rows, :topk_tokens] = topk_positions(logits, starts, topk_tokens)
    if meta.decode is not None:
        row = 0
        for r in range(meta.num_decodes):
            n, seq_len = int(meta.decode.decode_lens[r]), int(meta.decode.seq_lens[r])
            k8, k_scale = cache_gather(kv_cache, meta.decode.block_table[r], seq_len)
            zeros = torch.zeros(n, dtype=torch.long)
            ends = torch.arange(seq_len - n + 1, seq_len + 1)
            logits = mqa_logits(
                q_quant[row : row + n], weights[row : row + n], k8, k_scale, zeros, ends, logits_dtype
            )
            topk_indices_buffer[row : row + n, :topk_tokens] = topk_positions(logits, zeros, topk_tokens)
            row += n
    PRODUCTION.append((k_cache_prefix, topk_indices_buffer[:num_tokens, :topk_tokens].clone()))
    return topk_indices_buffer


# === the deepseek_v2 path (0.28) ======================================================


class DeepseekV32IndexerCache(nn.Module):
    def __init__(self, head_dim: int, dtype: torch.dtype, prefix: str, cache_config: Any) -> None:
        super().__init__()
        self.kv_cache = torch.zeros(NUM_BLOCKS, cache_config.block_size, head_dim, dtype=dtype)
        self.head_dim, self.prefix, self.dtype = head_dim, prefix, dtype


class CustomOp(nn.Module):
    """model_executor/custom_op.py: the platform method is bound once, at construction
    (`forward_cuda` on CUDA with the op enabled, as --enforce-eager gives)."""

    def __init__(self) -> None:
        super().__init__()
        self._forward_method = self.forward_cuda

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)


class SparseAttnIndexer(CustomOp):
    def __init__(
        self, k_cache: Any, quant_block_size: int, scale_fmt: str, topk_tokens: int, head_dim: int,
        max_model_len: int, max_total_seq_len: int, topk_indices_buffer: torch.Tensor,
        skip_k_cache_insert: bool = False, use_fp4_cache: bool = False, compress_ratio: int = 1,
    ) -> None:  # fmt: skip
        super().__init__()
        self.k_cache, self.quant_block_size, self.scale_fmt = k_cache, quant_block_size, scale_fmt
        self.topk_tokens, self.head_dim, self.max_model_len = topk_tokens, head_dim, max_model_len
        self.max_total_seq_len, self.topk_indices_buffer = max_total_seq_len, topk_indices_buffer
        self.skip_k_cache_insert, self.use_fp4_cache = skip_k_cache_insert, use_fp4_cache
        self.compress_ratio, self.dense_mha_metadata_layer_name, self.use_pcp = compress_ratio, "", False

    def forward_native(self, hidden_states: Any, q_quant: Any, k: Any, weights: Any) -> torch.Tensor:
        return self.forward_cuda(hidden_states, q_quant, k, weights)

    def forward_cuda(self, hidden_states: Any, q_quant: Any, k: Any, weights: Any) -> torch.Tensor:
        q_values, q_scale = q_quant if isinstance(q_quant, tuple) else (q_quant, None)
        return sparse_attn_indexer(
            hidden_states, self.k_cache.prefix, self.k_cache.kv_cache, q_values, q_scale, k, weights,
            self.quant_block_size, self.scale_fmt, self.topk_tokens, self.head_dim, self.max_model_len,
            self.max_total_seq_len, self.topk_indices_buffer, self.skip_k_cache_insert, self.use_pcp,
            self.dense_mha_metadata_layer_name, self.use_fp4_cache,
        )  # fmt: skip


class Indexer(nn.Module):
    op_cls: type = SparseAttnIndexer  # the registered SparseAttnIndexer (register())

    def __init__(
        self, vllm_config: Any, config: Any, hidden_size: int, q_lora_rank: int, quant_config: Any,
        cache_config: Any, topk_indices_buffer: torch.Tensor, prefix: str = "", is_inplace_rope: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.vllm_config, self.config = vllm_config, config
        self.topk_tokens, self.n_head, self.head_dim = (
            config.index_topk,
            config.index_n_heads,
            config.index_head_dim,
        )
        self.rope_dim, self.q_lora_rank = config.qk_rope_head_dim, q_lora_rank
        seed = 100 + int(prefix.split("layers.")[1].split(".")[0])
        self.wq_b = ReplicatedLinear(q_lora_rank, self.head_dim * self.n_head, seed)
        self.wk_weights_proj = MergedColumnParallelLinear(hidden_size, self.head_dim + self.n_head, seed + 50)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        self.softmax_scale, self.scale_fmt, self.quant_block_size = self.head_dim**-0.5, "ue8m0", 128
        self.topk_indices_buffer = topk_indices_buffer
        self.k_cache = DeepseekV32IndexerCache(
            self.head_dim + 4, torch.uint8, f"{prefix}.k_cache", cache_config
        )
        self.max_model_len, self.prefix, self.max_total_seq_len = MAX_POSITION, prefix, MAX_TOKENS
        self.indexer_op = type(self).op_cls(
            self.k_cache, self.quant_block_size, self.scale_fmt, self.topk_tokens, self.head_dim,
            self.max_model_len, self.max_total_seq_len, self.topk_indices_buffer,
        )  # fmt: skip
        self.is_inplace_rope, self.n_head_scale, self.use_fused_indexer_q = (
            is_inplace_rope,
            self.n_head**-0.5,
            True,
        )

    def forward(
        self, hidden_states: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rotary_emb: Any
    ) -> torch.Tensor:
        q, _ = self.wq_b(qr)
        q = q.view(-1, self.n_head, self.head_dim)
        kw, _ = self.wk_weights_proj(hidden_states)
        k, weights = kw[:, : self.head_dim], kw[:, self.head_dim :]
        k = self.k_norm(k)
        k_pe, k_nope = torch.split(k, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        q_fp8, weights = fused_indexer_q_rope_quant(
            positions, q, rotary_emb.cos_sin_cache, weights, self.softmax_scale, self.n_head_scale,
            rotary_emb.is_neox_style,
        )  # fmt: skip
        k_pe = k_pe.unsqueeze(1)
        _, k_pe = rotary_emb(positions, torch.empty_like(k_pe), k_pe)
        k = torch.cat([k_pe.reshape(-1, self.rope_dim), k_nope], dim=-1)
        return self.indexer_op(hidden_states, q_fp8, k, weights)


class DeepseekV2MLAAttention(nn.Module):
    """DeepseekV2MLAAttention with the MultiHeadLatentAttentionWrapper it delegates to
    (layers/mla.py): q_c = q_a_layernorm(q LoRA), then the indexer, then (here) a stand-in
    attention output. The wrapper names the MLA layer for the dense-MHA skip (0.28)."""

    indexer_cls: type = Indexer

    def __init__(self, vllm_config: Any, config: Any, prefix: str, topk_indices_buffer: torch.Tensor) -> None:
        super().__init__()
        layer = int(prefix.split("layers.")[1].split(".")[0])
        self.fused_qkv_a_proj = MergedColumnParallelLinear(HIDDEN, Q_LORA, seed=300 + layer)
        self.q_a_layernorm = RMSNorm(Q_LORA)
        self.o_proj = MergedColumnParallelLinear(Q_LORA, HIDDEN, seed=400 + layer)
        interleave = getattr(config, "indexer_rope_interleave", False)
        self.indexer_rope_emb = get_rope(ROPE, MAX_POSITION, config.rope_parameters, not interleave)
        self.indexer = type(self).indexer_cls(
            vllm_config, config, HIDDEN, Q_LORA, None, vllm_config.cache_config, topk_indices_buffer,
            prefix=f"{prefix}.indexer",
        )  # fmt: skip
        self.layer_name = f"{prefix}.attn"
        self.indexer.indexer_op.dense_mha_metadata_layer_name = self.layer_name
        self.is_sparse, self.skip_topk = True, False

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, llama_4_scaling: Any = None
    ) -> torch.Tensor:
        q_c = self.q_a_layernorm(self.fused_qkv_a_proj(hidden_states)[0])
        if self.indexer is not None and self.is_sparse and not self.skip_topk:
            self.indexer(hidden_states, q_c, positions, self.indexer_rope_emb)
        return self.o_proj(torch.tanh(q_c.float()).to(torch.bfloat16))[0]


class DeepseekV2DecoderLayer(nn.Module):
    attention_cls: type = DeepseekV2MLAAttention

    def __init__(self, vllm_config: Any, config: Any, prefix: str, topk_indices_buffer: torch.Tensor) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.self_attn = type(self).attention_cls(
            vllm_config, config, f"{prefix}.self_attn", topk_indices_buffer=topk_indices_buffer
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states), None)


class DeepseekV2Model(nn.Module):
    layer_cls: type = DeepseekV2DecoderLayer

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        gen = torch.Generator().manual_seed(7)
        self.embed_tokens = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen).to(torch.bfloat16))
        self.topk_indices_buffer = torch.empty(MAX_TOKENS, config.index_topk, dtype=torch.int32)
        self.layers = nn.ModuleList(
            type(self).layer_cls(vllm_config, config, f"model.layers.{i}", self.topk_indices_buffer)
            for i in range(config.num_hidden_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens[input_ids]
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return hidden


class DeepseekV2ForCausalLM(nn.Module):
    model_cls: type = DeepseekV2Model

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = vllm_config.model_config.hf_config
        self.model = type(self).model_cls(vllm_config=vllm_config, prefix="model")

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None,
        inputs_embeds: Any = None,
    ) -> torch.Tensor:  # fmt: skip
        return self.model(input_ids, positions)


# === the deepseek_v32 path (0.29 / 0.33) ==============================================


class DeepseekV32Indexer(nn.Module):
    """Holds the indexer's modules; no forward."""

    def __init__(
        self, vllm_config: Any, config: Any, hidden_size: int, q_lora_rank: int, quant_config: Any,
        cache_config: Any, topk_indices_buffer: torch.Tensor, prefix: str = "",
    ) -> None:  # fmt: skip
        super().__init__()
        self.topk_tokens, self.n_head, self.head_dim = (
            config.index_topk,
            config.index_n_heads,
            config.index_head_dim,
        )
        self.rope_dim, self.q_lora_rank = config.qk_rope_head_dim, q_lora_rank
        seed = 100 + int(prefix.split("layers.")[1].split(".")[0])
        self.wq_b = ReplicatedLinear(q_lora_rank, self.head_dim * self.n_head, seed)
        self.wk_weights_proj = MergedColumnParallelLinear(hidden_size, self.head_dim + self.n_head, seed + 50)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        self.softmax_scale, self.scale_fmt, self.quant_block_size = self.head_dim**-0.5, "ue8m0", 128
        self.topk_indices_buffer = topk_indices_buffer
        self.k_cache = DeepseekV32IndexerCache(
            self.head_dim + 4, torch.uint8, f"{prefix}.k_cache", cache_config
        )
        self.max_model_len, self.prefix, self.max_total_seq_len = MAX_POSITION, prefix, MAX_TOKENS
        self.indexer_op = SparseAttnIndexer(
            self.k_cache, self.quant_block_size, self.scale_fmt, self.topk_tokens, self.head_dim,
            self.max_model_len, self.max_total_seq_len, self.topk_indices_buffer,
        )  # fmt: skip
        dtype = vllm_config.attention_config.indexer_logits_dtype
        if dtype is not None:  # 0.34: the op's logits dtype and decode top-k backend
            self.indexer_op.logits_dtype = getattr(torch, dtype)
            self.indexer_op.topk_backend = "auto"


def fused_norm_rope(
    positions: torch.Tensor, q_c: torch.Tensor, q_norm: RMSNorm, index_k: torch.Tensor | None, k_norm: Any,
    index_table: torch.Tensor | None, topk_indices_buffer: torch.Tensor, slot_mapping: torch.Tensor | None,
    indexer_k_cache: torch.Tensor | None, interleave: bool,
) -> torch.Tensor:  # fmt: skip
    """common/kernels.py `_fused_norm_rope_kernel`, the parts that concern the indexer:
    program 3 clears the top-k rows of every token (padding included) to -1; program 2
    RMSNorms the q LoRA; program 0 LayerNorms index K in fp32 (mean, then the variance of the
    differences, rsqrt), ropes it with the indexer's table and quantizes it into the cache
    from fp32 registers (no bf16 rounding)."""
    if index_k is not None:
        topk_indices_buffer[: positions.shape[0], :TOPK] = -1
    q_c = q_norm(q_c)
    if index_k is not None and indexer_k_cache is not None and slot_mapping is not None:
        x = index_k.float()
        mean = x.sum(-1, keepdim=True) / D
        diff = x - mean
        rstd = torch.rsqrt((diff * diff).sum(-1, keepdim=True) / D + k_norm.eps)
        normed = diff * rstd * k_norm.weight.float() + k_norm.bias.float()
        assert index_table is not None
        cos, sin = _cos_sin(index_table, positions)
        codes, scales = ue8m0_quantize(_rotate_fp32(normed, cos, sin, interleave), amax_clamp=1e-4)
        cache_write(indexer_k_cache, slot_mapping[: positions.shape[0]], codes, scales)
    return q_c


def fused_q(
    positions: torch.Tensor, index_q: torch.Tensor, index_table: torch.Tensor, index_weights: torch.Tensor,
    softmax_scale: float, head_scale: float, interleave: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """common/kernels.py `_fused_q_kernel` program 1: index q roped in fp32 from the bf16
    GEMM output, `_fp8_ue8m0_quantize` per (token, head) (amax clamp 1e-4, no bf16 rounding),
    weights * q_scale * softmax_scale * head_scale."""
    cos, sin = _cos_sin(index_table, positions)
    roped = _rotate_fp32(index_q.float(), cos[:, None, :], sin[:, None, :], interleave)
    codes, scale = ue8m0_quantize(roped, amax_clamp=1e-4)
    weights = index_weights.float() * scale
    weights = weights * softmax_scale
    return codes, weights * head_scale


class DeepseekV32Attention(nn.Module):
    """models/deepseek_v32/attention.py (an MLAAttention: `_vllm_config`, `layer_name`,
    `use_pcp`). The MLA itself is reduced to a stand-in output; the indexer is whole."""

    indexer_cls: type = DeepseekV32Indexer

    def __init__(
        self, vllm_config: Any, config: Any, prefix: str, topk_indices_buffer: torch.Tensor | None = None,
        attn_backend: Any = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self._vllm_config, self.layer_name, self.use_pcp = vllm_config, f"{prefix}.attn", False
        layer = int(prefix.split("layers.")[1].split(".")[0])
        self.indexer = type(self).indexer_cls(
            vllm_config, config, config.hidden_size, config.q_lora_rank, None, vllm_config.cache_config,
            topk_indices_buffer, prefix=f"{prefix}.indexer",
        )  # fmt: skip
        self.topk_indices_buffer, self.skip_topk = topk_indices_buffer, False
        self._dense_mha_metadata_layer_name = self.layer_name
        # mla_attention.py (0.34): ShardQ on for the layer, flagged on the indexer's k cache too
        self.use_shardq = (
            vllm_config.attention_config.sparse_mla_shard_q
            and vllm_config.parallel_config.tensor_parallel_size > 1
        )
        if self.use_shardq:
            self.indexer.k_cache.use_shardq = True
        self._index_rope_interleave = getattr(config, "indexer_rope_interleave", False)
        self.fused_qkv_a_proj = MergedColumnParallelLinear(HIDDEN, Q_LORA, seed=300 + layer)
        self.q_a_layernorm = RMSNorm(Q_LORA)
        self.o_proj = MergedColumnParallelLinear(Q_LORA, HIDDEN, seed=400 + layer)
        self.rotary_emb = get_rope(ROPE, MAX_POSITION, config.rope_parameters, is_neox_style=False)
        self.indexer_rope_emb = get_rope(
            ROPE, MAX_POSITION, config.rope_parameters, not self._index_rope_interleave
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q_c = self.fused_qkv_a_proj(hidden_states)[0]
        indexer = self.indexer
        index_k = index_weights = None
        if indexer is not None and not self.skip_topk:
            kw = indexer.wk_weights_proj(hidden_states)[0]
            index_k, index_weights = kw[:, : indexer.head_dim], kw[:, indexer.head_dim :]
        output = torch.empty(hidden_states.shape[0], Q_LORA, dtype=hidden_states.dtype)
        forward_context = get_forward_context()
        slot = forward_context.slot_mapping.get(self.layer_name)
        has_indexer = indexer is not None and not self.skip_topk
        q_c = fused_norm_rope(
            positions, q_c, self.q_a_layernorm, index_k, indexer.k_norm if has_indexer else None,
            self.indexer_rope_emb.cos_sin_cache if has_indexer else None, self.topk_indices_buffer, slot,
            indexer.k_cache.kv_cache if has_indexer and forward_context.attn_metadata is not None else None,
            self._index_rope_interleave,
        )  # fmt: skip
        index_q_fp8 = index_weights_out = None
        if indexer is not None and not self.skip_topk:
            assert index_weights is not None
            index_q = indexer.wq_b(q_c)[0].view(-1, indexer.n_head, indexer.head_dim)
            index_q_fp8, index_weights_out = fused_q(
                positions, index_q, self.indexer_rope_emb.cos_sin_cache, index_weights, indexer.softmax_scale,
                indexer.n_head**-0.5, self._index_rope_interleave,
            )  # fmt: skip
        self._sparse_indexer_and_attn(
            positions, q_c, None, None, index_q_fp8, None, index_weights_out, None, None, None, None, output
        )
        return self.o_proj(output)[0]

    @eager_break_during_capture
    def _sparse_indexer_and_attn(
        self, positions: torch.Tensor, q_c: torch.Tensor, q_nope: Any, q_pe: Any, index_q_fp8: Any,
        index_k: Any, index_weights_out: Any, kv_c: Any, k_pe: Any, ql_nope: Any, mqa_q: Any,
        output: torch.Tensor,
    ) -> None:  # fmt: skip
        indexer = self.indexer
        if indexer is not None and not self.skip_topk:
            op = indexer.indexer_op  # 0.34 passes the op's top-k backend and logits dtype
            newer = (
                {"topk_backend": op.topk_backend, "logits_dtype": op.logits_dtype}
                if hasattr(op, "logits_dtype")
                else {}
            )
            sparse_attn_indexer(
                q_c, indexer.k_cache.prefix, indexer.k_cache.kv_cache, index_q_fp8, None, index_k,
                index_weights_out, indexer.quant_block_size, indexer.scale_fmt, indexer.topk_tokens,
                indexer.head_dim, indexer.max_model_len, indexer.max_total_seq_len, self.topk_indices_buffer,
                skip_k_cache_insert=not self.use_pcp, use_pcp=self.use_pcp,
                dense_mha_metadata_layer_name=self._dense_mha_metadata_layer_name,
                skip_topk_buffer_clear=True,
                **newer,
            )  # fmt: skip
        output.copy_(torch.tanh(q_c.float()).to(output.dtype))


class DeepseekV32DecoderLayer(nn.Module):
    """nvidia/model.py: the attention is called with keyword arguments."""

    attention_cls: type = DeepseekV32Attention

    def __init__(self, vllm_config: Any, config: Any, prefix: str, topk_indices_buffer: torch.Tensor) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.self_attn = type(self).attention_cls(
            vllm_config, config, prefix=f"{prefix}.self_attn", topk_indices_buffer=topk_indices_buffer
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(hidden_states)
        return hidden_states + self.self_attn(positions=positions, hidden_states=x)


class DeepseekV32Model(DeepseekV2Model):
    layer_cls: type = DeepseekV32DecoderLayer


# === the model runners ================================================================


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)  # a prefix-cache hit's cached blocks


@dataclass
class SchedulerOutput:
    """v1/core/sched/output.py, the fields the runners read."""

    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class _Request:
    tokens: list[int]  # prompt, then generated tokens
    prompt: int
    computed: int = 0
    blocks: list[int] = field(default_factory=list)


@dataclass
class StepRecord:
    """What the runner laid out for one forward: the tests' own view of the batch."""

    req_ids: list[str]
    starts: list[int]
    computed: list[int]
    gather: list[int] | None = None  # ShardQ: buffer row r holds global row gather[r]


class _States:
    """The runners' request states: tokens, computed counts, KV blocks (freed blocks are
    reused by later requests), and the per-forward attention metadata built from them."""

    def __init__(self, config: Any, vllm_config: Any) -> None:
        self.config, self.vllm_config = config, vllm_config
        self.requests: dict[str, _Request] = {}
        self.free = list(range(NUM_BLOCKS))
        self.history: list[StepRecord] = []

    def update(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            req = self.requests.pop(req_id, None)
            if req is not None:
                self.free = req.blocks + self.free
        for new in so.scheduled_new_reqs:
            ids = list(new.prompt_token_ids)
            # A prefix-cache hit starts computed up to its cached blocks, which it shares.
            self.requests[new.req_id] = _Request(ids, len(ids), new.num_computed_tokens, list(new.block_ids))

    def layout(self, order: list[str], so: SchedulerOutput, pad: int) -> dict[str, Any]:
        """Rows, positions, slots and the indexer's and MLA's metadata for `order`."""
        counts = [so.num_scheduled_tokens[r] for r in order]
        starts = np.zeros(len(order) + 1, dtype=np.int32)
        np.cumsum(counts, out=starts[1:])
        total = int(starts[-1])
        padded = -(-total // pad) * pad
        ids, positions, slots = [], [], []
        for r, n in zip(order, counts, strict=True):
            req = self.requests[r]
            while len(req.blocks) * BLOCK < req.computed + n:
                req.blocks.append(self.free.pop(0))
            span = range(req.computed, req.computed + n)
            ids += [req.tokens[p] for p in span]
            positions += list(span)
            slots += [req.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in span]
        self.history.append(
            StepRecord(list(order), starts.tolist(), [self.requests[r].computed for r in order])
        )
        decodes = 0
        while decodes < len(order) and counts[decodes] <= 1:  # split_decodes_and_prefills, threshold 1
            decodes += 1
        seq_lens = [self.requests[r].computed + n for r, n in zip(order, counts, strict=True)]
        gather = shardq_gather(self.vllm_config, counts, decodes, seq_lens, self.config.index_topk)
        self.history[-1].gather = gather
        meta = self._indexer_metadata(order, counts, starts, decodes, torch.tensor(slots), gather)
        prefill_lens = [
            self.requests[r].computed + n for r, n in zip(order[decodes:], counts[decodes:], strict=True)
        ]
        dense = (
            bool(prefill_lens)
            and decodes == 0
            and max(prefill_lens) <= self.config.index_topk
            and not self.vllm_config.attention_config.sparse_mla_force_mqa
        )  # sparse_mla_attention.py: prefill_max_seq_len <= topk_tokens and not force_mqa
        mla = SimpleNamespace(
            num_decode_tokens=int(starts[decodes]), num_actual_tokens=total,
            prefill=SimpleNamespace(use_dense_mha=dense) if len(order) > decodes else None,
        )  # fmt: skip
        metadata: dict[str, Any] = {}
        slot_mapping: dict[str, torch.Tensor] = {}
        padded_slots = torch.tensor(slots + [-1] * (padded - total))
        for i in range(self.config.num_hidden_layers):
            metadata[f"model.layers.{i}.self_attn.indexer.k_cache"] = meta
            metadata[f"model.layers.{i}.self_attn.attn"] = mla
            slot_mapping[f"model.layers.{i}.self_attn.attn"] = padded_slots
        return {
            "starts": starts, "total": total, "padded": padded, "order": order,
            "input_ids": torch.tensor(ids + [0] * (padded - total)),
            "positions": torch.tensor(positions + [0] * (padded - total), dtype=torch.int64),
            "metadata": metadata, "slot_mapping": slot_mapping,
        }  # fmt: skip

    def _indexer_metadata(
        self, order: list[str], counts: list[int], starts: np.ndarray, decodes: int, slots: torch.Tensor,
        gather: list[int] | None = None,
    ) -> Any:  # fmt: skip
        """v1/attention/backends/mla/indexer.py DeepseekV32IndexerMetadata: decode requests
        first; one prefill chunk whose per-token [ks, ke) index the chunk's gathered keys.
        Under ShardQ (`gather`), the chunk's rows are this rank's tokens, packed: compact row
        c is global row gather[c], and the prefill metadata carries the gather indices."""
        reqs = [self.requests[r] for r in order]
        width = max(len(r.blocks) for r in reqs)

        def table(rs: list[_Request]) -> torch.Tensor:
            return torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in rs], dtype=torch.int32)

        decode = prefill = None
        if decodes:
            decode = SimpleNamespace(
                block_table=table(reqs[:decodes]), decode_lens=torch.tensor(counts[:decodes]),
                seq_lens=torch.tensor([r.computed + n for r, n in zip(reqs, counts[:decodes], strict=False)]),
                requires_padding=False,
            )  # fmt: skip
        if decodes < len(order):
            seq_lens = [r.computed + n for r, n in zip(reqs[decodes:], counts[decodes:], strict=True)]
            cu = np.concatenate([[0], np.cumsum(seq_lens)])
            ks, ke = [], []
            for j, (r, n) in enumerate(zip(reqs[decodes:], counts[decodes:], strict=True)):
                ks += [int(cu[j])] * n
                ke += [int(cu[j]) + r.computed + i + 1 for i in range(n)]
            token_end = int(starts[-1])
            if gather is not None:  # the rank's rows only, in gather order
                first = int(starts[decodes])
                mine = [g - first for g in gather if g >= first]
                ks, ke = [ks[i] for i in mine], [ke[i] for i in mine]
                token_end = len(gather)
            chunk = SimpleNamespace(
                block_table=table(reqs[decodes:]), cu_seqlen_ks=torch.tensor(ks),
                cu_seqlen_ke=torch.tensor(ke),
                cu_seq_lens=torch.tensor(cu), token_start=int(starts[decodes]), token_end=token_end,
                num_reqs=len(order) - decodes, total_seq_lens=int(cu[-1]), skip_kv_gather=False,
                local_cu_seq_lens=torch.tensor(cu), local_total_seq_lens=int(cu[-1]),
                max_local_total_seq_lens=int(cu[-1]),
            )  # fmt: skip
            gathered = None if gather is None else torch.tensor(gather, dtype=torch.int32)
            prefill = SimpleNamespace(chunks=[chunk], shardq_gather_indices=gathered)
        return SimpleNamespace(
            seq_lens=None, max_seq_len=0, slot_mapping=slots, num_decodes=decodes,
            num_decode_tokens=int(starts[decodes]), num_prefills=len(order) - decodes,
            num_prefill_tokens=int(starts[-1] - starts[decodes]), decode=decode, prefill=prefill,
        )  # fmt: skip

    def advance(self, order: list[str], so: SchedulerOutput) -> None:
        """After the forward: the rows are computed; a request past its prompt samples a
        token (a fixed function of what it holds)."""
        for r in order:
            req = self.requests[r]
            req.computed += so.num_scheduled_tokens[r]
            if req.computed >= req.prompt and req.computed == len(req.tokens):
                req.tokens.append((sum(req.tokens[-3:]) * 7 + len(req.tokens)) % VOCAB)


class CpuGpuBuffer:
    def __init__(self, size: int) -> None:
        self.np = np.zeros(size, dtype=np.int32)


class InputBatchV1:
    """v1/worker/gpu_input_batch.py InputBatch: batch-aligned arrays, `req_ids` a property."""

    def __init__(self, max_reqs: int) -> None:
        self._req_ids: list[str | None] = []
        self.num_computed_tokens_cpu = np.zeros(max_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_reqs, dtype=np.int32)

    @property
    def req_ids(self) -> list[str]:
        return [r for r in self._req_ids if r is not None]

    @property
    def num_reqs(self) -> int:
        return len(self._req_ids)


class GPUModelRunnerV1:
    """v1/worker/gpu_model_runner.py GPUModelRunner."""

    def __init__(self, model: nn.Module, vllm_config: Any) -> None:
        self.model, self.vllm_config = model, vllm_config
        self.states = _States(vllm_config.model_config.hf_config, vllm_config)
        self.input_batch = InputBatchV1(16)
        self.query_start_loc = CpuGpuBuffer(17)
        self.full_graph = False  # the next steps replay a FULL CUDA graph (Engine.step)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput, intermediate_tensors: Any = None) -> Any:
        self._update_states(scheduler_output)
        req_ids = self.input_batch.req_ids
        batch = self.states.layout(req_ids, scheduler_output, pad=1)
        self.query_start_loc.np[: len(req_ids) + 1] = batch["starts"]
        with set_forward_context(batch["metadata"], self.vllm_config, slot_mapping=batch["slot_mapping"]):
            out = self._model_forward(input_ids=batch["input_ids"], positions=batch["positions"])
        self.states.advance(req_ids, scheduler_output)
        return out

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Drops finished requests, adds new ones, then `_may_reorder_batch`: decode ->
        extend -> prefill (reorder_batch_to_split_decodes_and_prefills)."""
        self.states.update(scheduler_output)
        scheduled = [r for r in scheduler_output.num_scheduled_tokens if r in self.states.requests]

        def region(r: str) -> int:
            req, n = self.states.requests[r], scheduler_output.num_scheduled_tokens[r]
            return 0 if req.computed > 0 and n <= 1 else (1 if req.computed > 0 else 2)

        order = sorted(scheduled, key=region)
        self.input_batch._req_ids = list(order)
        for i, r in enumerate(order):
            self.input_batch.num_computed_tokens_cpu[i] = self.states.requests[r].computed
            self.input_batch.num_prompt_tokens[i] = self.states.requests[r].prompt

    def _model_forward(
        self, input_ids: Any = None, positions: Any = None, intermediate_tensors: Any = None,
        inputs_embeds: Any = None, **model_kwargs: Any,
    ) -> Any:  # fmt: skip
        if self.full_graph:
            # CUDAGraphWrapper replays a FULL graph (uniform decode batches under the default
            # FULL_AND_PIECEWISE mode): none of the model's Python runs.
            return None
        return self.model(
            input_ids=input_ids, positions=positions, intermediate_tensors=intermediate_tensors,
            inputs_embeds=inputs_embeds, **model_kwargs,
        )  # fmt: skip

    @torch.inference_mode()
    def _dummy_run(self, num_tokens: int, is_profile: bool = False) -> Any:
        """Profile and warm-up: its own forward context (no metadata), not _model_forward."""
        positions = torch.arange(num_tokens)
        with set_forward_context(None, self.vllm_config):
            return self.model(input_ids=torch.zeros(num_tokens, dtype=torch.long), positions=positions)


@dataclass
class InputBatchV2:
    """v1/worker/gpu/input_batch.py InputBatch (the fields the runner and the model read)."""

    req_ids: list[str]
    num_reqs: int
    num_scheduled_tokens: np.ndarray
    num_tokens: int
    num_tokens_after_padding: int
    num_draft_tokens: int
    query_start_loc_np: np.ndarray
    num_computed_tokens_np: np.ndarray
    prefill_len_np: np.ndarray
    is_prefilling_np: np.ndarray
    input_ids: torch.Tensor
    positions: torch.Tensor


def sort_batch_req_ids(so: SchedulerOutput) -> list[str]:
    """gpu/model_runner.py: decode-like requests lead, then by query length (stable)."""
    tokens, drafts = so.num_scheduled_tokens, so.scheduled_spec_decode_tokens
    return sorted(tokens, key=lambda r: (not drafts.get(r), tokens[r] != 1, tokens[r]))


class GPUModelRunnerV2:
    """v1/worker/gpu/model_runner.py GPUModelRunner (0.33)."""

    def __init__(self, model: nn.Module, vllm_config: Any) -> None:
        self.model, self.vllm_config = model, vllm_config
        self.states = _States(vllm_config.model_config.hf_config, vllm_config)
        self.pcp_manager = self.adaptive_verification = None
        self._batch: dict[str, Any] = {}
        self.graph: BreakableCUDAGraphCapture | None = None
        self.full_graph = False  # the next steps replay a FULL CUDA graph (Engine.step)

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, intermediate_tensors: Any = None, dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False, is_profile: bool = False, context_len: int = 0,
        valid_dummy_state_slots: bool = False, randomize_inputs: bool = False,
    ) -> Any:  # fmt: skip
        if dummy_run:
            # InputBatch.make_dummy: random request ids, no prepare_inputs.
            tokens = scheduler_output.total_num_scheduled_tokens
            with set_forward_context(None, self.vllm_config):
                return self.model(
                    input_ids=torch.zeros(tokens, dtype=torch.long), positions=torch.arange(tokens)
                )
        self.states.update(scheduler_output)
        order = sort_batch_req_ids(scheduler_output)
        input_batch = self.prepare_inputs(scheduler_output, order, None, 0)
        batch = self._batch
        if self.full_graph:
            # A FULL CUDA graph replayed (uniform decode batches under the default
            # FULL_AND_PIECEWISE mode): none of the model's Python runs.
            with set_forward_context(
                batch["metadata"], self.vllm_config, batch["slot_mapping"], CUDAGraphMode.FULL
            ):
                out = None
        elif self.graph is not None:
            # run_pw_graph: a breakable graph's segments replayed inside the step's context.
            with set_forward_context(
                batch["metadata"], self.vllm_config, batch["slot_mapping"], CUDAGraphMode.PIECEWISE
            ):
                self.graph.replay()
            out = None
        else:
            with set_forward_context(batch["metadata"], self.vllm_config, slot_mapping=batch["slot_mapping"]):
                out = self.model(input_ids=input_batch.input_ids, positions=input_batch.positions)
        self.states.advance(order, scheduler_output)
        return out

    def capture_model(self, scheduler_output: SchedulerOutput) -> None:
        """capture_model with a breakable capture, here of the very batch the next step
        runs (so that replaying its eager segments recomputes that step): its own forward
        context, no prepare_inputs."""
        self.states.update(scheduler_output)
        order = sort_batch_req_ids(scheduler_output)
        batch = self.states.layout(order, scheduler_output, pad=PAD)
        self.states.history.pop()
        self.graph = BreakableCUDAGraphCapture()
        with (
            self.graph,
            set_forward_context(
                batch["metadata"], self.vllm_config, batch["slot_mapping"], CUDAGraphMode.PIECEWISE
            ),
        ):
            self.model(input_ids=batch["input_ids"], positions=batch["positions"])

    def prepare_inputs(
        self, scheduler_output: SchedulerOutput, batch_req_state: Any, batch_desc: Any, num_active_loras: int
    ) -> InputBatchV2:
        order = list(batch_req_state)
        batch = self._batch = self.states.layout(order, scheduler_output, pad=PAD)
        reqs = [self.states.requests[r] for r in order]
        return InputBatchV2(
            req_ids=order, num_reqs=len(order),
            num_scheduled_tokens=np.diff(batch["starts"]).astype(np.int32), num_tokens=batch["total"],
            num_tokens_after_padding=batch["padded"], num_draft_tokens=0, query_start_loc_np=batch["starts"],
            num_computed_tokens_np=np.array([r.computed for r in reqs], dtype=np.int32),
            prefill_len_np=np.array([r.prompt for r in reqs], dtype=np.int32),
            is_prefilling_np=np.array([r.computed < r.prompt for r in reqs]),
            input_ids=batch["input_ids"], positions=batch["positions"],
        )  # fmt: skip

    def _dummy_run(self, num_tokens: int, is_profile: bool = False) -> Any:
        return self.execute_model(
            SchedulerOutput({"dummy": num_tokens}), dummy_run=True, is_profile=is_profile
        )


# === registration =====================================================================


@dataclass
class Fake:
    """The registered fake vLLM: its modules, by the names the adapter targets."""

    modules: dict[str, ModuleType]

    def __getitem__(self, name: str) -> ModuleType:
        return self.modules[name]


def register(monkeypatch: Any, version: str = "0.33.0", newer_attention: bool = False) -> Fake:
    """Puts the fake vLLM into sys.modules for the test, with fresh classes (the adapter
    patches classes; each test gets its own). `newer_attention`: `_sparse_indexer_and_attn`
    takes one more parameter, as a release the adapter was not written for might."""
    PRODUCTION.clear()
    _ROPE_DICT.clear()

    def sub(base: type, name: str | None = None, **attrs: Any) -> type:
        return type(name or base.__name__, (base,), attrs)

    op = sub(SparseAttnIndexer)
    indexer = sub(Indexer, op_cls=op)
    mla = sub(DeepseekV2MLAAttention, indexer_cls=indexer)
    causal_lm = sub(
        DeepseekV2ForCausalLM,
        model_cls=sub(DeepseekV2Model, layer_cls=sub(DeepseekV2DecoderLayer, attention_cls=mla)),
    )
    attrs = {"_sparse_indexer_and_attn": _newer_sparse_indexer_and_attn} if newer_attention else {}
    attention = sub(DeepseekV32Attention, **attrs)
    v32_model = sub(DeepseekV32Model, layer_cls=sub(DeepseekV32DecoderLayer, attention_cls=attention))
    modules = {
        "vllm": register_module(monkeypatch, "vllm", __version__=version),
        "vllm.forward_context": register_module(
            monkeypatch, "vllm.forward_context", ForwardContext=ForwardContext,
            get_forward_context=get_forward_context, set_forward_context=set_forward_context,
        ),
        "vllm.compilation.breakable_cudagraph": register_module(
            monkeypatch, "vllm.compilation.breakable_cudagraph",
            BreakableCUDAGraphCapture=BreakableCUDAGraphCapture,
            eager_break_during_capture=eager_break_during_capture,
        ),
        OP_MODULE: register_module(
            monkeypatch, OP_MODULE, SparseAttnIndexer=op, sparse_attn_indexer=sparse_attn_indexer
        ),
        V2_MODULE: register_module(
            monkeypatch, V2_MODULE, Indexer=indexer, DeepseekV2MLAAttention=mla,
            DeepseekV2ForCausalLM=causal_lm,
            DeepseekV3ForCausalLM=sub(causal_lm, "DeepseekV3ForCausalLM"),
            GlmMoeDsaForCausalLM=sub(causal_lm, "GlmMoeDsaForCausalLM"),
            DeepseekV32IndexerCache=DeepseekV32IndexerCache,
        ),
        V32_MODULE: register_module(
            monkeypatch, V32_MODULE, DeepseekV32Attention=attention, DeepseekV32Indexer=DeepseekV32Indexer,
            sparse_attn_indexer=sparse_attn_indexer, eager_break_during_capture=eager_break_during_capture,
        ),
        # nvidia/model.py: DeepseekV32ForCausalLM(DeepseekV2ForCausalLM) with its own model_cls.
        NVIDIA_MODULE: register_module(
            monkeypatch, NVIDIA_MODULE,
            DeepseekV32ForCausalLM=sub(causal_lm, "DeepseekV32ForCausalLM", model_cls=v32_model),
        ),
        RUNNER_V1_MODULE: register_module(
            monkeypatch, RUNNER_V1_MODULE, GPUModelRunner=sub(GPUModelRunnerV1, "GPUModelRunner")
        ),
        RUNNER_V2_MODULE: register_module(
            monkeypatch, RUNNER_V2_MODULE, GPUModelRunner=sub(GPUModelRunnerV2, "GPUModelRunner")
        ),
    }  # fmt: skip
    return Fake(modules)


@eager_break_during_capture
def _newer_sparse_indexer_and_attn(
    self: Any, positions: torch.Tensor, q_c: torch.Tensor, q_nope: Any, q_pe: Any, index_q_fp8: Any,
    index_k: Any, index_weights_out: Any, kv_c: Any, k_pe: Any, ql_nope: Any, mqa_q: Any,
    output: torch.Tensor, index_group: Any = None,
) -> None:  # fmt: skip
    DeepseekV32Attention._sparse_indexer_and_attn.__wrapped__(  # type: ignore[attr-defined]
        self, positions, q_c, q_nope, q_pe, index_q_fp8, index_k, index_weights_out, kv_c, k_pe, ql_nope,
        mqa_q, output,
    )  # fmt: skip


class Engine:
    """One vLLM process of the stand-in: a model on one path, the runner that drives it,
    and what production computed (the buffer after every indexer call)."""

    def __init__(
        self, fake: Fake, path: str = "deepseek_v32", config: Any = None, force_mqa: bool = False,
        runner: str | None = None, shardq: tuple[int, int] | None = None, logits_dtype: str | None = None,
    ) -> None:  # fmt: skip
        self.path, self.config = path, config or hf_config()
        self.vllm_config = vllm_config(self.config, force_mqa, shardq, logits_dtype)
        if path == "deepseek_v32":
            model_cls = fake[NVIDIA_MODULE].DeepseekV32ForCausalLM
        else:
            model_cls = fake[V2_MODULE].DeepseekV2ForCausalLM
        self.model = model_cls(vllm_config=self.vllm_config)
        # The default runner of each route: v2 from 0.29 (the deepseek_v32 route), v1 before.
        runner = runner or ("v2" if path == "deepseek_v32" else "v1")
        module = RUNNER_V2_MODULE if runner == "v2" else RUNNER_V1_MODULE
        self.runner = fake[module].GPUModelRunner(self.model, self.vllm_config)
        self.step_of: dict[str, int] = {}  # request -> engine steps it appeared in
        self.production: dict[tuple[str, int, int], tuple[list[int], torch.Tensor]] = {}

    def layout(self, tokens: dict[str, int], new: dict[str, list[int]]) -> tuple[dict, dict]:
        """The attention metadata and slot mapping of a batch, without running it."""
        so = SchedulerOutput(dict(tokens), [NewRequestData(r, ids) for r, ids in new.items()])
        states = self.runner.states
        states.update(so)
        batch = states.layout(list(tokens), so, pad=1)
        states.history.pop()
        return batch["metadata"], batch["slot_mapping"]

    def capture(self, tokens: dict[str, int], new: dict[str, list[int]]) -> None:
        """A breakable CUDA-graph capture of the batch the next step() replays (v2 runner)."""
        self.runner.capture_model(
            SchedulerOutput(dict(tokens), [NewRequestData(r, ids) for r, ids in new.items()])
        )

    def step(
        self, tokens: dict[str, int], new: dict[str, list[int]] | None = None,
        finished: set[str] | None = None, preempted: set[str] | None = None,
        cached: dict[str, str] | None = None, full_graph: bool = False,
    ) -> Any:  # fmt: skip
        """One engine step; records production per (request, its step, layer). `cached`
        maps a new request to a live one whose KV blocks hold its prompt's first tokens:
        a prefix-cache hit on the full blocks they share. `full_graph`: the step replays a
        FULL CUDA graph, running none of the model's Python."""
        new_reqs = []
        for r, ids in (new or {}).items():
            source = (cached or {}).get(r)
            if source is None:
                new_reqs.append(NewRequestData(r, ids))
                continue
            donor = self.runner.states.requests[source]
            shared = 0
            while shared < min(len(ids), donor.computed) and ids[shared] == donor.tokens[shared]:
                shared += 1
            blocks = min(shared, len(ids) - 1) // BLOCK  # vLLM recomputes at least the last token
            new_reqs.append(NewRequestData(r, ids, blocks * BLOCK, donor.blocks[:blocks]))
        so = SchedulerOutput(
            num_scheduled_tokens=dict(tokens),
            scheduled_new_reqs=new_reqs,
            finished_req_ids=set(finished or ()), preempted_req_ids=set(preempted or ()),
        )  # fmt: skip
        for r in so.finished_req_ids | so.preempted_req_ids:
            self.step_of.pop(r, None)
        before = len(PRODUCTION)
        self.runner.full_graph = full_graph
        try:
            out = self.runner.execute_model(so)
        finally:
            self.runner.full_graph = False
        record = self.runner.states.history[-1]
        for prefix, rows in PRODUCTION[before:]:
            layer = int(prefix.split("layers.")[1].split(".")[0])
            owned = torch.ones(rows.shape[0], dtype=torch.bool)
            if record.gather is not None:  # the packed rows back in global order, this rank's only
                index = torch.tensor(record.gather)
                rows, packed = torch.full_like(rows, -1), rows
                rows[index] = packed[: len(index)]
                owned = torch.zeros(rows.shape[0], dtype=torch.bool)
                owned[index] = True
            for i, r in enumerate(record.req_ids):
                lo, hi = record.starts[i], record.starts[i + 1]
                mine = owned[lo:hi]
                positions = [
                    p
                    for p, m in zip(
                        range(record.computed[i], record.computed[i] + hi - lo), mine.tolist(), strict=True
                    )
                    if m
                ]
                self.production[(r, self.step_of.get(r, 0), layer)] = (positions, rows[lo:hi][mine])
        for r in record.req_ids:
            self.step_of[r] = self.step_of.get(r, 0) + 1
        return out


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
