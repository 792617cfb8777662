"""Writing runs in trace format v1, off the caller's thread, without losing a row unseen.

The contract is the Rust writer's (tracer/src/writer):

- rows go through a queue bounded in bytes; when it is full, `blocking` waits for room and
  `lossy` drops; every wait has a deadline, and a row that misses it is dropped; every
  dropped row is counted (`tables.<t>.dropped_rows`);
- a worker thread encodes rows into Parquet part files written under `.tmp` names and
  renamed when complete;
- manifest.json is rewritten atomically whenever a part completes, and at most every
  `_MANIFEST_EVERY_S` seconds while rows arrive, so a killed process leaves a manifest that
  lists its complete parts and how many rows the producer had handed over (`sent_rows`, also
  rewritten after a second without rows):
  what was sent and is neither written nor counted as dropped was lost, and readers say so;
- it says `incomplete` until `close()` has written every row; a close that cannot finish
  in time (the flush deadline), or a run whose request was interrupted, stays `incomplete`
  with the rows still queued counted (`counters.unflushed_rows`).

Nothing here raises into the traced engine's code path: `send` never raises; `close`
raises only when the writer failed, and the session catches it.
"""

import json
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shadowtrace_hooks import definitions, format
from shadowtrace_hooks.numerics import Lists

TMP_SUFFIX = ".tmp"

_BATCH_ROWS = {"topk": 256, "hidden": 8192, "events": 8192, "logits": 8192}
_ROW_GROUP_ROWS = {"topk": 4096, "hidden": 1 << 20, "events": 1 << 16, "logits": 1 << 16}
_PART_MAX_BYTES = 256 << 20
# A row given as a dict: its size in the queue, for the byte bound (lists counted apart).
_ROW_BYTES = 256
# While rows arrive, the manifest's sent and written counts are at most this old on disk.
_MANIFEST_EVERY_S = 1.0


def _now_ms() -> int:
    return int(time.time() * 1000)


def write_json_atomically(path: Path, document: Any) -> None:
    """Writes JSON under a temporary name and renames it: readers see old or new, never half."""
    tmp = path.with_name(f"{path.name}.{threading.get_ident()}{TMP_SUFFIX}")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    tmp.replace(path)


class _Columns:
    def __init__(self, columns: dict, rows: int) -> None:
        self.columns, self.rows = columns, rows


class _Table:
    """Rows of one table: buffered, written in batches, rolled into parts by size."""

    def __init__(self, run_dir: Path, name: str, run_id: str, on_part: Any) -> None:
        self.run_dir, self.name, self.run_id, self.on_part = run_dir, name, run_id, on_part
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
        self.rows = 0  # rows in completed parts
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
        self.on_part()

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


def _nbytes(columns: dict) -> int:
    """What a batch holds in memory while queued: its arrays' bytes."""
    total = 0
    for value in columns.values():
        if isinstance(value, Lists):
            total += value.values.nbytes + value.offsets.nbytes
        elif isinstance(value, np.ndarray):
            total += value.nbytes
        else:
            total += 8
    return total


_CLOSE = object()


class RunWriter:
    """Writes one run. Rows are dicts keyed by column name (missing nullable columns are
    null; `run_id` is filled in), or batches of columns. `send` never raises: a row it
    cannot queue is dropped and counted."""

    def __init__(
        self,
        run_dir: Path,
        identity: dict,
        *,
        queue_mode: str = "blocking",
        queue_bytes: int = 256 << 20,
        queue_timeout_s: float = 30.0,
        flush_timeout_s: float = 30.0,
        tool_version: str = "0.1.0",
    ) -> None:
        self.run_dir = Path(run_dir)
        if (self.run_dir / "manifest.json").exists():
            raise FileExistsError(f"run directory {self.run_dir}: already holds a run (manifest.json exists)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.mode = queue_mode
        self.capacity = queue_bytes
        self.queue_timeout_s, self.flush_timeout_s = queue_timeout_s, flush_timeout_s
        self.sent = dict.fromkeys(definitions.TABLES, 0)
        self.dropped = dict.fromkeys(definitions.TABLES, 0)
        self.rejected = 0  # rows for a table the format does not have
        # The producer's own counts (hook errors, skipped captures), merged into the manifest's.
        self.counters: dict[str, int] = {}
        self.errors: list[str] = []
        self.interrupted = False
        self._lock = threading.Lock()  # counts, the manifest document and its file
        self._ready = threading.Condition()  # the queue
        self._queue: deque = deque()
        self._queued_bytes = 0
        self._closing = False
        self._finished = threading.Event()
        self._last_manifest = 0.0
        settings = {
            **identity.get("settings", {}),
            "queue_mode": queue_mode,
            "queue_bytes": queue_bytes,
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
        run_id = identity["run_id"]
        self.tables = {
            name: _Table(self.run_dir, name, run_id, self._write_manifest) for name in definitions.TABLES
        }
        self._write_manifest()
        self._worker = threading.Thread(target=self._run, name=f"shadowtrace-writer-{run_id}", daemon=True)
        self._worker.start()

    # --- the caller's side ------------------------------------------------------------

    def send(self, table: str, row: dict) -> bool:
        """Queues a row of `table`; False (and counted) when it was dropped."""
        return self._put(table, row, 1, _ROW_BYTES)

    def send_columns(self, table: str, columns: dict, rows: int) -> bool:
        """Queues `rows` rows of `table` given as columns (see `_Table.push_columns`);
        False (and all of them counted) when they were dropped."""
        if rows == 0:
            return True
        return self._put(table, _Columns(columns, rows), rows, _nbytes(columns))

    def _put(self, table: str, payload: Any, rows: int, nbytes: int) -> bool:
        if table not in self.tables:
            with self._lock:
                self.rejected += rows
            return False
        with self._lock:
            self.sent[table] += rows
        deadline = time.monotonic() + self.queue_timeout_s
        with self._ready:
            while not self._fits(nbytes):
                left = deadline - time.monotonic()
                if self.mode == "lossy" or left <= 0 or self.errors or self._closing:
                    break
                self._ready.wait(left)
            if self._fits(nbytes) and not self.errors and not self._closing:
                self._queue.append((table, payload, rows, nbytes))
                self._queued_bytes += nbytes
                self._ready.notify_all()
                return True
            timed_out = self.mode == "blocking" and not self.errors and not self._closing
        with self._lock:
            self.dropped[table] += rows
            if timed_out:
                self.counters["queue_wait_timeouts"] = self.counters.get("queue_wait_timeouts", 0) + 1
        return False

    def _fits(self, nbytes: int) -> bool:
        # One batch larger than the whole bound still goes through an empty queue: the
        # bound limits what waits, not what a single capture may be.
        return self._queued_bytes + nbytes <= self.capacity or not self._queue

    def close(self, *, interrupted: bool = False, timeout_s: float | None = None) -> dict:
        """Finishes every table and returns the manifest: `complete` when every row sent
        was written or counted as dropped within the flush deadline and the run was not
        `interrupted` (its request stopped half way); `incomplete` otherwise, with what
        was left in the queue counted as `unflushed_rows`. Waits at most `timeout_s`
        (default: the writer's flush deadline)."""
        timeout = self.flush_timeout_s if timeout_s is None else timeout_s
        with self._ready:
            self.interrupted = self.interrupted or interrupted
            self._closing = True
            self._queue.append((None, _CLOSE, 0, 0))
            self._ready.notify_all()
        if not self._finished.wait(max(0.0, timeout)):
            with self._lock:
                self.counters["flush_timeouts"] = self.counters.get("flush_timeouts", 0) + 1
            self._write_manifest()
            raise TimeoutError(
                f"run {self.manifest['run_id']}: rows not written within {timeout:.1f} s "
                f"(counted as unflushed_rows; the run stays incomplete)"
            )
        if self.errors:
            raise RuntimeError(f"run {self.manifest['run_id']}: writer failed: {self.errors[0]}")
        return self.manifest

    # --- the worker ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    if not self._ready.wait(_MANIFEST_EVERY_S) and self._sent_changed():
                        # Idle: the producer may be stuck or about to die; what it sent is on disk.
                        self._ready.release()
                        try:
                            self._write_manifest()
                        finally:
                            self._ready.acquire()
                table, payload, rows, nbytes = self._queue.popleft()
            if payload is _CLOSE:
                break
            try:
                if not self.errors:
                    if isinstance(payload, _Columns):
                        self.tables[table].push_columns(payload.columns, payload.rows)
                    else:
                        self.tables[table].push(payload)
                else:
                    with self._lock:
                        self.dropped[table] += rows
            except Exception as e:
                with self._lock:
                    self.errors.append(f"{table}: {e}")
                    self.dropped[table] += rows
            finally:
                with self._ready:
                    self._queued_bytes -= nbytes
                    self._ready.notify_all()
            if time.monotonic() - self._last_manifest >= _MANIFEST_EVERY_S:
                self._write_manifest()
        try:
            for t in self.tables.values():
                t.close()
        except Exception as e:
            with self._lock:
                self.errors.append(str(e))
        try:
            self._write_manifest(final=True)
        finally:
            self._finished.set()

    def _sent_changed(self) -> bool:
        """Whether rows were sent since the manifest on disk counted them."""
        listed = self.manifest["tables"]
        return any(listed.get(name, {}).get("sent_rows") != n for name, n in self.sent.items())

    def _write_manifest(self, *, final: bool = False) -> None:
        """Rewrites manifest.json from the live counts (either thread may call it)."""
        with self._lock:
            self._last_manifest = time.monotonic()
            m = self.manifest
            unflushed = 0
            m["tables"] = {}
            for name, t in self.tables.items():
                missing = self.sent[name] - self.dropped[name] - t.rows
                if final:
                    # Rows written to a part that could not be completed are lost with it.
                    self.dropped[name] += max(0, missing) if self.errors else 0
                else:
                    unflushed += max(0, missing)
                m["tables"][name] = {
                    "status": "complete" if t.closed else "incomplete",
                    "rows": t.rows,
                    "dropped_rows": self.dropped[name],
                    "sent_rows": self.sent[name],
                    "files": list(t.files),
                }
            m["counters"] = {
                "dropped_rows": sum(self.dropped.values()),
                "rejected_rows": self.rejected,
                "writer_errors": len(self.errors),
                **self.counters,
            }
            if unflushed and not final:
                m["counters"]["unflushed_rows"] = unflushed
            if self.interrupted:
                m["counters"]["interrupted"] = 1
            if final and not self.errors and not self.interrupted:
                m["status"] = "complete"
                m["closed_unix_ms"] = _now_ms()
            write_json_atomically(self.run_dir / "manifest.json", m)
