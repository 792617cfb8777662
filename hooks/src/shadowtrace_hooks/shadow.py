"""Running engine modules in the shadow precision, and the indexer's shadow recompute.

`in_precision` runs a module with its floating-point parameters upcast for the duration of
one call: the originals are put back as the very same tensors, so the production weights
are untouched bit for bit, and at most one layer's upcast copy exists at a time. A failure
half way through the upcast (an out-of-memory error) puts back what was already swapped
before it propagates: production never runs on upcast weights.

`hooks_suspended` keeps every forward hook of a module tree (the user's, transformers'
output recorders, ours) from firing during the shadow re-run, which must be invisible to
everything but the tracer.
"""

import contextlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shadowtrace_hooks import numerics

_UPCASTABLE = (torch.bfloat16, torch.float16)
# nn.Module's per-instance hook registries: emptied for the shadow call, restored after.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)


@contextlib.contextmanager
def in_precision(module: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Within the block, `module`'s bf16/fp16 parameters and buffers are `dtype` copies.
    Only upcasts: fp32 tensors (routing biases kept in fp32 on purpose) and FP8 weights
    (which need their scales) stay as they are."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
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
                    data = tensor.data
                    upcast_data = data.to(dtype)
                    saved.append((tensor, data))
                    tensor.data = upcast_data
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


Hook = Callable[..., Any]


@contextlib.contextmanager
def hooks_suspended(
    module: torch.nn.Module, capture: dict[torch.nn.Module, Hook] | None = None
) -> Iterator[None]:
    """Within the block, no forward hook or pre-hook registered on `module` or any module
    below it fires; `capture` maps submodules to the only forward hooks that do (the
    tracer's shadow site captures). Everything is put back as it was."""
    saved = []
    for sub in module.modules():
        saved.append((sub, {name: getattr(sub, name) for name in _HOOK_DICTS if hasattr(sub, name)}))
        for name in saved[-1][1]:
            setattr(sub, name, OrderedDict())
    try:
        for sub, hook in (capture or {}).items():
            sub.register_forward_hook(hook)
        yield
    finally:
        for sub, dicts in saved:
            for name, value in dicts.items():
                setattr(sub, name, value)


def linear(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x @ weight.T in `dtype` (weights of FP8 layers must be dequantized by the caller)."""
    return torch.nn.functional.linear(x.to(dtype), weight.to(dtype))


def indexer_selection(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, q_pos: torch.Tensor, k_top: int, band: float | None
) -> numerics.Selection:
    """Shadow top-k from q [T,H,D], k [S,D], w [T,H] (w without the D^-0.5 softmax scale)."""
    return numerics.select(numerics.index_scores(q, k, w, q_pos), k_top, q_pos, band)
