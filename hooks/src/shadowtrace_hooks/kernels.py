"""Triton kernels for the shadow's device work where torch's ops cost too much at production
width. Each computes what a function of `numerics` defines, and is tested against it and
against an fp64 recomputation (hooks/tests/kernel_cases.py runs them in Triton's CPU
interpreter, from test_kernels.py; tests/gpu/kernels_h200.py times and checks them on the GPU).

- `index_scores`: the indexer's scores, `numerics.index_scores` in one kernel. torch's path
  writes and reads the [rows, H, S] fp32 products; this one keeps each tile's products in
  registers, summing w[t,h] * relu(q[t,h] . k[s]) over the heads, and skips the tiles the
  causal mask hides.
- `compare_masks`: the top-k comparison's per-row counts and list masks
  (`selection.compare`'s), in one pass over the two selections and their scores, where
  torch's ops take two dozen over [rows, keys].
- `row_stats`: a site's per-row statistics (`stats.counts_device` and `stats.hidden_device`'s
  sums) in one pass over prod and shadow, where torch's ops take a dozen.
- `slot_counts`: the non-finite elements of each slot of a KV-cache window
  (`stats.slot_nonfinite_device`), read where the cache holds them: slots lie along the
  middle dimension, and a slot-major copy for `row_stats` cost more than the count.
- `sentinel_reads`: the KV sentinel's reads of slot 0 and of a step's new slots, summarised
  (`stats.sentinel_device`), in one launch a cache where torch's ops take a dozen: inside a
  CUDA graph every launch is replayed each step.

Triton is imported when a kernel is first asked for, never at the hooks' import: a process
that does not trace, or traces on the CPU, never loads it.
"""

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

# (query rows, keys) per tile, warps, pipeline stages: a tile's fp32 accumulators and its K
# tile [D, keys] stay in registers while the heads' q tiles stream through.
SCORES_LAUNCH = (64, 64, 4, 2)
PRECISIONS = ("ieee", "tf32x3")
T = TypeVar("T")


# Kernels that raised in this process, with why: callers use torch's ops for them from then on,
# and every run closed after counts them (process.kernel_failed.<name>).
failed: dict[str, str] = {}


def unavailable(name: str, x: torch.Tensor) -> str | None:
    """Why kernel `name` ("index_scores", "row_stats", "membership", "compare_masks", "gap_code",
    "slot_counts", "sentinel_reads") will not run on x (None when it will): it raised before in this process,
    x is not on CUDA (or Triton's CPU interpreter is off), or Triton is absent; for
    "index_scores", a head size (x's last) that is not a power of two >= 16."""
    if name in failed:
        return failed[name]
    d = x.shape[-1]
    if name == "index_scores" and (d < 16 or d & (d - 1)):
        return f"head size {d} is not a power of two >= 16"
    if not x.is_cuda and not _interpreted():
        return f"device {x.device.type} (Triton runs on CUDA)"
    if _triton() is None:
        return "triton is not installed"
    return None


def describe() -> str:
    """One line for `doctor`: whether the kernels will run in this environment, and what runs
    instead when they will not."""
    if not torch.cuda.is_available():
        return "CUDA is not available: torch's ops (plain fp32 indexer scores on the CPU)"
    triton = _triton()
    if triton is None:
        return "triton is not installed: torch's ops (3xTF32 indexer scores through cuBLAS on CUDA)"
    name = torch.cuda.get_device_name()
    return f"triton {triton.__version__} on {name}: the indexer scores, site statistics and top-k comparison"


def attempt(name: str, x: torch.Tensor, launch: Callable[[], T]) -> tuple[T | None, str | None]:
    """Runs `launch` (kernel `name`'s work on x) unless `unavailable` gives a reason not to:
    (its result, None), or (None, why the caller must use torch's ops), a raise recorded by
    `note_failure` so that the kernel is not asked again in this process."""
    reason = unavailable(name, x)
    if reason is not None:
        return None, reason
    try:
        return launch(), None
    except Exception as e:  # a compile or launch failure: torch's ops from now on
        return None, note_failure(name, e)


def note_failure(name: str, error: Exception) -> str:
    """Records that kernel `name` raised `error`; returns the reason `unavailable` gives from now on."""
    failed[name] = f"the kernel raised {type(error).__name__}: {str(error)[:160]}"
    return failed[name]


def index_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    q_pos: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    precision: str = "tf32x3",
) -> torch.Tensor:
    """fp32 scores [T, S], -inf where masked, from q [T,H,D], k [S,D], w [T,H], query t seeing
    keys s <= q_pos[t]: `numerics.index_scores`'s definition. The products are Triton's
    `tl.dot` at `precision`: "ieee" (fp32 FMA) or "tf32x3" (three TF32 products, within
    `numerics.SPLIT_TF32_ERROR` of sum |q_i k_i|); heads are summed in order, in fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"kernels.index_scores: precision {precision!r}, expected one of {PRECISIONS}")
    reason = unavailable("index_scores", q)
    if reason is not None:
        raise RuntimeError(f"kernels.index_scores: {reason}")
    t, h, d = q.shape
    s = k.shape[0]
    if tuple(k.shape) != (s, d) or tuple(w.shape) != (t, h) or tuple(q_pos.shape) != (t,):
        raise ValueError(
            f"kernels.index_scores: q {tuple(q.shape)}, k {tuple(k.shape)}, w {tuple(w.shape)}, "
            f"q_pos {tuple(q_pos.shape)}; expected k [S, {d}], w [{t}, {h}], q_pos [{t}]"
        )
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    q, k, w = q.float().contiguous(), k.float().contiguous(), w.float().contiguous()
    q_pos = q_pos.to(torch.int64).contiguous()
    out = torch.empty(t, s, dtype=torch.float32, device=q.device)
    if t and s:
        launch_scores(q, k, w, q_pos, out, scale, precision, *SCORES_LAUNCH)
    return out


ROW_STATS = ("nan", "pos_inf", "neg_inf", "max_abs", "sum_sq")
ROW_PAIR_STATS = ("diff_sum_sq", "dot", "max_abs_diff")
ROW_FIRST = ("first_nan", "first_pos_inf", "first_neg_inf")
_ROW_BLOCK = 1024


def row_stats(x: torch.Tensor, shadow: torch.Tensor | None = None) -> torch.Tensor:
    """[C, T] fp32 per row of x [T, N]: `ROW_STATS` of x,
    then with `shadow` [T, N] the same of the shadow and `ROW_PAIR_STATS` of the two, then
    `ROW_FIRST` of x. Counts are of NaN, +Inf and -Inf elements (exact below 2^24 per row);
    every other sum and maximum is over the values with non-finite elements read as 0, summed
    in fp32; `ROW_FIRST` is the first element of the row holding each kind (-1: none), which
    a site's non-finite events name, so that its one pass gives them too."""
    if x.dim() != 2 or not x.is_floating_point() or (shadow is not None and shadow.shape != x.shape):
        got = None if shadow is None else tuple(shadow.shape)
        raise ValueError(
            f"kernels.row_stats: x {tuple(x.shape)} {x.dtype}, shadow {got}: "
            "expected a floating [T, N] x and a shadow of its shape"
        )
    if x.shape[1] >= 1 << 24:  # the element indices of ROW_FIRST are exact in fp32 below it
        raise ValueError(f"kernels.row_stats: rows of {x.shape[1]} elements; expected fewer than 2^24")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if shadow is not None and shadow.stride(-1) != 1:
        shadow = shadow.contiguous()
    t, n = x.shape
    c = len(ROW_STATS) * (1 if shadow is None else 2) + (0 if shadow is None else len(ROW_PAIR_STATS))
    c += len(ROW_FIRST)
    out = torch.empty(c, t, dtype=torch.float32, device=x.device)
    if t:
        s = x if shadow is None else shadow
        with _on(x):
            _row_kernel()[(t,)](
                x,
                s,
                out,
                t,
                n,
                x.stride(0),
                s.stride(0),
                HAS_SHADOW=shadow is not None,
                FIRST=c - len(ROW_FIRST),
                BLOCK=_ROW_BLOCK,
                BLOCKS=_blocks(n),
            )
    return out


def _pow2(n: int) -> int:
    """n rounded up to a power of two: a kernel compiled for a loop of n blocks serves every
    count up to twice it."""
    return 1 << max(0, (n - 1).bit_length())


def _blocks(n: int) -> int:
    """`_ROW_BLOCK`-element blocks for a row of n, rounded up to a power of two: a kernel
    compiled for one row length serves every length up to twice it (the indexer's rows grow
    with the prompt; a constexpr length would compile anew for each)."""
    return _pow2(-(-n // _ROW_BLOCK))


# (slots, elements of a slot's vector) per program of `slot_counts`
_SLOT_TILE = (32, 128)


def slot_counts(window: torch.Tensor) -> torch.Tensor:
    """[S] int32: the NaN, +Inf and -Inf elements of each slot s of window [O, S, D], summed
    over O and D, read in place whatever its strides (a narrowed cache is not contiguous)."""
    if window.dim() != 3 or not window.is_floating_point():
        raise ValueError(
            f"kernels.slot_counts: window {tuple(window.shape)} {window.dtype}: expected a floating [O, S, D]"
        )
    o, s, d = window.shape
    out = torch.zeros(s, dtype=torch.int32, device=window.device)
    if o and s and d:
        block_s, block_d = _SLOT_TILE
        with _on(window):
            _slot_kernel()[(-(-s // block_s), o)](
                window, out, s, d, *window.stride(), BLOCK_S=block_s, BLOCK_D=block_d,
                D_BLOCKS=-(-d // block_d),
            )  # fmt: skip
    return out


def sentinel_reads(caches: list[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """[B, 2, len(caches), 4] int64: the KV sentinel's two reads of each batch row b of every
    cache [B, O, S, D] (heads merged into O; any strides), read 0 of slot 0 and read 1 of
    the slots positions[b] [P]: the NaN, +Inf and -Inf elements of the slots read, the first
    slot read (in positions' order) holding one (the first slot read when none does), and the
    least and greatest slot read. A slot outside 0..S-1 is read as holding nothing. One
    program per (row, read) and cache, which loops over its slots: what a decode step's graph
    reads is a slot or two per row, and one launch a cache replaces a dozen of torch's ops."""
    if positions.dim() != 2 or positions.dtype != torch.int64 or not caches:
        raise ValueError(
            f"kernels.sentinel_reads: positions {tuple(positions.shape)} {positions.dtype}, "
            f"{len(caches)} caches: expected int64 [B, P] positions and at least one cache"
        )
    b, p = positions.shape
    for cache in caches:
        if cache.dim() != 4 or cache.shape[0] != b or not cache.is_floating_point():
            raise ValueError(
                f"kernels.sentinel_reads: cache {tuple(cache.shape)} {cache.dtype}: "
                f"expected a floating [{b}, O, S, D]"
            )
    out = torch.empty(b, 2, len(caches), 4, dtype=torch.int64, device=positions.device)
    if b and p:
        block_p, block_d = _SLOT_TILE
        with _on(positions):
            for i, cache in enumerate(caches):
                o, s, d = cache.shape[1:]
                _sentinel_kernel()[(b, 2)](
                    cache, positions, out[:, :, i], p, s, d, *cache.stride(), *positions.stride(),
                    *out[:, :, i].stride()[:2], HEADS=o, BLOCK_P=block_p, P_BLOCKS=_pow2(-(-p // block_p)),
                    BLOCK_D=block_d, D_BLOCKS=-(-d // block_d),
                )  # fmt: skip
    return out


def membership(
    indices: torch.Tensor,
    visible: torch.Tensor,
    keys: int,
    check: "tuple[torch.Tensor, torch.Tensor, int, float, bool] | None" = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`selection._membership`'s mask [rows, keys] (bool) of the valid keys of indices
    [rows, n] (>= 0 and below visible [rows]), and with `check` = (production's own scores
    [rows, keys], their k-th score [rows], k, tolerance, tail) the capture self-check's count
    [rows] int32 of `selection._contradicting`, in one pass over the indices (and the scores
    they point at) where torch's ops take a dozen over [rows, n] in int64."""
    rows, n = indices.shape
    device = indices.device
    mask = torch.zeros(rows, keys, dtype=torch.bool, device=device)
    count = None if check is None else torch.zeros(rows, dtype=torch.int32, device=device)
    if rows == 0 or n == 0:
        if check is not None and rows:  # no key in any slot: a sparse row's k slots are empty
            _, _, k, _, _ = check
            count = torch.where(visible > k, k, 0).to(torch.int32)
        return mask, count
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    scores, kth, k, tolerance, tail = (dummy, dummy, 0, 0.0, False) if check is None else check
    with _on(indices):
        _member_kernel()[(rows,)](
            indices, visible.to(torch.int64).contiguous(), mask.view(torch.uint8), scores,
            kth.float().contiguous(), dummy if count is None else count, n, keys,
            indices.stride(0), indices.stride(1), scores.stride(0) if check else 0,
            scores.stride(1) if check else 0, k, tolerance,
            CHECK=check is not None, TAIL=tail, BLOCK=_INDEX_BLOCK, BLOCKS=-(-n // _INDEX_BLOCK),
        )  # fmt: skip
    return mask, count


# entries of a selection's indices per block of `membership`
_INDEX_BLOCK = 1024


# the lists `compare_masks` can write, in `selection.compare`'s names
COMPARE_LISTS = ("prod_only", "shadow_only", "prod_boundary", "shadow_boundary", "prod")


def compare_masks(
    lists: tuple[str, ...],
    prod: torch.Tensor,
    shadow: torch.Tensor | None,
    prod_scores: torch.Tensor | None,
    shadow_scores: torch.Tensor | None,
    prod_kth: torch.Tensor | None,
    shadow_kth: torch.Tensor | None,
    visible: torch.Tensor,
    k: int,
    band: torch.Tensor | None,
    stored: float,
    sampled: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pass over a chunk of `selection.compare`'s rows: from the selections' masks prod
    and shadow [rows, keys] (bool) and the scores [rows, keys] with their k-th [rows], the
    masks of `lists` (each a name of `COMPARE_LISTS`) stacked [L, rows, keys] bool, their
    entries per row [L, rows] int32, `selection`'s seven counts [7, rows] int32 (zero where
    they do not apply) and production's best score left out of its selection [rows] (NaN
    when a left-out score is NaN, as torch's amax gives; -inf without prod_scores).
    Boundary candidates need `band` [rows] (in scores; NaN: none), the lists reaching
    `stored` times it; churn counts, within the band, need both paths' scores and a band."""
    rows, keys = prod.shape
    device = prod.device
    # the kernel walks each row with unit stride
    prod, shadow, prod_scores, shadow_scores = (
        t if t is None or t.stride(-1) == 1 else t.contiguous()
        for t in (prod, shadow, prod_scores, shadow_scores)
    )
    stacked = torch.empty(len(lists), rows, keys, dtype=torch.uint8, device=device)
    counts = torch.empty(len(lists), rows, dtype=torch.int32, device=device)
    ints = torch.empty(7, rows, dtype=torch.int32, device=device)
    left = torch.empty(rows, dtype=torch.float32, device=device)
    if rows == 0:
        return stacked.view(torch.bool), counts, ints, left
    where = {name: lists.index(name) if name in lists else -1 for name in COMPARE_LISTS}
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    zeros = torch.zeros(rows, dtype=torch.float32, device=device)
    keep = torch.zeros(rows, dtype=torch.bool, device=device) if sampled is None else sampled.contiguous()
    as_bytes = lambda m: m.view(torch.uint8)  # noqa: E731
    with _on(prod):
        _compare_kernel()[(rows,)](
            as_bytes(prod), as_bytes(prod if shadow is None else shadow),
            dummy if prod_scores is None else prod_scores, dummy if shadow_scores is None else shadow_scores,
            zeros if prod_kth is None else prod_kth.float().contiguous(),
            zeros if shadow_kth is None else shadow_kth.float().contiguous(),
            visible.to(torch.int64).contiguous(),
            as_bytes(keep),
            zeros if band is None else band.float().contiguous(), stored,
            stacked, counts, ints, left, rows, keys, k,
            prod.stride(0), prod.stride(0) if shadow is None else shadow.stride(0),
            0 if prod_scores is None else prod_scores.stride(0),
            0 if shadow_scores is None else shadow_scores.stride(0),
            HAS_SHADOW=shadow is not None, HAS_PS=prod_scores is not None,
            HAS_SS=shadow_scores is not None, HAS_BAND=band is not None,
            CHURN=band is not None and prod_scores is not None and shadow_scores is not None,
            L_PO=where["prod_only"], L_SO=where["shadow_only"], L_PB=where["prod_boundary"],
            L_SB=where["shadow_boundary"], L_P=where["prod"], BLOCK=_ROW_BLOCK, BLOCKS=_blocks(keys),
        )  # fmt: skip
    return stacked.view(torch.bool), counts, ints, left


def gap_code(
    lists: tuple[str, ...],
    paths: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    stacked: torch.Tensor,
    counts: torch.Tensor,
    total: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`selection._gap_coded`'s entries of the masks `stacked` [L, rows, keys] (bool), whose
    `counts` [L, rows] (int32) sum to `total`, known on the host: list-major, then row, then
    key, each key gap-coded within its row; for the boundary lists (`paths`: name -> scores
    [rows, keys], k-th score [rows], selection [rows, keys]) each key's score minus the k-th
    score in fp32 and whether that path selected it. Where `nonzero` must wait for the device
    to size its output, each (list, row) here writes its keys at its place in the counts'
    running sum, marking the row's first; the gaps are then one elementwise pass."""
    n_lists, rows, keys = stacked.shape
    device = stacked.device
    key = torch.empty(total, dtype=torch.int32, device=device)
    first = torch.empty(total, dtype=torch.bool, device=device)
    offsets = torch.zeros(total, dtype=torch.float32, device=device)
    selected = torch.zeros(total, dtype=torch.bool, device=device)
    if total == 0 or n_lists * rows == 0:
        return key, offsets, selected
    flat = counts.reshape(-1).to(torch.int64)
    starts = torch.cumsum(flat, 0) - flat
    where = {name: lists.index(name) if name in lists and name in paths else -1 for name in _BOUNDARY}
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    operands = []
    for name in _BOUNDARY:
        if where[name] < 0:
            operands.append((dummy, dummy, dummy.view(torch.uint8), 0, 0))
            continue
        scores, kth, chosen = paths[name]
        scores = scores if scores.stride(-1) == 1 else scores.contiguous()
        chosen = chosen if chosen.stride(-1) == 1 else chosen.contiguous()
        kth = kth.float().contiguous()
        operands.append((scores, kth, chosen.view(torch.uint8), scores.stride(0), chosen.stride(0)))
    (ps, pk, pc, stride_ps, stride_pc), (ss, sk, sc, stride_ss, stride_sc) = operands
    with _on(stacked):
        _gap_kernel()[(rows, n_lists)](
            stacked.contiguous().view(torch.uint8), starts, ps, pk, pc, ss, sk, sc,
            key, first.view(torch.uint8), offsets, selected.view(torch.uint8), rows, keys, total,
            stride_ps, stride_pc, stride_ss, stride_sc,
            L_PB=where["prod_boundary"], L_SB=where["shadow_boundary"],
            BLOCK=_ROW_BLOCK, BLOCKS=_blocks(keys),
        )  # fmt: skip
    # each row's first key as it is, the others less the key before
    return torch.where(first, key, key - torch.roll(key, 1)), offsets, selected


# the lists whose entries carry offsets from a k-th score and the path's selection
_BOUNDARY = ("prod_boundary", "shadow_boundary")


def launch_scores(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, q_pos: torch.Tensor, out: torch.Tensor,
    scale: float, precision: str, block_t: int, block_s: int, warps: int, stages: int,
) -> None:  # fmt: skip
    """One launch of the scores kernel on contiguous fp32 q, k, w, int64 q_pos and `out`, at
    a tile shape and schedule of the caller's (tests/gpu/kernels_h200.py compares them)."""
    t, h, d = q.shape
    s = k.shape[0]
    grid = (-(-t // block_t), -(-s // block_s))
    with _on(q):
        _kernel()[grid](
            q, k, w, q_pos, out, t, s, scale, H=h, D=d, BLOCK_T=block_t, BLOCK_S=block_s,
            PRECISION=precision, num_warps=warps, num_stages=stages,
        )  # fmt: skip


def _on(x: torch.Tensor) -> Any:
    """The device of x made current for a launch: Triton launches on the current device and
    stream, which an engine that spreads layers over GPUs (accelerate's device_map) need not
    have set to the tensors' own."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _triton() -> Any:
    try:
        import triton
    except ImportError:
        return None
    return triton


@functools.cache
def _kernel() -> Any:
    triton = _triton()
    import triton.language as tl

    @triton.jit
    def scores_kernel(q_ptr, k_ptr, w_ptr, pos_ptr, out_ptr, T, S, scale,
                      H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                      PRECISION: tl.constexpr):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        keys = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
        dims = tl.arange(0, D)
        row_ok = rows < T
        key_ok = keys < S
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=-1)
        visible = (keys[None, :] <= pos[:, None]) & key_ok[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_S], dtype=tl.float32)
        # a tile the causal mask hides whole takes no products
        if tl.program_id(1) * BLOCK_S <= tl.max(pos, axis=0):
            kt = tl.load(
                k_ptr + keys[None, :].to(tl.int64) * D + dims[:, None], mask=key_ok[None, :], other=0.0
            )
            for head in range(H):
                qh = tl.load(
                    q_ptr + (rows[:, None].to(tl.int64) * H + head) * D + dims[None, :],
                    mask=row_ok[:, None], other=0.0,
                )  # fmt: skip
                dots = tl.dot(qh, kt, input_precision=PRECISION)
                # relu that keeps NaN, as torch's does (max(NaN, 0) would drop it)
                dots = tl.where(dots < 0, 0.0, dots)
                wh = tl.load(w_ptr + rows * H + head, mask=row_ok, other=0.0)
                acc += wh[:, None] * dots
        out = out_ptr + rows[:, None].to(tl.int64) * S + keys[None, :]
        tl.store(out, tl.where(visible, acc * scale, float("-inf")), mask=row_ok[:, None] & key_ok[None, :])

    return scores_kernel


@functools.cache
def _row_kernel() -> Any:
    triton = _triton()
    import triton.language as tl

    @triton.jit
    def row_kernel(x_ptr, s_ptr, out_ptr, T, N, stride_x, stride_s,
                   HAS_SHADOW: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCKS: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        zero_i = tl.zeros([BLOCK], dtype=tl.int32)
        zero_f = tl.zeros([BLOCK], dtype=tl.float32)
        nan, pos, neg, top, sq = zero_i, zero_i, zero_i, zero_f, zero_f
        none = zero_i + N  # no element of the row holds the kind
        first_nan, first_pos, first_neg = none, none, none
        s_nan, s_pos, s_neg, s_top, s_sq = zero_i, zero_i, zero_i, zero_f, zero_f
        d_sq, dot, d_top = zero_f, zero_f, zero_f
        for block in range(BLOCKS):
            col = block * BLOCK + cols
            ok = col < N
            x = tl.load(x_ptr + row.to(tl.int64) * stride_x + col, mask=ok, other=0.0).to(tl.float32)
            x_nan, x_pos, x_neg = x != x, x == float("inf"), x == float("-inf")
            nan += x_nan.to(tl.int32)
            pos += x_pos.to(tl.int32)
            neg += x_neg.to(tl.int32)
            first_nan = tl.minimum(first_nan, tl.where(x_nan, col, N))
            first_pos = tl.minimum(first_pos, tl.where(x_pos, col, N))
            first_neg = tl.minimum(first_neg, tl.where(x_neg, col, N))
            x = tl.where(x_nan | x_pos | x_neg, 0.0, x)
            top = tl.maximum(top, tl.abs(x))
            sq += x * x
            if HAS_SHADOW:
                y = tl.load(s_ptr + row.to(tl.int64) * stride_s + col, mask=ok, other=0.0).to(tl.float32)
                y_nan, y_pos, y_neg = y != y, y == float("inf"), y == float("-inf")
                s_nan += y_nan.to(tl.int32)
                s_pos += y_pos.to(tl.int32)
                s_neg += y_neg.to(tl.int32)
                y = tl.where(y_nan | y_pos | y_neg, 0.0, y)
                s_top = tl.maximum(s_top, tl.abs(y))
                s_sq += y * y
                diff = x - y
                d_sq += diff * diff
                dot += x * y
                d_top = tl.maximum(d_top, tl.abs(diff))
        out = out_ptr + row
        tl.store(out, tl.sum(nan, axis=0).to(tl.float32))
        tl.store(out + T, tl.sum(pos, axis=0).to(tl.float32))
        tl.store(out + 2 * T, tl.sum(neg, axis=0).to(tl.float32))
        tl.store(out + 3 * T, tl.max(top, axis=0))
        tl.store(out + 4 * T, tl.sum(sq, axis=0))
        if HAS_SHADOW:
            tl.store(out + 5 * T, tl.sum(s_nan, axis=0).to(tl.float32))
            tl.store(out + 6 * T, tl.sum(s_pos, axis=0).to(tl.float32))
            tl.store(out + 7 * T, tl.sum(s_neg, axis=0).to(tl.float32))
            tl.store(out + 8 * T, tl.max(s_top, axis=0))
            tl.store(out + 9 * T, tl.sum(s_sq, axis=0))
            tl.store(out + 10 * T, tl.sum(d_sq, axis=0))
            tl.store(out + 11 * T, tl.sum(dot, axis=0))
            tl.store(out + 12 * T, tl.max(d_top, axis=0))
        first = out + FIRST * T
        at_nan, at_pos = tl.min(first_nan, axis=0), tl.min(first_pos, axis=0)
        at_neg = tl.min(first_neg, axis=0)
        tl.store(first, tl.where(at_nan < N, at_nan, -1).to(tl.float32))
        tl.store(first + T, tl.where(at_pos < N, at_pos, -1).to(tl.float32))
        tl.store(first + 2 * T, tl.where(at_neg < N, at_neg, -1).to(tl.float32))

    return row_kernel


@functools.cache
def _slot_kernel() -> Any:
    triton = _triton()
    import triton.language as tl

    @triton.jit
    def slot_kernel(x_ptr, out_ptr, S, D, stride_o, stride_s, stride_d,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, D_BLOCKS: tl.constexpr):  # fmt: skip
        slots = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        slot_ok = slots < S
        base = x_ptr + tl.program_id(1).to(tl.int64) * stride_o + slots[:, None].to(tl.int64) * stride_s
        count = tl.zeros([BLOCK_S], dtype=tl.int32)
        for block in range(D_BLOCKS):
            dims = block * BLOCK_D + tl.arange(0, BLOCK_D)
            ok = slot_ok[:, None] & (dims[None, :] < D)
            x = tl.load(base + dims[None, :].to(tl.int64) * stride_d, mask=ok, other=0.0).to(tl.float32)
            bad = (x != x) | (tl.abs(x) == float("inf"))
            count += tl.sum(bad.to(tl.int32), axis=1)
        # each program holds one slice of O: slices meet in the sum, which is zero nearly always
        tl.atomic_add(out_ptr + slots, count, mask=slot_ok & (count > 0))

    return slot_kernel


@functools.cache
def _sentinel_kernel() -> Any:
    triton = _triton()
    import triton.language as tl

    @triton.jit
    def sentinel_kernel(x_ptr, pos_ptr, out_ptr, P, S, D, stride_b, stride_o, stride_s, stride_d,
                        stride_pb, stride_pp, stride_ob, stride_or, HEADS: tl.constexpr,
                        BLOCK_P: tl.constexpr, P_BLOCKS: tl.constexpr, BLOCK_D: tl.constexpr,
                        D_BLOCKS: tl.constexpr):  # fmt: skip
        row, read = tl.program_id(0), tl.program_id(1)
        n = tl.where(read == 0, 1, P)  # read 0: slot 0 alone
        none = P + 1  # an index past every slot read
        total = tl.zeros([BLOCK_P], dtype=tl.int64)
        first = tl.zeros([BLOCK_P], dtype=tl.int32) + none
        low = tl.full([BLOCK_P], 2**62, dtype=tl.int64)
        high = tl.full([BLOCK_P], -(2**62), dtype=tl.int64)
        base = x_ptr + row.to(tl.int64) * stride_b
        row_pos = pos_ptr + row.to(tl.int64) * stride_pb
        for block in range(P_BLOCKS):  # read 0's blocks past its slot are masked whole
            idx = block * BLOCK_P + tl.arange(0, BLOCK_P)
            ok = idx < n
            listed = tl.load(row_pos + idx * stride_pp, mask=idx < n * read, other=0)  # read 0 lists none
            slot = tl.where(read == 0, 0, listed).to(tl.int64)
            held = ok & (slot >= 0) & (slot < S)
            count = tl.zeros([BLOCK_P], dtype=tl.int32)
            head = base + slot[:, None] * stride_s  # pointers: 64-bit offsets whatever the cache's size
            for _ in range(HEADS):
                for d_block in range(D_BLOCKS):
                    dims = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
                    where = head + dims[None, :].to(tl.int64) * stride_d
                    x = tl.load(where, mask=held[:, None] & (dims[None, :] < D), other=0.0).to(tl.float32)
                    count += tl.sum(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=1)
                head += stride_o
            total += count.to(tl.int64)
            first = tl.minimum(first, tl.where(ok & (count > 0), idx, none))
            low = tl.minimum(low, tl.where(ok, slot, 2**62))
            high = tl.maximum(high, tl.where(ok, slot, -(2**62)))
        at = tl.min(first, axis=0)
        at = tl.where(at < none, at, 0)
        found = tl.load(row_pos + at * stride_pp).to(tl.int64)  # at < P: a slot listed (read 0's is 0)
        out = out_ptr + row.to(tl.int64) * stride_ob + read * stride_or
        tl.store(out, tl.sum(total, axis=0))
        tl.store(out + 1, tl.where(read == 0, 0, found))
        tl.store(out + 2, tl.min(low, axis=0))
        tl.store(out + 3, tl.max(high, axis=0))

    return sentinel_kernel


@functools.cache
def _compare_kernel() -> Any:
    triton = _triton()
    import triton.language as tl

    @triton.jit
    def compare_kernel(prod_ptr, shadow_ptr, ps_ptr, ss_ptr, pk_ptr, sk_ptr, vis_ptr, sampled_ptr,
                       band_ptr, stored, lists_ptr, counts_ptr, ints_ptr, left_ptr, R, KEYS, k,
                       stride_p, stride_s, stride_ps, stride_ss,
                       HAS_SHADOW: tl.constexpr, HAS_PS: tl.constexpr, HAS_SS: tl.constexpr,
                       HAS_BAND: tl.constexpr, CHURN: tl.constexpr,
                       L_PO: tl.constexpr, L_SO: tl.constexpr, L_PB: tl.constexpr,
                       L_SB: tl.constexpr, L_P: tl.constexpr,
                       BLOCK: tl.constexpr, BLOCKS: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        r64 = row.to(tl.int64)
        cols = tl.arange(0, BLOCK)
        sparse = tl.load(vis_ptr + row) > k
        pk = tl.load(pk_ptr + row)
        sk = tl.load(sk_ptr + row)
        keep = tl.load(sampled_ptr + row) != 0
        band = tl.load(band_ptr + row)
        reach = band * stored
        nothing = tl.zeros([BLOCK], dtype=tl.int1)
        zero = tl.zeros([BLOCK], dtype=tl.int32)
        n_p, n_s, both, c_both, c_p, c_s, c_none = zero, zero, zero, zero, zero, zero, zero
        n_po, n_so, n_pb, n_sb, n_pr = zero, zero, zero, zero, zero
        best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        nan_left = zero
        for block in range(BLOCKS):
            col = block * BLOCK + cols
            ok = col < KEYS
            p = tl.load(prod_ptr + r64 * stride_p + col, mask=ok, other=0) != 0
            s = nothing
            if HAS_SHADOW:
                s = tl.load(shadow_ptr + r64 * stride_s + col, mask=ok, other=0) != 0
            near_p = nothing
            near_s = nothing
            churn_p = nothing
            churn_s = nothing
            if HAS_PS:
                ps = tl.load(ps_ptr + r64 * stride_ps + col, mask=ok, other=float("-inf"))
                out = (~p) & ok
                nan_left += (out & (ps != ps)).to(tl.int32)
                best = tl.maximum(best, tl.where(out & (ps == ps), ps, float("-inf")))
                if HAS_BAND:
                    dp = tl.abs(ps - pk)
                    near_p = tl.where(sparse, (dp <= reach) & ok, nothing)
                    churn_p = near_p & (dp <= band)
            if HAS_SS and HAS_BAND:
                ss = tl.load(ss_ptr + r64 * stride_ss + col, mask=ok, other=float("-inf"))
                ds = tl.abs(ss - sk)
                near_s = tl.where(sparse, (ds <= reach) & ok, nothing)
                churn_s = near_s & (ds <= band)
            n_p += p.to(tl.int32)
            if HAS_SHADOW:
                n_s += s.to(tl.int32)
                both += (p & s).to(tl.int32)
            if CHURN:
                churn = churn_p | churn_s
                c_both += (churn & p & s).to(tl.int32)
                c_p += (churn & p & ~s).to(tl.int32)
                c_s += (churn & s & ~p).to(tl.int32)
                c_none += (churn & ~p & ~s).to(tl.int32)
            base = lists_ptr + r64 * KEYS + col
            plane = R.to(tl.int64) * KEYS
            if L_PO >= 0:
                m = p & ~s
                n_po += m.to(tl.int32)
                tl.store(base + L_PO * plane, m.to(tl.uint8), mask=ok)
            if L_SO >= 0:
                m = s & ~p
                n_so += m.to(tl.int32)
                tl.store(base + L_SO * plane, m.to(tl.uint8), mask=ok)
            if L_PB >= 0:
                n_pb += near_p.to(tl.int32)
                tl.store(base + L_PB * plane, near_p.to(tl.uint8), mask=ok)
            if L_SB >= 0:
                n_sb += near_s.to(tl.int32)
                tl.store(base + L_SB * plane, near_s.to(tl.uint8), mask=ok)
            if L_P >= 0:
                m = p & keep
                n_pr += m.to(tl.int32)
                tl.store(base + L_P * plane, m.to(tl.uint8), mask=ok)
        tl.store(ints_ptr + row, tl.sum(n_p, axis=0))
        tl.store(ints_ptr + R + row, tl.sum(n_s, axis=0))
        tl.store(ints_ptr + 2 * R + row, tl.sum(both, axis=0))
        tl.store(ints_ptr + 3 * R + row, tl.sum(c_both, axis=0))
        tl.store(ints_ptr + 4 * R + row, tl.sum(c_p, axis=0))
        tl.store(ints_ptr + 5 * R + row, tl.sum(c_s, axis=0))
        tl.store(ints_ptr + 6 * R + row, tl.sum(c_none, axis=0))
        if L_PO >= 0:
            tl.store(counts_ptr + L_PO * R + row, tl.sum(n_po, axis=0))
        if L_SO >= 0:
            tl.store(counts_ptr + L_SO * R + row, tl.sum(n_so, axis=0))
        if L_PB >= 0:
            tl.store(counts_ptr + L_PB * R + row, tl.sum(n_pb, axis=0))
        if L_SB >= 0:
            tl.store(counts_ptr + L_SB * R + row, tl.sum(n_sb, axis=0))
        if L_P >= 0:
            tl.store(counts_ptr + L_P * R + row, tl.sum(n_pr, axis=0))
        top = tl.max(best, axis=0)
        tl.store(left_ptr + row, tl.where(tl.sum(nan_left, axis=0) > 0, float("nan"), top))

    return compare_kernel


@functools.cache
def _gap_kernel() -> Any:
    triton = _triton()
    import triton.language as tl

    # the total changes every call: a specialisation on its value (divisible by 16 or not)
    # would compile the kernel again inside a later forward
    @triton.jit(do_not_specialize=["TOTAL"])
    def gap_kernel(masks_ptr, starts_ptr, ps_ptr, pk_ptr, pc_ptr, ss_ptr, sk_ptr, sc_ptr,
                   keys_ptr, first_ptr, offsets_ptr, selected_ptr, R, KEYS, TOTAL,
                   stride_ps, stride_pc, stride_ss, stride_sc,
                   L_PB: tl.constexpr, L_SB: tl.constexpr,
                   BLOCK: tl.constexpr, BLOCKS: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        which = tl.program_id(1)
        r64 = row.to(tl.int64)
        mask_row = masks_ptr + (which.to(tl.int64) * R + r64) * KEYS
        first = tl.load(starts_ptr + which * R + row)
        at = first
        cols = tl.arange(0, BLOCK)
        pk = 0.0
        sk = 0.0
        if L_PB >= 0:
            pk = tl.load(pk_ptr + row)
        if L_SB >= 0:
            sk = tl.load(sk_ptr + row)
        for block in range(BLOCKS):
            col = block * BLOCK + cols
            ok = col < KEYS
            m = (tl.load(mask_row + col, mask=ok, other=0) != 0) & ok
            ones = m.to(tl.int32)
            pos = at + (tl.cumsum(ones, 0) - ones).to(tl.int64)
            # counts that disagreed with their masks would end up short: never past the end
            m = m & (pos < TOTAL)
            tl.store(keys_ptr + pos, col, mask=m)
            tl.store(first_ptr + pos, (pos == first).to(tl.uint8), mask=m)
            # A branch on the program's list, not a mask `m & (which == L_PB)`: Triton 3.9's
            # interpreter refuses a mask made with a scalar comparison ("mask has unsupported
            # dtype"), and the branch is uniform within a program.
            if L_PB >= 0:  # noqa: SIM102 (a compile-time branch around a runtime one)
                if which == L_PB:
                    s = tl.load(ps_ptr + r64 * stride_ps + col, mask=m, other=0.0).to(tl.float32)
                    c = tl.load(pc_ptr + r64 * stride_pc + col, mask=m, other=0)
                    tl.store(offsets_ptr + pos, s - pk, mask=m)
                    tl.store(selected_ptr + pos, (c != 0).to(tl.uint8), mask=m)
            if L_SB >= 0:  # noqa: SIM102
                if which == L_SB:
                    s = tl.load(ss_ptr + r64 * stride_ss + col, mask=m, other=0.0).to(tl.float32)
                    c = tl.load(sc_ptr + r64 * stride_sc + col, mask=m, other=0)
                    tl.store(offsets_ptr + pos, s - sk, mask=m)
                    tl.store(selected_ptr + pos, (c != 0).to(tl.uint8), mask=m)
            at += tl.sum(ones, axis=0).to(tl.int64)

    return gap_kernel


@functools.cache
def _member_kernel() -> Any:
    triton = _triton()
    import triton.language as tl

    @triton.jit
    def member_kernel(idx_ptr, vis_ptr, mask_ptr, s_ptr, kth_ptr, check_ptr, N, KEYS,
                      stride_i, stride_ij, stride_s, stride_sk, k, tol,
                      CHECK: tl.constexpr, TAIL: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCKS: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        r64 = row.to(tl.int64)
        vis = tl.load(vis_ptr + row)
        sparse = vis > k
        cols = tl.arange(0, BLOCK)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        finites = tl.zeros([BLOCK], dtype=tl.int32)
        unknown = tl.zeros([BLOCK], dtype=tl.int32)
        filled = tl.zeros([BLOCK], dtype=tl.int32)
        for block in range(BLOCKS):
            j = block * BLOCK + cols
            ok = j < N
            idx = tl.load(idx_ptr + r64 * stride_i + j * stride_ij, mask=ok, other=-1).to(tl.int64)
            # never a store or a load past the row, whatever a misread selection holds
            valid = ok & (idx >= 0) & (idx < vis) & (idx < KEYS)
            tl.store(mask_ptr + r64 * KEYS + idx, tl.full([BLOCK], 1, dtype=tl.uint8), mask=valid)
            if CHECK:
                got = tl.load(s_ptr + r64 * stride_s + idx * stride_sk, mask=valid, other=0.0).to(tl.float32)
                finite = valid & (got == got) & (tl.abs(got) != float("inf"))
                total += tl.where(finite, tl.abs(got), 0.0)
                finites += finite.to(tl.int32)
                unknown += (valid & ~finite).to(tl.int32)
                filled += (ok & (idx >= 0)).to(tl.int32)
        if CHECK:
            # the bound reads the mean |score| of the row's selected keys (selection's
            # score_scale over them): a second pass
            kth = tl.load(kth_ptr + row)
            scale = tl.sum(total, axis=0) / tl.maximum(tl.sum(finites, axis=0), 1).to(tl.float32)
            bound = kth - tol * scale
            bad = tl.zeros([BLOCK], dtype=tl.int32)
            unseen = tl.zeros([BLOCK], dtype=tl.int32)
            for block in range(BLOCKS):
                j = block * BLOCK + cols
                ok = j < N
                idx = tl.load(idx_ptr + r64 * stride_i + j * stride_ij, mask=ok, other=-1).to(tl.int64)
                valid = ok & (idx >= 0) & (idx < vis) & (idx < KEYS)
                got = tl.load(s_ptr + r64 * stride_s + idx * stride_sk, mask=valid, other=0.0).to(tl.float32)
                below = valid & (got < bound)
                # past the keys the query sees, or past every key scored
                beyond = ok & ((idx >= vis) | (idx >= KEYS))
                if TAIL:  # the appended tail key is production's by definition, never scored
                    beyond = beyond & (idx != vis)
                bad += ((below | beyond) & sparse).to(tl.int32)
                unseen += (beyond & sparse).to(tl.int32)
            missing = tl.maximum(k - tl.sum(filled, axis=0), 0) * sparse.to(tl.int32)
            certain = tl.sum(unseen, axis=0) + missing
            # a non-finite selected or k-th score: unchecked (-1, selection.UNCHECKED) unless
            # a key the query cannot see or an empty slot already contradicts the row
            blind = (tl.sum(unknown, axis=0) > 0) | (kth != kth) | (tl.abs(kth) == float("inf"))
            count = tl.sum(bad, axis=0) + missing
            tl.store(check_ptr + row, tl.where(sparse & blind & (certain == 0), -1, count))

    return member_kernel
