"""The top-k comparison of trace format v2 (schemas/v2/topk.json), computed on the device.

Per query row, `compare` produces what the topk table stores: the summary (keys each path
selected, keys both selected, k-th scores and margins, churn counts, the producer's Jaccard
with and without churn), the differences (keys only one path selected), the boundary
candidates of each path (keys within the band of its k-th score, with their offset from it
and whether that path selected them) and, for sampled rows, the full production selection.
Everything is computed on the tensors' device; each chunk of rows' lists come out in one
piece, already gap-coded, so the host only slices them into rows (`columns`). On CUDA the
counts and the lists' masks come from one pass of Triton's `kernels.compare_masks`, and the
lists from `kernels.gap_code`, which writes each row's entries at its place in the counts'
running sum: the host needs only their total, copied as the device reaches it, and the work
runs once it has (`Packet.later`), so nothing waits. torch's ops compute the same elsewhere,
the lists through a `nonzero` that waits for the device (on a side stream, after the
forward has queued more work).

Definitions, as DESIGN.md and the topk table give them:

- a path's selection is its valid keys: >= 0 and below the row's visible-key count
  (engines pad with -1; HF's short rows also pick masked keys), each counted once;
- a row is dense when it sees at most k keys; its k-th scores, margins, boundary lists and
  churn counts are null;
- a row's band is relative (`SHADOWTRACE_BOUNDARY_BAND`, a fraction): in scores, the band
  times the row's score scale, the mean |score| of the reference path's top-k (the shadow's
  where one ran, production's otherwise; finite scores only), so that one band means the same
  on every model whatever its scores' magnitude; a row whose scale is not finite has no band
  (null: churn unknown);
- a key is a churn key of a path when its score is finite and lies within the row's band of
  that path's k-th score (a NaN k-th score has none); the boundary lists hold each path's keys
  within `STORED` times the band, so a reader can widen the band up to that as well as
  narrow it; churn keys are those of either path;
- Jaccard = shared / (prod_selected + shadow_selected - shared), 1 when both are empty; the
  churn-free Jaccard removes the churn keys from both selections first. Churn, and so the
  churn-free Jaccard, is known only with both paths' boundary candidates (production's
  need its recomputed scores): otherwise both are null.

The capture self-check (`compare(..., check=True)`, issue 27): where `prod_scores` are
production's own scores (captured from its top-k call, or recomputed from its own operands),
production's selection must be their top-k. On each sparse row it counts the keys production
selected that contradict them: a key its query cannot see (beyond the causal limit), one
scored below the k-th score by more than `CHECK_TOLERANCE` of the row's score scale (the
mean |score| of the keys production selected: `score_scale`'s definition, for its reason),
and each of the k slots left without a key (a sparse row's top-k always fills k).
Keys tied at the k-th score never count. A row with any such key disagrees: the
adapter read the selection against other tokens, another request or another layer than the
scores, which is a misreading of the engine, not numerics. A sparse row whose k-th score or
a selected key's score is not finite cannot be checked against a bound (every comparison
with NaN is false): unless a key it cannot see or an empty slot already contradicts it, it
is unchecked (`UNCHECKED`), counted apart from the rows checked.

A top-k kernel that drops winners (a radix top-k whose candidate buffer overflows and
silently loses keys of its threshold bucket) also leaves a selection production's own scores
contradict, with the adapter reading the engine right. The check tells the two apart per
disagreeing row (`check_figures`, `short_of_winners`), in production's own scores: such a
kernel selects every key above its threshold bucket outright, so the selection holds
production's top keys whole down to a rank near k and departs from them only in its tail,
while a selection read against another token, request or layer misses one of the very top
keys within a few ranks. A row is short of winners when it selects no key its query cannot
see and leaves no slot empty, keeps production's top `SHORT_KEPT_SHARE` x k keys whole, and
selects at least `SHORT_RECALL` x k keys of its top-k (ties and the tolerance as above). The
worst rank a selected key holds is recorded beside them, never a criterion: the kernel fills
the slots its lost candidates leave with keys below the threshold bucket, which on a short
row can be its last key.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from shadowtrace_hooks import kernels
from shadowtrace_hooks.numerics import Lists
from shadowtrace_hooks.transfer import Later, Packet

# The capture self-check's count for a row it could not check (a non-finite k-th score or
# selected score): never a number of keys.
UNCHECKED = -1

# The capture self-check's tolerance, relative to the row's score scale. A
# recompute of production's operands in fp32 differs from the engine's kernel by its
# summation order: a few fp32 ulps of the sum's terms (below 1e-6 relative; the stand-ins'
# kernels, emulated, and HF's captured scores give 0). 1e-3 leaves three decades to that and
# still flags a key scored 0.1% of the row's range below the k-th: a selection read against
# the wrong tokens puts most keys far below it (hooks/tests/test_capture_check.py).
CHECK_TOLERANCE = 1e-3

# A disagreeing row is short of winners (module docs) when it keeps production's top
# SHORT_KEPT_SHARE x k keys whole and SHORT_RECALL x k of its top-k. Measured on the committed
# trained checkpoints with transformers' indexer patched to an overflowing 256-entry candidate
# buffer (tests/python/deviation_patches.py `drops_winners`, 3072-token prompts, layer 0): the
# rows that lose winners keep at least 0.37 k (GLM) and 0.85 k (DeepSeek) of the top keys
# whole, with recall 0.69 and above; the same layer's selection read one token late, 37 tokens
# late or from layer 1 keeps a median of 0 to 155 keys, and 4% of rows at most reach k / 4.
# Recall alone does not separate them (a misread keeps 0.57 to 1.0), which is why it only
# bounds "most of the top-k kept": SGLang's overflowing buffer left recall 0.53 at its worst.
SHORT_KEPT_SHARE = 0.25
SHORT_RECALL = 0.5
# The rows of `check_figures`: production's top keys the selection keeps whole (the visible
# keys scored above the best one it left out), keys of its top-k it selected (scored at or
# above the k-th less the tolerance), the rank of its worst selected key (1 + the visible keys
# scored above it), and its certain contradictions (keys its query cannot see, empty slots).
FIGURES = ("kept_top", "hits", "worst_rank", "certain")

# How far beyond the churn band the boundary lists reach: the analyzer can widen the band up
# to this many times without the lists running out (`shadowtrace analyze --churn-band`). Two:
# the candidates grow about linearly with the band, and a trace's volume goal (issue 14) has
# room for twice the lists, not four times.
STORED = 2.0

# What a relative band multiplies, as the manifest names it (settings.boundary_band_scale;
# schemas/v2/topk.json's boundary_band): its presence says the band is relative.
BAND_SCALE = "mean_abs_reference_topk_score"

# Elements of one [rows, keys] mask: rows are compared in chunks of at most this many, which
# bounds the comparison's device memory whatever the prompt length.
CHUNK_ELEMENTS = 1 << 25
_INTS = ("prod_selected", "shadow_selected", "shared", "churn_shared", "churn_prod_only",
         "churn_shadow_only", "churn_unselected")  # fmt: skip
_FLOATS = ("prod_kth_score", "prod_kth_margin", "shadow_kth_score", "shadow_kth_margin", "jaccard",
           "jaccard_no_churn", "boundary_band")  # fmt: skip


class ListsLost(RuntimeError):
    """A comparison's lists were not made (their `Packet.later` work raised): the rows of
    that comparison cannot be written. The topk decoder leaves them out and counts them
    (`topk_lists_lost_rows`), records the first reason (`settings.topk_lists_lost_reason`)
    and logs it once per process; the writer counts them dropped."""


@dataclass
class _Chunk:
    """One chunk's tensors, as indices into the packet that carries them."""

    rows: int
    ints: int
    floats: int
    counts: int  # [lists, rows] entries per list and row
    check: int | None  # [rows] keys contradicting production's own scores (capture check)
    figures: int | None  # [FIGURES, rows] how a row departs from those scores' top-k
    # [entries] each: the lists' gap-coded keys (list-major, then row, then key), score minus
    # that path's k-th score and whether that path selected the key (boundary lists only)
    lists: Later


@dataclass
class Compared:
    """A comparison in flight: what the host needs to turn the packet into topk columns."""

    lists: tuple[str, ...]  # which lists were computed, in their order in each chunk
    has_prod_scores: bool
    has_shadow: bool
    band: float | None  # relative: a fraction of each row's score scale
    check: bool = False  # whether the chunks carry the capture self-check
    check_tolerance: float = CHECK_TOLERANCE
    check_tail: bool = False
    chunks: list[_Chunk] = field(default_factory=list)

    @property
    def churn(self) -> bool:
        """Whether churn is known: a band, and both paths' boundary candidates."""
        return self.band is not None and self.has_prod_scores and self.has_shadow


def _selected(
    indices: torch.Tensor,
    visible: torch.Tensor,
    keys: int,
    check: tuple[torch.Tensor, torch.Tensor, int, float, bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(`_membership` of indices, and with `check` = (production's own scores, their k-th
    score, k, tolerance, tail) `_contradicting`'s count): Triton's `kernels.membership` in one
    pass where it runs, torch's ops elsewhere."""
    done, _ = kernels.attempt(
        "membership", indices, lambda: kernels.membership(indices, visible, keys, check)
    )
    if done is not None:
        return done
    mask = _membership(indices, visible, keys)
    if check is None:
        return mask, None
    scores, kth, k, tolerance, tail = check
    return mask, _contradicting(indices, scores, kth, visible, visible > k, k, tolerance, tail)


def _membership(indices: torch.Tensor, visible: torch.Tensor, keys: int) -> torch.Tensor:
    """[rows, keys] bool: the valid keys of each row of `indices` ([rows, n], any padding)."""
    mask = torch.zeros(indices.shape[0], keys + 1, dtype=torch.bool, device=indices.device)
    idx = indices.long()
    valid = (idx >= 0) & (idx < visible[:, None])
    # Invalid entries all land in one spare column, dropped after: a scatter of False could
    # otherwise overwrite a valid key sharing their clamped position.
    mask.scatter_(1, torch.where(valid, idx, keys), True)
    return mask[:, :keys]


def _kth(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k-th score, its margin to the (k+1)-th, top-k key indices, score scale) of each row."""
    take = min(k + 1, scores.shape[1])
    values, idx = scores.topk(take, dim=-1)
    kth = values[:, min(k, take) - 1]
    margin = kth - values[:, k] if take > k else torch.full_like(kth, math.nan)
    return kth, margin, idx[:, :k], score_scale(values[:, :k])


def _kth_of(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[rows] the k-th largest of each row's scores as torch.topk ranks them (NaN above every
    number: NaN only where the top k are all NaN), from an unsorted top-k."""
    values = scores.topk(min(k, scores.shape[1]), dim=-1, sorted=False).values.float()
    nan = torch.isnan(values)
    return torch.where(nan.all(-1), math.nan, torch.where(nan, math.inf, values).amin(-1))


def _shadow_top(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k-th score, top-k key indices in no order, score scale) of each row: the selection of
    torch.topk(k), the call an engine makes, so that keys tied at the k-th score fall as the
    engine's own would on the same scores; unsorted, where sorting each row's 2,048 scores
    cost more than selecting them. The k-th is the smallest selected, ranked as torch.topk
    ranks (NaN above every number); the margin is `_margin`'s, once the selection is a mask."""
    values, idx = scores.topk(min(k, scores.shape[1]), dim=-1, sorted=False)
    kth = values.topk(1, dim=-1, largest=False).values[:, 0]
    return kth, idx, score_scale(values)


def _margin(scores: torch.Tensor, kth: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """[rows] the k-th score less the best score `chosen` [rows, keys] leaves out (NaN when a
    NaN is left out, as torch.topk ranks it first); NaN where no key is left out."""
    if scores.shape[1] <= k:
        return torch.full_like(kth, math.nan)
    return kth - torch.where(chosen, -math.inf, scores).amax(-1)


def score_scale(top: torch.Tensor) -> torch.Tensor:
    """[rows] the mean |score| of each row's top-k scores `top` [rows, k], finite ones only
    (NaN where none is): the scale a relative band multiplies. A mean, not the largest: one
    attention-sink key scored far above the rest would otherwise set the band for the keys at
    the k-th score, whose rounding error is that of scores like theirs."""
    top = top.float()
    finite = torch.isfinite(top)
    return torch.where(finite, top.abs(), 0.0).sum(-1) / finite.sum(-1)


def _kth_from_top(
    scores: torch.Tensor, top: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k-th score, margin) of each row from the scores [rows, k] a top-k call returned for
    `scores` (descending, NaN first as torch.topk orders them) and its selection `chosen`
    [rows, keys]: the k-th returned score, less the best score left out. The same numbers as
    `_kth` wherever the selection is that top-k, at the cost of one masked max instead of a
    second top-k over every key."""
    kth = top[:, k - 1].float()
    best_left_out = torch.where(chosen, -math.inf, scores).amax(-1)
    return kth, kth - best_left_out


def _near(scores: torch.Tensor, kth: torch.Tensor, band: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    # No isfinite test: a non-finite score, a non-finite k-th score or a NaN band (no scale)
    # puts an infinite or NaN distance or bound there, which is never within.
    return ((scores - kth[:, None]).abs_() <= band[:, None]) & sparse[:, None]


def compare(
    packet: Packet,
    prod_topk: torch.Tensor,
    q_pos: torch.Tensor,
    keys: int,
    k: int,
    *,
    prod_scores: torch.Tensor | None = None,
    shadow_scores: torch.Tensor | None = None,
    band: float | None = None,
    sampled: torch.Tensor | None = None,
    prod_top_values: torch.Tensor | None = None,
    check: bool = False,
    check_tolerance: float = CHECK_TOLERANCE,
    check_tail: bool = False,
) -> Compared:
    """Compares production's selection `prod_topk` [T, n] (keys by position, any padding)
    with the top-k of `shadow_scores` [T, keys] (-inf where masked), query t seeing keys
    s <= q_pos[t]. `prod_scores` (production's recomputed scores) give its k-th score,
    margin and boundary candidates; `band` is relative (a fraction of each row's
    `score_scale`; module docs); `sampled` [T] bool marks rows whose full production
    list is kept. `prod_top_values` [T, k]: the scores production's own top-k call returned
    with `prod_topk`, when `prod_scores` are that call's input (captured, not recomputed);
    its k-th score is then read from them instead of a second top-k. With `check`, and
    `prod_scores` production's own, the capture self-check runs too (`check_counts`), with
    `check_tolerance` (relative; `CHECK_TOLERANCE` unless production ranked rounded scores);
    `check_tail`: production appends the query's incomplete tail key (index `visible`,
    unscored: GLM-5.3-Flash's k-pool tail), which the check then leaves alone. The results
    go into `packet`; `columns` reads them back."""
    for name, scores in (("prod_scores", prod_scores), ("shadow_scores", shadow_scores)):
        if scores is not None and tuple(scores.shape) != (prod_topk.shape[0], keys):
            raise ValueError(
                f"compare: {name} of shape {tuple(scores.shape)}, expected {(prod_topk.shape[0], keys)}"
            )
    top_shape = None if prod_top_values is None else tuple(prod_top_values.shape)
    if top_shape is not None and (prod_scores is None or top_shape != (prod_topk.shape[0], k)):
        raise ValueError(
            f"compare: prod_top_values of shape {top_shape} need prod_scores and shape "
            f"{(prod_topk.shape[0], k)}"
        )
    lists = ["prod"] if sampled is not None else []
    if shadow_scores is not None:
        lists = ["prod_only", "shadow_only", *lists]
    if band is not None:
        lists += ["prod_boundary"] if prod_scores is not None else []
        lists += ["shadow_boundary"] if shadow_scores is not None else []
    out = Compared(
        tuple(lists),
        prod_scores is not None,
        shadow_scores is not None,
        band,
        check,
        check_tolerance,
        check_tail,
    )
    if check and prod_scores is None:
        raise ValueError("compare: the capture check needs production's own scores (prod_scores)")
    rows_total = prod_topk.shape[0]
    step = max(1, CHUNK_ELEMENTS // max(1, keys))
    for start in range(0, rows_total, step):
        rows = slice(start, min(start + step, rows_total))
        out.chunks.append(
            _compare_chunk(
                packet, out, prod_topk[rows], q_pos[rows], keys, k,
                None if prod_scores is None else prod_scores[rows],
                None if shadow_scores is None else shadow_scores[rows],
                None if sampled is None else sampled[rows],
                None if prod_top_values is None else prod_top_values[rows],
            )
        )  # fmt: skip
    return out


def _compare_chunk(
    packet: Packet,
    spec: Compared,
    prod_topk: torch.Tensor,
    q_pos: torch.Tensor,
    keys: int,
    k: int,
    prod_scores: torch.Tensor | None,
    shadow_scores: torch.Tensor | None,
    sampled: torch.Tensor | None,
    prod_top_values: torch.Tensor | None,
) -> _Chunk:
    device = prod_topk.device
    rows = prod_topk.shape[0]
    visible = q_pos + 1
    sparse = visible > k
    nan = torch.full((rows,), math.nan, device=device)
    zero = torch.zeros(rows, dtype=torch.int32, device=device)
    ints = dict.fromkeys(_INTS, zero)
    floats = dict.fromkeys(_FLOATS, nan)
    paths: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # scores, k-th, selection
    prod_kth = scale = None
    if prod_scores is not None:
        if prod_top_values is None:
            prod_kth, floats["prod_kth_margin"], _, scale = _kth(prod_scores, k)
        else:
            prod_kth, scale = prod_top_values[:, k - 1].float(), score_scale(prod_top_values)
        floats["prod_kth_score"] = prod_kth
    check_args = None
    if spec.check:
        assert prod_scores is not None
        assert prod_kth is not None
        # The values production's top-k returned hold its k-th score only where the kernel
        # returns them sorted and selects right: a kernel that drops winners returns its own
        # selection's scores in its own order, whose k-th entry may be any of them (the check
        # then missed 193 of 458 disagreeing rows of transformers' GLM patched so). The check
        # reads the k-th of the scores themselves.
        kth = prod_kth if prod_top_values is None else _kth_of(prod_scores, k)
        check_args = (prod_scores, kth, k, spec.check_tolerance, spec.check_tail)
    prod, contradicting = _selected(prod_topk, visible, keys, check_args)
    check = None if contradicting is None else packet.add(contradicting)
    figures = None
    if check_args is not None:
        figures = packet.add(_check_figures(prod_topk, prod, *check_args[:2], visible, *check_args[2:]))
    if prod_scores is not None:
        assert prod_kth is not None
        paths["prod_boundary"] = (prod_scores, prod_kth, prod)
    shadow = shadow_kth = None
    if shadow_scores is not None:
        # the reference path's scale where there is one: production's own cannot widen its band
        shadow_kth, chosen, scale = _shadow_top(shadow_scores, k)
        shadow, _ = _selected(chosen, visible, keys)
        floats["shadow_kth_margin"] = _margin(shadow_scores, shadow_kth, shadow, k)
        floats["shadow_kth_score"] = shadow_kth
        paths["shadow_boundary"] = (shadow_scores, shadow_kth, shadow)
    band = None
    if spec.band is not None and scale is not None:
        band = floats["boundary_band"] = spec.band * scale
    done, _ = kernels.attempt(
        "compare_masks", prod,
        lambda: kernels.compare_masks(
            spec.lists, prod, shadow, prod_scores, shadow_scores, prod_kth, shadow_kth,
            visible, k, band, STORED, sampled,
        ),
    )  # fmt: skip
    if done is not None:
        stacked, counts, by_kernel, left = done
        ints = dict(zip(_INTS, by_kernel.unbind(0), strict=True))
        if prod_kth is not None and prod_top_values is not None:
            floats["prod_kth_margin"] = prod_kth - left
        return _chunk_tail(packet, spec, rows, ints, floats, paths, stacked, counts, (check, figures))
    if prod_scores is not None and prod_top_values is not None:
        _, floats["prod_kth_margin"] = _kth_from_top(prod_scores, prod_top_values, prod, k)
    ints["prod_selected"] = prod.sum(-1, dtype=torch.int32)
    masks: dict[str, torch.Tensor] = {}
    if shadow is not None:
        ints["shadow_selected"] = shadow.sum(-1, dtype=torch.int32)
        both = prod & shadow
        ints["shared"] = both.sum(-1, dtype=torch.int32)
        masks["prod_only"], masks["shadow_only"] = prod & ~shadow, shadow & ~both
    if band is not None:
        for name, (scores, kth, _) in paths.items():
            masks[name] = _near(scores, kth, STORED * band, sparse)
    if spec.churn:
        assert band is not None
        churn = torch.zeros_like(prod)
        for scores, kth, _ in paths.values():
            churn |= _near(scores, kth, band, sparse)
        in_prod, in_shadow = churn & prod, churn & shadow
        ints["churn_shared"] = (in_prod & shadow).sum(-1, dtype=torch.int32)
        ints["churn_prod_only"] = (in_prod & ~shadow).sum(-1, dtype=torch.int32)
        ints["churn_shadow_only"] = (in_shadow & ~prod).sum(-1, dtype=torch.int32)
        ints["churn_unselected"] = (churn & ~prod & ~shadow).sum(-1, dtype=torch.int32)
    if sampled is not None:
        masks["prod"] = prod & sampled[:, None]
    stacked = (
        torch.stack([masks[name] for name in spec.lists])
        if spec.lists
        else torch.zeros(0, rows, keys, dtype=torch.bool, device=device)
    )
    counts = stacked.sum(-1, dtype=torch.int32)
    return _chunk_tail(packet, spec, rows, ints, floats, paths, stacked, counts, (check, figures))


def _chunk_tail(
    packet: Packet,
    spec: Compared,
    rows: int,
    ints: dict[str, torch.Tensor],
    floats: dict[str, torch.Tensor],
    paths: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    stacked: torch.Tensor,
    counts: torch.Tensor,
    check: tuple[int | None, int | None],
) -> _Chunk:
    """A chunk's Jaccards from its counts, and its lists gap-coded from their masks `stacked`
    [L, rows, keys] with `counts` [L, rows] entries, into the packet."""
    if spec.has_shadow:
        union = ints["prod_selected"] + ints["shadow_selected"] - ints["shared"]
        floats["jaccard"] = _ratio(ints["shared"], union)
        if spec.churn:
            removed = ints["churn_shared"] + ints["churn_prod_only"] + ints["churn_shadow_only"]
            floats["jaccard_no_churn"] = _ratio(ints["shared"] - ints["churn_shared"], union - removed)
    # Only what the lists read, and that as tensors of their own: a slice of the engine's
    # scores would keep all of them alive until the work runs (the next layer's indexer).
    kept = {name: tuple(map(_own, path)) for name, path in paths.items() if name in spec.lists}
    held = stacked.nbytes + counts.nbytes + sum(t.nbytes for path in kept.values() for t in path)
    total = _on_host(counts.sum(dtype=torch.int64).reshape(1))
    lists = packet.later(
        stacked.device, 3, lambda: _gap_coded(spec.lists, kept, stacked, counts, total), held
    )
    return _Chunk(
        rows=rows,
        ints=packet.add(torch.stack([ints[n] for n in _INTS])),
        floats=packet.add(torch.stack([floats[n].float() for n in _FLOATS])),
        counts=packet.add(counts),
        lists=lists,
        check=check[0],
        figures=check[1],
    )


def _contradicting(
    prod_topk: torch.Tensor,
    prod_scores: torch.Tensor,
    kth: torch.Tensor,
    visible: torch.Tensor,
    sparse: torch.Tensor,
    k: int,
    tolerance: float,
    tail: bool = False,
) -> torch.Tensor:
    """[rows] int32: the keys of production's selection that its own scores contradict, and
    its empty slots (the module's capture self-check), 0 on dense rows, `UNCHECKED` on a
    sparse row that only a non-finite score could judge. Reads only the selected keys'
    scores, a [rows, n] gather, never the whole [rows, keys] matrix again."""
    idx = prod_topk.long()
    beyond = idx >= visible[:, None]  # never gathered: a misread row may point past the keys
    if tail:  # the appended tail key is production's by definition, never scored
        beyond = beyond & (idx != visible[:, None])
    unseen = beyond & sparse[:, None]
    valid = (idx >= 0) & (idx < visible[:, None])
    got = prod_scores.gather(1, torch.where(valid, idx, 0)).float()
    finite = valid & torch.isfinite(got)
    kth = kth.float()
    unknown = (valid & ~finite).any(-1) | ~torch.isfinite(kth)
    # score_scale over the selected keys: on a row it checks, every selected score is finite
    scale = torch.where(finite, got.abs(), 0.0).sum(-1) / finite.sum(-1).clamp(min=1)
    below = valid & (got < (kth - tolerance * scale)[:, None]) & sparse[:, None]
    # Padding (-1) in place of a key: a sparse row's top-k fills k slots.
    missing = (k - (idx >= 0).sum(-1)).clamp(min=0) * sparse
    certain = unseen.sum(-1) + missing
    count = below.sum(-1) + certain
    return torch.where(sparse & unknown & (certain == 0), UNCHECKED, count).to(torch.int32)


def _check_figures(
    prod_topk: torch.Tensor,
    chosen: torch.Tensor,
    scores: torch.Tensor,
    kth: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    tolerance: float,
    tail: bool = False,
) -> torch.Tensor:
    """[FIGURES, rows] int32: how production's selection (`prod_topk` [rows, n], its valid
    keys `chosen` [rows, keys]) departs from the top-k of its own `scores` [rows, keys] with
    k-th score `kth` (the module's short-of-winners reading; `FIGURES` names the rows). A
    selection that leaves no visible key out keeps every one. Ranks count only keys scored
    strictly above (ties rank together); NaN scores are never above, a row with any is
    unchecked and never read."""
    keys = scores.shape[1]
    seen = torch.arange(keys, device=scores.device)[None, :] < visible[:, None]
    values = scores.float()
    best_out = torch.where(chosen | ~seen, -math.inf, values).amax(-1)
    kept_top = ((values > best_out[:, None]) & seen).sum(-1, dtype=torch.int32)
    worst_in = torch.where(chosen, values, math.inf).amin(-1)
    worst_rank = 1 + ((values > worst_in[:, None]) & seen).sum(-1, dtype=torch.int32)
    picked = chosen.sum(-1).clamp(min=1)
    # the check's tolerance, scaled as `_contradicting` scales it: the selected keys' mean |score|
    scale = torch.where(chosen & torch.isfinite(values), values.abs(), 0.0).sum(-1) / picked
    hits = (chosen & (values >= (kth.float() - tolerance * scale)[:, None])).sum(-1, dtype=torch.int32)
    idx = prod_topk.long()
    beyond = idx >= visible[:, None]
    if tail:
        beyond = beyond & (idx != visible[:, None])
    missing = (k - (idx >= 0).sum(-1)).clamp(min=0)
    certain = (beyond.sum(-1) + missing).to(torch.int32)
    return torch.stack([kept_top, hits, worst_rank, certain])


def check_figures(spec: Compared, arrays: list[np.ndarray]) -> np.ndarray | None:
    """[FIGURES, T] `_check_figures` of every row, from the packet's host arrays; None when the
    comparison did not run the capture self-check."""
    if not spec.check:
        return None
    return np.concatenate([arrays[c.figures] for c in spec.chunks if c.figures is not None], axis=1)


def short_of_winners(contradicting: np.ndarray, figures: np.ndarray, k: int) -> np.ndarray:
    """[T] bool: the disagreeing rows (`check_counts` > 0) whose selection is production's top
    keys short of some (module docs): no certain contradiction, production's top
    `SHORT_KEPT_SHARE` x k keys kept whole and `SHORT_RECALL` x k of its top-k selected."""
    kept_top, hits, _, certain = figures
    return (
        (contradicting > 0) & (certain == 0) & (kept_top >= SHORT_KEPT_SHARE * k) & (hits >= SHORT_RECALL * k)
    )


def check_counts(spec: Compared, arrays: list[np.ndarray]) -> np.ndarray | None:
    """[T] the capture self-check's contradicting keys per row (0 on dense rows, `UNCHECKED`
    where it could not check), from the packet's host arrays; None when the comparison did
    not run the check."""
    if not spec.check:
        return None
    return np.concatenate([arrays[c.check] for c in spec.chunks if c.check is not None])


def _on_host(count: torch.Tensor) -> torch.Tensor:
    """`count` copied to the host without waiting for it: pinned memory the copy fills once
    the device reaches it (`Packet.later` runs its work after that), or `count` itself on a
    CPU or where no pinned memory is to be had (reading it then waits)."""
    if not count.is_cuda:
        return count
    try:
        host = torch.empty(count.shape, dtype=count.dtype, pin_memory=True)
    except RuntimeError:
        return count
    return host.copy_(count, non_blocking=True)


def _gap_coded(
    lists: tuple[str, ...],
    paths: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    stacked: torch.Tensor,
    counts: torch.Tensor,
    total: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The entries of the masks `stacked` [L, rows, keys] (`counts` [L, rows] a list and
    row, `total` [1] in all, on the host once the work runs), list-major then row then key:
    their keys gap-coded within each row, and for a boundary list each key's score minus
    that path's k-th score and whether that path selected it (zero elsewhere). Triton's
    `kernels.gap_code` writes them where it runs; torch's `nonzero` elsewhere, which makes
    the host wait for the device, so `Packet.later` runs this."""
    if all(kth.dtype == torch.float32 or scores.dtype == torch.float32 for scores, kth, _ in paths.values()):
        # (the kernel subtracts in fp32; torch, with both in a narrower dtype, would not)
        done, _ = kernels.attempt(
            "gap_code", stacked, lambda: kernels.gap_code(lists, paths, stacked, counts, int(total[0]))
        )
        if done is not None:
            return done
    which, row, key = stacked.nonzero().unbind(1)
    first = torch.ones_like(which, dtype=torch.bool)
    first[1:] = (which[1:] != which[:-1]) | (row[1:] != row[:-1])
    gaps = torch.where(first, key, key - torch.roll(key, 1)).to(torch.int32)
    offsets = torch.zeros(key.shape, dtype=torch.float32, device=stacked.device)
    selected = torch.zeros(key.shape, dtype=torch.bool, device=stacked.device)
    for name, (scores, kth, chosen) in paths.items():
        if name in lists:
            here = which == lists.index(name)
            offsets = torch.where(here, (scores[row, key] - kth[row]).float(), offsets)
            selected = torch.where(here, chosen[row, key], selected)
    return gaps, offsets, selected


def _own(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it where t is a view into a larger tensor."""
    return t if t.untyped_storage().nbytes() <= t.numel() * t.element_size() else t.clone()


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den as fp32, 1 where den is 0 (two empty selections do not disagree)."""
    return torch.where(
        den > 0, num.float() / den.clamp(min=1).float(), torch.ones_like(num, dtype=torch.float32)
    )


def _list_column(values: np.ndarray, counts: np.ndarray, null: np.ndarray | None) -> Lists:
    offsets = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    if null is None or not null.any():
        return Lists(values, offsets)
    mask = np.zeros(len(offsets), dtype=bool)
    mask[:-1] = null
    return Lists(values, np.ma.masked_array(offsets, mask=mask))


def columns(
    spec: Compared, arrays: list[np.ndarray], visible: np.ndarray, k: int, sampled: np.ndarray | None = None
) -> dict:
    """The topk table's summary, difference and boundary columns of a comparison, from its
    packet's host arrays. `visible` [T] is each row's visible-key count, `sampled` [T] the
    rows whose full production list was kept (as given to `compare`)."""
    for chunk in spec.chunks:
        if chunk.lists.error is not None:
            raise ListsLost(f"topk: the difference and candidate lists were not made: {chunk.lists.error}")
    ints = np.concatenate([arrays[c.ints] for c in spec.chunks], axis=1)
    floats = np.concatenate([arrays[c.floats] for c in spec.chunks], axis=1)
    dense = visible <= k
    cols: dict = {"prod_selected": ints[0]}

    def scalar(values: np.ndarray, null: np.ndarray) -> np.ndarray:
        return np.ma.masked_array(values, mask=null) if null.any() else values

    # A row without a finite band (no finite score among the reference's top-k) has no
    # candidates and no churn: null, never a count of zero.
    unbanded = dense | ~np.isfinite(floats[6])
    if spec.has_prod_scores:
        cols["prod_kth_score"] = scalar(floats[0], dense)
        cols["prod_kth_margin"] = scalar(floats[1], dense)
    if spec.has_shadow:
        cols["shadow_selected"], cols["shared"] = ints[1], ints[2]
        cols["shadow_kth_score"] = scalar(floats[2], dense)
        cols["shadow_kth_margin"] = scalar(floats[3], dense)
        cols["jaccard"] = floats[4]
        if spec.churn:
            for i, name in enumerate(_INTS[3:], start=3):
                cols[name] = scalar(ints[i], unbanded)
            cols["jaccard_no_churn"] = scalar(floats[5], unbanded & ~dense)
    if spec.band is not None and (spec.has_prod_scores or spec.has_shadow):
        cols["boundary_band"] = scalar(floats[6], unbanded)
    # Each list's entries sit in every chunk as one run, in `spec.lists` order.
    pieces: dict[str, list] = {name: [[], [], [], []] for name in spec.lists}
    for chunk in spec.chunks:
        counts = arrays[chunk.counts]
        start = 0
        for i, name in enumerate(spec.lists):
            end = start + int(counts[i].sum())
            for part, source in zip(pieces[name], chunk.lists.slots, strict=False):
                part.append(arrays[source][start:end])
            pieces[name][3].append(counts[i])
            start = end
    for name, (gaps, offsets, selected, counts) in pieces.items():
        per_row = np.concatenate(counts)
        gap_values = np.concatenate(gaps)
        if name in ("prod_only", "shadow_only"):
            cols[f"{name}_gaps"] = _list_column(gap_values, per_row, None)
        elif name == "prod":
            cols["prod_gaps"] = _list_column(gap_values, per_row, None if sampled is None else ~sampled)
        else:
            path = name.removesuffix("_boundary")
            cols[f"{path}_boundary_gaps"] = _list_column(gap_values, per_row, unbanded)
            cols[f"{path}_boundary_offsets"] = _list_column(np.concatenate(offsets), per_row, unbanded)
            cols[f"{path}_boundary_selected"] = _list_column(np.concatenate(selected), per_row, unbanded)
    return cols
