"""The Triton kernels' torch counterparts and dispatch, and (through kernel_cases.py, in a
process of its own) the kernels themselves in Triton's CPU interpreter. The GPU's
tensor-core products are measured against fp64 by tests/gpu/kernels_h200.py."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from shadowtrace_hooks import kernels, numerics, shadow


def test_the_kernels_match_torch_and_fp64_in_tritons_interpreter():
    pytest.importorskip("triton")
    cases = Path(__file__).with_name("kernel_cases.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout, done.stdout[-2000:]
    assert "skipped" not in done.stdout, done.stdout[-2000:]


def _operands(t: int, s: int, h: int = 4, d: int = 32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=gen)
    k = torch.randn(s, d, generator=gen)
    w = torch.randn(t, h, generator=gen)
    # a chunk of queries after a cached prefix: query t sees keys up to s - t + its row
    q_pos = torch.arange(s - t, s)
    return q, k, w, q_pos


def test_split_tf32_leaves_a_tf32_head_and_an_exact_remainder():
    x = torch.randn(1000) * torch.logspace(-20, 20, 1000)
    hi, lo = numerics.split_tf32(x)
    assert torch.equal(hi + lo, x)
    assert torch.equal(hi.view(torch.int32) & 0x1FFF, torch.zeros(1000, dtype=torch.int32))
    assert bool((lo.abs() <= x.abs() * 2.0**-10).all())


def test_the_shadow_scores_name_what_computed_them_in_the_manifest():
    settings: dict = {}
    # The run's writer as far as the shadow uses it: its only way to change a manifest.
    writer = SimpleNamespace(set_setting=lambda key, value, keep=False: settings.__setitem__(key, value))
    run = SimpleNamespace(writer=writer)
    q, k, w, q_pos = _operands(t=20, s=20)
    got = shadow.indexer_scores(run, q, k, w, q_pos, q_pos_host=q_pos.numpy())
    assert torch.equal(got, numerics.index_scores(q, k, w, q_pos))
    assert settings["shadow_indexer_scores"] == "torch ieee"


def test_the_kernels_refuse_what_they_cannot_score():
    q = torch.zeros(4, 2, 24)
    assert kernels.unavailable("index_scores", q) == "head size 24 is not a power of two >= 16"
    assert kernels.unavailable("row_stats", torch.zeros(4, 8)) == "device cpu (Triton runs on CUDA)"
    with pytest.raises(ValueError, match="expected one of"):
        numerics.index_scores(q, torch.zeros(3, 24), torch.zeros(4, 2), torch.arange(4), matmul="tf32")


def test_a_kernel_that_raised_is_counted_in_the_manifest_of_every_run_closed_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    import numpy as np
    from shadowtrace_hooks import session

    monkeypatch.setattr(kernels, "failed", {"row_stats": "the kernel raised RuntimeError: no such tile"})
    settings = session.Settings.from_environ({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)})
    sess = session.start(settings)
    try:
        run = sess.open_run(
            token_ids=[1, 2, 3],
            model={"name": "t", "architecture": "glm_moe_dsa", "config_hash": "0" * 64, "revision": None,
                   "num_layers": 1, "index_topk": 4},
            engine={"name": "transformers", "version": "test", "commit": None, "variant": None},
            device={"kind": "cpu", "name": "cpu", "index": None},
            dtypes={"prod": "bf16", "shadow": None},
        )  # fmt: skip
        run.step = 0
        run.logits(torch.randn(3, 5), None, np.arange(3))
        sess.close_run(run)
    finally:
        session.stop()
    (manifest,) = tmp_path.glob("*/manifest.json")
    counters = json.loads(manifest.read_text())["counters"]
    assert counters["process.kernel_failed.row_stats"] == 1
    assert "process.kernel_failed.compare_masks" not in counters
