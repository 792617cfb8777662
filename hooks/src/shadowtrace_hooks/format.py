"""Trace format v2 in pyarrow: the Arrow schema and Parquet encodings of each table, built
from the definition files alone, so Python-written runs match Rust-written ones."""

import pyarrow as pa

from shadowtrace_hooks import definitions

META_SCHEMA_VERSION = "shadowtrace.schema_version"
META_TABLE = "shadowtrace.table"
META_RUN_ID = "shadowtrace.run_id"
# A top-k part's boundary band rule, so a part moved out of its run still says what its
# per-row boundary_band is: JSON {"band", "scale", "stored"} from the run's settings.
META_BOUNDARY_BAND = "shadowtrace.boundary_band"

_ARROW_TYPES = {
    "i32": pa.int32(),
    "i64": pa.int64(),
    "f32": pa.float32(),
    "bool": pa.bool_(),
    "utf8": pa.string(),
    "list<i32>": pa.list_(pa.int32()),
    "list<f32>": pa.list_(pa.float32()),
    "list<bool>": pa.list_(pa.bool_()),
}
_PARQUET_ENCODINGS = {
    "delta": "DELTA_BINARY_PACKED",
    "byte_stream_split": "BYTE_STREAM_SPLIT",
    "plain": "PLAIN",
}


def columns(table: str) -> list[dict]:
    """The table's column definitions, in file order."""
    return definitions.load(table)["columns"]


def arrow_schema(table: str) -> pa.Schema:
    """The table's Arrow schema, with the format version and table name in its metadata."""
    fields = [pa.field(c["name"], _ARROW_TYPES[c["type"]], nullable=c["nullable"]) for c in columns(table)]
    metadata = {META_SCHEMA_VERSION: str(definitions.SCHEMA_VERSION), META_TABLE: table}
    return pa.schema(fields, metadata=metadata)


def parquet_options(table: str) -> dict:
    """Keyword arguments for `pyarrow.parquet.ParquetWriter`: the encoding each column's
    definition names (list values by their leaf path), zstd, dictionaries only where named."""
    dictionary = [c["name"] for c in columns(table) if c["encoding"] == "dictionary"]
    encoding = {}
    for c in columns(table):
        if c["encoding"] in _PARQUET_ENCODINGS:
            leaf = f"{c['name']}.list.element" if c["type"].startswith("list<") else c["name"]
            encoding[leaf] = _PARQUET_ENCODINGS[c["encoding"]]
    return {"compression": "zstd", "use_dictionary": dictionary, "column_encoding": encoding}
