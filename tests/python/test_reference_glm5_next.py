"""The Rust reference engine's GLM-5.3-Flash (`shadowtrace-run`, model::glm5_next) against
transformers 5.24's `Glm5Next` on the same `save_pretrained` checkpoint of a tiny random
model, both in fp32 on CPU: per-layer hidden states (the hyper-connection streams) of KDA
and MLA layers, dense and MoE, the k-pool indexer's selections (own and shared) and the
logits. The prompt sees up to 12 complete pools of 16 tokens against k = 4, so the sparse
regime and the incomplete-pool tail are both exercised. Also in bf16 (the dtype of every
step, bitwise through the first MLA and MoE layers) and with the unbounded KDA forget gate.
Then the same checkpoint traced: a v2 run whose selections `shadowtrace analyze` reads in
k-pool units, and a NaN planted in production located at its layer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, binary, transformers_path
from safetensors.torch import load_file

VERSION = "5.24.0"
LENGTH = 200
POOL, K = 16, 64 // 16
# fp32 against fp32 with different reduction orders (libtorch blocking, HF's chunked KDA
# against the engine's token-by-token recurrence of the same state), relative to the
# largest magnitude of the tensor compared.
HIDDEN_REL_TOL = 1e-5
# bf16 against bf16 past the first rounding flip (see the bf16 test): the whole tensor's
# relative L2 distance within bf16's unit roundoff, 2^-8. Not a largest-element bound: one
# token whose MoE routing flips on a rounding moves a few percent, and which token that is
# depends on the CPU's bf16 kernels (2.96e-2 on this machine's AMD EPYC at layer 5, whose
# tensor sits at 2.4e-3).
BF16_REL_L2 = 2.0**-8
# FP8 production against fp32: what one layer may add to the relative L2 distance, e4m3's
# unit roundoff (3 mantissa bits); see the FP8 test.
FP8_UNIT_ROUNDOFF = 2.0**-4
# Selected tokens may differ only where a pool's score is tied with the k-th within this
# relative margin; none are expected on random weights.
TIE_REL_TOL = 1e-5
MLA_LAYERS, FULL_INDEXERS = [1, 2, 5], [1, 5]


def hf_reference(tmp: Path, length: int, *extra: str) -> dict:
    """Saves the tiny checkpoint under tmp/model and returns what transformers 5.24 computed
    on it (glm5_next_reference.py); the prompt goes to tmp/ids.json."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE") and k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, REPO / "tests" / "python" / "glm5_next_reference.py", tmp / "model", str(length),
         tmp / "hf.pt", *extra],
        capture_output=True, text=True, env={**clean, **transformers_path(VERSION)}, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    hf = torch.load(tmp / "hf.pt")
    assert hf["version"] == VERSION
    (tmp / "ids.json").write_text(json.dumps(hf["ids"].tolist()))
    return hf


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("glm5_next")
    return tmp, hf_reference(tmp, LENGTH)


def test_the_unbounded_kda_forget_gate_matches_transformers(tmp_path: Path) -> None:
    """The softplus branch of the forget gate (`linear_lower_bound` None), on a shorter
    prompt: every layer within the same tolerance."""
    hf = hf_reference(tmp_path, 48, "--softplus-gate")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["text_config"]["linear_lower_bound"] is None
    rust = rust_dump(tmp_path, "fp32")
    for i, want in hf["layer_out"].items():
        got = rust[f"layer_out.{i}"].view(want.shape)
        err = float((got - want).abs().max() / want.abs().max())
        assert err <= HIDDEN_REL_TOL, (i, err)


def test_the_bf16_path_matches_transformers_in_bf16_bitwise_until_kda_rounding(tmp_path: Path) -> None:
    """The dtype each step runs in, checked where fp32 cannot see it: the model saved in bf16
    (the modules transformers keeps in fp32 stay fp32) and run by both in bf16. Up to the
    second KDA layer every element is identical (the k-pool indexer, MLA, the hyper-connection
    casts, the MoE summing its experts in fp32 as transformers' default grouped_mm path does);
    from there KDA's fp32 state, run token by token here and in chunks by transformers,
    rounds to bf16 differently in a few elements, and that compounds, within a bf16 rounding of
    each tensor as a whole."""
    hf = hf_reference(tmp_path, LENGTH, "--bf16")
    rust = rust_dump(tmp_path, "bf16")
    for i, want in hf["layer_out"].items():
        assert want.dtype == torch.bfloat16
        got = rust[f"layer_out.{i}"].view(want.shape)
        if i < 3:
            assert torch.equal(got, want.float()), i
        err = float((got - want.float()).norm() / want.float().norm())
        assert err <= BF16_REL_L2, (i, err)
    for i, want in hf["topk"].items():
        got = rust[f"topk.{i}"]
        for t in range(LENGTH):
            assert {int(x) for x in got[t] if x >= 0} == {int(x) for x in want[t] if x >= 0}, (i, t)


def rust_dump(tmp: Path, path: str) -> dict:
    out = tmp / f"rust-{path}.safetensors"
    untraced = {k: v for k, v in os.environ.items() if k != "SHADOWTRACE"}
    run = subprocess.run(
        [binary("shadowtrace-run"), "--model", tmp / "model", tmp / "ids.json", "--path", path,
         "--dump", out],
        capture_output=True, text=True, check=False, env=untraced,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return load_file(out)


@pytest.fixture(scope="module")
def rust_fp32(reference: tuple[Path, dict]) -> dict:
    return rust_dump(reference[0], "fp32")


def test_every_layer_of_the_fp32_path_matches_transformers_glm5_next(
    reference: tuple[Path, dict], rust_fp32: dict
) -> None:
    _, hf = reference
    rust = rust_fp32
    assert sorted(hf["layer_out"]) == list(range(6))
    for i, want in hf["layer_out"].items():
        got = rust[f"layer_out.{i}"].view(want.shape)  # a token's streams end to end
        err = float((got - want).abs().max() / want.abs().max())
        assert err <= HIDDEN_REL_TOL, (i, err)
    err = float((rust["logits"] - hf["logits"]).abs().max() / hf["logits"].abs().max())
    assert err <= HIDDEN_REL_TOL, ("logits", err)
    # Only MLA layers attend through a selection; KDA layers have none.
    assert sorted(int(k.split(".")[1]) for k in rust if k.startswith("topk.")) == MLA_LAYERS
    assert sorted(hf["topk"]) == FULL_INDEXERS


def test_the_k_pool_selections_agree_with_transformers_and_the_shared_layer_reuses_them(
    reference: tuple[Path, dict], rust_fp32: dict
) -> None:
    _, hf = reference
    rust = rust_fp32
    sparse_rows = 0
    for i, want in hf["topk"].items():
        got, scores = rust[f"topk.{i}"], rust[f"index_scores.{i}"]
        assert got.shape == want.shape == (LENGTH, 64 + POOL - 1)
        for t in range(LENGTH):
            a, b = {int(x) for x in got[t] if x >= 0}, {int(x) for x in want[t] if x >= 0}
            complete = (t + 1) // POOL
            sparse_rows += complete > K
            # Every query attends its incomplete pool's tokens.
            assert set(range(complete * POOL, t + 1)) <= b, (i, t)
            if a == b:
                continue
            # A differing pool must be tied with the k-th pool's score.
            chosen = rust[f"pools.{i}"][t]
            kth = scores[t, chosen[chosen >= 0]].min()  # -1 pads a row that sees fewer pools
            for token in a ^ b:
                gap = abs(float(scores[t, token // POOL] - kth))
                assert gap <= TIE_REL_TOL * float(scores[t, :complete].abs().max()), (i, t, token)
    assert sparse_rows > 100
    # Layer 2 is `shared`: it attends exactly what layer 1's indexer selected.
    assert torch.equal(rust["topk.2"], rust["topk.1"])


def test_each_layer_of_the_fp8_production_path_adds_at_most_e4m3s_unit_roundoff_to_its_distance(
    reference: tuple[Path, dict],
) -> None:
    """Not parity (production is FP8 by design): it runs every layer finite, and each layer
    adds at most FP8 e4m3's unit roundoff (2^-4, 3 mantissa bits) to the relative L2 distance
    from transformers' fp32 numbers: a layer rounds its linears' operands to e4m3 once each,
    and the distance the earlier layers left rides along the residual stream (measured here:
    3.7e-2 after layer 0, then 0.2e-2 to 1.7e-2 a layer, 7.9e-2 after layer 5). A broken
    production path (a wrong scale, a dropped block, a NaN) moves a layer by O(1)."""
    tmp, hf = reference
    rust = rust_dump(tmp, "fp8")
    before = 0.0
    for i, want in sorted(hf["layer_out"].items()):
        got = rust[f"layer_out.{i}"].view(want.shape)
        assert torch.isfinite(got).all(), i
        err = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
        assert 0 < err <= before + FP8_UNIT_ROUNDOFF, (i, err, before)
        before = err


def test_a_traced_run_records_k_pool_selections_that_analyze_reads(reference: tuple[Path, dict]) -> None:
    tmp, _ = reference
    runs = tmp / "runs"
    manifest, analysis = trace_and_analyze(tmp, runs)
    (run_dir,) = (p for p in runs.iterdir() if p.is_dir())
    assert manifest["status"] == "complete"
    assert manifest["model"]["architecture"] == "glm5_next"
    assert manifest["counters"]["fp8_linears_emulated"] > 0
    table = pq.read_table(run_dir / "topk")
    assert int(table.schema.metadata[b"shadowtrace.schema_version"]) == 2
    rows = table.to_pydict()
    assert sorted(set(rows["layer"])) == FULL_INDEXERS
    assert set(rows["unit"]) == {"kpool"}
    assert set(rows["unit_tokens"]) == {POOL}
    assert set(rows["k"]) == {K}
    for t, visible in zip(rows["token"], rows["visible"], strict=True):
        assert visible == (t + 1) // POOL
    hidden = pq.read_table(run_dir / "hidden").to_pydict()
    sites = zip(hidden["layer"], hidden["site"], hidden["numel"], strict=True)
    numel = {(layer, site): n for layer, site, n in sites}
    # A token's 4 hyper-connection streams of 64 as one vector; a block's output is one.
    assert numel[(0, "layer_out")] == 4 * 64
    assert numel[(0, "attn_out")] == 64
    assert analysis["onset"] is None
    assert analysis["counters"]["dropped_rows"] == 0
    # Read in pools: queries 0..78 see at most k = 4 complete pools (dense rows, no
    # Jaccard), the rest more; read in tokens, every row past 64 would count.
    dense = (K + 1) * POOL - 1
    layers = {row["layer"]: row for row in analysis["topk"]}
    assert sorted(layers) == FULL_INDEXERS
    for row in layers.values():
        assert (row["dense_rows"], row["informative_rows"]) == (dense, LENGTH - dense)
        assert row["rows_without_shadow"] == 0
        assert row["jaccard"]["n"] == row["informative_rows"]


def trace_and_analyze(tmp: Path, runs: Path, *extra: str) -> tuple[dict, dict]:
    """`shadowtrace run` on the fixture's checkpoint into `runs`, then `shadowtrace analyze`:
    the run's manifest and its analysis."""
    run = subprocess.run(
        [binary("shadowtrace"), "run", "--model", tmp / "model", tmp / "ids.json", "--out", runs, *extra],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    (run_dir,) = (p for p in runs.iterdir() if p.is_dir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    out = subprocess.run(
        [binary("shadowtrace"), "analyze", runs, "--format", "json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (analysis,) = json.loads(out.stdout)["runs"]
    return manifest, analysis


def test_a_nan_planted_in_a_kda_layer_of_production_is_located_there(reference: tuple[Path, dict]) -> None:
    tmp, _ = reference
    fault = {"kind": "non_finite", "layer": 3, "site": "mlp_out", "token": 120, "channel": 5, "value": "nan"}
    manifest, analysis = trace_and_analyze(tmp, tmp / "nan-runs", "--fault", json.dumps(fault))
    assert manifest["injections"] == [fault]
    onset = analysis["onset"]
    where = (onset["layer"], onset["site"], onset["token"], onset["shadow_finite"])
    assert where == (3, "mlp_out", 120, True)


def test_what_this_engine_cannot_plant_or_run_is_refused_not_ignored(reference: tuple[Path, dict]) -> None:
    tmp, _ = reference
    nan = {"kind": "non_finite", "site": "layer_out", "token": 3, "value": "nan"}
    cases = [
        (["--fault", json.dumps({"kind": "kv_slot", "layer": 1, "token": 3})], "non_finite faults only"),
        (["--fault", json.dumps({**nan, "layer": 6, "channel": 0})], "layer 6 outside the model's 6 layers"),
        # layer_out is a token's 4 streams of 64 end to end: channel 256 is past them.
        (["--fault", json.dumps({**nan, "layer": 1, "channel": 256})], "channel 256 outside"),
        (["--fault", json.dumps({**nan, "layer": 1, "channel": 0, "token": LENGTH})], "token 200 outside"),
        (["--deviation", "logits_bf16"], "--deviation is not implemented for glm5_next"),
        (["--fp8-indexer", "sglang"], "no engine FP8 indexer variant"),
        # trtllm is the other models' default: named here, it is refused too, not dropped
        (["--fp8-indexer", "trtllm"], "no engine FP8 indexer variant"),
    ]
    for extra, needle in cases:
        run = subprocess.run(
            [binary("shadowtrace-run"), "--model", tmp / "model", tmp / "ids.json", "--out", tmp / "refused",
             *extra],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert run.returncode == 2, (extra, run.stderr)
        assert needle in run.stderr, (needle, run.stderr)
    assert not (tmp / "refused").exists()
