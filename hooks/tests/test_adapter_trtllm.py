"""The TensorRT-LLM adapter on the stand-in engine (standins/trtllm.py), which replays the
PyTorch backend's call sequences: pre_indexer_proj on the padded batch with [1, T_pad]
positions, the K cache written once per layer, then one forward_from_projected call for the
context rows and another for the generation rows; one metadata object for every step, a new
KVCacheParams per step. Production top-k is the stand-in's own (DeepGEMM logits, TensorRT-LLM's
fused_cat_fp8), never the hooks' numerics.

The serving sequence most tests read (GLM-5 config, two indexer layers, engine request ids):

    step 0: context A (2100 tokens) and B (2080), one context call, B's rows from 2100 on
    step 1: context C (400) + generation A, B          (a mixed batch: two calls per layer)
    step 2: generation A, B, C
    step 3: context D, first chunk (300) + generation B, C    (A absent)
    step 4: context D, second chunk (200, 300 cached) + generation A, B, C    (A is back)
"""

import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import traced
from shadowtrace_hooks import session
from shadowtrace_hooks.adapters import engine as core
from standins import common
from standins import trtllm as st

A, B, C, D = 7001, 7002, 7003, 7004
PROMPTS = {A: st.TOPK + 52, B: st.TOPK + 32, C: 400, D: 500}
GENERATED = 4
# A short prompt selects from few more keys than index_topk, so every selection overlaps
# heavily; a config with a smaller index_topk discriminates conventions in a short prompt.
SMALL_TOPK, SMALL_PROMPT = 256, 600


def serve(executor: st.Executor) -> list[Any]:
    """The module docstring's sequence; returns the engine's outputs of every step."""
    for rid, n in PROMPTS.items():
        executor.add(rid, n + GENERATED)
    return [
        executor.step(context=[(A, PROMPTS[A]), (B, PROMPTS[B])]),
        executor.step(context=[(C, PROMPTS[C])], generation=[A, B]),
        executor.step(generation=[A, B, C]),
        executor.step(context=[(D, 300)], generation=[B, C]),
        executor.step(context=[(D, 200)], generation=[A, B, C]),
    ]


def jaccard(row: dict) -> float:
    a, b = set(row["prod_indices"]), set(row["shadow_indices"])
    return len(a & b) / len(a | b)


def mean_jaccard(runs: list[dict], shadow: str) -> float:
    """Over informative rows (more visible keys than k) only."""
    values = [
        jaccard(r)
        for run in runs
        for r in run["rows"]
        if r["shadow_input"] == shadow and r["visible"] > r["k"]
    ]
    assert values, f"no informative {shadow} rows"
    return sum(values) / len(values)


def fingerprint(indices: list[int]) -> tuple[int, int, int]:
    """As the stand-in logs its production rows."""
    return len(indices), sum(indices), sum(i * i for i in indices)


def by_request(runs: list[dict]) -> dict[str, dict]:
    return {run["manifest"]["tags"]["request"]: run for run in runs}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The serving sequence, traced once on the new module path."""
    out = tmp_path_factory.mktemp("trtllm")
    with pytest.MonkeyPatch.context() as mp:
        engine = st.register(mp, st.NEW)
        sess = traced.start(out)
        model = engine.build(st.glm5_config(layers=2))
        executor = st.Executor(model)
        calls: list[SimpleNamespace] = []
        record = core.EngineTracer.record

        def spy(self: core.EngineTracer, call: core.IndexerCall) -> None:
            md = executor.metadata
            indexer = model.layers[call.layer].mqa.indexer
            calls.append(SimpleNamespace(step=executor.steps, call=call, intermediates=indexer.intermediates,
                                         ctx_tokens=md.num_ctx_tokens, tokens=md.num_tokens))  # fmt: skip
            record(self, call)

        mp.setattr(core.EngineTracer, "record", spy)
        try:
            serve(executor)
            indexers = [layer.mqa.indexer for layer in model.layers]
            state = SimpleNamespace(
                disabled=dict(sess.disabled), counters=dict(sess.counters), calls=calls,
                logs=[ix.log for ix in indexers], rope_calls=[ix.rotary_emb.calls for ix in indexers],
                layout=getattr(engine.indexer_module, "_shadowtrace_layout", None),
            )  # fmt: skip
        finally:
            traced.stop()
    state.runs = traced.runs(out)
    return state


# --- issue 12: in-flight batches, steps from the engine --------------------------------------


def test_a_mixed_batch_keeps_one_run_per_request_with_the_engines_steps(served: SimpleNamespace) -> None:
    assert served.disabled == {}
    runs = by_request(served.runs)
    assert sorted(runs) == [f"trtllm-{rid}" for rid in (A, B, C, D)]
    assert not any("-s1-" in run["manifest"]["run_id"] for run in served.runs)
    # The steps each request took part in, numbered per request; A skipped engine step 3.
    expected = {
        A: [list(range(PROMPTS[A])), [PROMPTS[A]], [PROMPTS[A] + 1], [PROMPTS[A] + 2]],
        B: [list(range(PROMPTS[B])), [PROMPTS[B]], [PROMPTS[B] + 1], [PROMPTS[B] + 2], [PROMPTS[B] + 3]],
        C: [list(range(PROMPTS[C])), [PROMPTS[C]], [PROMPTS[C] + 1], [PROMPTS[C] + 2]],
        D: [list(range(300)), list(range(300, 500))],
    }
    for rid, steps in expected.items():
        rows = runs[f"trtllm-{rid}"]["rows"]
        for layer in (0, 1):
            got: dict[int, set[int]] = {}
            for r in rows:
                if r["layer"] == layer:
                    got.setdefault(r["step"], set()).add(r["token"])
            assert [sorted(got[s]) for s in sorted(got)] == steps, (rid, layer)
        manifest = runs[f"trtllm-{rid}"]["manifest"]
        assert manifest["counters"].get("hook_errors", 0) == 0
        assert manifest["prompt"]["length"] == PROMPTS[rid]


def test_generation_rows_record_the_engines_own_topk_for_their_request_and_position(
    served: SimpleNamespace,
) -> None:
    checked = 0
    for rid, run in by_request(served.runs).items():
        key = int(rid.removeprefix("trtllm-"))
        for r in run["rows"]:
            if r["shadow_input"] is None or r["token"] >= PROMPTS[key] - 8:
                assert fingerprint(r["prod_indices"]) == served.logs[r["layer"]][(key, r["token"])], (rid, r)
                checked += 1
    assert checked > 0


def test_the_generation_call_takes_the_batch_rows_after_the_context_tokens(served: SimpleNamespace) -> None:
    """In the mixed steps (1 and 4), per layer: the context call scores batch rows
    [0, num_ctx_tokens), the generation call rows [num_ctx_tokens, num_tokens) of the same
    full-batch intermediates, its output rows starting at 0."""
    for step, ctx_rows, gens in ((1, PROMPTS[C], (A, B)), (4, 200, (A, B, C))):
        seen = [c for c in served.calls if c.step == step]
        assert len(seen) == 4  # two layers, two phases
        for layer in (0, 1):
            ctx_call, gen_call = (c for c in seen if c.call.layer == layer)
            q8, k8, _, weights, _ = ctx_call.intermediates
            assert gen_call.intermediates is ctx_call.intermediates
            tokens = ctx_rows + len(gens)
            assert (ctx_call.ctx_tokens, ctx_call.tokens) == (ctx_rows, tokens)
            ctx, gen = ctx_call.call, gen_call.call
            assert [(r.start, r.rows, r.prefill) for r in gen.requests] == [
                (i, 1, False) for i in range(len(gens))
            ]
            assert [r.key for r in gen.requests] == [f"trtllm-{rid}" for rid in gens]
            assert gen.prod_topk.shape[0] == len(gens)
            assert torch.equal(gen.fp8.q8.view(torch.uint8), q8[ctx_rows:tokens].view(torch.uint8))
            assert torch.equal(gen.fp8.weights, weights[ctx_rows:tokens])
            assert gen.fp8.k_offset == ctx_rows
            assert torch.equal(ctx.fp8.q8.view(torch.uint8), q8[:ctx_rows].view(torch.uint8))
            assert torch.equal(ctx.fp8.weights, weights[:ctx_rows])
            assert ctx.fp8.k_offset == 0
            for call in (ctx, gen):
                assert torch.equal(call.fp8.k8.view(torch.uint8), k8.view(torch.uint8))


def test_generation_rows_get_production_only_and_are_counted(served: SimpleNamespace) -> None:
    runs = by_request(served.runs)
    for rid in (A, B, C):
        run = runs[f"trtllm-{rid}"]
        generated = [r for r in run["rows"] if r["token"] >= PROMPTS[rid]]
        assert generated
        assert {r["shadow_input"] for r in generated} == {None}
        assert run["manifest"]["counters"]["shadow_skipped_rows_without_keys"] == len(generated)
    d = runs[f"trtllm-{D}"]
    assert d["manifest"]["counters"]["shadow_skipped_rows_without_keys"] == 2 * 200  # the second chunk


# --- issue 12: the raw shadow's positions and RoPE -------------------------------------------


def test_the_raw_shadow_stays_close_to_production_with_positions_of_every_request(
    served: SimpleNamespace,
) -> None:
    runs = by_request(served.runs)
    # B's rows start at batch row 2100 of step 0: its positions come from the flattened
    # [1, T_pad] position_ids, not from its row numbers.
    for rid in (A, B):
        assert mean_jaccard([runs[f"trtllm-{rid}"]], "raw") > 0.9, rid
    assert served.counters.get("shadow_skipped_stale_stash", 0) == 0


def test_the_engines_in_place_rope_is_called_by_the_engine_alone(served: SimpleNamespace) -> None:
    # One call per layer and step: pre_indexer_proj's own. The shadow takes RoPE from the
    # model's config; the flashinfer kernel would rotate in place and refuses fp32.
    assert served.rope_calls == [5, 5]


def test_the_manifest_records_the_engines_indexer_rope_convention_next_to_the_models(
    served: SimpleNamespace,
) -> None:
    for run in served.runs:
        settings = run["manifest"]["settings"]
        assert "conventions" not in settings
        c = traced.conventions(run)
        assert list(c) == [
            "indexer_rope", "indexer_hadamard", "indexer_head_weight_scale", "indexer_weights_proj_dtype",
            "indexer_short_seq_skip", "indexer_topk_backend",
        ]  # fmt: skip
        scale = c["indexer_head_weight_scale"]
        assert scale["engine"] == scale["model"] == st.D**-0.5 * st.H**-0.5
        assert scale["engine_source"].endswith("Indexer.weight_scale_factor")
        convention = c["indexer_rope"]
        assert convention["engine"] == convention["model"] == "interleaved"
        assert "glm_moe_dsa" in convention["model_source"]
        assert "rotary_emb.is_neox" in convention["engine_source"]
        # GLM-5 publishes no reference FP8 indexer: no Hadamard value to get wrong.
        assert (c["indexer_hadamard"]["engine"], c["indexer_hadamard"]["model"]) == (False, None)
        assert "PR #11899" in c["indexer_hadamard"]["engine_source"]
        # Known of the layout, not observed in the engine: recorded as an assumption.
        assert c["indexer_hadamard"]["engine_assumed"] is True
        assert c["indexer_hadamard"]["engine_source"].startswith("assumed from ")
        assert "engine_assumed" not in c["indexer_rope"], "the RoPE layout is read from the engine"
        assert (c["indexer_weights_proj_dtype"]["engine"], c["indexer_weights_proj_dtype"]["model"]) == (
            "fp32",
            "fp32",
        )
        assert settings["adapter"].startswith(f"tensorrt_llm: layout {served.layout.name}")


def test_the_dequant_shadow_reproduces_production_up_to_ties_at_the_kth_score(
    served: SimpleNamespace,
) -> None:
    rows = [r for run in served.runs for r in run["rows"] if r["shadow_input"] == "dequant"]
    informative = [r for r in rows if r["visible"] > r["k"]]
    assert len(informative) > 100
    exact = 0
    for r in rows:
        differ = set(r["prod_indices"]) ^ set(r["shadow_indices"])
        exact += not differ
        # Members only one path selected lie within the boundary band of the k-th score.
        assert differ <= set(r["shadow_boundary_indices"] or []), (r["token"], sorted(differ))
    assert exact >= 0.99 * len(rows)


def test_request_runs_are_named_by_the_engines_request_ids(served: SimpleNamespace) -> None:
    for run in served.runs:
        manifest = run["manifest"]
        assert manifest["engine"]["name"] == "tensorrt_llm"
        assert manifest["engine"]["version"] == st.VERSION
        assert manifest["model"]["architecture"] == "glm_moe_dsa"
        assert manifest["run_id"].startswith(manifest["tags"]["request"] + "-rank")


# --- issue 12: both module paths ---------------------------------------------------------------


def short_run(
    monkeypatch: pytest.MonkeyPatch, out: Path, path: str = st.NEW, *, config: Any = None, **options: Any
) -> tuple[st.StandIn, st.Executor]:
    engine = st.register(monkeypatch, path)
    traced.start(out)
    executor = st.Executor(engine.build(config or st.glm5_config(layers=2), **options))
    return engine, executor


@pytest.mark.parametrize("path", [st.OLD, st.NEW], ids=["attention_backend", "attention.backends"])
def test_both_module_paths_are_hooked_and_traced(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, path: str
) -> None:
    engine, executor = short_run(monkeypatch, tmp_path, path)
    try:
        executor.add(A, 48)
        executor.add(B, 40)
        executor.step(context=[(A, 40)])
        executor.step(context=[(B, 32)], generation=[A])
        layout = engine.indexer_module._shadowtrace_layout
        disabled = dict(session.current().disabled)  # type: ignore[union-attr]
    finally:
        traced.stop()
    assert disabled == {}
    assert layout.name == {st.OLD: "attention_backend", st.NEW: "attention.backends"}[path]
    assert engine.modeling._shadowtrace_layout.name == "model"
    runs = by_request(traced.runs(tmp_path))
    assert sorted(runs) == [f"trtllm-{A}", f"trtllm-{B}"]
    assert {r["step"] for r in runs[f"trtllm-{A}"]["rows"]} == {0, 1}
    assert {r["shadow_input"] for r in runs[f"trtllm-{A}"]["rows"]} == {"raw", "dequant", None}


# --- issue 12: request ids, beam search, padding -----------------------------------------------


def test_beam_search_and_cuda_graph_padding_rows_are_counted_and_capture_goes_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, executor = short_run(monkeypatch, tmp_path)
    try:
        executor.add(A, 48)
        executor.step(context=[(A, 40)], dummies=2)
        executor.step(generation=[A], beams=2)  # request_ids holds A once for two sequences
        executor.step(generation=[A], dummies=3)
        sess = session.current()
        assert sess is not None
        disabled, counters = dict(sess.disabled), dict(sess.counters)
    finally:
        traced.stop()
    assert disabled == {}
    assert counters["rows_skipped_beam_search"] == 2 * 2  # two rows, two layers
    assert counters["rows_skipped_dummy_requests"] == 2 * (2 + 3)
    (run,) = traced.runs(tmp_path)
    assert run["manifest"]["tags"]["request"] == f"trtllm-{A}"
    assert sorted({(r["step"], r["token"]) for r in run["rows"] if r["token"] >= 40}) == [(1, 41)]


# --- the model's config: RoPE and conventions ---------------------------------------------------


def small(config: SimpleNamespace) -> SimpleNamespace:
    config.index_topk = SMALL_TOPK
    return config


def one_prompt(
    monkeypatch: pytest.MonkeyPatch, out: Path, config: SimpleNamespace, **options: Any
) -> list[dict]:
    _, executor = short_run(monkeypatch, out, config=config, **options)
    try:
        executor.add(A, SMALL_PROMPT)
        executor.step(context=[(A, SMALL_PROMPT)])
    finally:
        traced.stop()
    return traced.runs(out)


def test_an_engine_with_neox_indexer_rope_on_glm5_is_traced_and_diverges(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    right = one_prompt(monkeypatch, tmp_path / "right", small(st.glm5_config(layers=1)))
    wrong = one_prompt(monkeypatch, tmp_path / "wrong", small(st.glm5_config(layers=1)), interleave=False)
    convention = traced.conventions(wrong[0])["indexer_rope"]
    assert (convention["engine"], convention["model"]) == ("neox", "interleaved")
    assert mean_jaccard(right, "raw") > 0.9
    assert mean_jaccard(wrong, "raw") < mean_jaccard(right, "raw") - 0.2
    # The dequant shadow scores the engine's own operands, convention included.
    assert mean_jaccard(wrong, "dequant") > 0.99


def test_deepseek_v32_takes_half_split_yarn_rope_from_its_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    runs = one_prompt(monkeypatch, tmp_path, small(st.deepseek_v32_config(layers=1)))
    c = traced.conventions(runs[0])
    assert (c["indexer_rope"]["engine"], c["indexer_rope"]["model"]) == ("neox", "neox")
    # DeepSeek-V3.2's reference rotates q and k before FP8; TensorRT-LLM does not.
    assert (c["indexer_hadamard"]["engine"], c["indexer_hadamard"]["model"]) == (False, True)
    assert runs[0]["manifest"]["model"]["architecture"] == "deepseek_v32"
    assert mean_jaccard(runs, "raw") > 0.9


def test_bf16_indexer_weights_feed_the_raw_shadow(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRTLLM_DSA_INDEXER_BF16", "1")
    runs = one_prompt(monkeypatch, tmp_path, small(st.glm5_config(layers=1)))
    assert mean_jaccard(runs, "raw") > 0.9


def test_without_the_models_config_the_raw_shadow_is_skipped_and_counted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = st.register(monkeypatch, st.NEW)
    # A model class the adapter does not hook: its config never reaches the indexer hooks.
    monkeypatch.delitem(sys.modules, st.MODELING)
    traced.start(tmp_path)
    executor = st.Executor(engine.build(st.glm5_config(layers=2)))
    try:
        executor.add(A, 48)
        with caplog.at_level(logging.WARNING, logger="shadowtrace"):
            executor.step(context=[(A, 40)])
            executor.step(generation=[A])
    finally:
        traced.stop()
    (run,) = traced.runs(tmp_path)
    assert run["manifest"]["counters"]["shadow_skipped_no_model_config"] == 2 * 40
    assert {r["shadow_input"] for r in run["rows"]} == {"dequant", None}
    assert len([r for r in run["rows"] if r["shadow_input"] == "dequant"]) == 2 * 40
    assert sum("shadow_skipped_no_model_config" in m for m in caplog.messages) == 1


def test_a_stash_from_another_engine_step_is_not_used(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, executor = short_run(monkeypatch, tmp_path)
    try:
        executor.add(A, 48)
        executor.add(B, 48)
        executor.step(context=[(A, 40)])
        # Op 1 replayed from a captured graph: pre_indexer_proj's Python hook does not run.
        executor.step(context=[(B, 40)], replay_proj=True)
    finally:
        traced.stop()
    runs = by_request(traced.runs(tmp_path))
    assert {r["shadow_input"] for r in runs[f"trtllm-{A}"]["rows"]} == {"raw", "dequant"}
    assert {r["shadow_input"] for r in runs[f"trtllm-{B}"]["rows"]} == {"dequant"}
    assert runs[f"trtllm-{B}"]["manifest"]["counters"]["shadow_skipped_stale_stash"] == 2 * 40


# --- layouts, failures, the first forward ------------------------------------------------------


@pytest.mark.parametrize("where", ["indexer", "model"])
def test_an_engine_layout_the_adapter_was_not_written_for_is_refused_with_the_difference(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str
) -> None:
    engine = st.register(monkeypatch, st.NEW)
    if where == "indexer":
        cls, module, name = engine.indexer_module.Indexer, st.NEW, "forward_from_projected"

        def changed(self: Any, metadata: Any, hidden_states: Any, indexer_intermediates: Any,
                    is_generation: Any = None, phase_rows: Any = None) -> Any:  # fmt: skip
            return None

    else:
        cls, module, name = engine.modeling.DeepseekV3ForCausalLM, st.MODELING, "__init__"

        def changed(self: Any, model_config: Any, mapping_with_cp: Any = None) -> None:  # type: ignore[misc]
            return None

    monkeypatch.setattr(cls, name, changed)
    sess = traced.start(tmp_path)
    try:
        refused = sess.disabled.get(f"install:{module}")
    finally:
        traced.stop()
    assert refused is not None
    assert "UnsupportedVersion" in refused
    assert f"{name}: expected parameters" in refused
    assert "phase_rows" in refused or "mapping_with_cp" in refused
    assert "_shadowtrace_patched" not in vars(cls)


def test_a_failing_shadow_leaves_production_rows_recorded_and_counted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, executor = short_run(monkeypatch, tmp_path)
    from shadowtrace_hooks import numerics

    def broken(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("planted shadow failure")

    monkeypatch.setattr(numerics, "index_scores", broken)
    try:
        executor.add(A, 48)
        executor.step(context=[(A, 40)])
        executor.step(generation=[A])
        executor.step(generation=[A])
    finally:
        traced.stop()
    (run,) = traced.runs(tmp_path)
    assert run["manifest"]["counters"]["hook_errors"] >= 1
    assert {r["shadow_input"] for r in run["rows"]} == {None}
    assert sorted({(r["step"], r["token"]) for r in run["rows"] if r["layer"] == 1})[-3:] == [
        (0, 39), (1, 40), (2, 41),
    ]  # fmt: skip
    assert len(run["rows"]) == 2 * (40 + 2)
    logs = [layer.mqa.indexer.log for layer in executor.model.layers]
    for r in run["rows"]:
        assert fingerprint(r["prod_indices"]) == logs[r["layer"]][(A, r["token"])]


@pytest.mark.parametrize("capture", ["_stash", "_record", "_enter", "_keep_config"])
def test_an_out_of_memory_error_inside_a_capture_never_reaches_the_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capture: str
) -> None:
    from shadowtrace_hooks.adapters import trtllm

    engine = st.register(monkeypatch, st.NEW)

    def steps(executor: st.Executor) -> list[Any]:
        executor.add(A, 48)
        executor.add(B, 48)
        return [executor.step(context=[(A, 40)]), executor.step(context=[(B, 30)], generation=[A])]

    untraced = steps(st.Executor(engine.build(st.glm5_config(layers=2))))

    def oom(*args: Any, **kwargs: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (planted)")

    monkeypatch.setattr(trtllm, capture, oom)
    sess = traced.start(tmp_path)
    try:
        got = steps(st.Executor(engine.build(st.glm5_config(layers=2))))
        disabled = dict(sess.disabled)
    finally:
        traced.stop()
    assert any("OutOfMemoryError" in why for why in disabled.values()), disabled
    for step_got, step_untraced in zip(got, untraced, strict=True):
        for layer_got, layer_untraced in zip(step_got, step_untraced, strict=True):
            for a, b in zip(layer_got, layer_untraced, strict=True):
                assert torch.equal(a, b)


def test_a_first_forward_that_reaches_no_indexer_hook_prints_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = st.register(monkeypatch, st.NEW)
    sess = traced.start(tmp_path)
    try:
        # vanilla_backend.py's DSAVanillaIndexer is no Indexer: the patches never run.
        executor = st.Executor(engine.build(st.glm5_config(layers=1), indexer_cls=st.DSAVanillaIndexer))
        executor.add(A, 48)
        with caplog.at_level(logging.WARNING, logger="shadowtrace"):
            executor.step(context=[(A, 8)], cuda_graph=True)  # a CUDA-graph warm-up: not a real forward
            assert sess.counters.get("indexer_hooks_never_fired", 0) == 0
            executor.step(context=[(A, 16)])
            executor.step(generation=[A])
        counters = dict(sess.counters)
    finally:
        traced.stop()
    assert counters["indexer_hooks_never_fired"] == 1
    lines = [m for m in caplog.messages if "no indexer hook fired" in m]
    assert len(lines) == 1
    assert "DeepseekV3ForCausalLM" in lines[0]


def test_a_cuda_graph_step_is_skipped_and_counted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _, executor = short_run(monkeypatch, tmp_path)
    try:
        executor.add(A, 48)
        executor.step(context=[(A, 40)])
        executor.step(generation=[A], cuda_graph=True)
        executor.step(generation=[A])
        counters = dict(session.current().counters)  # type: ignore[union-attr]
    finally:
        traced.stop()
    assert counters["captures_skipped_cuda_graph"] == 2
    (run,) = traced.runs(tmp_path)
    assert sorted({(r["step"], r["token"]) for r in run["rows"] if r["token"] >= 40}) == [(1, 41)]


# --- issue 27, item 4: what ran instead of the indexer's own top-k ---------------------------


def test_rows_the_short_sequence_skip_filled_are_counted_and_the_skip_is_a_convention(
    served: SimpleNamespace,
) -> None:
    """skip_indexer_for_short_seqs (on by default): a phase whose requests all see at most k
    keys gets every visible key copied in, and the indexer does not run. C's prompt (400)
    and D's chunks (300, then 200: 500 keys) are such phases; A's and B's prompts and every
    generation phase here see more than k keys in some request."""
    runs = by_request(served.runs)
    layers = 2
    for rid, rows in ((C, PROMPTS[C]), (D, 500), (A, None), (B, None)):
        counters = runs[f"trtllm-{rid}"]["manifest"]["counters"]
        assert counters.get("indexer_rows_dense_skip") == (None if rows is None else rows * layers), rid
    for run in served.runs:
        conventions = {c["name"]: c for c in run["manifest"]["conventions"]}
        skip = conventions["indexer_short_seq_skip"]
        assert (skip["engine"], skip["model"]) == (True, None)
        backend = conventions["indexer_topk_backend"]
        assert backend["engine"] in ("cuda_radix", "prefill=cuda_radix,decode=cuda_radix")
        assert "enable_heuristic_topk=False" in backend["engine_source"]


def test_the_heuristic_top_k_is_recorded_as_the_top_k_backend(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """enable_heuristic_topk puts Guess-Verify-Refine in place of the radix top-k: the
    engine's own selection from its own scores, recorded as such (a convention the model
    defines no value of), never taken for the radix's."""
    runs = one_prompt(monkeypatch, tmp_path, small(st.glm5_config(layers=1)), heuristic_topk=True)
    (run,) = runs
    backend = {c["name"]: c for c in run["manifest"]["conventions"]}["indexer_topk_backend"]
    assert backend["engine"] == "cute_dsl_gvr"
    assert "enable_heuristic_topk=True" in backend["engine_source"]
    assert backend["model"] is None


@pytest.mark.parametrize(
    ("module", "cls", "model"),
    [
        ("tensorrt_llm._torch.models.modeling_glm5_next", "Glm5NextForCausalLM", "GLM-5.3-Flash"),
        ("tensorrt_llm._torch.models.modeling_deepseekv4", "DeepseekV4ForCausalLM", "DeepSeek-V4"),
    ],
)
def test_models_whose_attention_no_layout_hooks_say_so_once_when_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture, module: str, cls: str,
    model: str,
) -> None:  # fmt: skip
    """GLM-5.3-Flash runs the glm_kpool sparse attention, not the DSA indexer; DeepSeek-V4's
    indexer subclasses the hooked one but calls neither hooked method: building either is
    counted and said once."""
    st.register(monkeypatch, st.NEW)
    model_cls = type(cls, (torch.nn.Module,), {})
    common.register(monkeypatch, module, **{cls: model_cls})
    with caplog.at_level(logging.WARNING, logger="shadowtrace"):
        sess = traced.start(tmp_path)
        try:
            model_cls()
            model_cls()
            counters = dict(sess.counters)
        finally:
            traced.stop()
    assert counters["models_refused"] == 2
    lines = [r.getMessage() for r in caplog.records if f"{module}.{cls} is not traced" in r.getMessage()]
    assert len(lines) == 1, lines
    assert model in lines[0]


def test_shared_indexer_layers_are_counted_and_the_full_ones_recorded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """GLM-5.2's shared layers (`index_topk_pattern` "S") are built without an indexer and
    reuse the last full layer's top-k: no indexer hook runs there, so the model's
    construction counts them, and the full layers are recorded as ever."""
    config = small(st.glm5_config(layers=3))
    config.index_topk_pattern = "FSF"
    runs = one_prompt(monkeypatch, tmp_path, config)
    (run,) = runs
    assert run["manifest"]["counters"]["process.indexer_layers_shared"] == 1
    assert {r["layer"] for r in run["rows"]} == {0, 2}


def test_the_capture_self_check_finds_every_informative_row_consistent(served: SimpleNamespace) -> None:
    """Production's scores recomputed from its own FP8 operands (the dequant shadow): the
    engine's recorded selection is their top-k on every informative row of every request."""
    checked = 0
    for run in served.runs:
        check = run["manifest"]["settings"].get("capture_check")
        if check is None:  # no row of this request had its keys in the call
            continue
        assert check["sources"] == [core.DEQUANT_SOURCE]
        assert all(layer["disagree"] == 0 for layer in check["layers"].values()), check
        checked += sum(layer["rows"] for layer in check["layers"].values())
    assert checked > 0
