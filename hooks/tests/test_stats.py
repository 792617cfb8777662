"""Hidden-state statistics and non-finite events on vectors whose answers are known."""

import math

import numpy as np
import pytest
import torch
from shadowtrace_hooks import stats


def test_statistics_of_known_vectors() -> None:
    prod = torch.tensor([[3.0, 4.0, 0.0], [1.0, 1.0, 1.0]])
    shadow = torch.tensor([[3.0, 4.0, 0.0], [1.0, 1.0, 0.0]])
    cols = stats.hidden_columns(prod, shadow, torch.tensor([0, 1]))
    assert cols["prod_l2"].tolist() == pytest.approx([5.0, math.sqrt(3)])
    assert cols["prod_max_abs"].tolist() == [4.0, 1.0]
    assert cols["rel_l2_err"].tolist() == pytest.approx([0.0, 1 / math.sqrt(2)])
    assert cols["cosine"].tolist() == pytest.approx([1.0, 2 / (math.sqrt(3) * math.sqrt(2))])
    assert cols["max_abs_diff"].tolist() == [0.0, 1.0]
    assert cols["numel"].tolist() == [3, 3]
    assert cols["rel_l2_err"].dtype == np.float32
    assert cols["prod_nan"].dtype == np.int64


def test_non_finite_values_are_counted_and_make_the_comparison_nan() -> None:
    prod = torch.tensor([[math.nan, 2.0, math.inf], [1.0, -math.inf, -math.inf]])
    shadow = torch.ones(2, 3)
    cols = stats.hidden_columns(prod, shadow, torch.tensor([0, 1]))
    assert cols["prod_nan"].tolist() == [1, 0]
    assert cols["prod_pos_inf"].tolist() == [1, 0]
    assert cols["prod_neg_inf"].tolist() == [0, 2]
    assert cols["prod_max_abs"].tolist() == [2.0, 1.0]  # over the finite elements
    assert all(math.isnan(v) for v in cols["rel_l2_err"])
    assert cols["shadow_nan"].tolist() == [0, 0]


def test_events_give_the_first_token_and_channel_and_the_shadow_there() -> None:
    prod = torch.zeros(5, 4)
    prod[2, 3] = math.nan
    prod[4, 0] = math.nan
    prod[3, 1] = -math.inf
    shadow = torch.zeros(5, 4)
    shadow[3, 2] = math.inf
    events = {e["kind"]: e for e in stats.nonfinite_events(prod, shadow)}
    assert events["nan"] == {"kind": "nan", "token": 2, "channel": 3, "count": 2, "shadow_finite": True}
    assert events["neg_inf"] == {
        "kind": "neg_inf",
        "token": 3,
        "channel": 1,
        "count": 1,
        "shadow_finite": False,
    }
    assert "pos_inf" not in events
    assert stats.nonfinite_events(torch.zeros(2, 2), None) == []


def test_logits_rows_hold_the_top_ids_and_their_log_probabilities() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0]])
    cols = stats.logits_columns(logits, None, top_n=2)
    ids, lp = cols["prod_top_ids"], cols["prod_top_logprobs"]
    assert ids.values.tolist() == [1, 2, 0, 1] or ids.values.tolist() == [1, 2, 0, 2]
    assert ids.offsets.tolist() == [0, 2, 4]
    expected = torch.log_softmax(logits, -1)
    assert lp.values[0] == pytest.approx(float(expected[0, 1]))
    assert "shadow_top_ids" not in cols


def test_the_relative_error_against_a_zero_shadow_is_zero_or_infinite() -> None:
    prod = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    shadow = torch.zeros(2, 2)
    cols = stats.hidden_columns(prod, shadow, torch.tensor([0, 1]))
    assert cols["rel_l2_err"].tolist() == [0.0, math.inf]


def test_indexer_events_count_non_finite_scores_among_visible_keys_only() -> None:
    # Query positions 0..3 over 4 keys: -inf above the diagonal is the causal mask.
    scores = torch.tensor([[1.0, 2.0, 3.0, 4.0]]).repeat(4, 1)
    scores = scores.masked_fill(~(torch.arange(4)[None, :] <= torch.arange(4)[:, None]), -math.inf)
    scores[2, 1] = math.nan
    scores[3, 0] = math.nan
    scores[3, 3] = -math.inf  # a score the indexer produced, not the mask
    events = {e["kind"]: e for e in stats.indexer_events(scores, torch.arange(4))}
    assert events == {
        "nan": {"kind": "nan", "token": 2, "channel": 1, "count": 2, "shadow_finite": None},
        "neg_inf": {"kind": "neg_inf", "token": 3, "channel": 3, "count": 1, "shadow_finite": None},
    }
    masked_only = torch.tensor([[1.0, -math.inf], [1.0, 2.0]])
    assert stats.indexer_events(masked_only, torch.arange(2)) == []


def test_events_of_every_kind_match_a_row_by_row_search_on_planted_values() -> None:
    """events_device against the test's own search (rows in order, then channels), on random
    plants of each kind, with and without a per-row count of valid elements (the rest -inf,
    as the indexer's masked scores are)."""
    gen = torch.Generator().manual_seed(5)
    kinds = {"nan": math.nan, "pos_inf": math.inf, "neg_inf": -math.inf}
    for trial in range(60):
        t, n = 1 + trial % 7, 1 + (trial * 3) % 11
        x = torch.randn(t, n, generator=gen).to(torch.bfloat16 if trial % 2 else torch.float32)
        for value in kinds.values():
            for _ in range(int(torch.randint(0, 3, (1,), generator=gen))):
                r, c = (int(v) for v in torch.randint(0, 1 << 20, (2,), generator=gen))
                x[r % t, c % n] = value
        valid = torch.randint(0, n + 1, (t,), generator=gen) if trial % 3 == 0 else None
        if valid is not None:  # the indexer's contract: -inf past each row's valid keys
            x = x.masked_fill(torch.arange(n)[None, :] >= valid[:, None], -math.inf)
        finite = torch.rand(t, generator=gen) < 0.5
        want = []
        for kind, value in kinds.items():
            hits = [
                (r, c)
                for r in range(t)
                for c in range(n if valid is None else int(valid[r]))
                if (math.isnan(float(x[r, c])) if kind == "nan" else float(x[r, c]) == value)
            ]
            if hits:
                want.append({"kind": kind, "token": hits[0][0], "channel": hits[0][1], "count": len(hits),
                             "shadow_finite": bool(finite[hits[0][0]])})  # fmt: skip
        counts = stats.counts_device(x, valid)
        got = stats.event_rows(stats.events_device(x, counts, finite, valid).numpy())
        assert got == want, (trial, got, want)


def sentinel_by_hand(caches: list[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """The KV sentinel's reads (`stats.sentinel_device`), element by element in Python: for
    each batch row, slot 0 and then the row's positions, per cache [count, first slot holding
    a non-finite element (the first slot read when none), least and greatest slot read]."""
    out = []
    for b, row in enumerate(positions.tolist()):
        reads = []
        for slots in ([0], row):
            per_cache = []
            for cache in caches:
                held = [int((~torch.isfinite(cache[b, ..., s, :])).sum()) if 0 <= s < cache.shape[-2] else 0
                        for s in slots]  # fmt: skip
                found = next((s for s, n in zip(slots, held, strict=True) if n), slots[0])
                per_cache.append([sum(held), found, min(slots), max(slots)])
            reads.append(per_cache)
        out.append(reads)
    return torch.tensor(out, dtype=torch.int64)


def test_the_sentinel_reads_slot_zero_and_each_rows_new_slots_through_torchs_ops() -> None:
    # on the CPU: torch's ops (kernel_cases.py checks Triton's kernel on the same answer);
    # values' heads lie apart from their batch rows, as a transposed cache's do
    gen = torch.Generator().manual_seed(8)
    keys = torch.randn(2, 3, 48, 16, generator=gen)
    values = torch.randn(3, 2, 48, 8, generator=gen).bfloat16().transpose(0, 1)
    keys[0, 2, 0, 15], keys[1, 0, 35, 3], keys[1, 1, 35, 4] = math.nan, math.inf, -math.inf
    values[1, 2, 7, 7], values[1, 0, 36, 0] = math.nan, math.nan
    positions = torch.stack([torch.arange(8, 48), torch.arange(8, 48).flip(0)])
    got = stats.sentinel_device([keys, values], positions)
    assert torch.equal(got, sentinel_by_hand([keys, values], positions))
    assert got[1, 1].tolist() == [[2, 35, 8, 47], [1, 36, 8, 47]]
    assert got[0, 0].tolist() == [[1, 0, 0, 0], [0, 0, 0, 0]]
