"""Prefix-cache hits in HF transformers (context 004): a request that starts on a cache
already holding a prefix (`past_key_values` / `cache` reused from an earlier forward, the
recurrent state of linear-attention layers included).

- Every traced forward leaves the token ids its cache now holds on the cache object
  (`remember`; a `copy.deepcopy` of the cache keeps them), so a later request that starts
  on that cache is known by its whole prompt: its run's token hash and length cover the
  prefix and the new tokens, as the same request computed from scratch would.
- Every run is tagged `cache=miss` (it started on an empty cache) or `cache=hit` (on a
  cached prefix; `settings.cached_prefix_tokens` says how many tokens were reused), which
  `shadowtrace analyze` pairs by prompt.
- The first step of a hit cannot have a local shadow (the prefix's keys and states were
  computed by an earlier request, in production's precision): counted
  `shadow_skipped_cached_prefix`. Its free shadow is well defined, as it never depends on
  production: the free chain from the embeddings over the whole prompt (`Scratch`), the
  same chain a miss of that prompt computes, so both runs' hidden rows at the first
  generated position measure their distance to one reference.
- A cache whose ids were never seen (filled untraced, or changed since) still makes a
  hit; its run can only name the new tokens, and says so (`cache_hit_prefix_ids_unknown`).
"""

import contextlib
import functools
from typing import Any

import torch

from shadowtrace_hooks import shadow
from shadowtrace_hooks.session import Run

# run.state key: tokens of the request that came from a cache (its keys were never seen)
CACHED_PREFIX = "cached_prefix"
_IDS = "_shadowtrace_ids"


def cached_ids(cache: Any, past_len: int, batch: int) -> list[list[int]] | None:
    """The ids a cache holding `past_len` tokens was filled with, per batch row, when a
    traced forward left them and they still match its length."""
    if cache is None or past_len == 0:
        return None
    ids = getattr(cache, _IDS, None)
    if not isinstance(ids, list) or len(ids) != batch or any(len(row) != past_len for row in ids):
        return None
    return [list(row) for row in ids]


def tag(run: Run, past_len: int, prefix: list[int] | None) -> None:
    """Tags a request's run `cache=hit|miss`; a hit's run remembers its cached prefix."""
    run.writer.tag("cache", "hit" if past_len else "miss")
    if not past_len:
        return
    run.state[CACHED_PREFIX] = past_len
    run.state["prompt_ids"] = list(prefix or [])
    run.writer.set_setting("cached_prefix_tokens", past_len)
    if prefix is None:
        run.count("cache_hit_prefix_ids_unknown")


def remember(out: Any, runs: list[Run], length: int | None = None) -> None:
    """Leaves on the forward's cache the ids it holds (each run's prompt so far), when it
    holds `length` tokens (None: as many as it counts now)."""
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is None or not runs or not hasattr(cache, "get_seq_length"):
        return
    ids = [list(run.state.get("ids", [])) for run in runs]
    length = int(cache.get_seq_length()) if length is None else length
    if all(len(row) == length for row in ids):
        setattr(cache, _IDS, ids)
    elif hasattr(cache, _IDS):
        delattr(cache, _IDS)


def start(
    tracer: Any, cache: Any, past_len: int, seq: int, device: torch.device, graphed: bool = False
) -> "Scratch | None":
    """The shadows of a hit's first step: local ones are counted as skipped; the free chain
    is recomputed from the embeddings over the whole prompt when every row's prefix ids are
    known, except in a CUDA graph's replayed step (`graphed`), which holds no such re-run and
    counts `graph_skipped_free_chain`. Returns what that chain computed at this step's
    positions, or None."""
    modes = tracer.settings.layer_modes
    if "local" in modes:
        for run in tracer.runs:
            run.count("shadow_skipped_cached_prefix")
    if "free" not in modes or tracer.dtype is None:
        return None
    if graphed:
        for run in tracer.runs:
            run.count("graph_skipped_free_chain")
        return None
    rows = [run.state.get("ids", []) for run in tracer.runs]  # prefix and this step's tokens
    if any(len(row) != past_len + seq for row in rows):
        for run in tracer.runs:
            run.count("shadow_free_skipped_prefix_ids_unknown")
        return None
    return tracer.sess.guarded(
        "shadow_free_from_scratch", tracer.runs[0], Scratch.compute, tracer, rows, seq, device
    )


class Scratch:
    """A request's free shadow recomputed from the embeddings over its whole prompt, run as
    the decoder's own forward (which builds its masks and position embeddings for the
    whole prompt) with no cache, one layer's weights upcast at a time (its routed experts one
    at a time, FP8 weights dequantized), every hook but the captures below suspended. Keeps
    each layer's outputs at the last `tail` positions."""

    def __init__(self) -> None:
        self.layers: dict[int, dict[str, torch.Tensor]] = {}
        self.final: torch.Tensor | None = None

    @classmethod
    def compute(cls, tracer: Any, rows: list[list[int]], tail: int, device: torch.device) -> "Scratch":
        out = cls()
        inner, dtype = tracer.inner, tracer.dtype
        tails = {i: {} for i in range(len(inner.layers))}
        upcast: dict[int, contextlib.AbstractContextManager] = {}

        def last(x: Any) -> torch.Tensor:
            tensor = x[0] if isinstance(x, tuple) else x
            return tensor[:, -tail:].detach()

        def enter(i: int, module: torch.nn.Module, args: tuple) -> None:
            # As the layer's shadow re-run: the expert bank is never upcast whole (only the
            # routed experts, one at a time, dequantized when FP8), FP8 linears dequantized.
            banks = shadow.expert_banks(module)
            if shadow.sharded(banks):
                banks = []
            kept = shadow.bank_tensors(banks)
            stack = contextlib.ExitStack()
            try:
                stack.enter_context(shadow.in_precision(module, dtype, keep=lambda t: id(t) in kept))
                stack.enter_context(shadow.routed_experts(banks, dtype))
            except BaseException:
                stack.close()
                raise
            upcast[i] = stack

        def leave(i: int, module: torch.nn.Module, args: tuple, output: Any) -> None:
            upcast.pop(i).__exit__(None, None, None)
            tails[i]["layer_out"] = last(output)

        def site(i: int, name: str, module: torch.nn.Module, args: tuple, output: Any) -> None:
            tails[i][name] = last(output)

        def head(module: torch.nn.Module, args: tuple) -> None:
            out.final = last(args[0])

        ids = torch.tensor(rows, dtype=torch.long, device=device)
        with contextlib.ExitStack() as stack:
            stack.enter_context(shadow.hooks_suspended(inner))
            for child in inner.children():
                if child is not inner.layers:  # embeddings, rotary, final norm: small, for the call
                    stack.enter_context(shadow.in_precision(child, dtype))
            for i, layer in enumerate(inner.layers):
                layer.register_forward_pre_hook(functools.partial(enter, i))
                layer.register_forward_hook(functools.partial(leave, i))
                for name, block in tracer._sites(layer).items():
                    block.register_forward_hook(functools.partial(site, i, name))
            first = tracer._head()[0]
            if any(first is m for m in inner.modules()):
                first.register_forward_pre_hook(head)
            try:
                inner(input_ids=ids, use_cache=False)
            finally:
                # A layer that raised never reached its forward hook: put its weights back.
                for context in upcast.values():
                    context.__exit__(None, None, None)
        out.layers = tails
        return out

    def layer(self, index: int, step: Any) -> dict[str, torch.Tensor]:
        """Layer `index`'s free shadow at the step's positions; its sites land in the step."""
        outputs = self.layers.get(index, {})
        step.shadow_sites["free"] = {k: v for k, v in outputs.items() if k != "layer_out"}
        if index == 0 and self.final is not None:
            step.free = self.final  # the logits' free stream
        return {"free": outputs["layer_out"]} if "layer_out" in outputs else {}
