"""The SGLang adapter on the stand-in of sglang 0.5.8, 0.5.15, 0.5.22 and 0.5.23 (standins/sglang.py):
the rows it records and their shadows, requests and steps from the engine's own batches,
what it cannot record (counted, said once), and that no capture failure reaches the engine."""

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import traced
from shadowtrace_hooks import numerics, session
from shadowtrace_hooks.adapters import sglang as adapter
from standins import sglang as sg

LONG = sg.TOPK + 40  # a prompt whose last 40 rows see more keys than index_topk
SHORT = 300  # at most index_topk keys: the K-only path (0.5.8-0.5.15), dense MHA (0.5.23)
ENV = ("SGLANG_DSA_FUSE_TOPK", "SGLANG_NSA_FUSE_TOPK", "SGLANG_DISABLE_DSA_INDEXER_FUSION")


@pytest.fixture(autouse=True)
def stopped() -> Any:
    """No session outlives its test, whatever the test's outcome."""
    yield
    traced.stop()


def environ(monkeypatch: pytest.MonkeyPatch, **values: str | None) -> None:
    """SGLang's variables for the test, every one restored after it: SGLang's alias writes
    the new name when only the old one is set."""
    for name in ENV:
        monkeypatch.setenv(name, "unset")
        value = values.get(name)
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value)


def start(
    monkeypatch: pytest.MonkeyPatch, out: Path, version: str, *, shadow: str = "fp32", **env: str | None
) -> sg.Installed:
    """The stand-in of `version` installed and traced; positions, not slots, unless `env`
    says otherwise."""
    environ(monkeypatch, **({"SGLANG_DSA_FUSE_TOPK": "0", "SGLANG_NSA_FUSE_TOPK": "0"} | env))
    installed = sg.install(monkeypatch, version)
    traced.start(out, SHADOWTRACE_SHADOW=shadow)
    return installed


def by_request(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Every run under `out` grouped by its request tag (runs of one request in order)."""
    found: dict[str, list[dict[str, Any]]] = {}
    for run in traced.runs(out):
        found.setdefault(run["manifest"]["tags"]["request"], []).append(run)
    return found


def the_run(out: Path) -> dict[str, Any]:
    """The one run under `out` (a test of one request)."""
    (run,) = traced.runs(out)
    return run


def jaccard(a: list[int], b: list[int]) -> float:
    return len(set(a) & set(b)) / len(set(a) | set(b))


def check_shadows(rows: list[dict], length: int, inputs: tuple[str, ...] = ("dequant", "raw")) -> None:
    """Every prompt row once per shadow; `dequant` equals production up to which of the keys
    tied at the k-th score each top-k kept; `raw` stays close."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["shadow_input"], []).append(row)
    assert sorted(groups) == sorted(inputs)
    for shadow_input, group in groups.items():
        assert len(group) == length
        informative = [r for r in group if r["visible"] > r["k"]]
        assert len(informative) == max(0, length - sg.TOPK)
        for r in group:
            assert len(r["prod_indices"]) == min(r["visible"], r["k"])
            assert all(0 <= i < r["visible"] for i in r["prod_indices"])
        if shadow_input == "dequant":
            for r in informative:
                differ = set(r["prod_indices"]) ^ set(r["shadow_indices"])
                assert differ <= set(r["shadow_boundary_indices"]), (r["token"], differ)
        else:
            mean = sum(jaccard(r["prod_indices"], r["shadow_indices"]) for r in informative) / len(
                informative
            )
            # the model's own convention: well above the 0.9 a wrong one would still reach
            assert mean > 0.99, mean


def prompt_rows(run: dict[str, Any]) -> list[dict]:
    return [r for r in run["rows"] if r["step"] == 0]


# --- the capture and its shadows ----------------------------------------------------------


@pytest.mark.parametrize(("version", "norm"), [("0.5.8", "layer"), ("0.5.23", "rms")])
def test_layernorm_with_only_variance_epsilon_gives_production_rows_and_both_shadows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, norm: str
) -> None:
    installed = start(monkeypatch, tmp_path, version)
    config = sg.deepseek_v32_config(**({"index_k_norm_type": "rms"} if norm == "rms" else {}))
    model = installed.models.DeepseekV32ForCausalLM(config)
    k_norm = model.layers[0].self_attn.indexer.k_norm
    assert not hasattr(k_norm, "eps")
    assert hasattr(k_norm, "variance_epsilon")
    assert type(k_norm).__name__ == ("RMSNorm" if norm == "rms" else "LayerNorm")
    engine = sg.Engine(installed, model)
    a = engine.request("A", LONG, seed=1)
    engine.extend([(a, LONG)])
    sess = session.current()
    assert sess is not None
    assert not sess.disabled
    traced.stop()
    run = the_run(tmp_path)
    assert run["manifest"]["counters"].get("hook_errors", 0) == 0
    check_shadows(prompt_rows(run), LONG)


@pytest.mark.parametrize(
    ("version", "family"),
    [
        # DeepSeek-V3.2's YaRN rotary, whose forward_native turns a 2-D key into [1, T, T, 64]
        ("0.5.23", "deepseek_v32"),
        # GLM-5 with an RMSNorm k_norm and the fused indexer off (Hadamard, both helpers)
        ("0.5.22", "glm_moe_dsa"),
    ],
)
def test_the_raw_shadow_takes_rope_from_the_model_config_never_from_the_engine_rotary_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, family: str
) -> None:
    glm = family == "glm_moe_dsa"
    installed = start(monkeypatch, tmp_path, version, SGLANG_DISABLE_DSA_INDEXER_FUSION="1" if glm else None)
    if glm:
        model = installed.models.GlmMoeDsaForCausalLM(sg.glm5_config(index_k_norm_type="rms"))
    else:
        model = installed.models.DeepseekV32ForCausalLM(sg.deepseek_v32_config())
    rotary = model.layers[0].self_attn.indexer.rotary_emb
    assert type(rotary).__name__ == ("RotaryEmbedding" if glm else "DeepseekScalingRotaryEmbedding")
    engine = sg.Engine(installed, model)
    a = engine.request("A", LONG, seed=2)
    engine.extend([(a, LONG)])
    traced.stop()
    assert rotary.native_calls == 0
    run = the_run(tmp_path)
    check_shadows(prompt_rows(run), LONG)
    layout = "interleaved" if glm else "neox"
    c = traced.conventions(run)
    assert c["indexer_rope"] == {
        "name": "indexer_rope", "engine": layout, "model": layout,
        "engine_source": f"sglang {version} Indexer.rotary_emb.is_neox_style",
        "model_source": f"{family} indexer (transformers reference)",
    }  # fmt: skip
    # Both rotate (DeepSeek-V3.2 is NeoX, so never fused; GLM-5 runs with fusion off), and
    # only DeepSeek-V3.2's reference defines the rotation.
    assert (c["indexer_hadamard"]["engine"], c["indexer_hadamard"]["model"]) == (True, None if glm else True)
    scale = c["indexer_head_weight_scale"]
    assert scale["engine"] == scale["model"] == sg.HEAD_DIM**-0.5 * sg.HEADS**-0.5
    assert "softmax_scale x n_heads^-0.5" in scale["engine_source"]
    assert c["indexer_weights_proj_dtype"]["engine"] is None  # not read, and said so
    assert "not read" in c["indexer_weights_proj_dtype"]["engine_source"]


def test_an_engine_rope_convention_other_than_the_models_is_recorded_and_shows_in_the_raw_shadow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A GLM-5 config without indexer_rope_interleave: SGLang rotates NeoX pairs, the model
    # (transformers' GlmMoeDsaIndexer) interleaved ones; unfused, so both shadows run.
    installed = start(monkeypatch, tmp_path, "0.5.22")
    config = sg.glm5_config(index_k_norm_type="rms")
    del config.indexer_rope_interleave
    model = installed.models.GlmMoeDsaForCausalLM(config)
    assert model.layers[0].self_attn.indexer.rotary_emb.is_neox_style
    engine = sg.Engine(installed, model)
    a = engine.request("A", LONG, seed=3)
    engine.extend([(a, LONG)])
    traced.stop()
    run = the_run(tmp_path)
    convention = traced.conventions(run)["indexer_rope"]
    assert (convention["engine"], convention["model"]) == ("neox", "interleaved")
    rows = [r for r in prompt_rows(run) if r["visible"] > r["k"]]
    raw = [jaccard(r["prod_indices"], r["shadow_indices"]) for r in rows if r["shadow_input"] == "raw"]
    dequant = [
        jaccard(r["prod_indices"], r["shadow_indices"]) for r in rows if r["shadow_input"] == "dequant"
    ]
    assert sum(dequant) / len(dequant) > 0.999  # the engine's own operands agree with it
    # below what the raw shadow reaches when the conventions agree (check_shadows: > 0.99)
    assert sum(raw) / len(raw) < 0.99


def test_the_fused_glm5_indexer_records_production_and_raw_and_counts_the_missing_dequant_operands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed = start(monkeypatch, tmp_path, "0.5.22")
    model = installed.models.GlmMoeDsaForCausalLM(sg.glm5_config(index_k_norm_type="rms"))
    assert model.layers[0].self_attn.indexer.use_dsa_indexer_fusion
    engine = sg.Engine(installed, model)
    a = engine.request("A", LONG, seed=4)
    engine.extend([(a, LONG)])
    traced.stop()
    run = the_run(tmp_path)
    check_shadows(prompt_rows(run), LONG, inputs=("raw",))
    assert run["manifest"]["counters"]["dequant_unavailable_fused_indexer"] == LONG
    c = traced.conventions(run)
    assert (c["indexer_rope"]["engine"], c["indexer_rope"]["model"]) == ("interleaved", "interleaved")
    assert c["indexer_hadamard"]["engine"] is False
    assert "_fused_q_prepare_and_store" in c["indexer_hadamard"]["engine_source"]


def test_without_the_model_config_the_raw_shadow_is_skipped_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    installed = start(monkeypatch, tmp_path, "0.5.15")
    # built before tracing started: the hooks never saw its config
    session.stop()
    model = installed.models.DeepseekV32ForCausalLM(sg.deepseek_v32_config())
    traced.start(tmp_path, SHADOWTRACE_SHADOW="fp32")
    engine = sg.Engine(installed, model)
    a = engine.request("A", SHORT, seed=5)
    with caplog.at_level(logging.WARNING, logger="shadowtrace"):
        engine.extend([(a, SHORT)])  # the K-only path: production rows, no FP8 operands
    traced.stop()
    run = the_run(tmp_path)
    assert run["manifest"]["counters"]["shadow_skipped_no_model_config"] == SHORT
    assert len(run["rows"]) == SHORT
    assert {r["shadow_input"] for r in run["rows"]} == {None}
    assert sum("shadow_skipped_no_model_config" in r.message for r in caplog.records) == 1


# --- requests and steps -------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.5.8", "0.5.23"])
def test_requests_keep_one_run_each_through_alternation_chunking_mixed_batches_and_slot_reuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    installed = start(monkeypatch, tmp_path, version, shadow="none")
    config = sg.deepseek_v32_config()
    model = installed.models.DeepseekV32ForCausalLM(config)
    draft = installed.models.DeepseekV3ForCausalLMNextN(config)
    engine = sg.Engine(installed, model, draft=draft)
    a, b, c = engine.request("A", LONG, 11), engine.request("B", SHORT, 12), engine.request("C", LONG, 13)
    engine.extend([(a, LONG)])  # prefill A
    engine.decode([a])
    engine.extend([(b, SHORT)])  # a prefill-only step: A is running but absent
    engine.decode([a, b])
    engine.draft([a, b])  # the NextN draft layer, built as layer 0
    slot = a.req_pool_idx
    engine.finish(a)
    engine.decode([b])  # the running batch without A: A's run closes here
    traced.written()  # closing a run hands it to its writer and returns
    a_manifest = json.loads(next(tmp_path.glob("A-*/manifest.json")).read_text())
    assert a_manifest["status"] == "complete"
    chunk = 1200
    engine.extend([(c, chunk)])  # C takes A's pool row; its first chunk
    assert c.req_pool_idx == slot
    engine.extend([(c, LONG - chunk)], running=[b])  # MIXED: C's last chunk, B's decode row
    engine.decode([b, c])
    sess = session.current()
    assert sess is not None
    assert not sess.disabled
    traced.stop()

    runs = by_request(tmp_path)
    assert sorted(runs) == ["A", "B", "C"]
    assert all(len(group) == 1 for group in runs.values())
    (a_run,), (b_run,), (c_run,) = runs["A"], runs["B"], runs["C"]

    def steps(run: dict[str, Any]) -> dict[int, list[int]]:
        """Per step, the query tokens recorded."""
        out: dict[int, list[int]] = {}
        for row in run["rows"]:
            out.setdefault(row["step"], []).append(row["token"])
        return {step: sorted(tokens) for step, tokens in sorted(out.items())}

    # 0.5.8 selects every key of a short prefill itself (K-only path); 0.5.23 asks the
    # indexer for the K cache only (dense MHA prefill): counted, its step taken all the same
    short_prefill = version == "0.5.8"
    assert steps(a_run) == {0: list(range(LONG)), 1: [LONG], 2: [LONG + 1]}
    assert steps(b_run) == ({0: list(range(SHORT))} if short_prefill else {}) | {
        1: [SHORT],
        2: [SHORT + 1],
        3: [SHORT + 2],
        4: [SHORT + 3],
    }
    assert steps(c_run) == ({0: list(range(chunk))} if short_prefill else {}) | {
        1: list(range(chunk, LONG)),
        2: [LONG],
    }
    if not short_prefill:
        assert b_run["manifest"]["counters"]["indexer_rows_without_topk"] == SHORT
        assert c_run["manifest"]["counters"]["indexer_rows_without_topk"] == chunk
    lengths = [run["manifest"]["prompt"]["length"] for run in (a_run, b_run, c_run)]
    assert lengths == [LONG, SHORT, LONG]
    # the draft layer's rows are counted in the runs, not recorded as target layer 0
    assert a_run["manifest"]["counters"]["nextn_draft_rows_not_recorded"] == 1
    assert b_run["manifest"]["counters"]["nextn_draft_rows_not_recorded"] == 1
    assert "process.indexer_hooks_never_fired" not in c_run["manifest"]["counters"]


def test_decode_batches_replayed_from_a_cuda_graph_are_counted_in_each_requests_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang replays decode batches from its captured CUDA graphs by default: the batch is
    built (ForwardBatch.init_new) but none of the model's Python runs, so no indexer hook
    does. Each request of such a batch counts it in its run, the last batch of the session
    included, and one line says so; the batches run eagerly are recorded as before."""
    installed = start(monkeypatch, tmp_path, "0.5.23", shadow="none")
    engine = sg.Engine(installed, installed.models.DeepseekV32ForCausalLM(sg.deepseek_v32_config()))
    a, b = engine.request("A", LONG, 11), engine.request("B", LONG, 12)
    engine.extend([(a, LONG)])
    engine.extend([(b, LONG)])
    engine.decode([a, b], replayed=True)
    engine.decode([a, b])
    engine.decode([a, b], replayed=True)
    with caplog.at_level(logging.WARNING, logger="shadowtrace"):
        traced.stop()
    runs = {request: run for request, (run,) in by_request(tmp_path).items()}
    assert {r: run["manifest"]["counters"].get("indexer_steps_unseen") for r, run in runs.items()} == {
        "A": 2,
        "B": 2,
    }
    # The prompt, then the one decode step that ran: its token after the replayed one's.
    assert {row["token"] for row in runs["A"]["rows"]} == {*range(LONG), LONG + 1}
    lines = [r.getMessage() for r in caplog.records if "indexer_steps_unseen" in r.getMessage()]
    assert len(lines) == 1
    assert "--disable-cuda-graph" in lines[0]


def test_a_request_seen_again_after_its_run_closed_continues_in_a_new_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # retraction: SGLang drops a running request from the batch and prefills it again later
    installed = start(monkeypatch, tmp_path, "0.5.15", shadow="none")
    engine = sg.Engine(installed, installed.models.DeepseekV32ForCausalLM(sg.deepseek_v32_config()))
    a, b = engine.request("A", SHORT, 21), engine.request("B", SHORT, 22)
    engine.extend([(a, SHORT), (b, SHORT)])
    engine.decode([a, b])
    engine.decode([b])
    engine.decode([a, b])
    traced.stop()
    runs = by_request(tmp_path)
    assert [len(runs["A"]), len(runs["B"])] == [2, 1]
    resumed = runs["A"][1]["manifest"]
    assert "-s1-" in resumed["run_id"]
    assert resumed["counters"]["request_resumed"] == 1
    assert [r["token"] for r in runs["A"][1]["rows"]] == [SHORT + 1]


# --- what cannot be recorded ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "env", "fused"),
    [
        # 0.5.22+ reads only the new name: the old one set to 0 leaves the top-k fused
        pytest.param("0.5.22", {"SGLANG_NSA_FUSE_TOPK": "0"}, "SGLANG_DSA_FUSE_TOPK", id="0.5.22-old-name"),
        pytest.param("0.5.23", {"SGLANG_NSA_FUSE_TOPK": "0"}, "SGLANG_DSA_FUSE_TOPK", id="0.5.23-old-name"),
        # 0.5.8 reads only the old name
        pytest.param("0.5.8", {"SGLANG_DSA_FUSE_TOPK": "0"}, "SGLANG_NSA_FUSE_TOPK", id="0.5.8-new-name"),
        # SGLang's EnvBool does not know "off": it warns and keeps the default (fused)
        pytest.param("0.5.22", {"SGLANG_DSA_FUSE_TOPK": "off"}, "SGLANG_DSA_FUSE_TOPK", id="0.5.22-off"),
        # 0.5.13 to 0.5.20 honour the old name while the new one is unset
        pytest.param("0.5.15", {"SGLANG_NSA_FUSE_TOPK": "0"}, None, id="0.5.15-old-name-alias"),
        pytest.param("0.5.8", {"SGLANG_NSA_FUSE_TOPK": "0"}, None, id="0.5.8-old-name"),
        # ... and EnvBool knows "n"
        pytest.param("0.5.22", {"SGLANG_DSA_FUSE_TOPK": "n"}, None, id="0.5.22-n"),
    ],
)
def test_fused_topk_is_read_from_sglangs_own_envs_and_its_slots_are_counted_never_recorded(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    version: str,
    env: dict[str, str],
    fused: str | None,
) -> None:
    installed = start(
        monkeypatch, tmp_path, version, shadow="none",
        SGLANG_DSA_FUSE_TOPK=env.get("SGLANG_DSA_FUSE_TOPK"),
        SGLANG_NSA_FUSE_TOPK=env.get("SGLANG_NSA_FUSE_TOPK"),
    )  # fmt: skip
    engine = sg.Engine(installed, installed.models.DeepseekV32ForCausalLM(sg.deepseek_v32_config()))
    a = engine.request("A", SHORT, seed=31)
    invalid = "off" in env.values()
    rejected = pytest.warns(UserWarning, match='"off"') if invalid else contextlib.nullcontext()
    with caplog.at_level(logging.WARNING, logger="shadowtrace"), rejected:
        engine.extend([(a, SHORT)])  # the K-only path's top-k up to 0.5.15; K only on 0.5.23
        engine.decode([a])
    traced.stop()
    run = the_run(tmp_path)
    rows = (SHORT if version != "0.5.23" else 0) + 1
    if fused is None:
        assert len(run["rows"]) == rows
        assert all(0 <= i < r["visible"] for r in run["rows"] for i in r["prod_indices"])
        return
    assert run["rows"] == []
    assert run["manifest"]["counters"]["topk_fused_not_recorded"] == rows
    lines = [r.message for r in caplog.records if "topk_fused_not_recorded" in r.message]
    assert len(lines) == 1
    assert f"{fused}=0" in lines[0]


def test_rows_the_backend_forces_unfused_are_recorded_while_fused_rows_are_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 0.5.15+: with HiSparse, decode forces the unfused top-k whatever the variable says
    installed = start(monkeypatch, tmp_path, "0.5.15", shadow="none", SGLANG_DSA_FUSE_TOPK="1")
    engine = sg.Engine(installed, installed.models.DeepseekV32ForCausalLM(sg.deepseek_v32_config()))
    engine.backend.hisparse = True
    a = engine.request("A", SHORT, seed=32)
    engine.extend([(a, SHORT)])
    engine.decode([a])
    traced.stop()
    run = the_run(tmp_path)
    assert run["manifest"]["counters"]["topk_fused_not_recorded"] == SHORT
    assert [(r["step"], r["token"]) for r in run["rows"]] == [(1, SHORT)]
    assert run["rows"][0]["prod_indices"] == list(range(SHORT + 1))


def test_the_prefill_graph_split_op_calling_the_helpers_without_forward_cuda_is_counted_and_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    installed = start(monkeypatch, tmp_path, "0.5.23", shadow="none")
    deepseek = installed.models.DeepseekV32ForCausalLM(sg.deepseek_v32_config()).layers[0].self_attn.indexer
    glm = installed.models.GlmMoeDsaForCausalLM(sg.glm5_config()).layers[0].self_attn.indexer
    engine = sg.Engine(installed, installed.models.DeepseekV32ForCausalLM(sg.deepseek_v32_config()))
    a = engine.request("A", 16, seed=33)
    batch = engine.extend([(a, 16)])
    x, q_lora = engine.inputs[(33, 0)][0][:16], engine.inputs[(33, 0)][1][:16]
    with caplog.at_level(logging.WARNING, logger="shadowtrace"):
        # bcg_dsa_indexer_prefill_split at replay: the helpers alone, then the fused path
        _query, _, _ = deepseek._get_q_k_bf16(q_lora, x, batch.positions, False, batch)
        deepseek._get_logits_head_gate(x, torch.ones(16, sg.HEADS, 1))
        glm._fused_q_prepare_and_store(x, q_lora, batch.positions, batch, 0, sg.act_quant)
    sess = session.current()
    assert sess is not None
    assert sess.counters["indexer_graph_replay_not_recorded"] == 32
    assert "_shadowtrace_operands" not in deepseek.__dict__
    lines = [r.message for r in caplog.records if "indexer_graph_replay_not_recorded" in r.message]
    assert len(lines) == 1
    assert "--disable-cuda-graph" in lines[0]
    traced.stop()


def test_a_first_real_forward_that_reaches_no_indexer_hook_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    installed = start(monkeypatch, tmp_path, "0.5.23", shadow="none")
    model = installed.models.DeepseekV32ForCausalLM(sg.deepseek_v32_config())
    # a layout whose attention never calls the hooked Indexer (IndexerKPool, a new kernel)
    model.layers[0].self_attn.forward = lambda *args: None
    engine = sg.Engine(installed, model)
    a = engine.request("A", 64, seed=34)
    with caplog.at_level(logging.WARNING, logger="shadowtrace"):
        engine.extend([(a, 64)])
        engine.decode([a])
    sess = session.current()
    assert sess is not None
    assert sess.counters["indexer_hooks_never_fired"] == 1
    lines = [r.message for r in caplog.records if "no indexer hook fired" in r.message]
    assert len(lines) == 1
    assert "DeepseekV2ForCausalLM" in lines[0]
    traced.stop()


# --- failures stay in the hooks -------------------------------------------------------------


class OomOnClone(torch.Tensor):
    """A tensor whose copy fails as a full device would."""

    def clone(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (planted)")


def test_an_out_of_memory_error_inside_a_capture_never_reaches_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed = start(monkeypatch, tmp_path, "0.5.22")
    model = installed.models.DeepseekV32ForCausalLM(sg.deepseek_v32_config())
    q_k = installed.Indexer._q_k
    monkeypatch.setattr(
        installed.Indexer,
        "_q_k",
        lambda self, *a: tuple(t if t is None else t.as_subclass(OomOnClone) for t in q_k(self, *a)),
    )
    engine = sg.Engine(installed, model)
    a = engine.request("A", LONG, seed=41)
    engine.extend([(a, LONG)])  # the engine's call returns
    topk = model.topk[0]
    assert type(topk) is torch.Tensor
    assert topk.shape == (LONG, sg.TOPK)
    sess = session.current()
    assert sess is not None
    assert "OutOfMemoryError" in sess.disabled["sglang:operands"]
    assert sess.errors == 1
    traced.stop()
    run = the_run(tmp_path)
    # production and the raw shadow still recorded; the lost operands counted
    check_shadows(prompt_rows(run), LONG, inputs=("raw",))
    assert run["manifest"]["counters"]["dequant_unavailable"] == LONG


def test_a_failing_shadow_leaves_production_rows_recorded_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed = start(monkeypatch, tmp_path, "0.5.22")
    engine = sg.Engine(installed, installed.models.DeepseekV32ForCausalLM(sg.deepseek_v32_config()))

    def broken(linear: torch.nn.Module, block: int = 128) -> torch.Tensor:
        raise RuntimeError("planted shadow failure")

    monkeypatch.setattr(numerics, "dense_weight", broken)
    a = engine.request("A", LONG, seed=42)
    engine.extend([(a, LONG)])
    engine.decode([a])
    traced.stop()
    run = the_run(tmp_path)
    assert run["manifest"]["counters"]["hook_errors"] == 1
    assert "planted shadow failure" in run["manifest"]["settings"]["disabled_sites"]["sglang:shadow_raw"]
    check_shadows(prompt_rows(run), LONG, inputs=("dequant",))
    assert [(r["step"], r["token"]) for r in run["rows"] if r["step"] == 1] == [(1, LONG)]


# --- layouts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "layout"),
    [
        ("0.5.8", "unfused"),
        ("0.5.15", "fused_indexer"),
        ("0.5.22", "fused_indexer"),
        ("0.5.23", "use_cuda_graph"),
    ],
)
def test_each_release_is_hooked_with_its_own_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, layout: str
) -> None:
    installed = start(monkeypatch, tmp_path, version, shadow="none")
    sess = session.current()
    assert sess is not None
    assert not sess.disabled
    assert installed.indexer_module._shadowtrace_layout.name == layout
    assert installed.modules[adapter.BATCH_MODULE]._shadowtrace_layout.name == "init_new"
    assert installed.modules[adapter.MODEL_MODULE]._shadowtrace_layout.name == "deepseek_v2"
    engine = sg.Engine(installed, installed.models.DeepseekV32ForCausalLM(sg.deepseek_v32_config()))
    a = engine.request("A", SHORT, seed=51)
    engine.extend([(a, SHORT)])
    engine.decode([a])
    traced.stop()
    run = the_run(tmp_path)
    assert [r["token"] for r in run["rows"] if r["step"] == 1] == [SHORT]
    assert run["manifest"]["settings"]["adapter"].startswith(f"sglang: layout {layout} ")


def test_a_layout_the_adapter_was_not_written_for_is_refused_with_the_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shadowtrace_hooks.adapters.layout import UnsupportedVersion

    class Future(sg.Indexer0523):
        def forward_cuda(  # type: ignore[override]
            self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
            layer_id: int, return_indices: bool = True, use_cuda_graph: bool = True, topk_buffer: Any = None,
        ) -> torch.Tensor | None:  # fmt: skip
            return self._forward(x, q_lora, positions, forward_batch, layer_id, return_indices)

    environ(monkeypatch, SGLANG_DSA_FUSE_TOPK="0")
    installed = sg.install(monkeypatch, "0.5.23", indexer=Future)
    with pytest.raises(UnsupportedVersion, match="topk_buffer"):
        adapter.install(installed.indexer_module)
    sess = traced.start(tmp_path, SHADOWTRACE_SHADOW="none")
    refused = sess.disabled[f"install:{sg.INDEXER_MODULES['dsa']}"]
    assert "Indexer.forward_cuda: expected parameters" in refused
    assert "topk_buffer" in refused
    engine = sg.Engine(installed, installed.models.DeepseekV32ForCausalLM(sg.deepseek_v32_config()))
    a = engine.request("A", LONG, seed=52)
    engine.extend([(a, LONG)])  # the engine runs unhooked
    traced.stop()
    assert by_request(tmp_path) == {}


@pytest.mark.parametrize("litetopk", ["1", None])
def test_litetopk_indices_over_the_batchs_gathered_keys_are_counted_never_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, litetopk: str | None
) -> None:
    """SGLang main's LiteTopK (SGLANG_ENABLE_DSA_LITETOPK) selects for a whole extend batch
    and returns positions in the batch's gathered keys: B's are offset by A's keys, past
    B's own. Recorded as request positions they would be wrong for every request after the
    first; they are counted instead. Without it, both requests' rows are recorded."""
    if litetopk is None:
        monkeypatch.delenv("SGLANG_ENABLE_DSA_LITETOPK", raising=False)
    else:
        monkeypatch.setenv("SGLANG_ENABLE_DSA_LITETOPK", litetopk)
    environ(monkeypatch, SGLANG_DSA_FUSE_TOPK="0", SGLANG_NSA_FUSE_TOPK="0")
    installed = sg.install(monkeypatch, "0.5.22", indexer=sg.IndexerLiteTopK)
    traced.start(tmp_path, SHADOWTRACE_SHADOW="none")
    config = sg.deepseek_v32_config()
    engine = sg.Engine(installed, installed.models.DeepseekV32ForCausalLM(config))
    a, b = engine.request("A", LONG, seed=1), engine.request("B", LONG, seed=2)
    with caplog.at_level(logging.WARNING, logger="shadowtrace"):
        engine.extend([(a, LONG), (b, LONG)])
        engine.decode([a, b])
    traced.stop()
    runs = {request: found for request, (found,) in by_request(tmp_path).items()}
    layers = config.num_hidden_layers
    for run in runs.values():
        counters = run["manifest"]["counters"]
        steps = {r["step"] for r in run["rows"]}
        if litetopk:
            assert counters["topk_litetopk_not_recorded"] == LONG * layers
            assert steps == {1}, "only the decode rows, which do not take LiteTopK"
        else:
            assert "topk_litetopk_not_recorded" not in counters
            assert steps == {0, 1}
        assert all(0 <= i < r["visible"] for r in run["rows"] for i in r["prod_indices"])
    lines = [r.message for r in caplog.records if "topk_litetopk_not_recorded" in r.message]
    assert len(lines) == (1 if litetopk else 0)


def test_the_capture_self_check_finds_every_informative_row_consistent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Production's scores recomputed from its own FP8 operands (the dequant shadow): the
    engine's recorded selection is their top-k on every informative row."""
    installed = start(monkeypatch, tmp_path, "0.5.22")
    engine = sg.Engine(installed, installed.models.DeepseekV32ForCausalLM(sg.deepseek_v32_config()))
    a, b = engine.request("A", LONG, seed=1), engine.request("B", LONG, seed=2)
    engine.extend([(a, LONG), (b, LONG)])
    traced.stop()
    for (run,) in by_request(tmp_path).values():
        check = run["manifest"]["settings"]["capture_check"]
        assert all(layer["rows"] == LONG - sg.TOPK for layer in check["layers"].values()), check
        assert all(layer["disagree"] == 0 for layer in check["layers"].values()), check
