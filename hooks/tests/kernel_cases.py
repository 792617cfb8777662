"""The Triton kernels (shadowtrace_hooks.kernels) against torch's ops and an fp64
recomputation in Triton's CPU interpreter: the kernels' own code, tile loops, masks and
reductions, run on the CPU. Triton must be imported with TRITON_INTERPRET=1 already set, so
test_kernels.py runs this file in a process of its own; it is not collected on its own.

test_selection.py's and test_capture_check.py's cases run here too, so selection.compare's
kernel path meets the same independent recomputation (Python sets over torch.topk, counts
known by construction) as its torch path; a kernel that raised would fall back to torch
unseen, so every case here fails when one did."""

import math
import os

import numpy as np
import pytest
import torch
from shadowtrace_hooks import kernels, numerics, selection, stats
from shadowtrace_hooks.transfer import Packet

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by test_kernels.py with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from test_capture_check import *  # noqa: F403  (the capture check's cases, on the kernel path)
from test_kernels import _operands
from test_selection import *  # noqa: F403  (the compare cases, on the kernel path here)
from test_stats import sentinel_by_hand

# inf - inf in the interpreter's numpy (a masked score minus a k-th score) is the IEEE NaN
# the GPU computes, not a fault
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.fixture(autouse=True)
def no_kernel_fell_back():
    yield
    failed = dict(kernels.failed)
    kernels.failed.clear()
    assert not failed, failed


def _fp64_scores(q, k, w, q_pos, scale):
    dots = torch.einsum("thd,sd->ths", q.double(), k.double())
    ref = torch.einsum("th,ths->ts", w.double(), dots.relu()) * scale
    mag = torch.einsum(
        "th,ths->ts", w.double().abs(), torch.einsum("thd,sd->ths", q.double().abs(), k.double().abs())
    )
    visible = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    return ref.masked_fill(~visible, -math.inf), mag * scale, visible


def test_the_scores_kernel_is_within_the_split_bound_of_fp64_and_masks_exactly():
    q, k, w, q_pos = _operands(t=90, s=150)
    got = kernels.index_scores(q, k, w, q_pos, softmax_scale=0.25)
    ref, mag, visible = _fp64_scores(q, k, w, q_pos, 0.25)
    assert torch.equal(torch.isneginf(got), ~visible)
    err = ((got.double() - ref).abs() / mag)[visible].max().item()
    assert 0 < err <= numerics.SPLIT_TF32_ERROR


def test_the_scores_kernel_keeps_nan_where_torch_does():
    q, k, w, q_pos = _operands(t=70, s=70, seed=1)
    q[5, 2, 7] = math.nan
    k[3, 0] = math.nan
    got = kernels.index_scores(q, k, w, q_pos)
    want = numerics.index_scores(q, k, w, q_pos)
    assert torch.equal(got.isnan(), want.isnan())
    assert got.isnan().any()


def test_the_torch_split_product_is_within_the_split_bound_of_fp64():
    q, k, w, q_pos = _operands(t=40, s=100, d=128, seed=2)
    for q_in in (q, q.bfloat16()):
        got = numerics.index_scores(q_in, k, w, q_pos, matmul="3xtf32")
        ref, mag, visible = _fp64_scores(q_in.float(), k, w, q_pos, 128**-0.5)
        assert torch.equal(torch.isneginf(got), ~visible)
        assert ((got.double() - ref).abs() / mag)[visible].max().item() <= numerics.SPLIT_TF32_ERROR


def _counts(x: torch.Tensor) -> torch.Tensor:
    """NaN, +Inf and -Inf per row by torch's comparisons (stats.counts_device itself runs the
    kernel on CUDA and in the interpreter)."""
    return torch.stack([x.isnan().sum(-1), (x == math.inf).sum(-1), (x == -math.inf).sum(-1)]).int()


def _hidden_pair(t: int = 37, n: int = 2500):
    gen = torch.Generator().manual_seed(3)
    prod = torch.randn(t, n, generator=gen).bfloat16()
    shade = (prod.float() + 0.01 * torch.randn(t, n, generator=gen)).bfloat16()
    prod[1, 5], prod[2, 7], prod[2, 8], prod[4, 0] = math.nan, math.inf, -math.inf, math.inf
    shade[3, 9] = math.nan
    return prod, shade


def test_the_row_kernel_counts_exactly_and_sums_as_torch_does():
    prod, shade = _hidden_pair()
    got = kernels.row_stats(prod, shade)
    pc, sc = _counts(prod), _counts(shade)
    assert torch.equal(got[0:3], pc.float())
    assert torch.equal(got[5:8], sc.float())
    want = stats.hidden_device(prod, pc, shade, sc, None)
    assert torch.equal(got[3], want[3])
    assert torch.equal(got[8], want[8])
    torch.testing.assert_close(got[4].sqrt(), want[4], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[9].sqrt(), want[9], rtol=1e-6, atol=0)
    assert kernels.row_stats(prod).shape == (8, prod.shape[0])


def test_the_row_kernel_names_the_first_element_of_each_kind_in_each_row():
    # planted by hand across the kernel's 1024-element blocks: the answer is the plant
    prod = torch.randn(5, 2500).bfloat16()
    plants = {(0, 2400, math.nan), (0, 1500, math.nan), (0, 3, -math.inf), (2, 1024, math.inf),
              (2, 1023, math.inf), (4, 0, math.nan), (4, 2499, -math.inf)}  # fmt: skip
    for row, col, value in plants:
        prod[row, col] = value
    want = torch.full((3, 5), -1.0)
    for kind, match in enumerate((math.isnan, lambda v: v == math.inf, lambda v: v == -math.inf)):
        for row in range(5):
            cols = sorted(c for r, c, v in plants if r == row and match(v))
            if cols:
                want[kind, row] = cols[0]
    for shade in (None, prod.float()):
        assert torch.equal(kernels.row_stats(prod, shade)[-3:], want)
    assert want.tolist() == [[1500, -1, -1, -1, 0], [-1, -1, 1023, -1, -1], [3, -1, -1, -1, 2499]]


def _torch_site(prod, shadows, tokens):
    """site_device's rows through torch's ops: the kernel refused for the call."""
    kernels.failed["row_stats"] = "the torch reference"
    try:
        work = stats.site_device(prod, shadows, tokens, None if tokens is None else tokens.numpy())
        assert work.how == "torch (the torch reference)"
        return work.rows([t.numpy() for t in work.tensors])
    finally:
        kernels.failed.pop("row_stats")


def test_a_site_through_the_kernel_gives_torchs_statistics_and_events():
    prod, shade = _hidden_pair()
    tokens = torch.tensor([0, 2, 3, 20, 36])
    for shadows in ({"local": shade}, {"free": shade.roll(1, 0), "local": shade}, {}):
        for picked in (tokens, None):
            work = stats.site_device(prod, shadows, picked, None if picked is None else picked.numpy())
            assert work.how == "triton"
            assert len(work.tensors) == max(1, len(shadows))  # one pass a mode, nothing else
            events, hidden = work.rows([t.numpy() for t in work.tensors])
            want_events, want_hidden = _torch_site(prod, shadows, picked)
            assert np.array_equal(events, want_events), (events, want_events)
            assert list(hidden) == list(want_hidden)
            for mode, got in hidden.items():
                assert np.array_equal(np.isnan(got), np.isnan(want_hidden[mode]))
                np.testing.assert_allclose(got, want_hidden[mode], rtol=1e-5, atol=1e-7)
    # known by construction: _hidden_pair's plants, the shadow's NaN on a row of no event
    work = stats.site_device(prod, {"local": shade}, None, None)
    events, _ = work.rows([t.numpy() for t in work.tensors])
    assert [(e["kind"], e["token"], e["channel"], e["shadow_finite"]) for e in stats.event_rows(events)] == [
        ("nan", 1, 5, True), ("pos_inf", 2, 7, True), ("neg_inf", 2, 8, True)
    ]  # fmt: skip


def test_a_site_with_no_recorded_rows_ships_its_events_alone():
    prod, _ = _hidden_pair()
    work = stats.site_device(prod, {}, torch.tensor([], dtype=torch.int64), np.array([], dtype=np.int64))
    events, hidden = work.rows([t.numpy() for t in work.tensors])
    assert hidden == {}
    assert events[:, 0].tolist() == [1, 2, 1]


def test_a_kernel_that_raises_is_passed_over_from_then_on_and_named(monkeypatch):
    def broken():
        raise RuntimeError("no such tile")

    monkeypatch.setattr(kernels, "_row_kernel", broken)
    monkeypatch.setattr(kernels, "failed", {})
    prod, shade = _hidden_pair()
    for _ in range(2):
        work = stats.site_device(prod, {"local": shade}, None, None)
        assert work.how == "torch (the kernel raised RuntimeError: no such tile)"
    assert kernels.unavailable("row_stats", prod) == "the kernel raised RuntimeError: no such tile"


def test_counts_through_the_kernel_leave_out_the_masked_tail():
    prod, _ = _hidden_pair()
    valid = torch.randint(1, prod.shape[1], (prod.shape[0],))
    masked = prod.float().masked_fill(torch.arange(prod.shape[1])[None, :] >= valid[:, None], -math.inf)
    masked[0, 0] = -math.inf  # a -inf score among the visible ones counts
    want = torch.stack(
        [_counts(masked[t : t + 1, : int(valid[t])])[:, 0] for t in range(masked.shape[0])], dim=1
    )
    assert torch.equal(stats.counts_device(masked, valid), want)


_COMPARE_KERNELS = ("membership", "compare_masks", "gap_code")


def _compare(reference: bool, **kw) -> list:
    """compare's packet through torch's ops (`reference`) or through the kernels, which must
    not have raised (a raise would fall back to torch unseen)."""
    if reference:
        kernels.failed.update(dict.fromkeys(_COMPARE_KERNELS, "the torch reference"))
    try:
        packet = Packet()
        selection.compare(packet, **kw)
        return packet.ship().arrays()
    finally:
        if reference:
            for name in _COMPARE_KERNELS:
                kernels.failed.pop(name)
        else:
            assert not set(_COMPARE_KERNELS) & set(kernels.failed), kernels.failed


def test_the_compare_kernels_write_torchs_packet_exactly(monkeypatch):
    calls, coded = [], []
    real, real_gaps = kernels.compare_masks, kernels.gap_code
    monkeypatch.setattr(kernels, "compare_masks", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(kernels, "gap_code", lambda *a: coded.append(a[-1]) or real_gaps(*a))
    gen = torch.Generator().manual_seed(4)
    t, keys, k = 90, 130, 8
    q_pos = torch.arange(keys - t, keys)
    q_pos[:5] = torch.arange(5)  # rows that see at most k keys: dense
    visible = torch.arange(keys)[None, :] <= q_pos[:, None]
    prod = torch.randn(t, keys, generator=gen).masked_fill(~visible, -math.inf)
    shade = (prod + 1e-3 * torch.randn(t, keys, generator=gen)).masked_fill(~visible, -math.inf)
    prod[40, 3], shade[41, 2] = math.nan, math.nan
    prod[50, 10:14] = prod[50, 10]  # ties at the k-th score
    top = prod.topk(k)
    topk = top.indices.clone()
    topk[60, 0] = -1  # engine padding
    sampled = torch.arange(t) % 4 == 0
    cases = [
        {"prod_scores": prod, "shadow_scores": shade, "band": 1e-3, "sampled": sampled,
         "prod_top_values": top.values},
        {"prod_scores": prod, "shadow_scores": shade, "band": 1e-3},
        {"shadow_scores": shade, "band": 1e-3},
        {"prod_scores": prod, "band": 0.05, "prod_top_values": top.values},
        {"shadow_scores": shade},
        {"sampled": sampled},
        {},
    ]  # fmt: skip
    # scores as a column-major view, as a capture may hand them over
    cases.append(
        {
            "prod_scores": prod.t().contiguous().t(),
            "shadow_scores": shade,
            "band": 0.05,
            "prod_top_values": top.values,
        }
    )
    # the capture self-check, on production's own scores: an honest selection, one read against
    # other rows (keys far below the k-th, beyond the causal limit, empty slots), a tail key
    misread = topk.roll(7, dims=0)
    misread[70, 3:] = -1
    tailed = topk.clone()
    tailed[80:, -1] = torch.as_tensor(q_pos[80:] + 1, dtype=tailed.dtype)
    checks = [
        {"prod_topk": topk, "prod_scores": prod, "prod_top_values": top.values, "check": True},
        {"prod_topk": misread, "prod_scores": prod, "shadow_scores": shade, "band": 1e-3,
         "check": True, "check_tolerance": 1e-2},
        {"prod_topk": tailed, "prod_scores": prod.t().contiguous().t(), "check": True,
         "check_tail": True},
        {"prod_topk": tailed, "prod_scores": prod, "check": True},
    ]  # fmt: skip
    for case in cases + checks:
        args = {"prod_topk": topk, "q_pos": q_pos, "keys": keys, "k": k, **case}
        got, want = _compare(False, **args), _compare(True, **args)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    assert len(calls) == len(cases) + len(checks)
    # every case wrote its lists through gap_code (one chunk each); with entries: every case
    # but `{}`, and of the checks the one with a shadow and a band (the others have no list)
    assert len(coded) == len(cases) + len(checks), coded
    assert sum(n > 0 for n in coded) == (len(cases) - 1) + 1, coded
    # what the checks counted, through the kernel: on the honest selection only row 60's
    # padded slot, the same where production appends a tail key, more on each misread one;
    # row 40, whose NaN production selected (torch.topk ranks NaN first), is unchecked
    counted, unchecked = [], []
    for case in checks:
        packet = Packet()
        spec = selection.compare(packet, q_pos=q_pos, keys=keys, k=k, **case)
        counts = selection.check_counts(spec, packet.ship().arrays())
        counted.append(int(counts[counts > 0].sum()))
        unchecked.append(np.flatnonzero(counts == selection.UNCHECKED).tolist())
    assert counted[0] == 1, counted
    assert unchecked[0] == unchecked[2] == [40], unchecked
    assert counted[1] > t, counted
    assert counted[2] == 1, counted
    assert counted[3] == 1 + t - 80, counted


def test_kv_slot_counts_through_the_kernel_equal_torchs_sum():
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(3, 40, 16, generator=gen).bfloat16()
    cache[1, 7, 3], cache[2, 7, 0], cache[0, 33, 15] = math.nan, math.inf, -math.inf
    window = cache.narrow(-2, 5, 30)  # a cache's window: not contiguous across heads
    want = (~torch.isfinite(window)).sum((0, 2))
    assert torch.equal(kernels.slot_counts(window), want.to(torch.int32))
    assert torch.equal(stats.slot_nonfinite_device(window), want)
    assert want.sum() == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_slot_counts_span_tiles_and_merged_leading_dimensions(dtype):
    # 2 x 3 heads (merged into one O), 70 slots (three slot tiles) of 200 elements (two
    # element tiles, the second partial); one slot poisoned in several heads at once, so
    # the programs' partial counts meet in the atomic sum.
    gen = torch.Generator().manual_seed(6)
    cache = torch.randn(2, 3, 90, 200, generator=gen).to(dtype)
    for head, slot, dim, value in ((0, 0, 199, math.nan), (1, 64, 0, math.inf), (2, 64, 130, -math.inf),
                                   (0, 64, 5, math.nan), (2, 89, 128, math.nan)):  # fmt: skip
        cache[head // 3, head % 3, slot, dim] = value
    window = cache.narrow(-2, 10, 80)
    want = (~torch.isfinite(window)).sum((0, 1, 3))
    assert torch.equal(kernels.slot_counts(window.view(-1, 80, 200)), want.to(torch.int32))
    assert torch.equal(stats.slot_nonfinite_device(window), want)
    assert want.tolist().count(0) == 78
    assert (want[54], want[79]) == (3, 1)


def test_kv_slot_counts_of_a_window_whose_heads_do_not_merge_come_from_torchs_sum():
    cache = torch.randn(4, 3, 50, 8)
    cache[2, 1, 9, 4] = math.nan
    window = cache.transpose(0, 1)  # [3, 4, 50, 8]: heads that no view merges
    with pytest.raises(RuntimeError):
        window.view(-1, 50, 8)
    got = stats.slot_nonfinite_device(window)
    assert got.tolist() == [1 if s == 9 else 0 for s in range(50)]


def test_membership_never_reaches_past_the_keys_and_counts_keys_there_as_unseen():
    # A misread row: its query said to see 10 keys where 8 were scored, and indices 7 and 9 of
    # which only 7 exists. torch's scatter would raise; the kernel stores and gathers inside
    # the row only, and the check counts the key past every scored one.
    keys, k = 8, 2
    # (row 0's key 9 would land on row 1's key 1 were it stored: row 1 does not hold it)
    indices = torch.tensor([[0, 5, 7, 9], [2, 3, -1, -1]], dtype=torch.int32)
    visible = torch.tensor([10, 4])
    scores = torch.arange(2 * keys, dtype=torch.float32).reshape(2, keys)
    kth = torch.tensor([0.0, 1.0])
    mask, count = kernels.membership(indices, visible, keys, (scores, kth, k, 1e-3, False))
    assert mask.shape == (2, keys)
    assert mask[0].nonzero().flatten().tolist() == [0, 5, 7]
    assert mask[1].nonzero().flatten().tolist() == [2, 3]
    # row 0: key 9 unseen; row 1 (sparse, 4 > 2): nothing below its k-th, two slots filled
    assert count.tolist() == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sentinel_kernel_reads_slot_zero_and_each_rows_new_slots(dtype):
    # two rows, keys [2, 3, 40, 200] (two element tiles, the second partial) and values
    # whose heads sit apart from their batch rows (a transposed cache); 40 new slots per row
    # (two slot tiles), one beyond the cache, listed out of order
    gen = torch.Generator().manual_seed(8)
    keys = torch.randn(2, 3, 48, 200, generator=gen).to(dtype)
    values = torch.randn(3, 2, 48, 64, generator=gen).to(dtype).transpose(0, 1)
    keys[0, 2, 0, 199], keys[1, 0, 35, 3], keys[1, 1, 35, 4] = math.nan, math.inf, -math.inf
    values[1, 2, 7, 63], values[1, 0, 36, 0] = math.nan, math.nan
    positions = torch.stack([torch.arange(8, 48), torch.arange(8, 48).flip(0)])
    positions[1, 0] = 60
    want = sentinel_by_hand([keys, values], positions)
    got = kernels.sentinel_reads([keys, values.reshape(2, 3, 48, 64)], positions)
    assert torch.equal(got, want)
    assert want[1, 1].tolist() == [[2, 35, 8, 60], [1, 36, 8, 60]]
    assert want[0, 0].tolist() == [[1, 0, 0, 0], [0, 0, 0, 0]]
    assert torch.equal(stats.sentinel_device([keys, values], positions), want)
