"""GLM-5.3-Flash (`glm5_next`) and DeepSeek-V4 (`deepseek_v4`) traced by environment alone
on transformers 5.24.0 (installed apart, first on PYTHONPATH): tiny random models with the
real structure (tests/python/tiny_family.py) run in a subprocess with SHADOWTRACE=1, and
the Rust analyzer reads the runs.

Their indexers select over pooled (GLM-5.3-Flash's k-pools of 16 tokens) or compressed
(DeepSeek-V4's CSA entries of 4 tokens) keys: the top-k rows count keys, k and visible keys
in that unit, and the fp32 shadow, recomputed by the adapter from the model's weights,
agrees with HF's own bf16 production selection."""

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, transformers_path
from test_hooks_transformers import analyze, assert_nothing_disabled, manifests

TRACE = REPO / "tests" / "python" / "trace_family.py"
VERSION = "5.24.0"
LENGTH = 160
# model -> (unit, tokens per key, k in that unit, the layers with an indexer)
UNITS = {"glm5_next": ("kpool", 16, 64 // 16, [3]), "deepseek_v4": ("compressed", 4, 16, [1, 3])}


def run_family(
    tmp: Path, model: str, length: int, *extra: str, version: str = VERSION, **env: str
) -> tuple[dict, Path]:
    """Runs trace_family.py on transformers `version` (5.24 by default) with the given
    SHADOWTRACE* environment."""
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


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (scalars included: DeepSeek-V4's cache counts tokens)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def topk_rows(run_dir: Path) -> tuple[dict, int]:
    """The run's top-k table as columns, and the format version its files carry."""
    table = pq.read_table(run_dir / "topk")
    version = int(table.schema.metadata[b"shadowtrace.schema_version"])
    return table.to_pydict(), version


@pytest.mark.parametrize("model", sorted(UNITS))
def test_tracing_leaves_logits_generate_and_cache_identical_and_selections_count_their_unit(
    tmp_path: Path, model: str
) -> None:
    untraced, runs = run_family(tmp_path, model, LENGTH, "--generate", "3")
    assert not runs.exists()
    traced, runs = run_family(
        tmp_path, model, LENGTH, "--generate", "3", SHADOWTRACE="1", SHADOWTRACE_MODE="local,free"
    )
    assert bitwise(traced["logits"], untraced["logits"])
    assert torch.equal(traced["ids"], untraced["ids"])
    assert bitwise(traced["gen_logits"], untraced["gen_logits"])
    # the shadow re-runs neither read nor extend production's caches (KV, indexer, recurrent)
    assert len(traced["cache"]) == len(untraced["cache"]) > 0
    assert all(bitwise(a, b) for a, b in zip(traced["cache"], untraced["cache"], strict=True))

    forward, generate = manifests(runs)  # the forward's request, then generate's
    for manifest in (forward, generate):
        assert manifest["status"] == "complete"
        assert_nothing_disabled(manifest)
        assert manifest["model"]["architecture"] == model
        assert manifest["tags"]["cache"] == "miss"
    unit, tokens, k, layers = UNITS[model]
    # 4 layers x (layer_in + attn_out, mlp_out, layer_out in both modes) x every token
    assert forward["tables"]["hidden"]["rows"] == 4 * 7 * LENGTH
    assert forward["tables"]["topk"]["rows"] == len(layers) * LENGTH
    assert forward["tables"]["logits"]["rows"] == LENGTH
    assert generate["tables"]["topk"]["rows"] == len(layers) * (LENGTH + 2)
    # The capture self-check on GLM-5.3-Flash's pools: production's selection, its appended
    # tail pool aside, is the top-k of its own recomputed pool scores on every sparse row.
    # DeepSeek-V4's compressed selection runs no check (not calibrated), and its runs say so.
    check = forward["settings"].get("capture_check")
    if model == "glm5_next":
        sparse = sum(1 for p in range(LENGTH) if (p + 1) // tokens > k)
        assert check["run"] is True
        assert check["layers"] == {str(layer): {"rows": sparse, "disagree": 0, "first_token": None,
                                                "unchecked": 0, "short_of_winners": 0}
                                   for layer in layers}  # fmt: skip
    else:
        assert (check["run"], check["layers"]) == (False, {})
        assert "not calibrated" in check["why"]

    rows, version = topk_rows(runs / forward["run_id"])
    positions = torch.tensor(rows["token"])
    assert rows["k"] == [k] * len(positions)
    # visible keys are the keys of this unit whose tokens all precede the query
    assert rows["visible"] == torch.div(positions + 1, tokens, rounding_mode="floor").tolist()
    if version >= 2:  # the v2 top-k table names the unit (schemas/v2/topk.json)
        assert set(rows["unit"]) == {unit}
        assert set(rows["unit_tokens"]) == {tokens}

    (run, _) = analyze(runs)["runs"]
    assert run["onset"] is None
    assert run["hidden_verdict"] is None
    assert run["topk_verdict"] is None
    sparse = int(((positions + 1) // tokens > k).sum()) // len(layers)
    for layer in run["topk"]:
        assert layer["layer"] in layers
        assert layer["informative_rows"] == sparse > 0
        assert layer["dense_rows"] == LENGTH - sparse
        # the fp32 recompute agrees with HF's bf16 selection up to churn at the boundary
        assert layer["jaccard_no_churn"]["mean"] > 0.99


@pytest.mark.parametrize("model", sorted(UNITS))
def test_a_nan_planted_at_a_layer_is_located_there_with_the_shadow_finite(tmp_path: Path, model: str) -> None:
    _, runs = run_family(tmp_path, model, 100, "--nan-layer", "2", "--nan-token", "57", SHADOWTRACE="1")
    (manifest,) = manifests(runs)
    assert_nothing_disabled(manifest)
    (run,) = analyze(runs)["runs"]
    onset = run["onset"]
    assert (onset["step"], onset["layer"], onset["site"], onset["token"], onset["kind"]) == (
        0,
        2,
        "layer_out",
        57,
        "nan",
    )
    assert onset["shadow_finite"] is True
