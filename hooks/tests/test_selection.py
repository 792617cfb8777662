"""The format v2 top-k row (selection.compare, computed on the device) against an
independent recomputation: Python sets over torch.topk's indices, on inputs whose answers
are known by construction (identical selections, disjoint ones, ties at the k-th score,
dense rows, NaN scores, engine padding)."""

import itertools
import math

import numpy as np
import pytest
import torch
from shadowtrace_hooks import selection
from shadowtrace_hooks.transfer import Packet

INF = math.inf


def run(
    prod_topk: torch.Tensor,
    q_pos: list[int],
    k: int,
    *,
    prod_scores: torch.Tensor | None = None,
    shadow_scores: torch.Tensor | None = None,
    band: float | None = None,
    sampled: list[bool] | None = None,
    prod_top_values: torch.Tensor | None = None,
) -> list[dict]:
    """compare, shipped and read back as the writer's thread does: one dict per row."""
    packet = Packet()
    pos = torch.tensor(q_pos)
    keys = max(q_pos) + 1
    mask = None if sampled is None else torch.tensor(sampled)
    spec = selection.compare(packet, prod_topk, pos, keys, k, prod_scores=prod_scores,
                             shadow_scores=shadow_scores, band=band, sampled=mask,
                             prod_top_values=prod_top_values)  # fmt: skip
    host = None if sampled is None else np.array(sampled)
    cols = selection.columns(spec, packet.ship().arrays(), np.array(q_pos) + 1, k, host)
    rows = []
    for i in range(len(q_pos)):
        row = {}
        for name, value in cols.items():
            if hasattr(value, "offsets"):
                null = bool(np.ma.getmaskarray(value.offsets)[i])
                offsets = np.ma.getdata(value.offsets)
                row[name] = None if null else value.values[offsets[i] : offsets[i + 1]].tolist()
            elif isinstance(value, np.ndarray):
                row[name] = None if np.ma.getmaskarray(value)[i] else value[i].item()
            else:
                row[name] = value
        rows.append(row)
    return rows


def keys(gaps: list[int]) -> list[int]:
    return list(itertools.accumulate(gaps))


def causal(scores: torch.Tensor, q_pos: list[int]) -> torch.Tensor:
    visible = torch.arange(scores.shape[1])[None, :] <= torch.tensor(q_pos)[:, None]
    return scores.masked_fill(~visible, -INF)


def expected(prod: set[int], shadow: set[int], churn: set[int]) -> dict:
    """The summary of one row from Python sets: what the topk table's docs define."""
    shared = prod & shadow
    union = prod | shadow
    clean_union, clean_shared = union - churn, shared - churn
    return {
        "prod_selected": len(prod), "shadow_selected": len(shadow), "shared": len(shared),
        "jaccard": len(shared) / len(union) if union else 1.0,
        "jaccard_no_churn": len(clean_shared) / len(clean_union) if clean_union else 1.0,
        "churn_shared": len(churn & shared), "churn_prod_only": len(churn & (prod - shadow)),
        "churn_shadow_only": len(churn & (shadow - prod)), "churn_unselected": len(churn - union),
        "prod_only_gaps": sorted(prod - shadow), "shadow_only_gaps": sorted(shadow - prod),
    }  # fmt: skip


def check_row(row: dict, prod: set[int], shadow: set[int], churn: set[int]) -> None:
    want = expected(prod, shadow, churn)
    for name in ("prod_only_gaps", "shadow_only_gaps"):
        assert keys(row[name]) == want.pop(name), name
    for name, value in want.items():
        if name.startswith("jaccard"):
            assert row[name] == pytest.approx(value, rel=1e-6), name
        else:
            assert row[name] == value, name


def test_random_rows_agree_with_sets_over_torch_topk_indices() -> None:
    gen = torch.Generator().manual_seed(11)
    t, k, band = 40, 8, 0.05
    q_pos = list(range(t))
    prod_scores = causal(torch.randn(t, t, generator=gen), q_pos)
    shadow_scores = causal(prod_scores + 0.05 * torch.randn(t, t, generator=gen), q_pos)
    prod_topk = prod_scores.topk(k).indices.to(torch.int32)
    rows = run(prod_topk, q_pos, k, prod_scores=prod_scores, shadow_scores=shadow_scores, band=band)
    informative = wider = 0
    for i, row in enumerate(rows):
        visible = i + 1
        prod = {int(j) for j in prod_topk[i] if j < visible}
        shadow = {int(j) for j in shadow_scores[i].topk(k).indices if j < visible}
        if visible <= k:
            assert row["churn_shared"] is None  # dense: no churn, no boundary lists
            assert row["prod_boundary_gaps"] is None
            assert row["shadow_boundary_gaps"] is None
            assert row["prod_kth_score"] is None
            check_row({**row, "churn_shared": 0, "churn_prod_only": 0, "churn_shadow_only": 0,
                       "churn_unselected": 0}, prod, shadow, set())  # fmt: skip
            continue
        informative += 1
        pk = prod_scores[i].topk(k + 1).values
        sk = shadow_scores[i].topk(k + 1).values
        # the band in scores: the relative band times the mean |score| of the shadow's top-k
        absolute = band * sum(abs(float(v)) for v in sk[:k]) / k
        near, listed = (
            {
                path: {j for j in range(visible) if abs(float(scores[i, j]) - float(kth[k - 1])) <= reach}
                for path, scores, kth in (("prod", prod_scores, pk), ("shadow", shadow_scores, sk))
            }
            for reach in (absolute, selection.STORED * absolute)
        )
        check_row(row, prod, shadow, near["prod"] | near["shadow"])
        assert row["prod_kth_score"] == pytest.approx(float(pk[k - 1]))
        assert row["prod_kth_margin"] == pytest.approx(float(pk[k - 1] - pk[k]))
        assert row["shadow_kth_margin"] == pytest.approx(float(sk[k - 1] - sk[k]))
        for path, selected, scores, kth in (
            ("prod", prod, prod_scores, pk),
            ("shadow", shadow, shadow_scores, sk),
        ):
            boundary = keys(row[f"{path}_boundary_gaps"])
            assert boundary == sorted(listed[path])
            assert row[f"{path}_boundary_selected"] == [j in selected for j in boundary]
            offsets = [float(scores[i, j] - kth[k - 1]) for j in boundary]
            assert row[f"{path}_boundary_offsets"] == pytest.approx(offsets, abs=1e-6)
        assert row["boundary_band"] == pytest.approx(absolute, rel=1e-5)
        wider += listed["prod"] != near["prod"] or listed["shadow"] != near["shadow"]
    assert informative == t - k
    assert wider, "on some rows the lists reach keys beyond the churn band"
    assert any(row["jaccard"] < 1 for row in rows), "the noise should move some selections"


def test_identical_selections_share_everything_and_disjoint_ones_nothing() -> None:
    k = 3
    q_pos = [9, 9]
    prod_topk = torch.tensor([[1, 4, 7], [0, 1, 2]], dtype=torch.int32)
    prod, shadow = torch.full((2, 10), -1.0), torch.full((2, 10), -1.0)
    prod[0, [1, 4, 7]] = prod[1, [0, 1, 2]] = torch.tensor([3.0, 2.0, 1.0])
    # row 0: the shadow's top-3 is prod's; row 1: the shadow's is {7, 8, 9}
    shadow[0, [1, 4, 7]] = shadow[1, [7, 8, 9]] = torch.tensor([3.0, 2.0, 1.0])
    same, disjoint = run(prod_topk, q_pos, k, prod_scores=prod, shadow_scores=shadow, band=0.0)
    check_row(same, {1, 4, 7}, {1, 4, 7}, {7})  # each path's k-th key is its only candidate
    assert (same["jaccard"], same["prod_only_gaps"], same["shadow_only_gaps"]) == (1.0, [], [])
    check_row(disjoint, {0, 1, 2}, {7, 8, 9}, {2, 9})
    assert disjoint["jaccard"] == 0.0
    assert disjoint["prod_only_gaps"] == [0, 1, 1]  # keys 0, 1, 2 gap-coded
    assert disjoint["shadow_only_gaps"] == [7, 1, 1]
    # Without production's scores its candidates are unknown: so is the churn.
    for row in run(prod_topk, q_pos, k, shadow_scores=shadow, band=0.0):
        assert {"churn_shared", "jaccard_no_churn", "prod_boundary_gaps"}.isdisjoint(row)
        assert keys(row["shadow_boundary_gaps"]) in ([7], [9])


def test_keys_tied_at_the_kth_score_are_all_boundary_candidates_and_churn() -> None:
    k = 2
    # scores 5, 3, 3, 3, 0: the 2nd place is a three-way tie; prod took key 2, the shadow key 3
    scores = torch.tensor([[5.0, 3.0, 3.0, 3.0, 0.0]])
    prod_topk = torch.tensor([[0, 2]], dtype=torch.int32)
    (row,) = run(prod_topk, [4], k, prod_scores=scores, shadow_scores=scores, band=0.0)
    shadow = {int(j) for j in scores[0].topk(k).indices}
    assert keys(row["prod_boundary_gaps"]) == [1, 2, 3]
    assert row["prod_boundary_offsets"] == [0.0, 0.0, 0.0]
    assert row["prod_boundary_selected"] == [False, True, False]
    assert row["prod_kth_margin"] == 0.0
    check_row(row, {0, 2}, shadow, {1, 2, 3})
    assert row["jaccard_no_churn"] == 1.0  # the difference is churn among tied keys alone


def test_nan_scores_keep_a_nan_kth_score_and_no_boundary_while_padding_is_no_member() -> None:
    k = 2
    scores = torch.tensor([[math.nan, math.nan, 2.0, 1.0]])
    finite = torch.tensor([[4.0, 1.0, 2.0, 0.0]])
    prod_topk = torch.tensor([[2, -1, -1]], dtype=torch.int32)  # engine padding
    (row,) = run(prod_topk, [3], k, prod_scores=scores, shadow_scores=finite, band=0.1)
    assert row["prod_selected"] == 1
    assert math.isnan(row["prod_kth_score"])
    assert keys(row["prod_boundary_gaps"]) == []  # nothing lies within a band of NaN
    # the shadow's top-k, 4 and 2, set the band: 0.1 x 3
    assert row["boundary_band"] == pytest.approx(0.3)
    assert keys(row["shadow_boundary_gaps"]) == [2]
    check_row(row, {2}, {0, 2}, {2})
    # A shadow whose top-k holds no finite score gives the row no scale: no band, no
    # candidates, churn unknown (null), never a churn of zero.
    (row,) = run(prod_topk, [3], k, prod_scores=scores, shadow_scores=scores, band=0.1)
    assert math.isnan(row["prod_kth_score"])
    shadow = {int(j) for j in scores[0].topk(k).indices}  # torch ranks NaN first
    assert row["jaccard"] == pytest.approx(len({2} & shadow) / len({2} | shadow))
    for name in ("boundary_band", "prod_boundary_gaps", "shadow_boundary_gaps", "churn_shared",
                 "churn_prod_only", "churn_shadow_only", "churn_unselected", "jaccard_no_churn"):  # fmt: skip
        assert row[name] is None, name


def test_without_a_shadow_only_production_columns_are_filled_and_sampled_rows_keep_their_list() -> None:
    k = 2
    q_pos = [4, 5, 6]
    scores = causal(torch.arange(21, dtype=torch.float32).reshape(3, 7), q_pos)
    prod_topk = scores.topk(k).indices.to(torch.int32)
    rows = run(prod_topk, q_pos, k, prod_scores=scores, band=0.1, sampled=[True, False, True])
    for r, (row, pos) in enumerate(zip(rows, q_pos, strict=True)):
        # columns left out are written as null
        assert {"shadow_selected", "jaccard", "prod_only_gaps", "shadow_boundary_gaps"}.isdisjoint(row)
        # Without a shadow production's top-k sets the band: row r scores key j 7r + j, so
        # its top-2 (keys pos and pos - 1) average 7r + pos - 0.5, and the lists reach
        # STORED times 0.1 of that from the k-th score (key pos - 1), one score a key.
        band = 0.1 * (7 * r + pos - 0.5)
        assert row["boundary_band"] == pytest.approx(band)
        reach = int(selection.STORED * band)
        assert keys(row["prod_boundary_gaps"]) == list(
            range(max(0, pos - 1 - reach), min(pos, pos - 1 + reach) + 1)
        )
    assert keys(rows[0]["prod_gaps"]) == [3, 4]
    assert rows[1]["prod_gaps"] is None
    assert keys(rows[2]["prod_gaps"]) == [5, 6]


def test_a_relative_band_finds_the_same_candidates_and_churn_whatever_the_scores_scale() -> None:
    """Indexer scores scale with the model: the same rows scaled by 1e-3 and by 1e3 (powers
    of two apart would be exact; these are not, so the boundaries are kept off the band's
    edge) give the same candidates, churn and band relative to the scale."""
    k, t = 4, 24
    q_pos = list(range(t))
    gen = torch.Generator().manual_seed(8)
    # scores on a grid of 0.1, so rows tie, and the shadow 1e-5 off them: near-ties that a
    # band of 1e-3 of scores near 1 holds and the grid's steps stay far outside
    base = torch.round(10 * torch.randn(t, t, generator=gen)) / 10
    prod = causal(base, q_pos)
    shadow = causal(base + 1e-5 * torch.randn(t, t, generator=gen), q_pos)
    topk = prod.topk(k).indices.to(torch.int32)
    got, bands = {}, {}
    for c in (1.0, 1e-3, 1e3):
        rows = run(topk, q_pos, k, prod_scores=prod * c, shadow_scores=shadow * c, band=1e-3)
        got[c] = [
            (r["churn_shared"], r["churn_prod_only"], r["churn_shadow_only"], r["churn_unselected"],
             r["prod_boundary_gaps"], r["shadow_boundary_gaps"])
            for r in rows
        ]  # fmt: skip
        bands[c] = [r["boundary_band"] / c for r in rows[k:]]  # dense rows have none
    assert got[1e-3] == got[1.0] == got[1e3]
    assert bands[1e-3] == pytest.approx(bands[1.0], rel=1e-6)
    assert bands[1e3] == pytest.approx(bands[1.0], rel=1e-6)
    assert any(row[1] or row[2] for row in got[1.0]), "near-ties swapped keys as churn"


def test_rows_compared_in_chunks_read_back_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    q_pos = list(range(30))
    prod = causal(torch.randn(30, 30, generator=gen), q_pos)
    shadow = causal(prod + 0.1 * torch.randn(30, 30, generator=gen), q_pos)
    topk = prod.topk(4).indices.to(torch.int32)
    whole = run(topk, q_pos, 4, prod_scores=prod, shadow_scores=shadow, band=0.1, sampled=[True] * 30)
    monkeypatch.setattr(selection, "CHUNK_ELEMENTS", 7 * 30)  # 7 rows a chunk
    chunked = run(topk, q_pos, 4, prod_scores=prod, shadow_scores=shadow, band=0.1, sampled=[True] * 30)
    assert chunked == whole


def test_the_kth_score_read_from_productions_own_topk_equals_a_second_topk_over_every_key() -> None:
    """HF's indexer adds a finite float mask and calls topk(k) once; its returned scores give
    the k-th score and margin (the margin from the best key left out) that a second top-k
    over the masked scores gives, bit for bit: random rows, ties at the k-th, NaN scores."""
    gen = torch.Generator().manual_seed(5)
    t, k, band = 48, 8, 0.05
    q_pos = list(range(t))
    raw = torch.randn(t, t, generator=gen)
    raw[30] = torch.round(raw[30])  # ties at the k-th score
    raw[31, [0, 3, 9]] = math.nan  # fewer NaNs than k: they rank first and are selected
    raw[32, :20] = math.nan  # more NaNs than k: a NaN k-th score
    visible = torch.arange(t)[None, :] <= torch.tensor(q_pos)[:, None]
    float_mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)
    top = (raw + float_mask).topk(k, dim=-1)  # what production's top-k returned
    prod_topk = top.indices.to(torch.int32)
    prod_scores = causal(raw, q_pos)  # as the adapter records them: -inf where masked
    shadow_scores = causal(raw + 0.05 * torch.randn(t, t, generator=gen), q_pos)
    common = {"prod_scores": prod_scores, "shadow_scores": shadow_scores, "band": band}
    second = run(prod_topk, q_pos, k, **common)
    read = run(prod_topk, q_pos, k, **common, prod_top_values=top.values)
    assert len(read) == t
    for i, (a, b) in enumerate(zip(second, read, strict=True)):
        for name in a:
            same = a[name] == b[name] or (
                isinstance(a[name], float) and math.isnan(a[name]) and math.isnan(b[name])
            )
            assert same, f"row {i}, {name}: {a[name]} by a second top-k, {b[name]} read"
    assert math.isnan(read[32]["prod_kth_score"])
    assert not math.isnan(read[31]["prod_kth_score"])
    assert read[30]["prod_kth_margin"] == 0.0  # the tie
    with pytest.raises(ValueError, match="prod_top_values"):
        run(prod_topk, q_pos, k, **common, prod_top_values=top.values[:, :-1])


def _ranked(values: list[float]) -> list[float]:
    """values as torch.topk ranks them, written out: NaN first, then descending."""
    return [math.nan] * sum(map(math.isnan, values)) + sorted(
        (v for v in values if not math.isnan(v)), reverse=True
    )


def test_the_shadows_kth_score_margin_and_selection_are_a_sorted_top_ks_and_its_ties_torchs() -> None:
    k = 6
    gen = torch.Generator().manual_seed(11)
    scores = torch.randn(40, 30, generator=gen)
    scores[1, :5] = math.nan  # fewer NaNs than k: all selected, the k-th a number
    scores[2, :8] = math.nan  # more NaNs than k: a NaN k-th score
    scores[3, 6:] = -INF  # a masked tail below the k+1-th
    scores[4, 3:9] = scores[4, 3]  # ties across the k-th place
    scores[5] = scores[5].round()  # ties everywhere
    kth, chosen, scale = selection._shadow_top(scores, k)
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, chosen, True)
    margin = selection._margin(scores, kth, mask, k)
    # keys tied at the k-th score fall as an engine's own top-k call lets them fall
    engine = scores.topk(k).indices
    for r, row in enumerate(_ranked(row.tolist()) for row in scores):
        assert {int(j) for j in chosen[r]} == {int(j) for j in engine[r]}, r
        want_kth, want_margin = row[k - 1], row[k - 1] - row[k]
        assert (math.isnan(kth[r]) and math.isnan(want_kth)) or kth[r] == want_kth, r
        assert (math.isnan(margin[r]) and math.isnan(want_margin)) or margin[r] == want_margin, r
        # the selected keys' scores are the top k's, as a multiset
        assert [str(v) for v in _ranked(scores[r, chosen[r]].tolist())] == [str(v) for v in row[:k]], r
        finite = [abs(v) for v in row[:k] if math.isfinite(v)]
        if finite:
            assert scale[r].item() == pytest.approx(sum(finite) / len(finite), rel=1e-6), r
        else:
            assert math.isnan(scale[r]), r
    # a row of at most k keys leaves none out: no margin
    assert torch.isnan(selection._margin(scores[:, :k], kth, mask[:, :k], k)).all()
