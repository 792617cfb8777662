"""Python tools read what the Rust writer wrote, against the shipped definitions.

The definitions in schemas/v2 (top-k, manifest) and schemas/v1 (the rest, which v2
keeps) are the contract between producers (Rust tracer, Python hooks) and consumers
(analyzer, notebooks, DuckDB, Spark). These tests read a run written by the Rust writer
with pyarrow, polars and DuckDB, and validate its manifest with an independent JSON
Schema validator; v1 runs an older build wrote still validate against v1's schema.
"""

import json
import subprocess
from pathlib import Path

import duckdb
import jsonschema
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, SCHEMAS, binary
from shadowtrace_hooks import format

TABLES = ["hidden", "topk", "events", "logits"]
SCHEMAS_V2 = REPO / "schemas" / "v2"
V1_FIXTURES = REPO / "tests" / "fixtures" / "v1"
# The definition files' types in pyarrow, restated here rather than taken from a producer.
ARROW_TYPES = {
    "i32": pa.int32(),
    "i64": pa.int64(),
    "f32": pa.float32(),
    "bool": pa.bool_(),
    "utf8": pa.string(),
    "list<i32>": pa.list_(pa.int32()),
    "list<f32>": pa.list_(pa.float32()),
    "list<bool>": pa.list_(pa.bool_()),
}


def definition(table: str) -> dict:
    """The table's definition in trace format v2: v2's top-k, v1's for the rest."""
    folder = SCHEMAS_V2 if table == "topk" else SCHEMAS
    return json.loads((folder / f"{table}.json").read_text())


def defined_schema(table: str) -> pa.Schema:
    return pa.schema(
        [
            pa.field(c["name"], ARROW_TYPES[c["type"]], nullable=c["nullable"])
            for c in definition(table)["columns"]
        ]
    )


@pytest.mark.parametrize("table", TABLES)
def test_every_part_file_has_the_defined_arrow_schema(demo_run: Path, table: str) -> None:
    parts = sorted((demo_run / table).glob("part-*.parquet"))
    assert parts, f"the demo writes {table}"
    for part in parts:
        got = pq.read_schema(part)
        assert got.remove_metadata().equals(defined_schema(table)), f"{part}:\n{got}"
        if table != "topk":
            # The Python hooks build their schema from the same definition: both producers
            # agree. (Their v2 top-k is the hooks' own change; this test pins the Rust side.)
            assert got.remove_metadata().equals(format.arrow_schema(table).remove_metadata())
        metadata = pq.read_metadata(part).metadata
        assert metadata[b"shadowtrace.schema_version"] == b"2"
        assert metadata[b"shadowtrace.table"] == table.encode()
        # A top-k part says what its per-row boundary_band is, as the run's settings do.
        settings = json.loads((demo_run / "manifest.json").read_text())["settings"]
        rule = json.loads(metadata[b"shadowtrace.boundary_band"]) if table == "topk" else None
        assert rule == (
            {"band": settings["boundary_band"], "scale": settings["boundary_band_scale"],
             "stored": settings["boundary_stored"]}
            if table == "topk" else None
        )  # fmt: skip
        assert table == "topk" or b"shadowtrace.boundary_band" not in metadata


def test_the_manifest_validates_against_its_json_schema(demo_run: Path) -> None:
    schema = json.loads((SCHEMAS_V2 / "manifest.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    manifest = json.loads((demo_run / "manifest.json").read_text())
    assert manifest["schema_version"] == 2
    jsonschema.Draft202012Validator(schema).validate(manifest)
    assert manifest["status"] == "complete"


def test_v1_manifests_of_an_older_build_still_validate_against_v1s_schema() -> None:
    schema = json.loads((SCHEMAS / "manifest.schema.json").read_text())
    manifests = sorted(V1_FIXTURES.glob("*/manifest.json"))
    assert manifests
    for path in manifests:
        manifest = json.loads(path.read_text())
        assert manifest["schema_version"] == 1
        jsonschema.Draft202012Validator(schema).validate(manifest)


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
    for column in ["prod_only_gaps", "shadow_only_gaps", "prod_boundary_gaps", "shadow_boundary_gaps"]:
        # Sorted ascending and gap-coded: every gap after the first is positive.
        unsorted = topk.filter(pl.col(column).list.slice(1).list.eval(pl.element() <= 0).list.any())
        assert unsorted.height == 0, f"{column}: key lists are stored sorted and gap-coded"


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
    assert doc["manifest"] == json.loads((SCHEMAS_V2 / "manifest.schema.json").read_text())
    assert doc["v1"]["tables"]["topk"] == json.loads((SCHEMAS / "topk.json").read_text())
    assert doc["v1"]["manifest"] == json.loads((SCHEMAS / "manifest.schema.json").read_text())
    assert doc["vocabulary"] == json.loads((SCHEMAS / "vocabulary.json").read_text())
