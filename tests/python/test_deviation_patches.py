"""The kernel deviations of issue 40 planted in transformers' own trained models (models/,
through `deviation_patches`), each checked against what its mechanism fixes by construction,
on transformers' selections: what the reference engine's deviation of the same name
(tracer/src/model/kernel_deviation.rs, `shadowtrace suspects --deviations ...`) emulates must
show on the model the reports describe, or the emulation would be of nothing.

The selections are those of layer 0, whose input is the embeddings whatever is patched, so a
difference there is the patch's alone."""

import pytest
import torch
import trained
from deviation_patches import (
    coarse_key,
    drops_winners,
    exact,
    lowprec_head_sum,
    paged_past_len,
    selecting,
    zeros_past,
)

T = 3072
K = 2048


def layer0_selection(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Layer 0's top-k `[S, k]` as its indexer returned it, and the index scores beside it."""
    got = {}
    indexer = model.model.layers[0].self_attn.indexer

    def keep(module, args, out) -> None:  # returns None: the output stays the indexer's
        got["topk"] = out[0].long()

    handle = indexer.register_forward_hook(keep)
    with torch.no_grad():
        model(ids)
    handle.remove()
    return got["topk"]


def layer0_scores(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    seen = {}

    def keep(scores, k, layer):
        if layer == 0:
            seen["scores"] = scores[0].clone()
        return exact(scores, k, layer)

    with selecting(model, keep), torch.no_grad():
        model(ids)
    return seen["scores"]


def overlap(a: torch.Tensor, b: torch.Tensor, rows: slice) -> list[float]:
    out = []
    for r in range(rows.start, rows.stop):
        x, y = set(a[r].tolist()), set(b[r].tolist())
        out.append(len(x & y) / len(x | y))
    return out


@pytest.fixture(scope="module", params=list(trained.NAMES))
def model_and_ids(request: pytest.FixtureRequest):
    torch.manual_seed(0)
    model = trained.load(request.param)
    ids = trained.prompt(T)
    return request.param, model, ids, layer0_selection(model, ids)


def test_a_paged_kernel_wrong_past_a_length_moves_only_the_queries_that_see_past_it(model_and_ids) -> None:
    family, model, ids, clean = model_and_ids
    length = 2560
    with selecting(model, paged_past_len(length)):
        got = layer0_selection(model, ids)
    assert torch.equal(got[:length], clean[:length]), "queries before the length see no wrong key"
    j = overlap(got, clean, slice(length, T))
    assert min(j) < 1.0, (family, "a query past the length selects garbage")
    # The more wrong keys a query sees, the more its selection moves.
    early, late = sum(j[:128]) / 128, sum(j[-128:]) / 128
    assert late < early, (family, early, late)


def test_an_overflowing_candidate_buffer_drops_later_winners_for_earlier_keys(model_and_ids) -> None:
    family, model, ids, clean = model_and_ids
    scores = layer0_scores(model, ids)
    # A 256-entry buffer: on these models the threshold bucket of the fp16 coarse key holds
    # tens to about 1600 of a 3072-key row, so some rows overflow it and others do not.
    capacity = 256
    with selecting(model, drops_winners(capacity)):
        got = layer0_selection(model, ids)
    overflowed = short = 0
    for r in range(K, T):
        row = scores[r, : r + 1]
        bucket = coarse_key(row)
        from_top = torch.bincount(bucket, minlength=256).flip(0).cumsum(0)
        threshold = 255 - int((from_top >= K).nonzero()[0])
        candidates = (bucket == threshold).nonzero().view(-1)  # in key order
        picked, best = set(got[r].tolist()), set(clean[r].tolist())
        if candidates.numel() <= capacity:
            assert picked == best, (family, r, "a bucket the buffer holds: the exact top-k")
            continue
        overflowed += 1
        assert len(picked) == K, "a full, duplicate-free selection: the loss is silent"
        # Only winners the buffer had no room for are lost: candidates past its first
        # `capacity` in key order. Keys tied at the k-th score (many rows end in exact zeros,
        # where every head's relu is 0) are either side's choice.
        kth = float(row[sorted(best)].min())
        missed = {m for m in best - picked if float(row[m]) != kth}
        assert missed <= set(candidates[capacity:].tolist()), (family, r)
        short += bool(missed)
    assert overflowed > 0, (family, "some row overflows a 256-entry buffer")
    assert short > 0, (family, overflowed, "some overflowing row loses a winner")


def test_a_reduction_returning_zeros_past_a_length_keeps_each_querys_trailing_keys(model_and_ids) -> None:
    family, model, ids, clean = model_and_ids
    with selecting(model, zeros_past(T + 1)):
        assert torch.equal(layer0_selection(model, ids), clean), "below the length: untouched"
    with selecting(model, zeros_past(T - 1)):
        got = layer0_selection(model, ids)
    for r in (K, 2500, T - 1):
        assert sorted(got[r].tolist()) == list(range(r - K + 1, r + 1)), (family, r)


def test_a_bf16_head_sum_moves_the_selection_only_among_close_scores(model_and_ids) -> None:
    family, model, ids, clean = model_and_ids
    scores = layer0_scores(model, ids)
    with lowprec_head_sum(model):
        low = layer0_scores(model, ids)
        got = layer0_selection(model, ids)
    rows = slice(K, T)
    seen = torch.ones(T, T, dtype=torch.bool).tril()
    diff = (low - scores).abs()[seen]
    # Each of H terms and H - 1 sums rounds by at most 2^-9 of its magnitude.
    heads = model.config.index_n_heads
    bound = 2 * heads * 2.0**-9 * scores.abs()[seen].max()
    assert float(diff.max()) <= float(bound), (family, float(diff.max()), float(bound))
    assert float(diff.max()) > 0.0
    j = overlap(got, clean, rows)
    assert min(j) < 1.0, (family, "the rounding flips some selection")
