"""The hooks' shadow numerics reproduce the golden vectors (tests/golden/numerics_v1.json,
made from PyTorch's own FP8 casts and float64 torch math) and the Rust tracer's rules; the
golden top-k vectors go through the live device-side comparison (selection.compare)."""

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from shadowtrace_hooks import numerics, selection
from shadowtrace_hooks.transfer import Packet

GOLDEN = json.loads(
    (Path(__file__).resolve().parents[2] / "tests" / "golden" / "numerics_v1.json").read_text()
)
# Scores are fp32 sums of D=128 products: within this fraction of the row's largest score
# of the float64 reference (the Rust tests' FP32_SCORE_REL_TOL).
FP32_SCORE_REL_TOL = 1e-5


def f32(bits: list[int], shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(np.array(bits, dtype=np.uint32).view(np.float32)).reshape(shape)


def f64(bits: list[int]) -> torch.Tensor:
    return torch.tensor(np.array(bits, dtype=np.uint64).view(np.float64))


@pytest.mark.parametrize(
    "case", [c for c in GOLDEN["block_quant"]["cases"] if c["input"] == "act"], ids=lambda c: c["name"]
)
def test_activation_quantization_is_bit_exact_against_pytorch(case: dict) -> None:
    act = GOLDEN["block_quant"]["inputs"]["act"]
    x = f32(act["bits"], act["shape"])
    codes, scales = numerics.quantize_rows(
        x, fmt=case["format"], scale_format=case["scale_format"], amax_clamp=case["amax_clamp"]
    )
    got = codes.view(torch.uint8).flatten().tolist()
    assert got == case["values"]
    assert (
        scales.flatten().view(torch.int32).tolist()
        == np.array(case["scales"], dtype=np.uint32).view(np.int32).tolist()
    )


def indexer_inputs() -> tuple[torch.Tensor, ...]:
    g = GOLDEN["indexer"]
    t, s, h, d = g["t"], g["s"], g["h"], g["d"]
    return f32(g["q"], (t, h, d)), f32(g["k"], (s, d)), f32(g["w"], (t, h)), torch.tensor(g["q_pos"])


def assert_scores_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    expected = expected.reshape(got.shape)
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(got)), "masked entries differ"
    row_max = expected.masked_fill(~finite, 0).abs().amax(-1, keepdim=True).clamp(min=1e-30)
    err = ((got.double() - expected).abs() / row_max).masked_fill(~finite, 0)
    assert float(err.max()) <= FP32_SCORE_REL_TOL, float(err.max())


def test_fp32_scores_match_the_float64_reference() -> None:
    q, k, w, q_pos = indexer_inputs()
    assert_scores_close(numerics.index_scores(q, k, w, q_pos), f64(GOLDEN["indexer"]["scores_f64"]["fp32"]))


def test_bf16_scores_match_the_float64_reference_of_bf16_inputs() -> None:
    q, k, w, q_pos = indexer_inputs()
    bf16 = lambda v: v.to(torch.bfloat16)  # noqa: E731
    got = numerics.index_scores(bf16(q), bf16(k), bf16(w), q_pos)
    assert_scores_close(got, f64(GOLDEN["indexer"]["scores_f64"]["bf16"]))


@pytest.mark.parametrize("variant", list(GOLDEN["indexer"]["variants"]))
def test_fp8_engine_variants_match_the_float64_reference(variant: str) -> None:
    spec = GOLDEN["indexer"]["variants"][variant]
    q, k, w, q_pos = indexer_inputs()
    got = numerics.fp8_variant_scores(
        q,
        k,
        w,
        q_pos,
        rotate=spec["hadamard"],
        scale_format=spec["scale_format"],
        amax_clamp=spec["amax_clamp"],
    )
    assert_scores_close(got, f64(GOLDEN["indexer"]["scores_f64"][f"fp8_{variant}"]))


def shadow_columns(scores: torch.Tensor, k: int, q_pos: list[int], band: float) -> list[dict]:
    """The live device-side comparison (selection.compare, read back by selection.columns as
    the writer's thread does) with `scores` [T, S] as the shadow's and a production that
    selected nothing: per row, the shadow's selection, k-th score, margin and boundary."""
    packet = Packet()
    nothing = torch.full((scores.shape[0], k), -1)
    pos = torch.tensor(q_pos)
    spec = selection.compare(packet, nothing, pos, scores.shape[1], k, shadow_scores=scores, band=band)
    cols = selection.columns(spec, packet.ship().arrays(), np.array(q_pos) + 1, k)
    rows = []
    for i in range(len(q_pos)):
        row = {}
        for name in ("shadow_only_gaps", "shadow_boundary_gaps", "shadow_boundary_offsets"):
            lists = cols[name]
            null = bool(np.ma.getmaskarray(lists.offsets)[i])
            offsets = np.ma.getdata(lists.offsets)
            row[name] = None if null else lists.values[offsets[i] : offsets[i + 1]].tolist()
        for name in ("shadow_selected", "shadow_kth_score", "shadow_kth_margin"):
            row[name] = None if np.ma.getmaskarray(cols[name])[i] else cols[name][i]
        row["selected"] = list(itertools.accumulate(row.pop("shadow_only_gaps")))
        gaps = row.pop("shadow_boundary_gaps")
        row["boundary"] = None if gaps is None else list(itertools.accumulate(gaps))
        rows.append(row)
    return rows


@pytest.mark.parametrize("case", GOLDEN["topk"], ids=lambda c: c["name"])
def test_selection_matches_torch_topk_and_its_kth_score(case: dict) -> None:
    k, visible = case["k"], case["visible"]
    scores = f32(case["scores"], (1, -1))
    (row,) = shadow_columns(scores, k, [visible - 1], band=0.0)
    got = row["selected"]
    expected = sorted(i for i in case["torch_topk_indices"] if i < visible)
    assert row["shadow_selected"] == len(got)
    if case["name"] in ("boundary_ties", "all_tied"):
        # which tied key wins is unspecified; the tie's score and the count are not
        kth = f32([case["kth_score"]], (1,)).item()
        assert len(got) == k
        assert all(scores[0, i] >= kth for i in got)
    else:
        assert got == expected
    if visible <= k:
        # A dense row: null, as the topk table defines it.
        assert row["shadow_kth_score"] is None
        assert row["shadow_kth_margin"] is None
        assert row["boundary"] is None
    else:
        kth, nxt = f32([case["kth_score"], case["next_score"]], (2,)).tolist()
        assert row["shadow_kth_score"] == np.float32(kth)
        assert row["shadow_kth_margin"] == np.float32(kth - nxt)


def test_the_boundary_band_lists_the_keys_near_the_kth_score_ascending() -> None:
    scores = torch.tensor([[5.0, 1.0, 3.0, 2.95, 3.02, 0.0, -math.inf]])
    (row,) = shadow_columns(scores, 2, [5], band=0.1)
    assert row["selected"] == [0, 4]
    assert row["shadow_kth_score"] == np.float32(3.02)
    assert row["boundary"] == [2, 3, 4]
    # offsets from the k-th score, in fp32 as the device computed them
    expected = [np.float32(v) - np.float32(3.02) for v in (3.0, 2.95, 3.02)]
    assert row["shadow_boundary_offsets"] == pytest.approx(expected, abs=0.0)


def test_a_row_is_dense_by_its_visible_keys_never_because_its_kth_score_is_nan() -> None:
    inf = math.inf
    # k = 2. Row 0 sees one key (dense); row 1 sees four, two of them NaN: sparse, with a
    # NaN k-th score, and no finite score in its top-k to scale a band by: no candidates
    # (null, unknown, not an empty list).
    scores = torch.tensor([[1.0, -inf, -inf, -inf], [math.nan, math.nan, 2.0, 1.0]])
    dense, sparse = shadow_columns(scores, 2, [0, 3], band=0.5)
    assert dense["shadow_kth_score"] is None
    assert dense["shadow_kth_margin"] is None
    assert dense["boundary"] is None
    assert math.isnan(sparse["shadow_kth_score"])
    assert sparse["boundary"] is None


def test_members_drop_padding_and_keys_beyond_the_visible_range() -> None:
    indices = torch.tensor([[3, -1, 0, 7], [2, 1, 0, 3], [0, -1, -1, -1]])
    packet = Packet()
    spec = selection.compare(
        packet, indices, torch.tensor([3, 1, 0]), 8, 4, sampled=torch.ones(3, dtype=torch.bool)
    )
    cols = selection.columns(spec, packet.ship().arrays(), np.array([4, 2, 1]), 4, np.ones(3, dtype=bool))
    assert cols["prod_selected"].tolist() == [2, 2, 1]
    lists = cols["prod_gaps"]
    assert np.ma.getdata(lists.offsets).tolist() == [0, 2, 4, 5]
    assert lists.values.tolist() == [0, 3, 0, 1, 0]  # gap-coded: rows [0, 3], [0, 1], [0]


def test_dequantization_is_exact_for_power_of_two_scales() -> None:
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    codes, scales = numerics.quantize_rows(x, scale_format="ue8m0")
    back = numerics.dequantize_rows(codes, scales)
    assert torch.equal(back, codes.float().reshape(4, 2, 128).mul(scales[..., None]).reshape(4, 256))
    assert float((back - x).abs().max() / x.abs().max()) < 2**-3
