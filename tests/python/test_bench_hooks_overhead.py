"""The overhead benchmark cannot rot: its tiny mode runs all six processes on the CPU, and
its audit fails a run that did less than the forward it timed."""

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import bench_hooks_overhead as bench
from conftest import REPO

BENCH = REPO / "tests" / "python" / "bench_hooks_overhead.py"


def test_the_tiny_benchmark_runs_every_process_and_audits_their_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, BENCH, "--tiny", "--layers", "2", "--tokens", "64", "--repeat", "1",
         "--keep-runs", tmp_path],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    table = lines[: lines.index("goals (tiny widths: not a figure):")]
    for name in bench.MODES:
        (row,) = [line for line in table if line.strip().startswith(name)]
        assert "x" in row, row
    assert "NOT DONE" not in out.stdout
    assert "FALLBACK" not in out.stdout, "production's indexer scores were captured, not recomputed"
    assert "goals (tiny widths: not a figure):" in lines
    for name, _ in bench.GOALS:
        (goal,) = [line for line in lines if line.strip().startswith(f"{name}: ")]
        assert goal.endswith((": met", ": missed")), goal
    (volume,) = [line for line in lines if line.strip().startswith("volume, fp32 local shadow at 64 tokens")]
    assert "MB per layer, goal <= 1 MB" in volume
    # each traced mode wrote one complete run per forward (warm-up and timed)
    for i, env in enumerate(bench.MODES.values()):
        if env and env.get("SHADOWTRACE"):
            manifests = list((tmp_path / f"mode-{i}").glob("*/manifest.json"))
            assert len(manifests) == 2
            assert all(json.loads(m.read_text())["status"] == "complete" for m in manifests)


def test_the_tiny_benchmark_times_transformers_fp8_production_and_names_what_it_ran(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, BENCH, "--tiny", "--fp8", "--layers", "2", "--tokens", "64", "--repeat", "1",
         "--only", "capture only,fp32 local shadow", "--keep-runs", tmp_path],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    header = out.stdout.splitlines()[0]
    assert "production FP8 (transformers' fine-grained FP8" in header, header
    assert "attention sdpa" in header, "the model's own attention, not eager"
    assert "NOT DONE" not in out.stdout
    assert "FALLBACK" not in out.stdout
    # every traced run's production was FP8 and its shadow dequantized, as each manifest says
    manifests = [json.loads(m.read_text()) for m in tmp_path.glob("mode-*/*/manifest.json")]
    assert len(manifests) == 4, "two traced rows, a warm-up and a timed forward each"
    for m in manifests:
        assert m["dtypes"]["prod"] == "fp8_e4m3"
        assert m["settings"]["prod_fp8_kernel"].endswith(
            "loaded: tiny_fp8.emu_matmul (grouped tiny_fp8.per_expert.<locals>.grouped, "
            "batched tiny_fp8.per_expert.<locals>.batched)"
        )
    assert "computed by prod_fp8_kernel: " in out.stdout


def test_the_audit_names_a_disabled_capture_and_rows_a_forward_did_not_write(tmp_path: Path) -> None:
    env = bench.MODES["fp32 local shadow"]
    args = Namespace(layers=2, tokens=10)
    want = bench.expected_rows(env, 2, 10)
    assert want == {"hidden": 2 * 4 * 10, "topk": 20, "logits": 1}
    run = tmp_path / "r0"
    run.mkdir()
    tables = {t: {"rows": n} for t, n in want.items()}
    tables["topk"]["rows"] = 15
    manifest = {"run_id": "r0", "status": "complete", "counters": {"hook_errors": 1},
                "settings": {"disabled_sites": {"indexer_shadow:1": "OutOfMemoryError: CUDA out of memory"}},
                "tables": tables}  # fmt: skip
    (run / "manifest.json").write_text(json.dumps(manifest))
    _, problems, _, _ = bench.audit(tmp_path, env, args, forwards=1)
    assert problems == [
        "r0: capture indexer_shadow:1 disabled: OutOfMemoryError: CUDA out of memory",
        "r0: hook_errors = 1",
        "r0: topk has 15 rows, the forward calls for 20",
    ]


def test_each_goal_reads_met_or_missed_against_its_bound() -> None:
    ratios = {"unhooked": 1.0, "installed, SHADOWTRACE unset": 1.01, "capture only (SHADOW=none)": 1.06,
              "On (fp32 indexer shadow)": 1.149}  # fmt: skip
    args = Namespace(tiny=False, tokens=8192)
    text = bench.goals(ratios, {"fp32 local shadow": 1_000_001.0}, args)
    assert text.splitlines() == [
        "goals:",
        "  installed, SHADOWTRACE unset: 1.010x, goal <= 1.01x: met",
        "  capture only (SHADOW=none): 1.060x, goal <= 1.05x: missed",
        "  On (fp32 indexer shadow): 1.149x, goal <= 1.15x: met",
        "  volume, fp32 local shadow at 8192 tokens: 1.000 MB per layer, goal <= 1 MB: missed",
    ]
    # rows not run say nothing; a volume measured at another length says so
    text = bench.goals({"unhooked": 1.0}, {"fp32 local shadow": 5e5}, Namespace(tiny=True, tokens=64))
    assert text.splitlines() == [
        "goals (tiny widths: not a figure):",
        "  volume, fp32 local shadow at 64 tokens (the goal is at 8192): 0.500 MB per layer, "
        "goal <= 1 MB: met",
    ]


def test_the_on_row_records_every_site_for_prod_only_and_one_topk_row_per_token() -> None:
    env = bench.MODES["On (fp32 indexer shadow)"]
    assert bench.expected_rows(env, 2, 10) == {"hidden": 2 * 4 * 10, "topk": 20, "logits": 1}
