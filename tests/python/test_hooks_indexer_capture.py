"""Production's indexer scores are captured from HF's own top-k call, not recomputed: tiny
random GLM-5 and DeepSeek-V3.2 models of transformers traced in-process, the captured rows
against the recompute they replace (forced by a capture that keeps nothing) and against the
indices HF's indexer returned."""

import json
import struct
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import tiny_models
import torch
from shadowtrace_hooks import session, startup
from shadowtrace_hooks.adapters import hf

K, LENGTH = 16, 80  # most rows see more than k keys: sparse rows, with k-th scores and margins


def trace(out: Path, model: torch.nn.Module, **env: str) -> tuple[dict, list[dict[str, Any]], torch.Tensor]:
    """One traced forward of `model` into `out`: its manifest, topk rows by (layer, token),
    and the logits."""
    environ = {"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(out), "SHADOWTRACE_TOPK_LISTS": "all", **env}
    assert startup.activate(environ) is not None
    try:
        with torch.no_grad():
            logits = model(tiny_models.prompt(LENGTH)).logits
    finally:
        session.stop()
    (run,) = out.iterdir()
    manifest = json.loads((run / "manifest.json").read_text())
    rows = sorted(pq.read_table(run / "topk").to_pylist(), key=lambda r: (r["layer"], r["token"]))
    return manifest, rows, logits


def bits(value: float | None) -> bytes | None:
    return None if value is None else struct.pack("<f", value)


def keys(gaps: list[int]) -> list[int]:
    out, at = [], 0
    for i, gap in enumerate(gaps):
        at = gap if i == 0 else at + gap
        out.append(at)
    return out


def never_kept(
    self: hf._TopkInput, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
) -> Any:
    return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["glm", "deepseek"])
def test_captured_scores_give_the_recomputes_kth_scores_margins_and_boundaries_bit_for_bit(
    tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = getattr(tiny_models, family)
    captured, rows, logits = trace(tmp_path / "captured", build(index_topk=K))
    untraced = build(index_topk=K)
    with torch.no_grad():
        assert torch.equal(logits, untraced(tiny_models.prompt(LENGTH)).logits)
    with monkeypatch.context() as m:
        m.setattr(hf._TopkInput, "__torch_function__", never_kept)
        recomputed, again, _ = trace(tmp_path / "recomputed", build(index_topk=K))

    layers = untraced.config.num_hidden_layers
    assert "indexer_scores_recomputed" not in captured["counters"]
    assert recomputed["counters"]["indexer_scores_recomputed"] == layers  # one per indexer call
    for manifest in (captured, recomputed):
        assert manifest["settings"].get("disabled_sites") is None
        assert manifest["counters"].get("hook_errors", 0) == 0
    assert len(rows) == len(again) == layers * LENGTH
    sparse = [r for r in rows if r["visible"] > K]
    assert len(sparse) == layers * (LENGTH - K)
    assert all(r["prod_boundary_gaps"] for r in sparse), "the band holds at least the k-th key"
    for a, b in zip(rows, again, strict=True):
        assert (a["layer"], a["token"]) == (b["layer"], b["token"])
        for name in ("prod_kth_score", "prod_kth_margin", "shadow_kth_score", "jaccard", "jaccard_no_churn"):
            assert bits(a[name]) == bits(b[name]), (name, a["layer"], a["token"])
        for name in ("prod_gaps", "prod_boundary_gaps", "prod_boundary_selected", "churn_prod_only"):
            assert a[name] == b[name], (name, a["layer"], a["token"])
        offsets = [bits(v) for v in a["prod_boundary_offsets"] or []]
        assert offsets == [bits(v) for v in b["prod_boundary_offsets"] or []]


@pytest.mark.parametrize("family", ["glm", "deepseek"])
def test_the_captured_scores_rank_exactly_the_keys_hf_returned(tmp_path: Path, family: str) -> None:
    model = getattr(tiny_models, family)(index_topk=K)
    returned: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):

        def keep(module: torch.nn.Module, args: tuple, output: torch.Tensor, i: int = i) -> None:
            returned[i] = output[0].clone()

        layer.self_attn.indexer.register_forward_hook(keep)
    # A band wider than any score: every visible key is a boundary candidate, listed with
    # its score's offset from the k-th score and whether production selected it.
    manifest, rows, _ = trace(tmp_path, model, SHADOWTRACE_BOUNDARY_BAND="1e30")
    assert "indexer_scores_recomputed" not in manifest["counters"]
    checked = 0
    for row in rows:
        chosen = returned[row["layer"]][row["token"]].tolist()
        visible = row["visible"]
        assert keys(row["prod_gaps"]) == sorted({s for s in chosen if 0 <= s < visible})
        if visible <= K:
            continue
        candidates = keys(row["prod_boundary_gaps"])
        assert candidates == list(range(visible)), "every visible key, ascending"
        offsets, selected = row["prod_boundary_offsets"], row["prod_boundary_selected"]
        assert selected == [s in chosen for s in candidates]
        assert sum(selected) == K
        # HF's top-k picked the k highest captured scores: none selected below the k-th,
        # none left out above it, and the k-th itself selected.
        assert all(o >= 0 for o, s in zip(offsets, selected, strict=True) if s)
        assert all(o <= 0 for o, s in zip(offsets, selected, strict=True) if not s)
        assert any(o == 0 and s for o, s in zip(offsets, selected, strict=True))
        assert row["prod_kth_margin"] >= 0  # NaN fails too
        checked += 1
    assert checked == model.config.num_hidden_layers * (LENGTH - K)


def test_a_decode_step_whose_capture_fails_after_a_captured_one_is_counted_not_scored_on_shifted_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill's capture fails (its scores are recomputed and its keys kept), the first
    decode step's succeeds (its key joins no list), the second's fails again: its scores
    would miss the first decode step's key, so its rows are recorded without scores and
    counted."""
    model = tiny_models.glm(index_topk=K)
    layers = model.config.num_hidden_layers
    forwards = [0]
    model.model.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))
    keep = hf._TopkInput.__torch_function__

    def kept_on_the_first_decode_step(self: hf._TopkInput, func: Any, *rest: Any, **kw: Any) -> Any:
        return (keep if forwards[0] == 2 else never_kept)(self, func, *rest, **kw)

    monkeypatch.setattr(hf._TopkInput, "__torch_function__", kept_on_the_first_decode_step)
    environ = {"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)}
    assert startup.activate(environ) is not None
    try:
        with torch.no_grad():
            model.generate(tiny_models.prompt(LENGTH), max_new_tokens=3, do_sample=False)
    finally:
        session.stop()
    assert forwards[0] == 3
    (run,) = tmp_path.iterdir()
    manifest = json.loads((run / "manifest.json").read_text())
    counters = manifest["counters"]
    assert counters["indexer_scores_recomputed"] == layers  # the prefill's calls alone
    assert counters["topk_scores_skipped_capture_failed"] == layers  # one query row a layer
    rows = pq.read_table(run / "topk").to_pylist()
    by_step = {step: [r for r in rows if r["step"] == step] for step in (0, 1, 2)}
    assert len(by_step[2]) == layers
    assert all(r["prod_kth_score"] is None and r["prod_selected"] == K for r in by_step[2])
    assert all(r["prod_kth_score"] is not None for r in by_step[1])


@pytest.mark.parametrize("family", ["glm", "deepseek"])
def test_the_relative_band_finds_the_same_churn_on_a_model_whose_scores_are_eight_times_larger(
    tmp_path: Path, family: str
) -> None:
    """Indexer scores scale with the model (issue 28, item 4): transformers' own model, its
    indexer's head weights (`weights_proj`) times 8, scores every key exactly 8 times higher (a
    power of two, in bf16 and fp32 alike). The relative band then records the same boundary
    candidates and churn on every row, its band in scores 8 times wider; an absolute band
    would have listed other keys."""
    build = getattr(tiny_models, family)
    band = {"SHADOWTRACE_BOUNDARY_BAND": "0.02"}
    manifest, base, _ = trace(tmp_path / "x1", build(index_topk=K), **band)
    assert manifest["settings"]["boundary_band"] == pytest.approx(0.02)
    assert manifest["settings"]["boundary_band_scale"] == "mean_abs_reference_topk_score"
    assert manifest["settings"]["boundary_stored"] == pytest.approx(0.04)
    # each top-k part says so too, for a part read away from its run
    (part,) = (tmp_path / "x1").glob("*/topk/*.parquet")
    rule = json.loads(pq.read_metadata(part).metadata[b"shadowtrace.boundary_band"])
    assert rule == {"band": 0.02, "scale": "mean_abs_reference_topk_score", "stored": 0.04}
    scaled = build(index_topk=K)
    with torch.no_grad():
        for layer in scaled.model.layers:
            layer.self_attn.indexer.weights_proj.weight.mul_(8)
    _, rows, _ = trace(tmp_path / "x8", scaled, **band)
    same = ("prod_boundary_gaps", "prod_boundary_selected", "shadow_boundary_gaps",
            "shadow_boundary_selected", "churn_shared", "churn_prod_only", "churn_shadow_only",
            "churn_unselected", "jaccard_no_churn")  # fmt: skip
    listed = 0
    assert len(rows) == len(base)
    for a, b in zip(base, rows, strict=True):
        assert {n: a[n] for n in same} == {n: b[n] for n in same}, (a["layer"], a["token"])
        if a["visible"] > K:
            assert b["boundary_band"] == 8 * a["boundary_band"]
            listed += len(a["prod_boundary_gaps"]) > 1
    assert listed, "some rows list candidates besides the k-th key"


def test_an_indexer_over_a_static_cache_scores_every_slot_and_its_selections_are_recorded_whole(
    tmp_path: Path,
) -> None:
    # transformers' StaticIndexedLayer holds max_cache_len keys, and the indexer scores them all
    # (the unwritten slots masked): production's scores are wider than the keys any query sees,
    # and than the shadow's. The oracle is what HF's indexer returned, call by call.
    model = tiny_models.glm(index_topk=K)
    returned: dict[int, list[torch.Tensor]] = {}
    for i, layer in enumerate(model.model.layers):

        def keep(module: torch.nn.Module, args: tuple, output: torch.Tensor, i: int = i) -> None:
            returned.setdefault(i, []).append(output[0].clone())

        layer.self_attn.indexer.register_forward_hook(keep)
    environ = {"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path), "SHADOWTRACE_TOPK_LISTS": "all"}
    assert startup.activate(environ) is not None
    try:
        with torch.no_grad():
            model.generate(
                tiny_models.prompt(LENGTH), max_new_tokens=3, do_sample=False, cache_implementation="static"
            )
    finally:
        session.stop()
    (run,) = tmp_path.iterdir()
    manifest = json.loads((run / "manifest.json").read_text())
    rows = pq.read_table(run / "topk").to_pylist()
    assert manifest["settings"].get("disabled_sites") is None, manifest["settings"]
    assert manifest["counters"].get("hook_errors", 0) == 0, manifest["counters"]
    assert "indexer_scores_recomputed" not in manifest["counters"]
    layers = model.config.num_hidden_layers
    assert len(rows) == layers * (LENGTH + 2)  # the prompt, then two decode steps
    checks = manifest["settings"]["capture_check"]["layers"]
    assert sum(c["rows"] for c in checks.values()) == layers * (LENGTH + 2 - K)
    assert all(c["disagree"] == 0 and c["unchecked"] == 0 for c in checks.values()), checks
    for row in rows:
        calls = returned[row["layer"]]
        # The prompt's call returns a row per token; each decode step's, one.
        chosen = calls[0][row["token"]] if row["token"] < LENGTH else calls[row["token"] - LENGTH + 1][0]
        visible = row["visible"]
        assert visible == row["token"] + 1
        assert keys(row["prod_gaps"]) == sorted({s for s in chosen.tolist() if 0 <= s < visible})
        if visible > K:  # a sparse row: scored against the shadow, with its k-th score
            assert row["shadow_kth_score"] is not None
            assert row["prod_kth_score"] is not None
            assert len(keys(row["prod_gaps"])) == K
