"""HF transformers traced by environment alone: tiny random GLM-5 and DeepSeek-V3.2 models
run in a subprocess with SHADOWTRACE=1 (the installed shadowtrace_hooks.pth activates the
hooks; the traced script never imports shadowtrace), and the Rust analyzer reads the runs.

Executed on two transformers releases: the virtualenv's 5.17.0 and 5.24.0 (which renamed
the cache argument `past_key_values` to `cache` and caches compressed latents), the latter
installed apart from the virtualenv (tests/python/upstream.py) and first on PYTHONPATH."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import REPO, TRANSFORMERS, binary, transformers_path
from shadowtrace_hooks import config

TRACE = REPO / "tests" / "python" / "trace_tiny.py"
K = 2048  # index_topk of the tiny models, as in the real ones


def run_model(
    tmp: Path, model: str, length: int, *extra: str, version: str = transformers.__version__, **env: str
) -> tuple[dict, Path]:
    """Runs trace_tiny.py with the given SHADOWTRACE* environment; returns what it saved and
    the runs directory."""
    runs = tmp / "runs"
    out = tmp / f"out-{len(list(tmp.glob('out-*')))}.pt"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE") and k != "PYTHONPATH"}
    environ = {**clean, "SHADOWTRACE_DIR": str(runs), **transformers_path(version), **env}
    done = subprocess.run(
        [sys.executable, TRACE, model, str(length), out, *extra], capture_output=True, text=True, env=environ
    )
    assert done.returncode == 0, done.stderr[-4000:]
    saved = torch.load(out)
    assert saved["version"] == version
    return saved, runs


def manifests(runs: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(runs.glob("*/manifest.json"))]


def assert_nothing_disabled(manifest: dict) -> None:
    assert manifest["settings"].get("disabled_sites") is None, manifest["settings"]["disabled_sites"]
    assert manifest["counters"].get("hook_errors", 0) == 0
    assert manifest["counters"]["dropped_rows"] == 0


def analyze(runs: Path) -> dict:
    out = subprocess.run(
        [binary("shadowtrace"), "analyze", runs, "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode in (0, 1), out.stderr
    return json.loads(out.stdout)


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("version", TRANSFORMERS)
@pytest.mark.parametrize("model", ["glm", "deepseek"])
@pytest.mark.parametrize("length", [300, K + 100])
def test_a_traced_run_is_analyzed_and_leaves_the_logits_bit_identical(
    tmp_path: Path, model: str, length: int, version: str
) -> None:
    untraced, runs = run_model(tmp_path, model, length, version=version)
    assert not runs.exists()
    traced, runs = run_model(
        tmp_path, model, length, version=version, SHADOWTRACE="1", SHADOWTRACE_MODE="local,free"
    )
    assert bitwise(traced["logits"], untraced["logits"])
    # the shadow re-runs neither read nor extend production's KV and indexer caches
    assert len(traced["cache"]) == len(untraced["cache"]) > 0
    assert all(bitwise(a, b) for a, b in zip(traced["cache"], untraced["cache"], strict=True))

    (manifest,) = manifests(runs)
    assert manifest["status"] == "complete"
    assert_nothing_disabled(manifest)
    # production's indexer scores were captured from its top-k call, never recomputed
    assert "indexer_scores_recomputed" not in manifest["counters"]
    assert manifest["model"]["architecture"] == {"glm": "glm_moe_dsa", "deepseek": "deepseek_v32"}[model]
    assert manifest["engine"]["name"] == "transformers"
    assert manifest["engine"]["version"] == version
    assert manifest["prompt"]["length"] == length
    # 3 layers x (layer_in + attn_out, mlp_out, layer_out in both modes) x every token
    assert manifest["tables"]["hidden"]["rows"] == 3 * 7 * length
    assert manifest["tables"]["topk"]["rows"] == 3 * length
    assert manifest["tables"]["logits"]["rows"] == length

    # transformers holds the indexer's head weights in bf16 in a bf16 load (its
    # _keep_in_fp32_modules applies to fp16 only), where the reference computes them in fp32:
    # read from the model, recorded, and named by the analyzer (issue 27, item 6)
    (weights_proj,) = [c for c in manifest["conventions"] if c["name"] == "indexer_weights_proj_dtype"]
    assert (weights_proj["engine"], weights_proj["model"]) == ("bf16", "fp32")
    assert weights_proj["engine_source"].endswith(
        "indexer.weights_proj.weight.dtype, read from the loaded model"
    )
    assert "engine_assumed" not in weights_proj

    # The capture self-check ran on production's captured scores: every informative row's
    # selection is their top-k in transformers' own model (issue 27, item 1).
    check = manifest["settings"]["capture_check"]
    assert check["sources"] == ["captured: the scores production's top-k call ranked"]
    informative = max(0, length - K)
    assert check["layers"] == {
        str(layer): {
            "rows": informative,
            "disagree": 0,
            "first_token": None,
            "unchecked": 0,
            "short_of_winners": 0,
        }
        for layer in range(3)
    }

    (run,) = analyze(runs)["runs"]
    assert [m["name"] for m in run["convention_mismatches"]] == ["indexer_weights_proj_dtype"]
    assert run["capture_check"]["layers"][0]["disagree"] == 0
    assert run["onset"] is None
    assert run["hidden_verdict"] is None
    assert run["topk_verdict"] is None
    for layer in run["topk"]:
        assert layer["dense_rows"] == min(length, K)
        assert layer["informative_rows"] == informative
        if informative:
            # the indexer's fp32 recompute agrees with its bf16 production selection,
            # up to churn among keys tied within the boundary band
            assert layer["jaccard_no_churn"]["mean"] > 0.99
    # per layer: layer_in (prod only: it is the shadow's input), then three sites x two modes
    assert len(run["hidden"]) == 3 * 7


@pytest.mark.parametrize("version", TRANSFORMERS)
@pytest.mark.parametrize("model", ["glm", "deepseek"])
def test_a_nan_planted_at_a_layer_is_located_there_with_the_shadow_finite(
    tmp_path: Path, model: str, version: str
) -> None:
    _, runs = run_model(
        tmp_path, model, 400, "--nan-layer", "1", "--nan-token", "123", version=version, SHADOWTRACE="1"
    )
    (manifest,) = manifests(runs)
    assert_nothing_disabled(manifest)
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


@pytest.mark.parametrize("version", TRANSFORMERS)
@pytest.mark.parametrize("model", ["glm", "deepseek"])
def test_generate_is_one_run_with_a_step_per_decoded_token_and_the_untraced_tokens(
    tmp_path: Path, model: str, version: str
) -> None:
    untraced, _ = run_model(tmp_path, model, 100, "--generate", "4", version=version)
    traced, runs = run_model(tmp_path, model, 100, "--generate", "4", version=version, SHADOWTRACE="1")
    assert torch.equal(traced["ids"], untraced["ids"])
    assert bitwise(traced["logits"], untraced["logits"])
    (manifest,) = manifests(runs)
    assert manifest["status"] == "complete"
    assert_nothing_disabled(manifest)
    # the prefill's 100 query rows plus one per decode step, on each of 3 layers
    assert manifest["tables"]["topk"]["rows"] == 3 * (100 + 3)
    assert manifest["counters"]["shadow_skipped_decode_steps"] == 3


@pytest.mark.parametrize("version", TRANSFORMERS)
def test_drafts_rejected_by_assisted_decoding_are_cut_from_the_runs_keys_with_the_cache(
    tmp_path: Path, version: str
) -> None:
    """Prompt-lookup decoding (assisted decoding without a second model) drafts tokens from
    the repeated prompt; the random model rejects some, and generate crops the cache. The
    run's indexer shadow keys are cut back with it: before, the next step's shadow scored
    the rejected keys too, its width disagreed with production's, and the indexer capture
    was disabled for the process. Past index_topk, every decode row is informative."""
    args = ("--generate", "12", "--prompt-lookup", "4", "--repeat-prompt", "50")
    untraced, _ = run_model(tmp_path, "glm", K + 52, *args, version=version)
    traced, runs = run_model(tmp_path, "glm", K + 52, *args, version=version, SHADOWTRACE="1")
    assert torch.equal(traced["ids"], untraced["ids"])
    (manifest,) = manifests(runs)
    assert manifest["status"] == "complete"
    assert_nothing_disabled(manifest)
    assert manifest["counters"]["cache_rollback_tokens"] > 0
    check = manifest["settings"]["capture_check"]["layers"]
    assert all(layer["disagree"] == 0 for layer in check.values()), check
    (run,) = analyze(runs)["runs"]
    assert run["topk_verdict"] is None
    assert "cache_rollback_tokens" not in " ".join(n["why"] for n in run["not_measured"])


@pytest.mark.parametrize("version", TRANSFORMERS)
def test_a_nan_written_into_kv_slot_0_fails_the_sentinel_before_the_onset_it_explains(
    tmp_path: Path, version: str
) -> None:
    _, runs = run_model(tmp_path, "glm", 64, "--generate", "3", "--poison-slot0", "1", version=version,
                        SHADOWTRACE="1")  # fmt: skip
    (manifest,) = manifests(runs)
    assert_nothing_disabled(manifest)
    (run,) = analyze(runs)["runs"]
    failed = run["failed_sentinels"]
    assert failed, "the poisoned slot was not reported"
    first = failed[0]
    assert (first["step"], first["layer"], first["check"]) == (1, 1, "kv_slot0_finite")
    assert "slot 0" in first["detail"]
    # Nothing was non-finite before the poisoned write: the onset comes after it.
    onset = run["onset"]
    assert onset is None or (onset["step"], onset["layer"]) >= (1, 1)


@pytest.mark.parametrize("version", TRANSFORMERS)
def test_the_shadow_re_run_fires_no_hook_of_the_users(tmp_path: Path, version: str) -> None:
    untraced, _ = run_model(tmp_path, "glm", 64, "--count-hooks", version=version)
    traced, _ = run_model(tmp_path, "glm", 64, "--count-hooks", version=version, SHADOWTRACE="1",
                          SHADOWTRACE_MODE="local,free")  # fmt: skip
    assert untraced["hook_calls"] == {"self_attn": 3, "mlp": 3}
    assert traced["hook_calls"] == untraced["hook_calls"]


def test_with_shadowtrace_unset_nothing_of_shadowtrace_is_imported() -> None:
    code = (
        "import sys, transformers.models.glm_moe_dsa.modeling_glm_moe_dsa;"
        "print(any(m.startswith('shadowtrace') for m in sys.modules))"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE")}
    for value, expected in [(None, "False"), ("1", "True")]:
        env = clean if value is None else {**clean, "SHADOWTRACE": value}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
        )
        assert out.stdout.strip() == expected, value


@pytest.mark.parametrize("value", ["", "0", "false", "no", "off", " OFF ", "False"])
def test_every_off_value_imports_nothing(value: str) -> None:
    watched = "('shadowtrace_hooks', 'torch', 'pyarrow')"
    code = f"import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in {watched}))"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**clean, "SHADOWTRACE": value},
    )
    assert out.stdout.strip() == "[]"


def test_a_bad_and_an_unknown_variable_are_each_said_once_at_startup() -> None:
    """Python 3.11's venvs run site-packages' .pth files twice: the hooks still say once that
    they are not tracing, and name a typo'd variable once with the one it is closest to (the
    words the Rust side's `shadowtrace env` prints)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE")}
    env = {**clean, "SHADOWTRACE": "1", "SHADOWTRACE_LAYERS": "abc", "SHADOWTRACE_LAYER": "0"}
    out = subprocess.run([sys.executable, "-c", "pass"], capture_output=True, text=True, check=True, env=env)
    assert out.stderr.splitlines() == [
        "shadowtrace: SHADOWTRACE_LAYER is no shadowtrace variable and is ignored: did you mean "
        "SHADOWTRACE_LAYERS?",
        "shadowtrace: not tracing: SHADOWTRACE_LAYERS='abc': expected all, or layers and ranges "
        "such as 0-3,10",
    ]
    rust = subprocess.run([binary("shadowtrace"), "env"], capture_output=True, text=True, check=False,
                          env={"SHADOWTRACE_LAYER": "0"})  # fmt: skip
    assert rust.returncode == 0, rust.stderr
    assert rust.stderr.splitlines() == [
        "warning: SHADOWTRACE_LAYER is no shadowtrace variable and is ignored: did you mean "
        "SHADOWTRACE_LAYERS?"
    ]


def test_the_startup_line_reads_off_as_the_environment_definition_does() -> None:
    """The .pth decides before importing anything, so it repeats the false words: the same
    words config.py (and schemas/v1/env.json's bool) reads as false."""
    line = (REPO / "hooks" / "shadowtrace_hooks.pth").read_text()
    words = ast.literal_eval(line.split(" not in ")[1].split(" and ")[0])
    assert tuple(words) == config.FALSE_WORDS


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

    monkeypatch.setattr(stats, "hidden_device", broken)
    assert startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)}) is not None
    try:
        with torch.no_grad():
            traced = model(ids).logits
            again = model(ids).logits
    finally:
        session.stop()
    assert torch.equal(traced, untraced)
    assert torch.equal(again, untraced)
    (first_dir, first), (second_dir, second) = sorted(
        ((p.parent, json.loads(p.read_text())) for p in tmp_path.glob("*/manifest.json")),
        key=lambda dm: dm[1]["started_unix_ms"],
    )
    for manifest in (first, second):
        assert manifest["status"] == "complete"
        assert manifest["settings"]["disabled_sites"] == {"hidden": "RuntimeError: planted"}
        assert manifest["tables"]["hidden"]["rows"] == 0
        assert manifest["tables"]["topk"]["rows"] == 3 * 64  # other captures go on
    assert first["counters"]["hook_errors"] == 1  # raised once, then the capture stayed off
    assert "hook_errors" not in second["counters"]
    # The second request's run is complete with no error of its own, and has no hidden rows:
    # its verdicts are not judged, and --fail-on does not pass it.
    for run_dir in (first_dir, second_dir):
        analyze = [binary("shadowtrace"), "analyze", run_dir, "--fail-on", "nonfinite"]
        out = subprocess.run(analyze, capture_output=True, text=True, check=False)
        assert out.returncode == 2, (out.stdout, out.stderr)
        why = "capture hidden disabled in this process: RuntimeError: planted"
        assert f"non-finite onset not judged: {why}" in out.stderr
        assert "non-finite onset:  not judged: capture hidden disabled" in out.stdout
        partial = subprocess.run([*analyze, "--allow-partial"], capture_output=True, text=True, check=False)
        # The first request's own hook error leaves nothing of it judged; the second's top-k and
        # logits are whole, and partial data may be accepted there.
        assert partial.returncode == (2 if run_dir == first_dir else 0), partial.stderr
