"""The MoE shadow never upcasts the expert bank: a model whose bank in fp32 is far beyond
the memory budget is traced with an fp32 shadow at every site, within the budget, and the
shadow's MoE is the model's own computed in fp32 (transformers' model converted to fp32
is the reference)."""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import tiny_models
import torch
from conftest import REPO
from shadowtrace_hooks import session, startup

PEAK = REPO / "tests" / "python" / "moe_peak.py"
# The bound: tracing's extra peak memory at most this share of the model's weights.
BUDGET_SHARE = 0.10


def peak(tmp: Path, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE")}
    # Large blocks straight from mmap: freed memory leaves the resident set at once, so the
    # kernel's peak counts what was live, not what the C allocator kept.
    environ = {**clean, "MALLOC_MMAP_THRESHOLD_": "65536", "SHADOWTRACE_DIR": str(tmp / "runs"), **env}
    done = subprocess.run([sys.executable, PEAK, "64"], capture_output=True, text=True, env=environ)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_moe_whose_fp32_expert_bank_exceeds_the_budget_is_traced_within_it(tmp_path: Path) -> None:
    """Measured: the peak resident memory of one forward (the kernel's VmHWM, reset just
    before it) above what the process held before it, traced minus untraced."""
    untraced = peak(tmp_path)
    traced = peak(tmp_path, SHADOWTRACE="1", SHADOWTRACE_MODE="local,free")
    budget = BUDGET_SHARE * traced["weights"]
    assert 2 * traced["bank"] > 10 * budget, "an upcast bank must be far beyond the budget"
    extra = traced["extra_peak"] - untraced["extra_peak"]
    assert extra <= budget, (
        f"tracing took {extra / 2**20:.1f} MiB more at its peak; budget {budget / 2**20:.1f}"
    )
    (manifest_path,) = sorted((tmp_path / "runs").glob("*/manifest.json"))[-1:]
    manifest = json.loads(manifest_path.read_text())
    assert manifest["status"] == "complete"
    assert manifest["settings"].get("disabled_sites") is None
    assert manifest["counters"].get("hook_errors", 0) == 0
    hidden = pq.read_table(manifest_path.parent / "hidden").to_pylist()
    moe = [r for r in hidden if r["layer"] == 1 and r["site"] == "mlp_out"]
    assert {r["shadow_mode"] for r in moe} == {"local", "free"}
    assert all(r["shadow_l2"] > 0 and math.isfinite(r["rel_l2_err"]) for r in moe)


def test_the_free_shadow_is_the_model_converted_to_fp32(tmp_path: Path) -> None:
    """The free chain runs every layer in fp32 from the embeddings: its layer outputs are
    those of transformers' own model converted to fp32 (eager experts), token by token."""
    model, ids = tiny_models.glm(), tiny_models.prompt(48)
    reference = copy.deepcopy(model).float()
    expected: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(reference.model.layers):
        layer.register_forward_hook(
            lambda m, a, out, i=i: expected.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
    with torch.no_grad():
        reference(ids)
    assert startup.activate(
        {"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path), "SHADOWTRACE_MODE": "free"}
    )
    try:
        with torch.no_grad():
            model(ids)
    finally:
        session.stop()
    (manifest_path,) = tmp_path.glob("*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    assert manifest["settings"].get("disabled_sites") is None
    rows = pq.read_table(manifest_path.parent / "hidden").to_pylist()
    free = {
        (r["layer"], r["token"]): r for r in rows if r["site"] == "layer_out" and r["shadow_mode"] == "free"
    }
    assert len(free) == 3 * 48
    for (layer, token), row in free.items():
        want = expected[layer][0, token]
        assert row["shadow_l2"] == pytest.approx(float(want.norm()), rel=1e-5), (layer, token)
        assert row["shadow_max_abs"] == pytest.approx(float(want.abs().max()), rel=1e-5), (layer, token)
