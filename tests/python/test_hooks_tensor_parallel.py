"""Tensor parallelism on CPU (gloo): a tiny GLM-5 checkpoint run with transformers'
tp_plan="auto" under torchrun on two ranks, traced with SHADOWTRACE=1. Both ranks write
their own run without collision, the analyzer reads them as one run, and its verdicts
equal those of the same checkpoint and prompt on one rank. On the virtualenv's transformers
(5.17) the plan shards the routed experts (DTensor banks, upcast per rank for the shadow);
5.25's plan leaves them replicated (only the shared experts and attention are sharded)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from conftest import REPO, binary, transformers_path

SCRIPT = REPO / "tests" / "python" / "tp_tiny.py"
LENGTH, NAN_LAYER, NAN_TOKEN = 2300, 1, 2100
# TP splits bf16 reductions differently from one rank: per-layer mean churn-free Jaccard
# of the two traces may differ by this much.
JACCARD_TOLERANCE = 0.02


def trace(tmp: Path, model: Path, ranks: int, version: str) -> Path:
    runs = tmp / f"runs-tp{ranks}"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE")}
    env = {**clean, "SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(runs), "OMP_NUM_THREADS": "1"}
    env.update(transformers_path(version))
    args = [SCRIPT, model, str(LENGTH), tmp / f"logits-{ranks}.pt", "--nan-layer", str(NAN_LAYER)]
    args += ["--nan-token", str(NAN_TOKEN)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd = [*launcher, *args] if ranks > 1 else [sys.executable, *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    return runs


def layer_of(verdict: dict | None) -> int | None:
    return None if verdict is None else verdict["layer"]


def analyze(runs: Path) -> list[dict]:
    out = subprocess.run(
        [binary("shadowtrace"), "analyze", runs, "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode in (0, 1), out.stderr
    return json.loads(out.stdout)["runs"]


@pytest.mark.parametrize("version", list(dict.fromkeys([transformers.__version__, "5.25.0"])))
def test_two_ranks_write_apart_and_read_as_one_run_with_the_single_rank_verdicts(
    tmp_path: Path, version: str
) -> None:
    model = tmp_path / "model"
    subprocess.run([sys.executable, SCRIPT, model, "--save"], check=True, capture_output=True)
    single, double = trace(tmp_path, model, 1, version), trace(tmp_path, model, 2, version)

    dirs = sorted(p.name for p in double.iterdir())
    assert len(dirs) == 2
    assert [d.split("-rank")[1].split("-")[0] for d in dirs] == ["0", "1"]
    manifests = [json.loads((double / d / "manifest.json").read_text()) for d in dirs]
    assert [m["parallelism"]["rank"] for m in manifests] == [0, 1]
    assert all(m["parallelism"]["world_size"] == 2 and m["status"] == "complete" for m in manifests)
    assert manifests[0]["tags"]["request"] == manifests[1]["tags"]["request"]
    assert all(m["engine"]["version"] == version for m in manifests)
    # every shadow ran on both ranks; sharded expert banks were upcast per rank, and said so
    assert all(m["settings"].get("disabled_sites") is None for m in manifests)
    upcast = 2 if version < "5.25" else None  # 2 MoE layers; 5.25 replicates the routed experts
    assert all(m["counters"].get("shadow_expert_bank_upcast") == upcast for m in manifests)

    (one,) = analyze(single)
    (merged,) = analyze(double)
    assert merged["ranks"]["ranks"] == [0, 1]
    assert merged["ranks"]["same_verdicts"] is True
    assert merged["ranks"]["max_jaccard_diff"] == 0.0  # replicated indexer: ranks agree exactly
    for key in ("layer", "site", "token", "kind", "shadow_finite"):
        assert merged["onset"][key] == one["onset"][key], key
    assert (merged["onset"]["layer"], merged["onset"]["token"]) == (NAN_LAYER, NAN_TOKEN)
    for verdict in ("hidden_verdict", "topk_verdict"):
        assert layer_of(merged[verdict]) == layer_of(one[verdict]), verdict
    for a, b in zip(merged["topk"], one["topk"], strict=True):
        assert a["layer"] == b["layer"]
        assert a["informative_rows"] == b["informative_rows"] == LENGTH - 2048
        if a["jaccard_no_churn"] and b["jaccard_no_churn"]:
            assert abs(a["jaccard_no_churn"]["mean"] - b["jaccard_no_churn"]["mean"]) <= JACCARD_TOLERANCE
