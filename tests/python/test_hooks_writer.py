"""Runs written by the Python hooks are runs the Rust analyzer reads, and the hooks read
the environment exactly as the Rust side does."""

import json
import math
import subprocess
import sys
from pathlib import Path

import jsonschema
import pyarrow.parquet as pq
import pytest
from conftest import SCHEMAS, binary
from shadowtrace_hooks import format
from shadowtrace_hooks.config import resolve
from shadowtrace_hooks.writer import RunWriter

IDENTITY = {
    "run_id": "py-run",
    "model": {
        "name": "synthetic/tiny",
        "architecture": "glm_moe_dsa",
        "config_hash": "0" * 64,
        "revision": None,
        "num_layers": 2,
        "index_topk": 4,
    },
    "engine": {"name": "transformers", "version": "test", "commit": None, "variant": None},
    "device": {"kind": "cpu", "name": "cpu", "index": None},
    "dtypes": {"prod": "bf16", "shadow": "fp32"},
    "parallelism": {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "rank": 0, "world_size": 1},
    "shadow": {"precision": "fp32", "modes": ["local"]},
    "prompt": {"kind": "tool", "length": 8, "token_hash": "ab" * 32, "salt_id": None},
    "settings": {},
    "tags": {"written_by": "pytest"},
    "injections": [],
}


def hidden(layer: int, token: int, nan: int = 0) -> dict:
    err = math.nan if nan else 1e-3
    return {
        "seq": layer * 100 + token, "step": 0, "layer": layer, "site": "layer_out", "token": token,
        "shadow_mode": "local", "numel": 16, "prod_nan": nan, "prod_pos_inf": 0, "prod_neg_inf": 0,
        "prod_max_abs": 1.0, "prod_l2": 2.0, "shadow_nan": 0, "shadow_pos_inf": 0, "shadow_neg_inf": 0,
        "shadow_max_abs": 1.0, "shadow_l2": 2.0, "rel_l2_err": err, "cosine": 1.0, "max_abs_diff": err,
    }  # fmt: skip


def write_run(run_dir: Path) -> dict:
    writer = RunWriter(run_dir, IDENTITY)
    for layer in range(2):
        for token in range(8):
            assert writer.send("hidden", hidden(layer, token, nan=int(layer == 1 and token == 5)))
        for token in range(4, 8):
            writer.send(
                "topk",
                {
                    "step": 0, "layer": layer, "token": token, "shadow_input": "raw", "indexer_layer": layer,
                    "k": 4, "visible": token + 1, "prod_indices": [0, 1, 2, 3],
                    "prod_kth_score": 1.0, "prod_kth_margin": 0.1, "shadow_indices": [0, 1, 2, token],
                    "shadow_kth_score": 1.0, "shadow_kth_margin": 0.1,
                },
            )  # fmt: skip
    writer.send("logits", {"step": 0, "token": 7, "prod_top_ids": [5, 6], "prod_top_logprobs": [-0.1, -2.0]})
    return writer.close()


def test_a_python_run_is_read_by_the_rust_analyzer(tmp_path: Path) -> None:
    run = tmp_path / "py-run"
    manifest = write_run(run)
    assert manifest["status"] == "complete"
    jsonschema.Draft202012Validator(json.loads((SCHEMAS / "manifest.schema.json").read_text())).validate(
        manifest
    )
    inspect = subprocess.run(
        [binary("shadowtrace"), "inspect", run], capture_output=True, text=True, check=False
    )
    assert inspect.returncode == 0, inspect.stderr
    assert "written by shadowtrace-hooks" in inspect.stdout
    out = subprocess.run(
        [binary("shadowtrace"), "analyze", run, "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    (result,) = json.loads(out.stdout)["runs"]
    onset = result["onset"]
    assert (onset["layer"], onset["site"], onset["token"], onset["shadow_finite"]) == (
        1,
        "layer_out",
        5,
        True,
    )
    # Query tokens 4..7 see 5..8 keys with k = 4, and the shadow swaps key 3
    # for the query's own key: |P & S| = 3, |P | S| = 5.
    assert result["topk"][0]["jaccard"]["mean"] == pytest.approx(3 / 5)


def test_python_files_have_the_defined_schema_and_encodings(tmp_path: Path) -> None:
    run = tmp_path / "py-run"
    write_run(run)
    part = run / "topk" / "part-00000.parquet"
    assert pq.read_schema(part).remove_metadata().equals(format.arrow_schema("topk").remove_metadata())
    metadata = pq.read_metadata(part)
    assert metadata.metadata[b"shadowtrace.run_id"] == b"py-run"
    encodings = {
        metadata.row_group(0).column(i).path_in_schema: metadata.row_group(0).column(i).encodings
        for i in range(metadata.num_columns)
    }
    assert "DELTA_BINARY_PACKED" in encodings["prod_indices.list.element"]
    assert "BYTE_STREAM_SPLIT" in encodings["prod_kth_score"]


def test_the_lossy_queue_accounts_for_every_row(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path / "lossy", IDENTITY, queue_mode="lossy", queue_capacity=1)
    sent = 20_000
    dropped = sum(not writer.send("hidden", hidden(0, t % 8)) for t in range(sent))
    manifest = writer.close()
    entry = manifest["tables"]["hidden"]
    assert entry["dropped_rows"] == dropped
    assert entry["rows"] + entry["dropped_rows"] == sent


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"SHADOWTRACE": "1", "SHADOWTRACE_LAYERS": "76-77, 0-3", "SHADOWTRACE_TOKENS": "last:512"},
        {
            "SHADOWTRACE_MODE": "free,local",
            "SHADOWTRACE_TAGS": "a=1,b=two",
            "SHADOWTRACE_BOUNDARY_BAND": "0.25",
        },
    ],
)
def test_python_and_rust_read_the_environment_alike(environ: dict) -> None:
    rust = subprocess.run(
        [binary("shadowtrace"), "env", "--format", "json"],
        capture_output=True,
        text=True,
        env=environ,
        check=True,
    )
    assert json.loads(rust.stdout) == resolve(environ)


def test_importing_the_hooks_package_loads_nothing_heavy() -> None:
    code = "import sys, shadowtrace_hooks; print(sorted(m for m in ('torch', 'pyarrow') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
