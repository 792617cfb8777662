"""Python tools read what the Rust writer wrote, against the shipped definitions.

The definitions in schemas/v1 are the contract between producers (Rust tracer,
Python hooks) and consumers (analyzer, notebooks, DuckDB, Spark). These tests
read a run written by the Rust writer with pyarrow, polars and DuckDB, and
validate its manifest with an independent JSON Schema validator.
"""

import json
import subprocess
from pathlib import Path

import duckdb
import jsonschema
import polars as pl
import pyarrow.parquet as pq
import pytest
from conftest import SCHEMAS, binary
from shadowtrace_hooks import format

TABLES = ["hidden", "topk", "events", "logits"]


def definition(table: str) -> dict:
    return json.loads((SCHEMAS / f"{table}.json").read_text())


@pytest.mark.parametrize("table", TABLES)
def test_every_part_file_has_the_defined_arrow_schema(demo_run: Path, table: str) -> None:
    parts = sorted((demo_run / table).glob("part-*.parquet"))
    assert parts, f"the demo writes {table}"
    for part in parts:
        got = pq.read_schema(part)
        # The Python hooks build their schema from the same definition: both producers agree.
        assert got.remove_metadata().equals(format.arrow_schema(table).remove_metadata()), f"{part}:\n{got}"
        metadata = pq.read_metadata(part).metadata
        assert metadata[b"shadowtrace.schema_version"] == b"1"
        assert metadata[b"shadowtrace.table"] == table.encode()


def test_the_manifest_validates_against_its_json_schema(demo_run: Path) -> None:
    schema = json.loads((SCHEMAS / "manifest.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    manifest = json.loads((demo_run / "manifest.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(manifest)
    assert manifest["status"] == "complete"


def test_polars_reads_the_runs_directory_as_one_dataset(demo_runs: Path) -> None:
    manifests = [json.loads(p.read_text()) for p in demo_runs.glob("*/manifest.json")]
    assert len(manifests) == 8
    for table in TABLES:
        frame = pl.read_parquet(demo_runs / "*" / table / "*.parquet")
        assert frame.height == sum(m["tables"][table]["rows"] for m in manifests), table
        # Every run writes each table: the reference engine checks its KV sentinels each step.
        assert frame["run_id"].n_unique() == 8, table
    # Only the run with the planted NaN has non-finite events.
    events = pl.read_parquet(demo_runs / "*" / "events" / "*.parquet")
    assert events.filter(pl.col("kind") != "sentinel")["run_id"].n_unique() == 1
    topk = pl.read_parquet(demo_runs / "*" / "topk" / "*.parquet")
    unsorted = topk.filter(pl.col("prod_indices") != pl.col("prod_indices").list.sort())
    assert unsorted.height == 0, "index lists are stored sorted"


def test_duckdb_reads_the_runs_directory_without_shadowtrace(demo_runs: Path) -> None:
    pattern = str(demo_runs / "*" / "hidden" / "*.parquet")
    ((nan_rows,),) = duckdb.sql(
        f"select count(*) from read_parquet('{pattern}') where prod_nan > 0"
    ).fetchall()
    # The demo plants one NaN in glm-tool-3k at layer 3 (its last) mlp_out,
    # token 2500; it reaches that token's layer_out and nothing else.
    assert nan_rows == 2


def test_schema_json_is_exactly_the_shipped_definitions() -> None:
    out = subprocess.run(
        [binary("shadowtrace"), "schema", "--format", "json"], check=True, capture_output=True
    )
    doc = json.loads(out.stdout)
    for table in TABLES:
        assert doc["tables"][table] == definition(table)
    assert doc["manifest"] == json.loads((SCHEMAS / "manifest.schema.json").read_text())
    assert doc["vocabulary"] == json.loads((SCHEMAS / "vocabulary.json").read_text())
