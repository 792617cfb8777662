"""The convention-mismatch verdict on runs an engine wrote, traced in-process by the hooks and
read back by `shadowtrace analyze`: the SGLang stand-in (hooks/tests/standins/sglang.py)
serving GLM-5 with NeoX indexer RoPE where the model's reference is interleaved, and with the
model's own layout; the TensorRT-LLM stand-in serving DeepSeek-V3.2, which its checked layouts
are known not to Hadamard-rotate before the FP8 cast (PR #11899) where the reference does: an
assumption, named and not judged."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, binary

# The hooks' own test helpers and the engine stand-ins beside them.
sys.path.insert(0, str(REPO / "hooks" / "tests"))
import traced
from standins import sglang as sg
from standins import trtllm as st

TOKENS = sg.TOPK + 40  # rows that see more keys than index_topk


def analyze(out: Path, *args: str) -> subprocess.CompletedProcess:
    """`shadowtrace analyze ARGS...` of the one run under `out`."""
    (run,) = sorted(p.parent for p in out.glob("*/manifest.json"))
    return subprocess.run(
        [binary("shadowtrace"), "analyze", run, *args], capture_output=True, text=True, check=False
    )


def analysed(out: Path) -> dict:
    """`shadowtrace analyze --format json` of the one run under `out`."""
    result = analyze(out, "--format", "json")
    assert result.returncode == 0, result.stderr
    (analysis,) = json.loads(result.stdout)["runs"]
    return analysis


@pytest.mark.parametrize(
    ("interleave", "mismatches"),
    [
        # No indexer_rope_interleave in config.json: SGLang 0.5.22 rotates NeoX pairs.
        (None, ["neox"]),
        (True, []),
    ],
)
def test_the_verdict_names_an_engine_rope_layout_other_than_the_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interleave: bool | None, mismatches: list[str]
) -> None:
    for name in ("SGLANG_DSA_FUSE_TOPK", "SGLANG_NSA_FUSE_TOPK"):
        monkeypatch.setenv(name, "0")
    monkeypatch.delenv("SGLANG_DISABLE_DSA_INDEXER_FUSION", raising=False)
    installed = sg.install(monkeypatch, "0.5.22")
    traced.start(tmp_path, SHADOWTRACE_SHADOW="fp32")
    try:
        config = sg.glm5_config(index_k_norm_type="rms")
        if interleave is None:
            del config.indexer_rope_interleave
        else:
            config.indexer_rope_interleave = interleave
        model = installed.models.GlmMoeDsaForCausalLM(config)
        engine = sg.Engine(installed, model)
        request = engine.request("A", TOKENS, seed=3)
        engine.extend([(request, TOKENS)])
    finally:
        traced.stop()
    analysis = analysed(tmp_path)
    found = analysis["convention_mismatches"]
    assert [m["engine"] for m in found] == mismatches, found
    if mismatches:
        (mismatch,) = found
        assert (mismatch["name"], mismatch["model"]) == ("indexer_rope", "interleaved")
        assert "is_neox_style" in mismatch["engine_source"]
    # The correct ones are recorded too, and are no verdict: RoPE, Hadamard (GLM-5 defines
    # none), the head-weight scale (SGLang's softmax_scale x n_heads^-0.5, the model's),
    # weights_proj (not read on SGLang).
    assert [c["name"] for c in analysis["conventions"]] == [
        "indexer_rope",
        "indexer_hadamard",
        "indexer_head_weight_scale",
        "indexer_weights_proj_dtype",
    ]
    scale = analysis["conventions"][2]
    assert scale["engine"] == scale["model"] == config.index_head_dim**-0.5 * config.index_n_heads**-0.5


def test_the_hadamard_rotation_tensorrt_llm_is_assumed_to_drop_is_not_judged_but_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapter knows TensorRT-LLM's checked layouts drop the rotation (PR #11899) but
    observes nothing at run time: the value is an assumption, and the analyzer names the
    difference without judging it, and --fail-on convention does not pass it."""
    engine = st.register(monkeypatch, st.NEW)
    traced.start(tmp_path, SHADOWTRACE_SHADOW="fp32")
    try:
        config = st.deepseek_v32_config(layers=1)
        config.index_topk = 16
        executor = st.Executor(engine.build(config))
        executor.add(7001, 40)
        executor.step(context=[(7001, 40)])
    finally:
        traced.stop()
    analysis = analysed(tmp_path)
    assert analysis["convention_mismatches"] == []
    (assumed,) = [n for n in analysis["not_measured"] if n["questions"] == ["convention"]]
    assert assumed["why"].startswith("indexer hadamard: the engine's value (false) is assumed (assumed from ")
    assert "PR #11899" in assumed["why"]
    assert assumed["why"].endswith("not read from the engine; the model's is true")
    out = analyze(tmp_path, "--fail-on", "convention")
    assert out.returncode == 2, out.stderr
    line = "convention:        not judged: indexer hadamard: the engine's value (false) is assumed"
    assert line in out.stdout
    assert ": convention not judged: indexer hadamard" in out.stderr
