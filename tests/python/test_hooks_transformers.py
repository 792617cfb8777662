"""HF transformers traced by environment alone: tiny random GLM-5 and DeepSeek-V3.2 models
run in a subprocess with SHADOWTRACE=1 (the installed shadowtrace_hooks.pth activates the
hooks; the traced script never imports shadowtrace), and the Rust analyzer reads the runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, binary

TRACE = REPO / "tests" / "python" / "trace_tiny.py"
K = 2048  # index_topk of the tiny models, as in the real ones


def run_model(tmp: Path, model: str, length: int, *extra: str, **env: str) -> tuple[torch.Tensor, Path]:
    """Runs trace_tiny.py with the given SHADOWTRACE* environment; returns logits and run dir."""
    runs = tmp / "runs"
    logits = tmp / f"logits-{len(list(tmp.glob('logits-*')))}.pt"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE")}
    environ = {**clean, "SHADOWTRACE_DIR": str(runs), **env}
    subprocess.run(
        [sys.executable, TRACE, model, str(length), logits, *extra],
        check=True, capture_output=True, env=environ,
    )  # fmt: skip
    return torch.load(logits), runs


def analyze(runs: Path) -> dict:
    out = subprocess.run(
        [binary("shadowtrace"), "analyze", runs, "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode in (0, 1), out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("model", ["glm", "deepseek"])
@pytest.mark.parametrize("length", [300, K + 100])
def test_a_traced_run_is_analyzed_and_leaves_the_logits_bit_identical(
    tmp_path: Path, model: str, length: int
) -> None:
    untraced, runs = run_model(tmp_path, model, length)
    assert not runs.exists()
    traced, runs = run_model(tmp_path, model, length, SHADOWTRACE="1", SHADOWTRACE_MODE="local,free")
    assert torch.equal(traced.view(torch.int16), untraced.view(torch.int16))

    (run_dir,) = runs.iterdir()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["model"]["architecture"] == {"glm": "glm_moe_dsa", "deepseek": "deepseek_v32"}[model]
    assert manifest["engine"]["name"] == "transformers"
    assert manifest["prompt"]["length"] == length
    assert manifest["counters"]["dropped_rows"] == 0
    # 3 layers x (layer_in + attn_out, mlp_out, layer_out in both modes) x every token
    assert manifest["tables"]["hidden"]["rows"] == 3 * 7 * length
    assert manifest["tables"]["topk"]["rows"] == 3 * length
    assert manifest["tables"]["logits"]["rows"] == length

    (run,) = analyze(runs)["runs"]
    assert run["onset"] is None
    assert run["hidden_verdict"] is None
    assert run["topk_verdict"] is None
    informative = max(0, length - K)
    for layer in run["topk"]:
        assert layer["dense_rows"] == min(length, K)
        assert layer["informative_rows"] == informative
        if informative:
            # the indexer's fp32 recompute agrees with its bf16 production selection,
            # up to churn among keys tied within the boundary band
            assert layer["jaccard_no_churn"]["mean"] > 0.99
    # per layer: layer_in (prod only: it is the shadow's input), then three sites x two modes
    assert len(run["hidden"]) == 3 * 7


def test_a_nan_planted_at_a_layer_is_located_there_with_the_shadow_finite(tmp_path: Path) -> None:
    _, runs = run_model(tmp_path, "glm", 400, "--nan-layer", "1", "--nan-token", "123", SHADOWTRACE="1")
    (run,) = analyze(runs)["runs"]
    onset = run["onset"]
    assert (onset["step"], onset["layer"], onset["site"], onset["token"], onset["kind"]) == (
        0,
        1,
        "layer_out",
        123,
        "nan",
    )
    assert onset["shadow_finite"] is True


def test_generate_is_one_run_with_a_step_per_decoded_token(tmp_path: Path) -> None:
    _, runs = run_model(tmp_path, "deepseek", 100, "--generate", "4", SHADOWTRACE="1")
    (run_dir,) = runs.iterdir()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    # the prefill's 100 query rows plus one per decode step, on each of 3 layers
    assert manifest["tables"]["topk"]["rows"] == 3 * (100 + 3)
    assert manifest["counters"]["shadow_skipped_decode_steps"] == 3


def test_with_shadowtrace_unset_nothing_of_shadowtrace_is_imported() -> None:
    code = (
        "import sys, transformers.models.glm_moe_dsa.modeling_glm_moe_dsa;"
        "print(any(m.startswith('shadowtrace') for m in sys.modules))"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE")}
    for value, expected in [(None, "False"), ("0", "False"), ("1", "True")]:
        env = clean if value is None else {**clean, "SHADOWTRACE": value}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
        )
        assert out.stdout.strip() == expected, value


def test_an_exception_inside_a_hook_is_counted_disables_its_capture_and_leaves_outputs_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiny_models
    from shadowtrace_hooks import session, startup, stats

    model, ids = tiny_models.glm(), tiny_models.prompt(64)
    with torch.no_grad():
        untraced = model(ids).logits

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("planted")

    monkeypatch.setattr(stats, "hidden_columns", broken)
    assert startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)}) is not None
    try:
        with torch.no_grad():
            traced = model(ids).logits
            again = model(ids).logits
    finally:
        session.stop()
    assert torch.equal(traced, untraced)
    assert torch.equal(again, untraced)
    first, second = sorted(
        (json.loads(p.read_text()) for p in tmp_path.glob("*/manifest.json")),
        key=lambda m: m["started_unix_ms"],
    )
    for manifest in (first, second):
        assert manifest["status"] == "complete"
        assert manifest["settings"]["disabled_sites"] == {"hidden": "RuntimeError: planted"}
        assert manifest["tables"]["hidden"]["rows"] == 0
        assert manifest["tables"]["topk"]["rows"] == 3 * 64  # other captures go on
    assert first["counters"]["hook_errors"] == 1  # raised once, then the capture stayed off
    assert "hook_errors" not in second["counters"]
