"""The vLLM adapter against the vLLM stand-in (standins/vllm.py), on both routes vLLM gives
GLM-5 and DeepSeek-V3.2: `deepseek_v32` (CUDA from 0.29: DeepseekV32Attention, fused kernels,
the function `sparse_attn_indexer`; GPUModelRunner v2) and `deepseek_v2` (Indexer.forward and
the SparseAttnIndexer CustomOp; GPUModelRunner v1). Production top-k comes from the
stand-in's kernels, written from vLLM's source; the runs are read back from disk."""

import logging
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import traced
from shadowtrace_hooks import selection
from shadowtrace_hooks.adapters import engine
from shadowtrace_hooks.adapters import vllm as vllm_adapter
from standins import common
from standins import vllm as sv

V32, V2 = "deepseek_v32", "deepseek_v2"
LAYERS = 2


@dataclass
class Traced:
    """One traced stand-in process: its engine and what the session and the runs hold."""

    fake: sv.Fake
    engine: sv.Engine
    observed: Any  # what the scenario returned
    runs: dict[str, list[dict[str, Any]]]  # request -> its runs (segments), in order
    counters: dict[str, int]
    disabled: dict[str, str]
    hook_calls: dict[str, int]

    def run(self, request: str) -> dict[str, Any]:
        (only,) = self.runs[request]
        return only

    def rows(self, request: str, shadow_input: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.run(request)["rows"] if r["shadow_input"] == shadow_input]


def trace(
    monkeypatch: pytest.MonkeyPatch, out: Path, scenario: Callable[[sv.Engine], Any], path: str = V32,
    newer_attention: bool = False, unhooked: tuple[str, ...] = (), version: str = "0.33.0",
    **engine_kwargs: Any,
) -> Traced:  # fmt: skip
    """Registers the stand-in, starts tracing as SHADOWTRACE=1 would (the adapter installs
    on the imported modules, before the model is built), runs `scenario`, stops and reads
    the runs back. Modules in `unhooked` are left out of sys.modules: not hooked."""
    fake = sv.register(monkeypatch, version=version, newer_attention=newer_attention)
    for name in unhooked:
        monkeypatch.delitem(sys.modules, name)
    sess = traced.start(out)
    try:
        eng = sv.Engine(fake, path=path, **engine_kwargs)
        observed = scenario(eng)
        state = dict(sess.counters), dict(sess.disabled), dict(sess.hook_calls)
    finally:
        traced.stop()
    runs: dict[str, list[dict[str, Any]]] = {}
    for run in traced.runs(out):
        runs.setdefault(run["manifest"]["tags"]["request"], []).append(run)
    return Traced(fake, eng, observed, runs, *state)


def expected(t: Traced, request: str, step: int, layer: int) -> dict[int, list[int]]:
    """The engine's own top-k of one request's rows in one step and layer, by position."""
    positions, rows = t.engine.production[(request, step, layer)]
    return {
        p: sorted(int(i) for i in row.tolist() if 0 <= i <= p) for p, row in zip(positions, rows, strict=True)
    }


def recorded(t: Traced, request: str) -> dict[tuple[int, int, int], list[int]]:
    """Production rows of a request's run by (step, layer, token)."""
    return {(r["step"], r["layer"], r["token"]): list(r["prod_indices"]) for r in t.run(request)["rows"]}


def informative(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with more visible keys than k: the only ones whose selection says anything."""
    return [r for r in rows if r["visible"] > r["k"]]


def excluded_overlap(row: dict[str, Any]) -> float:
    """Jaccard of the keys the two paths left out: with 2048 of ~2090 keys selected, the
    Jaccard of the selections is above 0.95 whatever the shadow does; this is not."""
    visible = set(range(row["visible"]))
    prod, shadow = visible - set(row["prod_indices"]), visible - set(row["shadow_indices"])
    return len(prod & shadow) / max(1, len(prod | shadow))


# === a serving sequence on each route =================================================


def _tables() -> list[tuple[torch.dtype, int]]:
    return [(m.cos_sin_cache.dtype, m.cos_sin_cache.data_ptr()) for m in sv._ROPE_DICT.values()]


def _serving(eng: sv.Engine) -> dict[str, Any]:
    """Two prefills, one past index_topk; decodes of both beside a chunked prefill (twice); A
    finishes, and D, new, takes A's freed KV blocks. Returns the rope tables before and
    after, and A's blocks."""
    tables = _tables()
    eng.step({"A": 2090, "B": 700}, new={"A": sv.prompt(2090, 1), "B": sv.prompt(700, 2)})
    eng.step({"A": 1, "B": 1, "C": 800}, new={"C": sv.prompt(1200, 3)})
    eng.step({"A": 1, "B": 1, "C": 400})
    freed = list(eng.runner.states.requests["A"].blocks)
    eng.step({"B": 1, "C": 1, "D": 300}, new={"D": sv.prompt(300, 4)}, finished={"A"})
    return {"tables": (tables, _tables()), "freed": freed}


@pytest.fixture(scope="module", params=[V32, V2])
def serving(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Traced:
    with pytest.MonkeyPatch.context() as mp:
        return trace(mp, tmp_path_factory.mktemp(request.param), _serving, path=request.param)


def test_each_request_is_a_run_of_its_own_named_by_the_engines_request_id(serving: Traced) -> None:
    assert serving.hook_calls.get("vllm", 0) > 0
    assert sorted(serving.runs) == ["A", "B", "C", "D"]
    for request, runs in serving.runs.items():
        assert len(runs) == 1, f"{request}: {[r['manifest']['run_id'] for r in runs]}"
        assert runs[0]["manifest"]["run_id"].startswith(f"{request}-rank0-")
        assert runs[0]["manifest"]["engine"]["name"] == "vllm"
    assert "indexer_hooks_never_fired" not in serving.counters


def test_production_rows_are_the_engines_own_for_every_request_step_and_layer(serving: Traced) -> None:
    assert sorted(serving.runs) == ["A", "B", "C", "D"]
    for request in serving.runs:
        got = recorded(serving, request)
        want = {
            (step, layer, p): rows
            for (req, step, layer) in serving.engine.production
            if req == request
            for p, rows in expected(serving, req, step, layer).items()
        }
        assert got.keys() == want.keys(), request
        wrong = [key for key in want if got[key] != want[key]]
        assert not wrong, f"{request}: {len(wrong)} rows differ from production, first {wrong[:3]}"


def test_decode_rows_and_later_prefill_chunks_keep_their_requests_steps(serving: Traced) -> None:
    tokens = {
        request: {(r["step"], r["token"]) for r in serving.run(request)["rows"]}
        for request in ("A", "B", "C", "D")
    }
    assert tokens["A"] == {(0, p) for p in range(2090)} | {(1, 2090), (2, 2091)}
    assert tokens["B"] == {(0, p) for p in range(700)} | {(1, 700), (2, 701), (3, 702)}
    assert tokens["C"] == {(0, p) for p in range(800)} | {(1, p) for p in range(800, 1200)} | {(2, 1200)}
    assert tokens["D"] == {(0, p) for p in range(300)}
    # Rows whose keys are not all in the call are production only, and counted.
    without_keys = {"A": 2, "B": 3, "C": 401, "D": 0}
    for request, rows in without_keys.items():
        run = serving.run(request)
        assert run["manifest"]["counters"].get("shadow_skipped_rows_without_keys", 0) == rows * LAYERS
        shadowed = {(r["step"], r["token"]) for r in run["rows"] if r["shadow_input"] == "dequant"}
        assert all(step == 0 for step, _ in shadowed)
    assert serving.run("C")["manifest"]["prompt"]["length"] == 1200
    # A closed when the scheduler reported it finished, the others at exit; D took A's
    # freed KV blocks, under a run of its own.
    assert "closed_at_exit" not in serving.run("A")["manifest"]["counters"]
    assert serving.run("B")["manifest"]["counters"]["closed_at_exit"] == 1
    assert serving.engine.runner.states.requests["D"].blocks[0] in serving.observed["freed"]


def test_the_dequant_shadow_reproduces_production_up_to_ties_at_the_kth_score(serving: Traced) -> None:
    rows = informative(serving.rows("A", "dequant"))
    assert len(rows) == (2090 - 2048) * LAYERS
    exact = 0
    for row in rows:
        prod, shadow = set(row["prod_indices"]), set(row["shadow_indices"])
        assert prod ^ shadow <= set(row["shadow_boundary_indices"]), (row["layer"], row["token"])
        exact += prod == shadow
    assert exact >= 0.9 * len(rows)


def test_the_capture_self_check_finds_the_engines_own_reading_consistent_and_churn_known(
    serving: Traced,
) -> None:
    """Production's scores are recomputed from its own FP8 operands (the dequant shadow): its
    recorded selection is their top-k on every informative row (issue 27's self-check), and
    production's boundary is known, so churn is too (issue 27, item 7)."""
    for request in ("A",):  # the one request past index_topk
        manifest = serving.run(request)["manifest"]
        check = manifest["settings"]["capture_check"]
        assert check["sources"] == [engine.DEQUANT_SOURCE]
        assert check["tolerance"] == selection.CHECK_TOLERANCE
        for layer in range(LAYERS):
            want = len([r for r in informative(serving.rows(request, "dequant")) if r["layer"] == layer])
            assert want > 0
            assert check["layers"][str(layer)] == {
                "rows": want,
                "disagree": 0,
                "first_token": None,
                "unchecked": 0,
                "short_of_winners": 0,
            }
    for row in informative(serving.rows("A", "raw")):
        assert row["prod_kth_score"] is not None
        assert row["jaccard_no_churn"] is not None, "churn is known where production's scores are"


def test_the_raw_shadow_stays_close_to_production(serving: Traced) -> None:
    rows = informative(serving.rows("A", "raw"))
    assert len(rows) == (2090 - 2048) * LAYERS
    jaccard = []
    for row in rows:
        prod, shadow = set(row["prod_indices"]), set(row["shadow_indices"])
        jaccard.append(len(prod & shadow) / len(prod | shadow))
    assert statistics.mean(jaccard) > 0.9
    assert statistics.mean(excluded_overlap(r) for r in rows) > 0.6


def test_the_raw_shadow_leaves_the_engines_rope_tables_untouched(serving: Traced) -> None:
    before, after = serving.observed["tables"]
    assert before
    assert after == before
    assert all(dtype == torch.bfloat16 for dtype, _ in after)


def test_each_run_records_the_engines_rope_convention_beside_the_models(serving: Traced) -> None:
    path = serving.engine.path
    source = {V32: "DeepseekV32Attention._index_rope_interleave", V2: "Indexer rotary_emb.is_neox_style"}
    assert sorted(serving.runs) == ["A", "B", "C", "D"]
    for request in serving.runs:
        settings = serving.run(request)["manifest"]["settings"]
        c = traced.conventions(serving.run(request))
        assert list(c) == [
            "indexer_rope", "indexer_hadamard", "indexer_head_weight_scale", "indexer_weights_proj_dtype"
        ]  # fmt: skip
        convention = c["indexer_rope"]
        assert (convention["engine"], convention["model"]) == ("neox", "neox")
        scale = c["indexer_head_weight_scale"]
        assert scale["engine"] == scale["model"] == sv.D**-0.5 * sv.H**-0.5
        assert scale["engine_source"].endswith("Indexer.softmax_scale x n_head^-0.5")
        # vLLM casts q and k to FP8 unrotated and runs weights_proj in the bf16 wk GEMM.
        assert (c["indexer_hadamard"]["engine"], c["indexer_hadamard"]["model"]) == (False, True)
        assert c["indexer_hadamard"]["engine_assumed"] is True, "read from the route, not observed"
        proj = c["indexer_weights_proj_dtype"]
        assert (proj["engine"], proj["model"]) == ("bf16", "fp32")
        assert convention["engine_source"].startswith(source[path])
        assert convention["model_source"] == "deepseek_v32 indexer (transformers reference)"
        assert settings["adapter"].startswith(f"vllm: layout {path} ")


# === GLM-5 whose config lacks indexer_rope_interleave =================================


@pytest.fixture(scope="module")
def glm_without_the_key(tmp_path_factory: pytest.TempPathFactory) -> Traced:
    def scenario(eng: sv.Engine) -> None:
        eng.step({"A": 2090}, new={"A": sv.prompt(2090, 1)})

    with pytest.MonkeyPatch.context() as mp:
        config = sv.hf_config("GlmMoeDsaForCausalLM", layers=1)
        return trace(mp, tmp_path_factory.mktemp("glm"), scenario, path=V32, config=config)


def test_a_glm5_config_without_the_interleave_key_shows_the_engines_neox_rope_against_the_models(
    glm_without_the_key: Traced,
) -> None:
    """vLLM reads indexer_rope_interleave with a False (NeoX) default; GLM-5's indexer is
    interleaved. The convention is recorded, the dequant shadow (the engine's own operands)
    still reproduces production, the raw shadow (the model's RoPE) departs from it."""
    t = glm_without_the_key
    convention = traced.conventions(t.run("A"))["indexer_rope"]
    assert (convention["engine"], convention["model"]) == ("neox", "interleaved")
    for row in informative(t.rows("A", "dequant")):
        assert set(row["prod_indices"]) ^ set(row["shadow_indices"]) <= set(row["shadow_boundary_indices"])
    assert statistics.mean(excluded_overlap(r) for r in informative(t.rows("A", "raw"))) < 0.3


# === what is counted, not recorded ====================================================


@pytest.mark.parametrize("path", [V32, V2])
def test_short_prefill_batches_served_by_dense_mha_are_counted_not_recorded(
    path: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A pure-prefill batch whose sequences fit in index_topk is served by dense MHA: the
    indexer returns without writing the buffer (stale on deepseek_v2, -1 on deepseek_v32)."""

    def scenario(eng: sv.Engine) -> None:
        eng.step({"A": 300}, new={"A": sv.prompt(300, 1)})
        eng.step({"A": 1, "B": 200}, new={"B": sv.prompt(200, 2)})  # a decode: the indexer runs
        eng.step({"C": 100}, new={"C": sv.prompt(100, 3)})  # the buffer holds the last step's rows

    t = trace(monkeypatch, tmp_path, scenario, path=path)
    # Only the middle step's rows: B's prefill and A's decode, in every layer.
    keys = [
        {(r["step"], r["layer"], r["token"]) for r in run["rows"]} for runs in t.runs.values() for run in runs
    ]
    assert sum(map(len, keys)) == (200 + 1) * LAYERS
    counted = {request: t.run(request)["manifest"]["counters"] for request in ("A", "B", "C")}
    assert counted["A"]["indexer_rows_dense_mha_prefill"] == 300 * LAYERS
    assert counted["C"]["indexer_rows_dense_mha_prefill"] == 100 * LAYERS
    assert "indexer_rows_dense_mha_prefill" not in counted["B"]
    assert {r["step"] for r in t.run("A")["rows"]} == {1}
    assert t.run("C")["rows"] == []
    assert recorded(t, "B").keys() == {(0, layer, p) for layer in range(LAYERS) for p in range(200)}


@pytest.mark.parametrize("path", [V32, V2])
def test_indexer_calls_outside_an_engine_step_are_counted_not_recorded(
    path: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The profile run (v1: _dummy_run's own forward; v2: execute_model(dummy_run=True),
    which skips prepare_inputs) has no request ids; the real step after it does."""

    def scenario(eng: sv.Engine) -> None:
        eng.runner._dummy_run(64, is_profile=True)
        eng.step({"A": 300}, new={"A": sv.prompt(300, 1)})

    with caplog.at_level(logging.WARNING, logger="shadowtrace"):
        t = trace(monkeypatch, tmp_path, scenario, path=path, force_mqa=True)
    assert t.counters["indexer_calls_outside_engine_steps"] == LAYERS
    assert sorted(t.runs) == ["A"]
    assert {r["step"] for r in t.run("A")["rows"]} == {0}
    lines = [r.getMessage() for r in caplog.records if "outside an engine step" in r.getMessage()]
    assert len(lines) == 1
    assert "indexer_hooks_never_fired" not in t.counters


@pytest.mark.parametrize("path", [V32, V2])
def test_steps_replayed_from_a_full_cuda_graph_are_counted_in_each_requests_run(
    path: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A FULL CUDA-graph replay (vLLM's uniform decode batches under the default
    FULL_AND_PIECEWISE mode) runs none of the model's Python: no indexer call reaches the
    hooks. Each request of such a step counts it in its own run, and one line says so; the
    steps run eagerly are recorded as before."""

    def scenario(eng: sv.Engine) -> None:
        eng.step({"A": 300, "B": 200}, new={"A": sv.prompt(300, 1), "B": sv.prompt(200, 2)})
        eng.step({"A": 1, "B": 1}, full_graph=True)
        eng.step({"A": 1, "B": 1}, full_graph=True)
        eng.step({"A": 1, "B": 1})
        eng.step({"B": 1}, full_graph=True, finished={"A"})

    with caplog.at_level(logging.WARNING, logger="shadowtrace"):
        t = trace(monkeypatch, tmp_path, scenario, path=path, force_mqa=True)
    counted = {r: t.run(r)["manifest"]["counters"].get("indexer_steps_unseen") for r in ("A", "B")}
    assert counted == {"A": 2, "B": 3}
    assert "indexer_steps_unseen" not in t.counters  # every such step had its requests' runs
    # The prompt and the one decode step that ran eagerly: its token after two replayed ones.
    assert {r["token"] for r in t.run("A")["rows"]} == {*range(300), 302}
    assert {r["step"] for r in t.run("A")["rows"]} == {0, 1}
    lines = [r.getMessage() for r in caplog.records if "indexer_steps_unseen" in r.getMessage()]
    assert len(lines) == 1
    assert "--enforce-eager" in lines[0]


def test_without_a_hooked_model_runner_no_row_is_recorded_and_one_line_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def scenario(eng: sv.Engine) -> None:
        eng.step({"A": 300}, new={"A": sv.prompt(300, 1)})
        eng.step({"A": 1})

    with caplog.at_level(logging.WARNING, logger="shadowtrace"):
        unhooked = (sv.RUNNER_V1_MODULE, sv.RUNNER_V2_MODULE)
        t = trace(monkeypatch, tmp_path, scenario, unhooked=unhooked, force_mqa=True)
    assert t.runs == {}
    assert t.counters["indexer_calls_outside_engine_steps"] == 2 * LAYERS
    lines = [r.getMessage() for r in caplog.records if "no model runner layout is hooked" in r.getMessage()]
    assert len(lines) == 1


def test_a_layout_the_adapter_was_not_written_for_is_refused_and_its_first_forward_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A release whose _sparse_indexer_and_attn takes another parameter: refused at install
    with the difference named; the model's first real forward then reaches no indexer hook,
    and one line says so."""

    def scenario(eng: sv.Engine) -> None:
        eng.step({"A": 300}, new={"A": sv.prompt(300, 1)})
        eng.step({"A": 1})

    with caplog.at_level(logging.WARNING, logger="shadowtrace"):
        t = trace(monkeypatch, tmp_path, scenario, newer_attention=True, force_mqa=True)
    why = t.disabled[f"install:{sv.V32_MODULE}"]
    assert "DeepseekV32Attention._sparse_indexer_and_attn" in why
    assert "index_group" in why
    assert t.runs == {}
    assert t.counters["indexer_hooks_never_fired"] == 1
    assert len([r for r in caplog.records if "no indexer hook fired" in r.getMessage()]) == 1


@pytest.mark.parametrize("path", [V32, V2])
def test_without_a_reachable_model_config_the_raw_shadow_is_skipped_and_counted(
    path: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The shadow's RoPE comes from the model's HF config, never from the engine; where the
    config is out of reach (attention._vllm_config, Indexer.config), the raw shadow is not
    guessed."""

    def scenario(eng: sv.Engine) -> None:
        for module in eng.model.modules():
            if hasattr(module, "_vllm_config"):
                module._vllm_config = SimpleNamespace(model_config=None)
            if isinstance(module, sv.Indexer):
                module.config = None
        eng.step({"A": 300}, new={"A": sv.prompt(300, 1)})

    with caplog.at_level(logging.WARNING, logger="shadowtrace"):
        t = trace(monkeypatch, tmp_path, scenario, path=path, force_mqa=True)
    assert {r["shadow_input"] for r in t.run("A")["rows"]} == {"dequant"}
    assert t.run("A")["manifest"]["counters"]["shadow_skipped_no_model_config"] == 300 * LAYERS
    assert len([r for r in caplog.records if "HF config is not reachable" in r.getMessage()]) == 1
    c = traced.conventions(t.run("A"))
    assert (c["indexer_rope"]["engine"], c["indexer_rope"]["model"]) == ("neox", None)
    assert (c["indexer_hadamard"]["engine"], c["indexer_hadamard"]["model"]) == (False, None)


# === failures stay in the tracer ======================================================


def test_deepseek_v4_op_calls_with_k_none_return_the_engines_result_and_record_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """DeepSeek-V4 calls SparseAttnIndexer(hidden, q_quant, None, weights), q_quant an FP8
    tensor or an FP4 (values, scales) tuple, on a compressed cache it writes itself."""
    fake = sv.register(monkeypatch)
    sess = traced.start(tmp_path)
    try:
        eng = sv.Engine(fake, path=V2, force_mqa=True)
        metadata, _ = eng.layout({"V4": 300}, new={"V4": sv.prompt(300, 9)})
        prefix = "model.layers.0.self_attn.indexer.k_cache"
        gen = torch.Generator().manual_seed(4)
        keys = torch.randn(300, sv.D, generator=gen)
        codes, scales = sv.ue8m0_quantize(keys)
        q8 = torch.randn(300, sv.H, sv.D, generator=gen).to(torch.float8_e4m3fn)
        weights, hidden = torch.rand(300, sv.H, generator=gen), torch.randn(300, sv.HIDDEN, generator=gen)
        results = []
        for cls in (fake[sv.OP_MODULE].SparseAttnIndexer, sv.SparseAttnIndexer):  # traced, then not
            cache = sv.DeepseekV32IndexerCache(sv.D + 4, torch.uint8, prefix, eng.vllm_config.cache_config)
            sv.cache_write(cache.kv_cache, metadata[prefix].slot_mapping, codes, scales)
            op = cls(cache, 128, "ue8m0", sv.TOPK, sv.D, sv.MAX_POSITION, sv.MAX_TOKENS,
                     torch.zeros(sv.MAX_TOKENS, sv.TOPK, dtype=torch.int32), skip_k_cache_insert=True,
                     compress_ratio=4)  # fmt: skip
            with sv.set_forward_context(metadata, eng.vllm_config):
                out = op(hidden, q8, None, weights)[:300].clone()
                out_fp4 = op(hidden, (q8, torch.ones(300, sv.H)), None, weights)[:300].clone()
            results.append((out, out_fp4))
        counters, disabled, errors = dict(sess.counters), dict(sess.disabled), sess.errors
    finally:
        traced.stop()
    (traced_out, traced_fp4), (plain_out, plain_fp4) = results
    assert torch.equal(traced_out, plain_out)
    assert torch.equal(traced_fp4, plain_fp4)
    assert disabled == {}
    assert errors == 0
    assert traced.runs(tmp_path) == []
    assert "hook_errors" not in counters


@pytest.mark.parametrize("path", [V32, V2])
def test_a_failing_raw_shadow_leaves_production_and_dequant_rows_recorded_and_counted(
    path: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def planted(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("planted raw shadow failure")

    monkeypatch.setattr(engine, "raw_qkw", planted)

    def scenario(eng: sv.Engine) -> None:
        eng.step({"A": 300}, new={"A": sv.prompt(300, 1)})

    t = trace(monkeypatch, tmp_path, scenario, path=path, force_mqa=True)
    run = t.run("A")
    assert {r["shadow_input"] for r in run["rows"]} == {"dequant"}
    want = {(0, layer, p): rows for layer in range(LAYERS) for p, rows in expected(t, "A", 0, layer).items()}
    assert recorded(t, "A") == want
    assert len(t.rows("A", "dequant")) == 300 * LAYERS
    assert run["manifest"]["counters"]["hook_errors"] >= 1
    assert any("shadow_raw" in key for key in t.disabled)
    assert f"install:{sv.V32_MODULE}" not in t.disabled


@pytest.mark.parametrize("path", [V32, V2])
def test_an_out_of_memory_error_inside_a_capture_never_reaches_the_engine(
    path: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def planted(*args: Any, **kwargs: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (planted)")

    monkeypatch.setattr(engine.EngineTracer, "record", planted)
    outputs = []

    def scenario(eng: sv.Engine) -> None:
        outputs.append(eng.step({"A": 300}, new={"A": sv.prompt(300, 1)}))
        outputs.append(eng.step({"A": 1}))

    t = trace(monkeypatch, tmp_path, scenario, path=path, force_mqa=True)
    assert "OutOfMemoryError" in t.disabled["vllm:indexer"]
    # The same steps with tracing off (the classes stay patched; the session is gone).
    twin = sv.Engine(t.fake, path=path, force_mqa=True)
    plain = [twin.step({"A": 300}, new={"A": sv.prompt(300, 1)}), twin.step({"A": 1})]
    assert all(torch.equal(a, b) for a, b in zip(outputs, plain, strict=True))
    assert twin.production.keys() == t.engine.production.keys()
    assert all(torch.equal(twin.production[k][1], t.engine.production[k][1]) for k in twin.production)


# === CUDA graphs ======================================================================


def test_a_breakable_cuda_graph_replay_records_production_through_the_redecorated_hook(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM >= 0.29 serves these models with breakable CUDA graphs: a replay runs only the
    eager segments, calling what @eager_break_during_capture wrapped. A plain wrapper around
    the decorated method would run once at capture and never on replay."""
    new = {"A": sv.prompt(300, 1), "B": sv.prompt(200, 2)}

    def scenario(eng: sv.Engine) -> None:
        eng.capture({"A": 300, "B": 200}, new=new)
        eng.step({"A": 300, "B": 200})

    t = trace(monkeypatch, tmp_path, scenario, path=V32, force_mqa=True)
    assert t.counters["captures_skipped_cuda_graph"] == LAYERS
    for request, length in (("A", 300), ("B", 200)):
        want = {
            (0, layer, p): rows
            for layer in range(LAYERS)
            for p, rows in expected(t, request, 0, layer).items()
        }
        assert recorded(t, request) == want
        assert {r["shadow_input"] for r in t.run(request)["rows"]} == {None}
        assert t.run(request)["manifest"]["counters"]["shadow_skipped_cudagraph_replay"] == length * LAYERS


# === preemption =======================================================================


def test_a_preempted_request_continues_in_a_run_segment_of_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def scenario(eng: sv.Engine) -> None:
        eng.step({"A": 300, "B": 200}, new={"A": sv.prompt(300, 1), "B": sv.prompt(200, 2)})
        eng.step({"B": 1}, preempted={"A"})
        eng.step({"A": 300, "B": 1}, new={"A": sv.prompt(300, 1)})  # recomputed from its first token

    t = trace(monkeypatch, tmp_path, scenario, force_mqa=True)
    first, second = t.runs["A"]
    assert first["manifest"]["run_id"].startswith("A-rank0-")
    assert second["manifest"]["run_id"].startswith("A-s1-rank0-")
    assert second["manifest"]["counters"]["request_resumed"] == 1
    assert {(r["step"], r["token"]) for r in second["rows"] if r["shadow_input"] is None} <= {
        (0, p) for p in range(300)
    }
    assert len(t.runs["B"]) == 1


def test_a_request_served_from_the_prefix_cache_is_tagged_a_hit_and_a_fresh_one_a_miss(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Context 004: E's prompt starts with A's first 256 tokens, whose KV blocks it reuses;
    its first rows start at position 256. Engines give no token ids: `analyze` cannot pair
    the two by prompt and lists the hit as unpaired, saying why."""
    shared = sv.prompt(300, 1)

    def scenario(eng: sv.Engine) -> None:
        eng.step({"A": 300}, new={"A": shared})
        eng.step({"A": 1, "E": 44 + 40}, new={"E": shared[:256] + sv.prompt(84, 5)}, cached={"E": "A"})

    t = trace(monkeypatch, tmp_path, scenario, force_mqa=True)
    a, e = t.run("A")["manifest"], t.run("E")["manifest"]
    assert a["tags"]["cache"] == "miss"
    assert "cached_prefix_tokens" not in a["settings"]
    assert e["tags"]["cache"] == "hit"
    assert e["settings"]["cached_prefix_tokens"] == 256
    assert {r["token"] for r in t.run("E")["rows"] if r["shadow_input"] is None} == set(range(256, 340))
    # the prefix's keys live in the engine's cache: its rows are production only, counted
    assert e["counters"]["shadow_skipped_rows_without_keys"] == 84 * LAYERS
    assert e["prompt"]["length"] == 340


# === vLLM 0.34 ShardQ at TP = 2 =======================================================


def _sharded_serving(eng: sv.Engine) -> None:
    """A prefill step ShardQ shards (3700 tokens after no decode, A longer than index_topk),
    then decodes of both, which it does not."""
    eng.step({"A": 3000, "B": 700}, new={"A": sv.prompt(3000, 1), "B": sv.prompt(700, 2)})
    eng.step({"A": 1, "B": 1})


def _trace_rank(
    monkeypatch: pytest.MonkeyPatch, out: Path, rank: int | None, misread: bool = False
) -> Traced:
    """One tensor-parallel rank of a 0.34 engine with ShardQ (rank None: TP = 1). With
    `misread`, the adapter reads the buffer in global row order, as it did before 0.34."""
    with pytest.MonkeyPatch.context() as mp:
        if rank is not None:
            mp.setenv("RANK", str(rank))
            mp.setenv("WORLD_SIZE", "2")
        if misread:
            mp.setattr(vllm_adapter, "_shardq_gather", lambda prefix: None)
        return trace(mp, out, _sharded_serving, version="0.34.0", shardq=None if rank is None else (rank, 2))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Traced]:
    with pytest.MonkeyPatch.context() as mp:
        return {rank: _trace_rank(mp, tmp_path_factory.mktemp(f"rank{rank}"), rank) for rank in (None, 0, 1)}


def prod_rows(t: Traced, request: str) -> dict[tuple[int, int, int], list[int]]:
    return {
        (r["step"], r["layer"], r["token"]): sorted(r["prod_indices"])
        for run in t.runs[request]
        for r in run["rows"]
        if r["shadow_input"] is None or r["shadow_input"] == "dequant"
    }


def test_shardq_rows_are_put_back_on_their_tokens_and_the_ranks_together_record_every_row(
    sharded: dict[Any, Traced],
) -> None:
    """Each rank scored its zigzag share of the prefill and wrote it packed (0.34's
    sparse_attn_indexer): the adapter records each packed row on its own token, and the two
    ranks' rows together are exactly what one unsharded engine computes, row for row."""
    whole = sharded[None]
    for request in ("A", "B"):
        union: dict[tuple[int, int, int], list[int]] = {}
        for rank in (0, 1):
            t = sharded[rank]
            mine = prod_rows(t, request)
            # the engine's own rows of this rank, un-permuted by the stand-in from its gather
            for layer in range(LAYERS):
                for p, keys in expected(t, request, 0, layer).items():
                    assert mine[(0, layer, p)] == keys, (request, rank, layer, p)
            assert not set(mine) & {k for k in union if k[0] == 0}, "a prefill row on both ranks"
            union.update(mine)
        assert union == prod_rows(whole, request)


def test_shardq_runs_count_the_rows_another_rank_scored_and_are_no_cache_hit(
    sharded: dict[Any, Traced],
) -> None:
    tokens = {"A": 3000, "B": 700}
    for rank in (0, 1):
        t = sharded[rank]
        for request, n in tokens.items():
            (run,) = t.runs[request]
            manifest = run["manifest"]
            assert manifest["run_id"].endswith(f"-rank{rank}-pid{os.getpid()}")
            assert manifest["engine"]["version"] == "0.34.0"
            assert "untested_engine_version" not in manifest["settings"]
            assert manifest["tags"]["cache"] == "miss"
            mine = len({r["token"] for r in run["rows"] if r["step"] == 0 and r["layer"] == 0})
            assert 0 < mine < n
            assert manifest["counters"]["topk_rows_on_other_ranks"] == (n - mine) * LAYERS


def test_shardq_shadows_score_every_rank_row_against_the_keys_from_position_0(
    sharded: dict[Any, Traced],
) -> None:
    """Rank 1 holds A's middle half (positions 750 to 2249): its rows past index_topk are
    informative, and their shadows see all of A's keys, so they are the unsharded run's up
    to fp32 summation order (the rank scores fewer query rows at once): the same k-th score
    to 1e-5, the same selection but for keys within the boundary band of that score."""
    whole = {(r["layer"], r["token"]): r for r in sharded[None].rows("A", "dequant")}
    rows = informative(sharded[1].rows("A", "dequant"))
    assert {r["token"] for r in rows} == set(range(2048, 2250))
    for row in rows:
        same = whole[(row["layer"], row["token"])]
        assert row["shadow_kth_score"] == pytest.approx(same["shadow_kth_score"], rel=1e-5)
        moved = set(row["shadow_indices"]) ^ set(same["shadow_indices"])
        assert moved <= set(row["shadow_boundary_indices"]) | set(same["shadow_boundary_indices"])


def test_the_capture_self_check_passes_the_shardq_reading_and_flags_the_global_order_one(
    sharded: dict[Any, Traced], tmp_path: Path
) -> None:
    """Issue 27's acceptance: read in global row order (the adapter before 0.34), each rank's
    packed rows land on other tokens and other requests; the self-check says so on every
    informative row. Read through the gather indices, every row agrees."""
    for rank in (0, 1):
        check = sharded[rank].run("A")["manifest"]["settings"]["capture_check"]
        assert all(layer["disagree"] == 0 for layer in check["layers"].values()), check
        assert sum(layer["rows"] for layer in check["layers"].values()) > 0
    with pytest.MonkeyPatch.context() as mp:
        old = _trace_rank(mp, tmp_path, 1, misread=True)
    check = old.run("A")["manifest"]["settings"]["capture_check"]
    for layer in range(LAYERS):
        entry = check["layers"][str(layer)]
        assert entry["rows"] == 3000 - 2048
        assert entry["disagree"] == entry["rows"], entry


def test_a_shared_indexer_layer_is_counted_and_the_others_recorded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """GLM-5.2's shared layers (honoured by vLLM 0.34) have no indexer of their own and reuse
    an earlier layer's selection: nothing to record there, but never silently."""

    def scenario(eng: sv.Engine) -> None:
        eng.model.model.layers[1].self_attn.indexer = None  # as indexer_types "shared" builds it
        eng.step({"A": 300}, new={"A": sv.prompt(300, 1)})
        eng.step({"A": 1})

    t = trace(monkeypatch, tmp_path, scenario, version="0.34.0", force_mqa=True)
    assert t.counters[vllm_adapter.SHARED_LAYER] == 2
    run = t.run("A")
    assert {r["layer"] for r in run["rows"]} == {0}
    assert run["manifest"]["counters"][f"process.{vllm_adapter.SHARED_LAYER}"] == 2


@pytest.mark.parametrize("logits_dtype", ["bfloat16", "float32"])
def test_the_logits_dtype_and_top_k_backend_of_0_34_are_conventions_and_bf16_logits_widen_the_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, logits_dtype: str
) -> None:
    """vLLM 0.34 reduces and ranks DeepSeek-V3.2's indexer logits in bf16 on SM100 (its
    `indexer_logits_dtype`, resolved per model), in fp32 elsewhere. The run records the
    engine's dtype beside the reference's fp32, and the decode top-k backend; with bf16
    logits the capture self-check allows their rounding, and still finds every row
    consistent (the stand-in's bf16 logits round at every head)."""

    def scenario(eng: sv.Engine) -> None:
        eng.step({"A": 2600}, new={"A": sv.prompt(2600, 1)})

    t = trace(monkeypatch, tmp_path, scenario, version="0.34.0", logits_dtype=logits_dtype)
    manifest = t.run("A")["manifest"]
    conventions = {c["name"]: c for c in manifest["conventions"]}
    bf16 = logits_dtype == "bfloat16"
    logits = conventions["indexer_logits_dtype"]
    assert (logits["engine"], logits["model"]) == ("bf16" if bf16 else "fp32", "fp32")
    assert logits["engine_source"] == "vllm 0.34.0 SparseAttnIndexer.logits_dtype"
    backend = conventions["indexer_topk_backend"]
    assert (backend["engine"], backend["model"]) == ("auto", None)
    check = manifest["settings"]["capture_check"]
    assert check["tolerance"] == (engine.BF16_LOGITS_CHECK_TOLERANCE if bf16 else selection.CHECK_TOLERANCE)
    assert [v["disagree"] for v in check["layers"].values()] == [0] * LAYERS
    assert all(v["rows"] == 2600 - 2048 for v in check["layers"].values())


def test_releases_before_0_34_record_no_logits_dtype(serving: Traced) -> None:
    names = {c["name"] for c in serving.run("A")["manifest"]["conventions"]}
    assert "indexer_logits_dtype" not in names
    assert "indexer_topk_backend" not in names


def test_the_standalone_cpu_runner_of_0_34_is_named_in_the_line_it_causes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM 0.34 on CPUs runs StandaloneCPUModelRunner (v1/worker/cpu_worker.py), which is no
    GPUModelRunner: its steps publish no request ids. The line says which runner, not
    "outside an engine step"."""

    def scenario(eng: sv.Engine) -> None:
        standalone = ModuleType(vllm_adapter.CPU_RUNNER_MODULE)
        monkeypatch.setitem(sys.modules, vllm_adapter.CPU_RUNNER_MODULE, standalone)
        eng.runner._dummy_run(300)  # a forward no hooked runner published a step for

    with caplog.at_level(logging.WARNING, logger="shadowtrace"):
        t = trace(monkeypatch, tmp_path, scenario, version="0.34.0", force_mqa=True)
    assert t.runs == {}
    assert t.counters[vllm_adapter.OUTSIDE] == LAYERS
    messages = [r.getMessage() for r in caplog.records]
    assert sum("standalone CPU model runner" in m for m in messages) == 1, messages
    assert not any("outside an engine step" in m for m in messages)


@pytest.mark.parametrize(
    ("module", "cls", "model"),
    [
        ("vllm.models.glm5next", "Glm5NextForCausalLM", "GLM-5.3-Flash"),
        ("vllm.models.deepseek_v4", "DeepseekV4ForCausalLM", "DeepSeek-V4"),
    ],
)
def test_models_whose_indexer_no_layout_hooks_say_so_once_when_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture, module: str, cls: str,
    model: str,
) -> None:  # fmt: skip
    """vLLM 0.34 builds GLM-5.3-Flash (its own indexer over pooled keys) and DeepSeek-V4 (an
    op call without DSA keys, said only when eager) from packages no layout hooks: building
    one is counted and said once, compiled or not."""
    model_cls = type(cls, (torch.nn.Module,), {})
    common.register(monkeypatch, module, **{cls: model_cls})

    def scenario(eng: sv.Engine) -> None:
        model_cls()
        model_cls()

    with caplog.at_level(logging.WARNING, logger="shadowtrace"):
        t = trace(monkeypatch, tmp_path, scenario, version="0.34.0", force_mqa=True)
    assert t.counters["models_refused"] == 2
    lines = [r.getMessage() for r in caplog.records if f"{module}.{cls} is not traced" in r.getMessage()]
    assert len(lines) == 1, lines
    assert model in lines[0]
    assert "vLLM 0.34.0" in lines[0]


def test_unsharding_puts_each_packed_row_on_its_token_and_cuts_requests_to_the_rows_this_rank_scored() -> (
    None
):
    """By hand: 2 decode rows, then requests A (rows 2..9) and B (10..13); this rank scored
    A's rows 2, 3, 8, 9 and B's 10, 13, packed after the decode rows."""
    gather = torch.tensor([0, 1, 2, 3, 8, 9, 10, 13], dtype=torch.int32)
    packed = torch.full((14, 2), -1, dtype=torch.int32)
    packed[: len(gather), 0] = gather  # each packed row names the token it belongs to
    requests = [
        engine.Request(key="d0", start=0, rows=1, prefix=40, prefill=False),
        engine.Request(key="d1", start=1, rows=1, prefix=50, prefill=False),
        engine.Request(key="A", start=2, rows=8, prefix=0, skipped={"some_reason": 8}),
        engine.Request(key="B", start=10, rows=4, prefix=100),
    ]
    rows, pieces = vllm_adapter._unshard_rows(packed, gather, requests)
    assert rows[:, 0].tolist() == [0, 1, 2, 3, -1, -1, -1, -1, 8, 9, 10, -1, -1, 13]
    got = [(p.key, p.start, p.rows, p.prefix, p.first_row, p.skipped, p.counts) for p in pieces]
    assert got == [
        ("d0", 0, 1, 40, None, {}, {}),
        ("d1", 1, 1, 50, None, {}, {}),
        ("A", 2, 2, 0, 2, {"some_reason": 2}, {"topk_rows_on_other_ranks": 4}),
        ("A", 8, 2, 6, 2, {"some_reason": 2}, {}),
        ("B", 10, 1, 100, 10, {}, {"topk_rows_on_other_ranks": 2}),
        ("B", 13, 1, 103, 10, {}, {}),
    ]
    # A's second piece sees A's keys from its first row: the shadows score from position 0.
    assert pieces[3].key_rows() == slice(2, 10)
    assert pieces[5].key_rows() is None  # B's rows started at position 100: earlier keys not here
