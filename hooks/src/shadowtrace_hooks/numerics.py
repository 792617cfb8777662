"""Indexer numerics of the shadow: FP8 block quantization, index scores and top-k rows.

The same definitions as the Rust tracer (tracer/src/fp8, tracer/src/indexer) and the golden
vectors of tests/golden/numerics_v1.json, written on the engine's own torch so the shadow
runs on the engine's device:

- `quantize_rows`: 1x128 block quantization as production indexers do it (amax clamp,
  fp32 or ue8m0 scale, saturating cast to e4m3fn);
- `index_scores`: I[t,s] = sum_h w[t,h] * relu(q[t,h] . k[s]) * D^-0.5 in fp32, causal
  (key s visible to query t iff s <= q_pos[t], the query's own key included);
- `fp8_scores`: the same from FP8 codes and their scales, the product a kernel computes;
- `Lists`: a list column in flat form, as the writer takes it.

Top-k selections, k-th scores, margins and boundary keys are `selection.compare`'s, on the
device.
"""

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

FP8_MAX = {"e4m3fn": 448.0, "e5m2": 57344.0}
FP8_DTYPE = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# Query rows scored at once: bounds the [rows, heads, keys] fp32 intermediate.
_ROW_CHUNK_ELEMENTS = 1 << 27
MATMULS = ("ieee", "3xtf32")
# Clears the 13 mantissa bits fp32 has beyond TF32's 10.
_TF32_MASK = ~((1 << 13) - 1)
# The largest error of a 3xtf32 dot product relative to sum |q_i k_i|: lo's TF32 rounding
# (below 2^-10 |lo| < 2^-20 |x|) in hi.lo and lo.hi, the dropped lo.lo (below 2^-20) and fp32
# accumulation over the 3D = 384 terms (worst case 384 * 2^-24 < 2^-15.4): 2^-15 in all.
SPLIT_TF32_ERROR = 2.0**-15


def round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0: the smallest power of two >= scale, exactly, from the fp32 bits."""
    bits = scale.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    rounded = ((exponent + (mantissa != 0).to(torch.int32)) << 23).view(torch.float32)
    return torch.where(torch.isfinite(scale), rounded, scale)


def quantize_rows(
    x: torch.Tensor,
    *,
    fmt: str = "e4m3fn",
    scale_format: str = "ue8m0",
    amax_clamp: float = 1e-4,
    block: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes the last dimension in blocks of `block`: (fp8 codes, fp32 scales [..., n_blocks]).

    Dequantized value = code * scale. The division is a true IEEE division by a tensor,
    so CUDA and CPU give the same codes.
    """
    x = x.float()
    *lead, cols = x.shape
    if cols % block:
        raise ValueError(f"quantize_rows: last dimension {cols} is not a multiple of the block {block}")
    xb = x.reshape(*lead, cols // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=amax_clamp)
    scale = amax / torch.tensor(FP8_MAX[fmt], device=x.device)
    if scale_format == "ue8m0":
        scale = round_up_pow2(scale)
    elif scale_format != "fp32":
        raise ValueError(f"quantize_rows: scale format {scale_format!r}: expected fp32 or ue8m0")
    codes = (xb / scale).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(FP8_DTYPE[fmt])
    return codes.reshape(*lead, cols), scale.squeeze(-1)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """fp32 values of `quantize_rows` output: exact, the scale being fp32."""
    *lead, cols = codes.shape
    values = codes.float().reshape(*lead, cols // block, block) * scale.float().unsqueeze(-1)
    return values.reshape(*lead, cols)


def hadamard(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Sylvester Hadamard matrix scaled to be orthonormal, fp32."""
    if n & (n - 1):
        raise ValueError(f"hadamard: size {n} is not a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).float().to(device)


def causal_mask(q_pos: torch.Tensor, keys: int) -> torch.Tensor:
    """[T, S] bool: key s is visible to query t iff s <= q_pos[t]."""
    return torch.arange(keys, device=q_pos.device)[None, :] <= q_pos[:, None]


def index_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    q_pos: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    q_pos_host: np.ndarray | None = None,
    matmul: str = "ieee",
) -> torch.Tensor:
    """fp32 scores [T, S] with -inf where masked, from q [T,H,D], k [S,D], w [T,H], scaled
    by D^-0.5 unless `softmax_scale` says otherwise (1.0 when w already holds it).

    Inputs are taken at their precision and upcast: the shadow's precision is whatever
    produced q, k and w. Query rows go in chunks that bound the [rows, H, S] intermediate;
    with `q_pos_host` (q_pos on the host) each chunk scores only the keys up to its last
    visible one, about half the work of a prefill, without asking the device where that is.

    `matmul="3xtf32"` computes each q . k on the TF32 tensor cores from q and k split into a
    TF32 part and an fp32 remainder (`split_tf32`; an operand whose dtype TF32 holds exactly,
    bf16, fp16 or FP8, is not split): hi.hi + hi.lo + lo.hi, within `SPLIT_TF32_ERROR` of
    sum |q_i k_i| per dot product (exact products when neither operand is split).
    "ieee" is the plain fp32 product (with TF32 off, as `shadow.full_fp32` sets it).
    """
    if matmul not in MATMULS:
        raise ValueError(f"index_scores: matmul {matmul!r}, expected one of {MATMULS}")
    t, h, d = q.shape
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    keys = k.shape[0]
    if q_pos_host is None:
        out = torch.empty(t, keys, dtype=torch.float32, device=q.device)
    else:
        out = torch.full((t, keys), -math.inf, dtype=torch.float32, device=q.device)
    split = matmul == "3xtf32"
    if split:
        k_parts = _tf32_parts(k)
        # every pair of parts but lo.lo, side by side along D: one product sums them
        q_count = 1 if q.dtype.itemsize <= 2 else 2
        pairs = [(i, j) for i in range(q_count) for j in range(len(k_parts)) if i + j < 2]
        kt = torch.cat([k_parts[j] for _, j in pairs], -1).t()
    else:
        kt = k.float().t()
    rows = max(1, _ROW_CHUNK_ELEMENTS // max(1, h * keys))
    for start in range(0, t, rows):
        stop = min(start + rows, t)
        end = keys if q_pos_host is None else min(keys, int(q_pos_host[start:stop].max()) + 1)
        if end <= 0:
            continue
        if split:
            q_parts = _tf32_parts(q[start:stop])
            with _tf32():
                dots = torch.matmul(torch.cat([q_parts[i] for i, _ in pairs], -1), kt[:, :end])
        else:
            dots = torch.matmul(q[start:stop].float(), kt[:, :end])
        dots.relu_()  # [rows, H, end]
        wc = w[start:stop].float().unsqueeze(1)  # [rows, 1, H]
        chunk = torch.bmm(wc, dots).squeeze(1) * scale
        out[start:stop, :end] = chunk.masked_fill_(~causal_mask(q_pos[start:stop], end), -math.inf)
    return out


def split_tf32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) with x == hi + lo exactly: hi is x with its 13 low mantissa bits cleared (a
    TF32 number, which the tensor cores take without rounding), lo the fp32 remainder, below
    2^-10 |x|. Non-finite x give a non-finite hi."""
    hi = (x.contiguous().view(torch.int32) & _TF32_MASK).view(torch.float32)
    return hi, x - hi


def _tf32_parts(x: torch.Tensor) -> list[torch.Tensor]:
    """x in fp32 as TF32 parts that sum to it: x itself where its dtype has no more mantissa
    bits than TF32 (bf16, fp16, FP8), else `split_tf32`'s (hi, lo)."""
    if x.dtype.itemsize <= 2:
        return [x.float()]
    return list(split_tf32(x.float()))


@contextlib.contextmanager
def _tf32() -> Iterator[None]:
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


def fp8_scores(
    q_codes: torch.Tensor,
    q_scale: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    w: torch.Tensor,
    q_pos: torch.Tensor,
) -> torch.Tensor:
    """Scores of FP8 q [T,H,D] / k [S,D] with one scale per row ([T,H], [S]), in fp32:
    k_scale[s] * sum_h w[t,h] * q_scale[t,h] * D^-0.5 * relu(q8 . k8), as the kernels fold it."""
    folded = w.float() * q_scale.float().reshape(w.shape)
    scores = index_scores(q_codes.float(), k_codes.float(), folded, q_pos)
    return scores * k_scale.float().reshape(1, -1)


def fp8_variant_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    q_pos: torch.Tensor,
    *,
    rotate: bool,
    scale_format: str,
    amax_clamp: float,
) -> torch.Tensor:
    """An engine variant's FP8 indexer emulated from unquantized q, k, w: optional Hadamard
    rotation, 1x128 quantization of every q head and k row, then `fp8_scores`."""
    if rotate:
        had = hadamard(q.shape[-1], q.device)
        q, k = q.float() @ had, k.float() @ had
    q8, qs = quantize_rows(q, scale_format=scale_format, amax_clamp=amax_clamp)
    k8, ks = quantize_rows(k, scale_format=scale_format, amax_clamp=amax_clamp)
    return fp8_scores(q8, qs.squeeze(-1), k8, ks.squeeze(-1), w, q_pos)


def folded_scores(
    q_codes: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    q_pos: torch.Tensor,
) -> torch.Tensor:
    """Scores from an engine's own FP8 operands, the product its logits kernel computes:
    k_scale[s] * sum_h weights[t,h] * relu(q8[t,h] . k8[s]), where the engine has folded
    q_scale, D^-0.5 and H^-0.5 into `weights` [T,H]. The fp32 recompute of production."""
    scores = index_scores(q_codes.float(), k_codes.float(), weights.float(), q_pos, softmax_scale=1.0)
    return scores * k_scale.float().reshape(1, -1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, neox: bool) -> torch.Tensor:
    """Rotary embedding of x [..., R] with cos/sin [..., R/2] broadcast against it: NeoX
    pairs (i, i + R/2), interleaved (GPT-J) pairs (2i, 2i + 1)."""
    if neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def dense_weight(linear: torch.nn.Module, block: int = 128) -> torch.Tensor:
    """A linear layer's weight in fp32; FP8 block-quantized weights are multiplied by their
    per-block scale (`weight_scale_inv` in DeepSeek checkpoints, vLLM and SGLang;
    `weight_scale` in TensorRT-LLM)."""
    weight = linear.weight
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return weight.float()
    scale = getattr(linear, "weight_scale_inv", None)
    if scale is None:
        scale = linear.weight_scale
    rows, cols = weight.shape
    expanded = scale.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return weight.float() * expanded


@dataclass
class Lists:
    """A list column in flat form: row i is values[offsets[i]:offsets[i+1]]. Where `offsets`
    is a numpy masked array, a masked offsets[i] makes row i null (Arrow reads list offsets
    with nulls so), which is how a dense row's boundary lists reach the file."""

    values: np.ndarray
    offsets: np.ndarray
