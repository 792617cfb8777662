"""The reference engine's kernel deviations (tracer/src/model/kernel_deviation.rs) as patches
applied to transformers' own DSA indexer (`GlmMoeDsaIndexer`, `DeepseekV32Indexer`), written
here from the upstream reports, not from the Rust code: transformers computes its q, k, head
weights and index scores as it always does, and the patch changes only the op the report
root-caused.

- `paged_past_len`: scores of keys at or past a context length replaced by near-random values
  within the row's range of correct scores (vLLM #47827, #39303);
- `drops_winners`: the radix top-k whose fp16 8-bit coarse key puts more candidates in the
  threshold bucket than its buffer holds; the first `capacity` candidates in key order are
  kept (SGLang #37591, #36807);
- `zeros_past`: the head reduction returning zeros past a length, top-k keeping the trailing
  keys (mlx-lm #1454);
- `lowprec_head_sum`: the head-weighted sum with each term and the running sum in bf16.

Each takes transformers' index scores `[B, S, T]` as the indexer hands them to `topk` (masked
keys at the additive mask's large negative value, or -inf) and returns the top-k indices.
"""

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

# transformers' additive causal mask holds finfo.min; anything below this is masked.
MASKED = torch.finfo(torch.float32).min / 2
# torch's own top-k, whatever a patch has put in its place.
TOPK = torch.Tensor.topk


def visible(scores: torch.Tensor) -> torch.Tensor:
    return scores > MASKED


def indexers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.self_attn.indexer for layer in model.model.layers]


@contextlib.contextmanager
def selecting(
    model: torch.nn.Module, select: Callable[[torch.Tensor, int, int], torch.Tensor]
) -> Iterator[None]:
    """Within the block, each indexer's final `index_scores.topk(k, dim=-1)` returns
    `select(index_scores, k, layer_idx)` as its indices; everything before it is
    transformers' own."""
    patched = []
    for indexer in indexers(model):
        original = indexer.forward

        def forward(*args, _original=original, _layer=indexer.layer_idx, **kwargs):
            def topk(self, k, dim=-1, *rest, **kw):
                if dim != -1 or self.dim() != 3 or rest or kw:
                    return TOPK(self, k, dim, *rest, **kw)
                indices = select(self, k, _layer)
                return torch.return_types.topk((self.gather(-1, indices), indices))

            torch.Tensor.topk = topk
            try:
                return _original(*args, **kwargs)
            finally:
                torch.Tensor.topk = TOPK

        indexer.forward = forward
        patched.append((indexer, original))
    try:
        yield
    finally:
        for indexer, original in patched:
            indexer.forward = original


def exact(scores: torch.Tensor, k: int, _layer: int) -> torch.Tensor:
    return TOPK(scores, k, dim=-1).indices


def garbage(layer: int, rows: int, keys: int) -> torch.Tensor:
    """Reproducible near-random values in [0, 1) per (layer, query, key): fract(sin(.) * c)."""
    q = torch.arange(rows, dtype=torch.float64).view(rows, 1)
    k = torch.arange(keys, dtype=torch.float64).view(1, keys)
    return torch.frac(torch.sin(q * 78.233 + k * 12.9898 + layer * 37.719) * 43758.5453).abs().float()


def paged_past_len(length: int) -> Callable[[torch.Tensor, int, int], torch.Tensor]:
    def select(scores: torch.Tensor, k: int, layer: int) -> torch.Tensor:
        _, rows, keys = scores.shape
        out = scores.clone()
        if length < keys:
            key = torch.arange(keys).view(1, 1, keys)
            seen = visible(scores)
            correct = seen & (key < length)
            lo = scores.masked_fill(~correct, math.inf).amin(-1, keepdim=True)
            hi = scores.masked_fill(~correct, -math.inf).amax(-1, keepdim=True)
            noise = lo + garbage(layer, rows, keys).unsqueeze(0) * (hi - lo)
            out = torch.where(seen & (key >= length), noise, scores)
        return exact(out, k, layer)

    return select


def coarse_key(values: torch.Tensor) -> torch.Tensor:
    """SGLang topk.cu's 8-bit key: fp16 bits made order-preserving, the top byte."""
    bits = values.half().view(torch.int16).to(torch.int32) & 0xFFFF
    ordered = torch.where(bits >= 0x8000, (~bits) & 0xFFFF, bits | 0x8000)
    return ordered >> 8


def drops_winners(capacity: int) -> Callable[[torch.Tensor, int, int], torch.Tensor]:
    def select(scores: torch.Tensor, k: int, layer: int) -> torch.Tensor:
        picked = exact(scores, k, layer).clone()
        for b in range(scores.shape[0]):
            for r in range(scores.shape[1]):
                row = scores[b, r]
                keys = visible(row).nonzero().view(-1)
                if keys.numel() <= k:
                    continue
                bucket = coarse_key(row[keys])
                # The highest bucket whose count with every bucket above it reaches k.
                from_top = torch.bincount(bucket, minlength=256).flip(0).cumsum(0)
                threshold = 255 - int((from_top >= k).nonzero()[0])
                above = keys[bucket > threshold]
                candidates = keys[bucket == threshold]  # in key order
                if candidates.numel() <= capacity:
                    continue
                kept = candidates[:capacity]
                need = k - above.numel()
                order = row[kept].argsort(descending=True, stable=True)
                chosen = kept[order[:need]]
                if chosen.numel() < need:
                    below = keys[bucket < threshold]
                    fill = below[row[below].argsort(descending=True, stable=True)[: need - chosen.numel()]]
                    chosen = torch.cat([chosen, fill])
                if chosen.numel() < need:
                    # Kept and lower keys cannot fill k: the remaining slots hold dropped
                    # candidates in no score order (the Rust emulation's -inf ties), here the
                    # last in key order.
                    dropped = candidates[capacity:].flip(0)
                    chosen = torch.cat([chosen, dropped[: need - chosen.numel()]])
                picked[b, r] = torch.cat([above, chosen])
        return picked

    return select


def zeros_past(length: int) -> Callable[[torch.Tensor, int, int], torch.Tensor]:
    def select(scores: torch.Tensor, k: int, layer: int) -> torch.Tensor:
        if scores.shape[-1] <= length:
            return exact(scores, k, layer)
        # Every visible score is 0; the top-k of equal values keeps the trailing keys.
        position = torch.arange(scores.shape[-1], dtype=torch.float32).expand_as(scores)
        return exact(position.masked_fill(~visible(scores), -math.inf), k, layer)

    return select


@contextlib.contextmanager
def lowprec_head_sum(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """Within the block, the indexers' head-weighted sum `weights[..., 1, H] @ scores[..., H, T]`
    holds each term and the running sum in `dtype` (summed over heads in order)."""
    real_matmul = torch.matmul
    heads = {indexer.n_heads for indexer in indexers(model)}

    def matmul(a, b, *rest, **kw):
        if not rest and not kw and a.dim() == 4 and a.shape[-2] == 1 and a.shape[-1] in heads:
            terms = (a.transpose(-1, -2) * b).to(dtype)  # [B, S, H, T]
            acc = terms[:, :, 0]
            for h in range(1, terms.shape[2]):
                acc = acc + terms[:, :, h]
            return acc.float().unsqueeze(-2)
        return real_matmul(a, b, *rest, **kw)

    torch.matmul = matmul
    try:
        yield
    finally:
        torch.matmul = real_matmul
