"""Writing runs in trace format v1, off the caller's thread.

The contract is the Rust writer's (tracer/src/writer): rows go through a bounded queue
(blocking, or lossy with every dropped row counted), a worker thread encodes them into
Parquet part files written under `.tmp` names and renamed when complete, and manifest.json
says `incomplete` until `close()`. A failure inside the worker is counted and stops writing;
it never raises into the traced engine's code path (`send` never raises).
"""

import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shadowtrace_hooks import definitions, format
from shadowtrace_hooks.numerics import Lists

TMP_SUFFIX = ".tmp"


class _Columns:
    def __init__(self, columns: dict, rows: int) -> None:
        self.columns, self.rows = columns, rows


_CLOSE_RUN = object()
_BATCH_ROWS = {"topk": 256, "hidden": 8192, "events": 8192, "logits": 8192}
_ROW_GROUP_ROWS = {"topk": 4096, "hidden": 1 << 20, "events": 1 << 16, "logits": 1 << 16}
_PART_MAX_BYTES = 256 << 20


def _now_ms() -> int:
    return int(time.time() * 1000)


def write_json_atomically(path: Path, document: Any) -> None:
    """Writes JSON under a temporary name and renames it: readers see old or new, never half."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    tmp.replace(path)


class _Table:
    """Rows of one table: buffered, written in batches, rolled into parts by size."""

    def __init__(self, run_dir: Path, name: str, run_id: str) -> None:
        self.run_dir, self.name, self.run_id = run_dir, name, run_id
        self.schema = format.arrow_schema(name)
        self.names = [c["name"] for c in format.columns(name)]
        self.buffer: list[dict] = []
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.part: pq.ParquetWriter | None = None
        self.part_path: Path | None = None
        self.part_rows = 0
        self.next_part = 0
        self.relative = ""
        self.files: list[str] = []
        self.rows = 0
        self.closed = False

    def push(self, row: dict) -> None:
        self.buffer.append(row)
        if len(self.buffer) >= _BATCH_ROWS[self.name]:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            columns = {n: [r.get(n) for r in self.buffer] for n in self.names if n != "run_id"}
            columns = {"run_id": [self.run_id] * len(self.buffer), **columns}
            self.buffer = []
            self.pending.append(pa.table(columns, schema=self.schema))
        if self.pending:
            batch = pa.concat_tables(self.pending) if len(self.pending) > 1 else self.pending[0]
            self.pending, self.pending_rows = [], 0
            self.write(batch)

    def push_columns(self, columns: dict, rows: int) -> None:
        """Writes a batch given as columns: numpy arrays, `Lists`, one scalar for every row,
        or absent for null."""
        arrays = []
        for field in self.schema:
            value = self.run_id if field.name == "run_id" else columns.get(field.name)
            arrays.append(_column(value, field.type, rows))
        if self.buffer:
            self.flush()
        # Batches gather into row groups of the table's size, not one group per capture.
        self.pending.append(pa.Table.from_arrays(arrays, schema=self.schema))
        self.pending_rows += rows
        if self.pending_rows >= _ROW_GROUP_ROWS[self.name]:
            self.flush()

    def write(self, batch: pa.Table) -> None:
        if self.part is None:
            relative = f"{self.name}/part-{self.next_part:05}.parquet"
            self.next_part += 1
            self.part_path = self.run_dir / (relative + TMP_SUFFIX)
            self.part_path.parent.mkdir(parents=True, exist_ok=True)
            metadata = {format.META_RUN_ID: self.run_id}
            self.part = pq.ParquetWriter(
                self.part_path,
                self.schema.with_metadata({**self.schema.metadata, **metadata}),
                **format.parquet_options(self.name),
            )
            self.relative = relative
        self.part.write_table(batch, row_group_size=_ROW_GROUP_ROWS[self.name])
        self.part_rows += batch.num_rows
        if self.part_path is not None and self.part_path.stat().st_size >= _PART_MAX_BYTES:
            self.finish_part()

    def finish_part(self) -> None:
        if self.part is None or self.part_path is None:
            return
        self.part.close()
        with self.part_path.open("rb") as f:
            os.fsync(f.fileno())
        self.part_path.replace(self.run_dir / self.relative)
        self.files.append(self.relative)
        self.rows += self.part_rows
        self.part, self.part_path, self.part_rows = None, None, 0

    def close(self) -> None:
        if not self.closed:
            self.flush()
            self.finish_part()
            self.closed = True


def _column(value: Any, kind: pa.DataType, rows: int) -> pa.Array:
    if value is None:
        return pa.nulls(rows, kind)
    if isinstance(value, Lists):
        offsets = pa.array(value.offsets, pa.int32())
        return pa.ListArray.from_arrays(offsets, pa.array(value.values, kind.value_type), type=kind)
    if isinstance(value, np.ndarray):
        if len(value) != rows:
            raise ValueError(f"column of {len(value)} rows in a batch of {rows}")
        return pa.array(value, kind)
    return pa.array([value] * rows, kind)


class RunWriter:
    """Writes one run. Rows are dicts keyed by column name (missing nullable columns are
    null; `run_id` is filled in). `send` never raises: a row it cannot queue is counted."""

    def __init__(
        self,
        run_dir: Path,
        identity: dict,
        *,
        queue_mode: str = "blocking",
        queue_capacity: int = 4096,
        tool_version: str = "0.1.0",
    ) -> None:
        self.run_dir = Path(run_dir)
        if (self.run_dir / "manifest.json").exists():
            raise FileExistsError(f"run directory {self.run_dir}: already holds a run (manifest.json exists)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.mode = queue_mode
        self.dropped = dict.fromkeys(definitions.TABLES, 0)
        self.rejected = 0  # rows for a table the format does not have
        # The producer's own counts (hook errors, skipped captures), merged into the manifest's.
        self.counters: dict[str, int] = {}
        self.errors: list[str] = []
        self._count = threading.Lock()
        settings = {
            **identity.get("settings", {}),
            "queue_mode": queue_mode,
            "queue_capacity": queue_capacity,
        }
        self.manifest = {
            "schema_version": definitions.SCHEMA_VERSION,
            "tool": {"name": "shadowtrace-hooks", "version": tool_version},
            "status": "incomplete",
            "started_unix_ms": _now_ms(),
            "closed_unix_ms": None,
            **identity,
            "settings": settings,
            "tables": {},
            "counters": {},
        }
        self.tables = {name: _Table(self.run_dir, name, identity["run_id"]) for name in definitions.TABLES}
        self._write_manifest()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_capacity)
        self._worker = threading.Thread(
            target=self._run, name=f"shadowtrace-writer-{identity['run_id']}", daemon=True
        )
        self._worker.start()

    def send(self, table: str, row: dict) -> bool:
        """Queues a row of `table`; False (and counted) when it was dropped."""
        if table not in self.tables:
            with self._count:
                self.rejected += 1
            return False
        try:
            if self.errors:
                raise queue.Full
            if self.mode == "lossy":
                self._queue.put_nowait((table, row))
            else:
                self._queue.put((table, row))
        except queue.Full:
            self._drop(table)
            return False
        return True

    def send_columns(self, table: str, columns: dict, rows: int) -> bool:
        """Queues `rows` rows of `table` given as columns (see `_Table.push_columns`);
        False (and all of them counted) when they were dropped."""
        if rows == 0:
            return True
        if table not in self.tables:
            with self._count:
                self.rejected += rows
            return False
        try:
            if self.errors:
                raise queue.Full
            item = (table, _Columns(columns, rows))
            if self.mode == "lossy":
                self._queue.put_nowait(item)
            else:
                self._queue.put(item)
        except queue.Full:
            self._drop(table, rows)
            return False
        return True

    def _drop(self, table: str, rows: int = 1) -> None:
        with self._count:
            self.dropped[table] += rows

    def close(self) -> dict:
        """Finishes every table, marks the run complete and returns the manifest."""
        self._queue.put(_CLOSE_RUN)
        self._worker.join()
        if self.errors:
            raise RuntimeError(f"run {self.manifest['run_id']}: writer failed: {self.errors[0]}")
        return self.manifest

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _CLOSE_RUN:
                break
            table, payload = item
            batch = isinstance(payload, _Columns)
            if self.errors:
                self._drop(table, payload.rows if batch else 1)
                continue
            try:
                if batch:
                    self.tables[table].push_columns(payload.columns, payload.rows)
                else:
                    self.tables[table].push(payload)
            except Exception as e:
                self.errors.append(f"{table}: {e}")
        try:
            for table in self.tables.values():
                table.close()
            self._write_manifest(complete=not self.errors)
        except Exception as e:
            self.errors.append(str(e))

    def _write_manifest(self, *, complete: bool = False) -> None:
        m = self.manifest
        m["tables"] = {
            name: {
                "status": "complete" if t.closed else "incomplete",
                "rows": t.rows,
                "dropped_rows": self.dropped[name],
                "files": list(t.files),
            }
            for name, t in self.tables.items()
        }
        m["counters"] = {
            "dropped_rows": sum(self.dropped.values()),
            "rejected_rows": self.rejected,
            "writer_errors": len(self.errors),
            **self.counters,
        }
        if complete:
            m["status"] = "complete"
            m["closed_unix_ms"] = _now_ms()
        write_json_atomically(self.run_dir / "manifest.json", m)
