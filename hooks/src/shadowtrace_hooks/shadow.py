"""Running engine modules in the shadow precision, and the indexer's shadow recompute.

`in_precision` runs a module with its floating-point parameters upcast for the duration of
one call: the originals are put back as the very same tensors, so the production weights
are untouched bit for bit, and at most one layer's upcast copy exists at a time.
"""

import contextlib
import itertools
from collections.abc import Iterator

import torch

from shadowtrace_hooks import numerics

_UPCASTABLE = (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def in_precision(module: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Within the block, `module`'s bf16/fp16 parameters and buffers are `dtype` copies.
    Only upcasts: fp32 tensors (routing biases kept in fp32 on purpose) and FP8 weights
    (which need their scales) stay as they are."""
    saved, swapped = [], []
    if dtype == torch.float32:
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if tensor.dtype not in _UPCASTABLE:
                continue
            if _is_dtensor(tensor):
                # A tensor-parallel shard: `.data` assignment does not reach the local
                # tensor, swapping the whole tensor does, and swapping back is exact.
                upcast = torch.nn.Parameter(tensor.data.to(dtype), requires_grad=False)
                torch.utils.swap_tensors(tensor, upcast)
                swapped.append((tensor, upcast))
            else:
                saved.append((tensor, tensor.data))
                tensor.data = tensor.data.to(dtype)
    try:
        yield
    finally:
        for tensor, data in saved:
            tensor.data = data
        for tensor, upcast in swapped:
            torch.utils.swap_tensors(tensor, upcast)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(tensor, DTensor)


def linear(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x @ weight.T in `dtype` (weights of FP8 layers must be dequantized by the caller)."""
    return torch.nn.functional.linear(x.to(dtype), weight.to(dtype))


def indexer_selection(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, q_pos: torch.Tensor, k_top: int, band: float | None
) -> numerics.Selection:
    """Shadow top-k from q [T,H,D], k [S,D], w [T,H] (w without the D^-0.5 softmax scale)."""
    return numerics.select(numerics.index_scores(q, k, w, q_pos), k_top, q_pos, band)
