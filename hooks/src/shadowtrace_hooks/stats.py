"""Per-token hidden-state statistics, non-finite events and logits summaries, computed on
the tensor's device as a few small tensors per capture (`*_device`), which a capture packs
for one copy to the host (shadowtrace_hooks.transfer); the host turns them into rows
(`*_rows`, `*_from_host`). Nothing here synchronises with the device.

Definitions are the columns' docs in schemas/v1/hidden.json, events.json and logits.json.
`hidden_columns`, `nonfinite_events`, `indexer_events` and `logits_columns` compute the same
on the host in one call, for tests and callers off the forward's path. On CUDA,
`site_device` computes a site's counts, statistics and events in one Triton pass per shadow
mode, and the host finishes them.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from shadowtrace_hooks import kernels
from shadowtrace_hooks.numerics import Lists

KINDS = ("nan", "pos_inf", "neg_inf")
PROD_STATS = ("prod_nan", "prod_pos_inf", "prod_neg_inf", "prod_max_abs", "prod_l2")
SHADOW_STATS = ("shadow_nan", "shadow_pos_inf", "shadow_neg_inf", "shadow_max_abs", "shadow_l2",
                "rel_l2_err", "cosine", "max_abs_diff")  # fmt: skip
_COUNTS = 3  # the first three statistics of each path are element counts


def counts_device(x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[3, T] int32: NaN, +Inf and -Inf elements of each row of x [T, N] (with `valid`
    [T] counts, only among each row's first valid[t] elements, whose rest is -Inf: the
    indexer's masked scores). On CUDA, one pass of Triton's `kernels.row_stats`."""
    if x.dim() == 2:
        counts, _ = kernels.attempt("row_stats", x, lambda: kernels.row_stats(x)[:3].to(torch.int32))
        if counts is not None:
            if valid is not None:
                counts[2] -= (x.shape[-1] - valid).to(torch.int32)
            return counts
    nan = x.isnan().sum(-1, dtype=torch.int32)
    pos = (x == math.inf).sum(-1, dtype=torch.int32)
    neg = (x == -math.inf).sum(-1, dtype=torch.int32)
    if valid is not None:
        neg = neg - (x.shape[-1] - valid).to(torch.int32)
    return torch.stack([nan, pos, neg])


def slot_nonfinite_device(window: torch.Tensor) -> torch.Tensor:
    """[S] int64: the non-finite elements of each slot of a KV-cache window [..., S, D]
    (slots along dim -2, as HF's caches hold them). On CUDA one pass of Triton's
    `kernels.slot_counts`, read in place, when the leading dimensions merge without a copy;
    elsewhere (or when it raised) the sum over every other dimension where the elements lie."""
    merged = _leading_merged(window)
    if merged is not None:
        count = lambda: kernels.slot_counts(merged).to(torch.int64)  # noqa: E731
        counted, _ = kernels.attempt("slot_counts", merged, count)
        if counted is not None:
            return counted
    others = [d for d in range(window.dim()) if d != window.dim() - 2]
    return torch.isfinite(window).logical_not_().sum(others)


def sentinel_device(caches: list[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """[B, 2, len(caches), 4] int64: the KV sentinel's reads of each batch row of every cache
    [B, ..., S, D] (slots along dim -2, as HF's caches hold them), read 0 of slot 0 and read 1
    of the slots `positions` [B, P]: the non-finite elements of the slots read, the first
    slot read holding one (the first slot read when none), the least and greatest slot read
    (`kernels.sentinel_reads`). On CUDA one launch a cache (each launch is replayed with the
    graph that captured it); elsewhere, or when a cache's heads do not merge, torch's ops."""
    positions = positions.to(torch.int64)
    merged = [_batch_merged(c) for c in caches]
    if all(m is not None for m in merged):
        read = lambda: kernels.sentinel_reads(merged, positions)  # type: ignore[arg-type]  # noqa: E731
        done, _ = kernels.attempt("sentinel_reads", positions, read)
        if done is not None:
            return done
    rows = []
    for b, slots in enumerate(positions.unbind(0)):
        reads = (torch.zeros_like(slots[:1]), slots)
        rows.append(torch.stack([_sentinel_read([c[b] for c in caches], read) for read in reads]))
    return torch.stack(rows)


def _sentinel_read(windows: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """[len(windows), 4] int64: `sentinel_device`'s one read of one batch row, by torch's ops."""
    parts = []
    for window in windows:
        per_slot = slot_nonfinite_device(window.index_select(-2, slots))
        found = slots.index_select(0, (per_slot > 0).to(torch.int8).argmax().reshape(1))[0]
        parts.append(torch.stack([per_slot.sum(), found, slots.min(), slots.max()]))
    return torch.stack(parts)


def _batch_merged(cache: torch.Tensor) -> torch.Tensor | None:
    """cache [B, ..., S, D] as a view [B, O, S, D]; None when it has fewer than three
    dimensions or its middle ones cannot merge without a copy."""
    if cache.dim() < 3:
        return None
    try:
        return cache.view(cache.shape[0], -1, *cache.shape[-2:])
    except RuntimeError:  # strides that do not merge: torch's ops read them where they lie
        return None


def _leading_merged(window: torch.Tensor) -> torch.Tensor | None:
    """window [..., S, D] as a view [O, S, D]; None when its leading dimensions cannot merge
    without a copy, or it has fewer than two dimensions."""
    if window.dim() < 2:
        return None
    try:
        return window.view(-1, *window.shape[-2:])
    except RuntimeError:  # strides that do not merge: torch's sum reads them where they lie
        return None


def _finite_float(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 with its non-finite elements zeroed (never x itself: callers may hold it)."""
    if x.dtype == torch.float32:
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    return x.float().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def hidden_device(
    prod: torch.Tensor,
    prod_counts: torch.Tensor,
    shadow: torch.Tensor | None,
    shadow_counts: torch.Tensor | None,
    tokens: torch.Tensor | None,
) -> torch.Tensor:
    """[C, n] fp32: the statistics of `PROD_STATS` (and `SHADOW_STATS`) of rows `tokens`
    (None: every row) of prod [T, N] and shadow [T, N], given each one's `counts_device`.
    Counts are exact in fp32 below 2^24 elements per vector."""
    prod, shadow = prod.detach(), None if shadow is None else shadow.detach()
    if tokens is not None:
        prod, prod_counts = prod.index_select(0, tokens), prod_counts.index_select(1, tokens)
    p, pc = _finite_float(prod), prod_counts
    p_l2 = torch.linalg.vector_norm(p, dim=-1)
    out = [*pc.float(), torch.linalg.vector_norm(p, ord=math.inf, dim=-1), p_l2]
    if shadow is not None:
        assert shadow_counts is not None
        if tokens is not None:
            shadow, shadow_counts = shadow.index_select(0, tokens), shadow_counts.index_select(1, tokens)
        s, sc = _finite_float(shadow), shadow_counts
        diff = p - s
        out += _compared(
            pc, p_l2, sc, torch.linalg.vector_norm(s, ord=math.inf, dim=-1),
            torch.linalg.vector_norm(s, dim=-1), torch.linalg.vector_norm(diff, dim=-1),
            (p * s).sum(-1), torch.linalg.vector_norm(diff, ord=math.inf, dim=-1),
        )  # fmt: skip
    return torch.stack(out)


def _compared(
    pc: torch.Tensor, p_l2: torch.Tensor, sc: torch.Tensor, s_max: torch.Tensor, s_l2: torch.Tensor,
    diff_norm: torch.Tensor, dot: torch.Tensor, max_diff: torch.Tensor,
) -> list[torch.Tensor]:  # fmt: skip
    """The shadow's rows of `hidden_device` from each row's norms and sums."""
    # Against a zero shadow: 0 when prod is zero too, +inf otherwise (never 0/0 = NaN,
    # which reads as a non-finite vector).
    against_zero = torch.where(diff_norm > 0, math.inf, 0.0)
    rel = torch.where(s_l2 != 0, diff_norm / s_l2, against_zero)
    cosine = dot / (p_l2 * s_l2)
    # Non-finite anywhere in either vector makes the comparison NaN, as the docs say.
    bad = (pc.sum(0) + sc.sum(0)) > 0
    nan = torch.full_like(rel, math.nan)
    return [*sc.float(), s_max, s_l2] + [torch.where(bad, nan, v) for v in (rel, cosine, max_diff)]


@dataclass
class Site:
    """One hidden site's device work (`site_device`): the tensors a capture ships, what
    computed them, and `rows`, which turns their host copies (in the same order) into the
    site's `events_device` summary and each mode's `hidden_device` statistics (key None: prod
    alone). `rows` holds no device tensor: it runs on the writer's thread, and again after
    each replay of a graph that captured the site."""

    tensors: list[torch.Tensor]
    how: str
    rows: Callable[[list[np.ndarray]], tuple[np.ndarray, dict[str | None, np.ndarray]]]


def site_device(
    prod: torch.Tensor,
    shadows: dict[str, torch.Tensor],
    tokens: torch.Tensor | None,
    index: np.ndarray | None,
) -> Site:
    """One hidden site's device work: the statistics of rows `tokens` (device) / `index`
    (host; None: every row, empty: none) per shadow mode, and prod's non-finite events, with
    whether the event mode's shadow (local, else the first) was finite at the event's row.
    On CUDA one pass of Triton's `kernels.row_stats` per mode, and nothing else on the
    device ("triton"): the rows are picked, the norms finished and the events found on the
    host from its per-row sums. Elsewhere torch's ops ("torch", with the reason)."""
    event_mode = "local" if "local" in shadows else next(iter(shadows), None)
    recorded = index is None or len(index) > 0
    done, reason = kernels.attempt("row_stats", prod, lambda: _site_sums(prod, shadows))
    if done is not None:
        modes = list(done)

        def from_sums(arrays: list[np.ndarray]) -> tuple[np.ndarray, dict[str | None, np.ndarray]]:
            sums = dict(zip(modes, arrays, strict=True))
            events = _events_from_sums(sums, event_mode)
            if not recorded:
                return events, {}
            return events, {m: _hidden_from_sums(r, index, m is not None) for m, r in sums.items()}

        return Site(list(done.values()), "triton", from_sums)
    prod_counts = counts_device(prod)
    counts = {mode: counts_device(s) for mode, s in shadows.items()}
    finite = None if event_mode is None else counts[event_mode].sum(0) == 0
    tensors = [events_device(prod, prod_counts, finite)]
    recorded_modes: list[str | None] = list(shadows or {None: None}) if recorded else []
    for mode in recorded_modes:
        shadow = None if mode is None else shadows[mode]
        tensors.append(hidden_device(prod, prod_counts, shadow, counts.get(mode), tokens))

    def as_made(arrays: list[np.ndarray]) -> tuple[np.ndarray, dict[str | None, np.ndarray]]:
        return arrays[0], dict(zip(recorded_modes, arrays[1:], strict=True))

    return Site(tensors, f"torch ({reason})", as_made)


def _site_sums(prod: torch.Tensor, shadows: dict[str, torch.Tensor]) -> dict[str | None, torch.Tensor]:
    prod = prod.detach()
    return {mode: kernels.row_stats(prod, s.detach()) for mode, s in shadows.items()} or {
        None: kernels.row_stats(prod)
    }


def _hidden_from_sums(sums: np.ndarray, index: np.ndarray | None, shadowed: bool) -> np.ndarray:
    """`hidden_device`'s statistics from `kernels.row_stats`' sums [C, T], rows `index`: the
    same fp32 operations the device would run (IEEE square roots and quotients), on the host."""
    r = torch.from_numpy(np.array(sums if index is None else sums[:, index], dtype=np.float32))
    out = [r[0], r[1], r[2], r[3], r[4].sqrt()]
    if shadowed:
        out += _compared(r[0:3], out[4], r[5:8], r[8], r[9].sqrt(), r[10].sqrt(), r[11], r[12])
    return torch.stack(out).numpy()


def _events_from_sums(sums: dict[str | None, np.ndarray], event_mode: str | None) -> np.ndarray:
    """`events_device`'s summary [3, 4] from `kernels.row_stats`' sums of every row: prod's
    counts and first elements per row (alike in every mode's sums), and the event mode's
    shadow counts. Equal to what `events_device` makes of the same rows, element for element."""
    first = next(iter(sums.values()))
    counts = first[: len(KINDS)].astype(np.int64)  # [3, T]
    if counts.shape[1] == 0:
        return np.array([[0, 0, 0, -1]] * len(KINDS), dtype=np.int64)
    total = counts.sum(1)
    rows = (counts > 0).argmax(1)  # the first row holding each kind (0 if none)
    at = first[-len(KINDS) :].astype(np.int64)[np.arange(len(KINDS)), rows]
    channels = np.where(total > 0, at, 0)
    if event_mode is None:
        finite = np.full(len(KINDS), -1, dtype=np.int64)
    else:
        shadow_counts = sums[event_mode][len(PROD_STATS) : len(PROD_STATS) + _COUNTS]
        finite = (shadow_counts[:, rows].sum(0) == 0).astype(np.int64)
    return np.stack([total, rows, channels, finite], axis=1)


def hidden_from_host(stats: np.ndarray, numel: int) -> dict[str, np.ndarray]:
    """hidden-table columns from `hidden_device`'s host copy."""
    names = PROD_STATS + (SHADOW_STATS if stats.shape[0] > len(PROD_STATS) else ())
    out = {}
    for i, name in enumerate(names):
        counted = i < _COUNTS or len(PROD_STATS) <= i < len(PROD_STATS) + _COUNTS
        out[name] = stats[i].astype(np.int64) if counted else stats[i].astype(np.float32, copy=False)
    out["numel"] = np.full(stats.shape[1], numel, dtype=np.int64)
    return out


def events_device(
    x: torch.Tensor,
    counts: torch.Tensor,
    shadow_finite: torch.Tensor | None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """[3, 4] int64, one row per kind of `KINDS`: its count over x [T, N], the first row
    holding it, the first element of that row holding it (with `valid`, among its first
    valid[row] elements), and whether the shadow was finite at that row (`shadow_finite`
    [T] bool; -1 when unknown). Rows of a kind that never occurs say count 0."""
    # All kinds at once: a dozen small kernels per call rather than three dozen (twenty
    # calls a forward at GLM-5's four sites and its indexer).
    total = counts.sum(-1, dtype=torch.int64)
    rows = (counts > 0).to(torch.int8).argmax(-1)  # [3] the first row holding each kind (0 if none)
    # index_select, not x[row]: indexing by a tensor of rows reads it on the host (a sync).
    values = x.detach().index_select(0, rows)  # [3, N], row i for kind i
    where = torch.stack([values[0].isnan(), values[1] == math.inf, values[2] == -math.inf])
    if valid is not None:
        where = where & (torch.arange(x.shape[-1], device=x.device) < valid.index_select(0, rows)[:, None])
    channels = where.to(torch.int8).argmax(-1)
    finite = (
        torch.full((len(KINDS),), -1, dtype=torch.int64, device=x.device)
        if shadow_finite is None
        else shadow_finite.index_select(0, rows).long()
    )
    return torch.stack([total, rows.long(), channels.long(), finite], dim=1)


def event_rows(summary: np.ndarray) -> list[dict]:
    """One event per kind present, from `events_device`'s host copy: token is the row."""
    out = []
    for kind, (count, row, channel, finite) in zip(KINDS, summary.tolist(), strict=True):
        if count:
            shadow_finite = None if finite < 0 else bool(finite)
            out.append({"kind": kind, "token": row, "channel": channel, "count": count,
                        "shadow_finite": shadow_finite})  # fmt: skip
    return out


def logits_device(x: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-N ids (int32) and log-probabilities (fp32) of each row of logits x [T, V]."""
    logprobs = torch.log_softmax(x.detach().float(), dim=-1)
    values, ids = logprobs.topk(min(top_n, x.shape[-1]), dim=-1)
    return ids.to(torch.int32), values


def logits_lists(ids: np.ndarray, logprobs: np.ndarray) -> tuple[Lists, Lists]:
    """`logits_device`'s host copy as two list columns."""
    rows, n = ids.shape
    offsets = np.arange(0, (rows + 1) * n, n, dtype=np.int32)
    return Lists(ids.reshape(-1), offsets), Lists(logprobs.reshape(-1), offsets.copy())


# === on the host, in one call ===


def hidden_columns(
    prod: torch.Tensor, shadow: torch.Tensor | None, tokens: torch.Tensor
) -> dict[str, np.ndarray]:
    """Statistics of rows `tokens` of prod [T, N] (and shadow [T, N]), as hidden-table columns."""
    shadow_counts = None if shadow is None else counts_device(shadow)
    stats = hidden_device(prod, counts_device(prod), shadow, shadow_counts, tokens.to(prod.device))
    out = hidden_from_host(stats.cpu().numpy(), prod.shape[-1])
    out["token"] = tokens.cpu().numpy().astype(np.int32)
    return out


def nonfinite_events(prod: torch.Tensor, shadow: torch.Tensor | None) -> list[dict]:
    """One event per non-finite kind present in prod [T, N]: its count over the whole tensor,
    the first (token, channel) holding it, and whether the shadow was finite at that token."""
    finite = None if shadow is None else counts_device(shadow).sum(0) == 0
    return event_rows(events_device(prod, counts_device(prod), finite).cpu().numpy())


def indexer_events(
    scores: torch.Tensor, q_pos: torch.Tensor, shadow: torch.Tensor | None = None
) -> list[dict]:
    """`nonfinite_events` of an indexer score matrix [T, S] whose query t sees keys
    s <= q_pos[t]: the -inf beyond them is the mask, not a score. token is the first query
    row holding the kind, channel its first key, count over every visible score; with the
    shadow's scores, whether they were finite over that query's visible keys."""
    visible = q_pos + 1
    finite = None if shadow is None else counts_device(shadow, visible).sum(0) == 0
    summary = events_device(scores, counts_device(scores, visible), finite, visible)
    return event_rows(summary.cpu().numpy())


def logits_columns(prod: torch.Tensor, shadow: torch.Tensor | None, top_n: int) -> dict:
    """Top-N ids and log-probabilities per position of prod logits [T, V] (and shadow), as
    flat list columns."""
    out: dict = {"token": np.arange(prod.shape[0], dtype=np.int32)}
    ids, values = logits_device(prod, top_n)
    out["prod_top_ids"], out["prod_top_logprobs"] = logits_lists(ids.cpu().numpy(), values.cpu().numpy())
    if shadow is not None:
        ids, values = logits_device(shadow, top_n)
        out["shadow_top_ids"], out["shadow_top_logprobs"] = logits_lists(
            ids.cpu().numpy(), values.cpu().numpy()
        )
    return out
