"""vLLM 0.34's ShardQ read by the real `shadowtrace analyze` (issue 27): the vLLM stand-in
(hooks/tests/standins/vllm.py) replays a prefill ShardQ shards across two tensor-parallel
ranks, traced in-process rank by rank, and the same schedule on one unsharded engine. Each
rank's run holds its own rows and counts the others'; the analyzer unites the ranks' rows
into the request, so its top-k is judged, over the same rows as the unsharded run's."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, binary

sys.path.insert(0, str(REPO / "hooks" / "tests"))
from test_adapter_vllm import _trace_rank


def analyze(runs: Path, *args: str) -> dict:
    out = subprocess.run(
        [binary("shadowtrace"), "analyze", runs, "--format", "json", *args],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def layers(run: dict) -> dict[int, dict]:
    return {layer["layer"]: layer for layer in run["topk"]}


@pytest.fixture(scope="module")
def traced_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    sharded, whole = tmp_path_factory.mktemp("tp2"), tmp_path_factory.mktemp("tp1")
    with pytest.MonkeyPatch.context() as mp:
        for rank in (0, 1):
            _trace_rank(mp, sharded / f"rank{rank}", rank)
        _trace_rank(mp, whole, None)
    return sharded, whole


def test_the_ranks_rows_are_united_into_the_request_and_its_top_k_is_judged(
    traced_ranks: tuple[Path, Path],
) -> None:
    sharded, whole = traced_ranks
    merged = {r["tags"]["request"]: r for r in analyze(sharded)["runs"]}
    single = {r["tags"]["request"]: r for r in analyze(whole)["runs"]}
    assert sorted(merged) == sorted(single) == ["A", "B"]
    for request, run in merged.items():
        assert run["ranks"]["ranks"] == [0, 1]
        # every rank counted the rows the other scored, and the union makes the request whole
        assert run["counters"]["topk_rows_on_other_ranks"] > 0
        losses = [n["why"] for n in run["not_measured"]]
        assert not any("topk_rows_on_other_ranks" in why for why in losses), losses
        assert any("top-k rows of ranks 0, 1 united" in n for n in run["notes"]), run["notes"]
        # the same rows as one unsharded engine's, layer by layer
        one = layers(single[request])
        for layer, got in layers(run).items():
            want = one[layer]
            for field in ("informative_rows", "dense_rows", "rows_without_shadow"):
                assert got[field] == want[field], (request, layer, field)
            if want["jaccard"] is not None:
                assert got["jaccard"]["mean"] == pytest.approx(want["jaccard"]["mean"], abs=1e-3)
        assert (run["topk_verdict"] is None) == (single[request]["topk_verdict"] is None)


def test_ranks_whose_rows_do_not_make_the_request_whole_stay_not_judged(
    traced_ranks: tuple[Path, Path], tmp_path: Path
) -> None:
    """One rank alone (the other's runs lost): its count of the rows it did not score is
    not covered, and the top-k is not judged."""
    sharded, _ = traced_ranks
    shutil.copytree(sharded / "rank0", tmp_path / "rank0")
    (run_a, *_) = [r for r in analyze(tmp_path)["runs"] if r["tags"]["request"] == "A"]
    assert any("topk_rows_on_other_ranks" in n["why"] for n in run_a["not_measured"])
