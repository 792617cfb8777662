"""The capture self-check (selection.compare(check=True)): production's selection against
production's own scores. Expected answers are built here with torch.topk over the scores and
Python sets, never with the check's code: a selection that is the scores' top-k agrees, keys
tied at the k-th score never count, and a selection read against other tokens (the
misreading the check exists to catch) disagrees on nearly every sparse row."""

import math
from pathlib import Path

import numpy as np
import torch
from shadowtrace_hooks import selection
from shadowtrace_hooks.transfer import Packet


def contradicting(
    prod_topk: torch.Tensor, scores: torch.Tensor, q_pos: list[int], k: int, **kw: object
) -> list[int]:
    """The check's count per row, shipped and read back as the writer's thread does."""
    packet = Packet()
    spec = selection.compare(
        packet, prod_topk, torch.tensor(q_pos), scores.shape[1], k, prod_scores=scores, check=True, **kw
    )
    counts = selection.check_counts(spec, packet.ship().arrays())
    assert counts is not None
    return counts.tolist()


def causal_scores(rows: int, keys: int, q_pos: list[int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, keys, generator=g)
    visible = torch.arange(keys)[None, :] <= torch.tensor(q_pos)[:, None]
    return scores.masked_fill(~visible, -math.inf)


def test_a_selection_that_is_its_scores_top_k_agrees_on_every_row() -> None:
    q_pos = list(range(40, 72))
    scores = causal_scores(len(q_pos), 72, q_pos)
    top = scores.topk(16, dim=-1).indices
    assert contradicting(top, scores, q_pos, 16) == [0] * len(q_pos)
    # In any order, and padded by an engine's -1 beyond k entries.
    shuffled = top[:, torch.randperm(16)]
    padded = torch.cat([shuffled, torch.full((len(q_pos), 4), -1)], dim=1)
    assert contradicting(padded, scores, q_pos, 16) == [0] * len(q_pos)


def test_each_key_scored_below_the_kth_beyond_the_tolerance_counts_once() -> None:
    q_pos = [63] * 6
    scores = causal_scores(6, 64, q_pos, seed=1)
    order = scores.argsort(dim=-1, descending=True)
    chosen = order[:, :8].clone()
    # Row r swaps its r lowest selected keys for the r best keys left out... of the worst.
    for r in range(6):
        chosen[r, 8 - r :] = order[r, 64 - r :]
    want = list(range(6))
    assert contradicting(chosen, scores, q_pos, 8) == want


def test_keys_tied_at_the_kth_score_never_count() -> None:
    q_pos = [15, 15]
    scores = torch.zeros(2, 16)
    scores[:, :3] = 2.0  # three clear winners, then 13 keys tied at 0 for the last slot of k = 4
    first = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 15]])  # either tied key is a valid top-k
    assert contradicting(first, scores, q_pos, 4) == [0, 0]


def test_a_key_within_the_tolerance_of_the_kth_score_is_not_counted_and_one_past_it_is() -> None:
    q_pos = [7, 7]
    scores = torch.tensor([[10.0, 9, 8, 7, 6, 5, 4, 3]] * 2)
    # the row's scale is the mean |score| of the keys selected (10, 9, 8 and about 7): 8.5
    tol = selection.CHECK_TOLERANCE * 8.5
    scores[0, 7] = 7.0 - 0.9 * tol  # within: rounding between two sums of the same terms
    scores[1, 7] = 7.0 - 1.1 * tol  # past it
    chosen = torch.tensor([[0, 1, 2, 7], [0, 1, 2, 7]])
    assert contradicting(chosen, scores, q_pos, 4) == [0, 1]


def test_one_dominant_key_does_not_widen_the_tolerance_for_the_others() -> None:
    """An attention-sink key scored far above the rest: scaled by the row's largest score it
    would excuse every key within CHECK_TOLERANCE of 1000 below the k-th; scaled by the mean
    of the selected scores (score_scale's definition, for its reason) it excuses rounding of
    scores like the k-th's only. Issue 42: one dominant key excused a key 0.5 below a k-th of
    1.5."""
    q_pos = [39]
    scores = torch.zeros(1, 40)
    scores[0, 0] = 1000.0
    scores[0, 1:15] = 2.0
    scores[0, 15] = 1.5  # the k-th of the true top-16: keys 0..15
    scores[0, 16] = 1.0  # selected instead of key 15: 0.5 below the k-th
    chosen = torch.tensor([[*range(15), 16]])
    mean = (1000.0 + 14 * 2.0 + 1.0) / 16
    shortfall = 1.5 - 1.0
    assert shortfall > selection.CHECK_TOLERANCE * mean  # a contradiction at the mean's scale...
    assert shortfall < selection.CHECK_TOLERANCE * 1000.0  # ...that the largest score would excuse
    assert contradicting(chosen, scores, q_pos, 16) == [1]


def test_a_key_the_query_cannot_see_counts_on_sparse_rows_and_dense_rows_are_never_judged() -> None:
    q_pos = [3, 9]  # k = 4: row 0 sees 4 keys (dense), row 1 sees 10 (sparse)
    scores = torch.cat([causal_scores(2, 10, q_pos, seed=2), torch.full((2, 1), -math.inf)], dim=1)
    best = scores[1].topk(3).indices.tolist()
    chosen = torch.tensor([[0, 1, 2, 10], [*best, 10]])  # both pick key 10, a future key
    assert contradicting(chosen, scores, q_pos, 4) == [0, 1]


def test_a_sparse_row_with_fewer_keys_than_k_counts_each_empty_slot() -> None:
    """A sparse row's top-k fills all k slots: padding in its place (a buffer row left -1,
    read for a token this rank did not score) contradicts it, once per empty slot."""
    q_pos = [15, 15, 2]  # k = 4: rows 0 and 1 sparse, row 2 dense (3 keys)
    scores = causal_scores(3, 16, q_pos, seed=5)
    top = scores.topk(4, dim=-1).indices
    chosen = top.clone()
    chosen[0] = -1
    chosen[1, 2:] = -1
    chosen[2] = torch.tensor([0, 1, 2, -1])  # dense: never judged
    assert contradicting(chosen, scores, q_pos, 4) == [4, 2, 0]


def test_a_row_pointing_past_every_key_is_counted_never_gathered() -> None:
    """A misread row may hold another request's keys, past this request's last key: the check
    counts them on a sparse row and must not index out of the scores on any row."""
    q_pos = [5, 1]  # k = 2: row 0 sparse, row 1 dense
    scores = causal_scores(2, 6, q_pos, seed=6)
    chosen = torch.tensor([[int(scores[0].argmax()), 730], [1, 731]])
    assert contradicting(chosen, scores, q_pos, 2) == [1, 0]


def test_an_appended_tail_key_is_productions_own_and_left_alone_only_where_the_model_appends_it() -> None:
    """GLM-5.3-Flash appends each query's incomplete tail pool (index `visible`, unscored) to
    its top-k: with `check_tail` it is left alone, without it it is a key the query cannot
    see. A key past the tail still counts either way."""
    q_pos = [9, 9]
    scores = causal_scores(2, 11, q_pos, seed=7)  # keys 0..9 scored, key 10 the tail
    best = scores[:, :10].topk(4, dim=-1).indices
    chosen = torch.cat([best, torch.tensor([[10], [11]])], dim=1)
    assert contradicting(chosen, scores, q_pos, 4, check_tail=True) == [0, 1]
    assert contradicting(chosen, scores, q_pos, 4) == [1, 1]


def test_rows_whose_selected_or_kth_score_is_not_finite_are_unchecked_never_agreeing() -> None:
    """Every comparison with NaN is false: a row whose scores are NaN would otherwise count as
    checked with no key below the k-th (issue 42). Such a sparse row is unchecked, apart from
    the rows checked; a key it cannot see or an empty slot still contradicts it for sure, and
    a dense row is never judged."""
    k, q_pos = 4, [7, 7, 7, 7, 7, 7, 2]
    g = torch.Generator().manual_seed(8)
    scores = torch.randn(7, 8, generator=g)
    scores[6, 3:] = -math.inf  # row 6 sees 3 keys: dense
    chosen = scores.topk(k, dim=-1).indices.clone()
    scores[0] = math.nan  # every score NaN, the k-th too
    scores[1, chosen[1, 2]] = math.nan  # one selected key's score NaN (it stays selected)
    scores[2, 1:] = math.inf  # the k-th score +inf: no bound below it
    chosen[2] = torch.arange(4)
    scores[3, chosen[3, 0]] = math.nan  # a NaN, and a key the query cannot see: contradicted
    chosen[3, 1] = 9
    scores[4, chosen[4, 3]] = -math.inf  # a selected key at -inf: not a number to bound
    # row 5 finite: checked, and agreeing
    scores[6, 0] = math.nan
    chosen[6] = torch.tensor([0, 1, 2, -1])
    unchecked = selection.UNCHECKED
    assert contradicting(chosen, scores, q_pos, k) == [unchecked, unchecked, unchecked, 1, unchecked, 0, 0]


def test_a_selection_read_against_shifted_tokens_disagrees_on_nearly_every_sparse_row() -> None:
    """What a misreading looks like (ShardQ's compact rows read in global order): row t holds
    the selection of another query. The check must flag it; it is the defect it exists for."""
    q_pos = list(range(256, 512))
    scores = causal_scores(len(q_pos), 512, q_pos, seed=3)
    top = scores.topk(64, dim=-1).indices
    shifted = torch.roll(top, shifts=37, dims=0)
    counts = np.array(contradicting(shifted, scores, q_pos, 64))
    assert (counts > 0).mean() > 0.99, counts
    # Against the checked selection itself, the same rows agree.
    assert contradicting(top, scores, q_pos, 64) == [0] * len(q_pos)


def test_the_check_reads_production_top_values_when_given() -> None:
    """Where production's own top-k values come with its selection (HF captures both), the
    k-th score is production's: a selection consistent with them agrees."""
    q_pos = [31] * 4
    scores = causal_scores(4, 32, q_pos, seed=4)
    values, top = scores.topk(8, dim=-1)
    assert contradicting(top, scores, q_pos, 8, prod_top_values=values) == [0] * 4
    wrong = top.clone()
    wrong[:, 0] = scores.argmin(dim=-1)
    assert contradicting(wrong, scores, q_pos, 8, prod_top_values=values) == [1] * 4


def test_the_bf16_logits_tolerance_covers_a_head_by_head_bf16_reduction_of_64_heads() -> None:
    """Calibration of `engine.BF16_LOGITS_CHECK_TOLERANCE` (vLLM 0.34 reduces DeepSeek-V3.2's
    logits in bf16 on SM100): production ranks bf16 logits whose sum over 64 heads rounded at
    every head (the stand-ins' emulation, more pessimistic than one rounding), the check
    recomputes them in fp32. Its rows all agree at the bf16 tolerance, with margin; at the
    default tolerance they would not, which is why the engines widen it."""
    from shadowtrace_hooks.adapters import engine
    from standins.common import mqa_logits

    torch.manual_seed(0)
    rows, keys, heads, dim, k = 64, 2600, 64, 128, 2048
    q8 = (torch.randn(rows, heads, dim) * 2).to(torch.float8_e4m3fn)
    k8 = (torch.randn(keys, dim) * 2).to(torch.float8_e4m3fn)
    k_scale = torch.rand(keys) * 0.02
    weights = torch.randn(rows, heads) * dim**-0.5 * heads**-0.5
    first, end = torch.zeros(rows, dtype=torch.long), torch.full((rows,), keys)
    fp32 = mqa_logits(q8, weights, k8, k_scale, first, end)
    chosen = mqa_logits(q8, weights, k8, k_scale, first, end, torch.bfloat16).topk(k, dim=-1).indices
    q_pos = [keys - 1] * rows
    # the largest shortfall, measured here with torch.topk against the mean |score| of the
    # keys selected: below the tolerance by 1.5x
    kth = fp32.topk(k, dim=-1).values[:, -1]
    got = fp32.gather(1, chosen)
    shortfall = ((kth[:, None] - got).clamp(min=0).amax(-1) / got.abs().mean(-1)).max().item()
    assert selection.CHECK_TOLERANCE < shortfall < engine.BF16_LOGITS_CHECK_TOLERANCE / 1.5
    assert (
        contradicting(chosen, fp32, q_pos, k, check_tolerance=engine.BF16_LOGITS_CHECK_TOLERANCE)
        == [0] * rows
    )
    assert sum(c > 0 for c in contradicting(chosen, fp32, q_pos, k)) > rows // 4


def test_the_manifest_counts_unchecked_rows_apart_from_the_rows_checked(tmp_path: Path) -> None:
    """What the writer's thread records per layer (`settings.capture_check`): a NaN row among
    the informative ones is `unchecked`, never one of the `rows` checked, and the tolerance
    names the scale it multiplies."""
    from shadowtrace_hooks import session
    from shadowtrace_hooks.writer import RunWriter
    from test_writer_off_path import IDENTITY

    settings = session.Settings.from_environ({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)})
    run = session.Run(RunWriter(tmp_path / "run", IDENTITY), settings)
    q_pos = [3, 7, 7, 7]  # k = 4: row 0 dense, rows 1..3 informative
    scores = causal_scores(4, 8, q_pos, seed=9)
    chosen = scores.topk(4, dim=-1).indices.clone()
    scores[2, chosen[2, 0]] = math.nan
    chosen[3, 0] = int(scores[3].argmin())  # the key scored lowest: below the k-th
    run.topk(0, 0, 4, np.array(q_pos, dtype=np.int32), torch.tensor(q_pos), chosen, scores, {},
             check="captured")  # fmt: skip
    run.ship()
    check = run.writer.close()["settings"]["capture_check"]
    assert check["run"] is True
    assert check["tolerance_scale"] == "mean_abs_selected_score"
    # row 3's one key scored lowest leaves its top-k short of a winner, but not of the best
    # keys: its selection keeps none of them whole (k = 4 keys of 8), so it is no short row
    assert check["layers"]["0"] == {
        "rows": 2, "disagree": 1, "first_token": 7, "unchecked": 1, "short_of_winners": 0
    }  # fmt: skip
    assert check["short_of_winners_rule"] == {
        "kept_top": selection.SHORT_KEPT_SHARE, "recall": selection.SHORT_RECALL
    }  # fmt: skip


def figures(
    prod_topk: torch.Tensor, scores: torch.Tensor, q_pos: list[int], k: int
) -> tuple[list, np.ndarray]:
    """The check's count and `check_figures` per row, and its short-of-winners reading."""
    packet = Packet()
    spec = selection.compare(
        packet, prod_topk, torch.tensor(q_pos), scores.shape[1], k, prod_scores=scores, check=True
    )
    arrays = packet.ship().arrays()
    counts, got = selection.check_counts(spec, arrays), selection.check_figures(spec, arrays)
    assert counts is not None
    assert got is not None
    return got.T.tolist(), selection.short_of_winners(counts, got, k)


def test_a_selection_short_of_winners_is_told_from_one_read_against_other_tokens() -> None:
    """A top-k kernel that drops winners keeps production's top keys whole and departs from
    them in the tail; a misread misses a top key within a few ranks. Each row's selection is
    built here from the scores' own ranking (argsort), so its figures are known: production's
    top keys kept whole (the best key left out's rank less one), keys of the top-k selected,
    the worst selected key's rank, and keys the query cannot see or empty slots."""
    k, keys = 64, 512
    q_pos = [keys - 1] * 6
    g = torch.Generator().manual_seed(9)
    # Distinct integer scores, one apart: no ties, and no key within the tolerance of another.
    scores = torch.stack([torch.randperm(keys, generator=g).float() for _ in q_pos])
    assert selection.CHECK_TOLERANCE * keys < 1
    rank = scores.argsort(dim=-1, descending=True)  # rank[r, i]: the key ranked i + 1
    top = rank[:, :k]

    def swap(r: int, lose: range, take: range) -> torch.Tensor:
        row = [int(x) for x in top[r] if int(x) not in {int(rank[r, i]) for i in lose}]
        return torch.tensor(row + [int(rank[r, i]) for i in take])

    rows = [
        swap(0, range(56, 64), range(64, 72)),  # the last 8 winners lost to ranks 65..72
        swap(1, range(16, 48), range(64, 96)),  # 32 lost: exactly half the top-k kept
        swap(2, range(0, 1), range(64, 65)),  # the best key lost: a misread's mark
        swap(3, range(24, 64), range(64, 104)),  # the top 24 kept whole, but recall 24/64
        torch.cat([top[4, :-1], torch.tensor([keys])]),  # one key past the query: a misread
        top[5].clone(),  # the top-k itself: agrees
    ]
    got, short = figures(torch.stack(rows), scores, q_pos, k)
    # (kept_top, hits, worst_rank, certain), and short of winners
    assert got[0] == [56, 56, 72, 0]
    assert got[1] == [16, 32, 96, 0]
    assert got[2] == [0, 63, 65, 0]
    assert got[3] == [24, 24, 104, 0]
    assert got[4][3] == 1
    assert got[5] == [64, 64, 64, 0]
    assert short.tolist() == [True, True, False, False, False, False]
    # The rule's edges, in shares of k: 16 = SHORT_KEPT_SHARE k kept, 32 = SHORT_RECALL k hit.
    assert selection.SHORT_KEPT_SHARE * k == 16
    assert selection.SHORT_RECALL * k == 32


def test_a_selection_read_against_shifted_tokens_is_not_short_of_winners() -> None:
    """The misreading the check exists for stays one: every disagreeing row of a selection
    rolled by 37 rows misses its scores' best keys."""
    q_pos = list(range(256, 512))
    scores = causal_scores(len(q_pos), 512, q_pos, seed=3)
    shifted = torch.roll(scores.topk(64, dim=-1).indices, shifts=37, dims=0)
    _, short = figures(shifted, scores, q_pos, 64)
    assert not short.any()
