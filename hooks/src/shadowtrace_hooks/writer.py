"""Writing runs in trace format v2, off the caller's thread, without losing a row unseen.

The contract is the Rust writer's (tracer/src/writer):

- rows go through a queue bounded in bytes (`ByteBudget`: one per process in a session,
  shared by every run's writer, so runs that close faster than they are written cannot
  pile up without bound); when it is full, `blocking` waits for room and `lossy` drops;
  every wait has a deadline, and a row that misses it is dropped; every dropped row is
  counted (`tables.<t>.dropped_rows`);
- a worker thread per run turns what was queued into Arrow batches and Parquet part files,
  written under `.tmp` names and renamed when complete. Captures may queue a `Shipment`
  (shadowtrace_hooks.transfer) still being copied from the device, with the function that
  turns it into rows: waiting for the copy and building the rows happen on the worker too;
- `close()` hands the run over and returns at once (`wait=False`), or waits for the worker
  to finish (the default, and what the session does at process exit): nothing on the
  traced forward's path waits for encoding or disk;
- manifest.json is rewritten atomically whenever a part completes, and at most every
  `_MANIFEST_EVERY_S` seconds while rows arrive, so a killed process leaves a manifest that
  lists its complete parts and how many rows the producer had handed over (`sent_rows`, also
  rewritten after a second without rows):
  what was sent and is neither written nor counted as dropped was lost, and readers say so.
  Its file keeps the room of its own rewrites: where the disk is full, it is rewritten in
  place (`rewrite_json_in_place`, counted `manifest_rewritten_in_place`);
- it says `incomplete` until the worker has written every row after `close()`; a run whose
  rows are not written within the flush deadline, or whose request was interrupted, stays
  `incomplete` with the rows still queued counted (`counters.unflushed_rows`); so does a run
  whose producer lost rows it never sent (`lose_rows`, with its counter and reason);
- the writer owns its manifest: the forward's thread changes it only through `RunWriter`'s
  methods (`set_setting`, `tag`, `add_conventions`, ...), under the lock the worker takes to
  copy it before serialising, so the worker never reads a dict that is changing;
- a worker that dies (the manifest's disk full, any exception) is counted (`writer_died`),
  gives the room of what was still queued back to the budget the process's runs share,
  refuses (and counts as dropped) every later row, and leaves its run `incomplete` and
  `interrupted`: the other runs of the process never wait on a dead one;
- closing a run rewrites its manifest at once, from the closing thread: a process killed
  (SIGKILL) before the worker wrote the run leaves a manifest that counts every row sent
  and not yet written (`unflushed_rows`), and the shipments not yet decoded, whose rows of
  tables the device sizes (events) no count can name yet (`unflushed_shipments`).

Nothing here raises into the traced engine's code path: `send` never raises; `close`
raises only when it waits and the writer failed or ran out of time, and the session
catches it.
"""

import contextlib
import copy
import errno
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shadowtrace_hooks import definitions, format

try:  # a dependency of the package; an environment installed without it records no hashes
    import xxhash
except ImportError:  # pragma: no cover - counted as parts_unhashed
    xxhash = None
from shadowtrace_hooks.numerics import Lists
from shadowtrace_hooks.transfer import Shipment

TMP_SUFFIX = ".tmp"

_BATCH_ROWS = {"topk": 256, "hidden": 8192, "events": 8192, "logits": 8192}
# Rows per row group, as the Rust writer sizes them in format v2 (tracer/src/writer/props.rs):
# a v2 top-k row is a summary and short lists, so its groups hold 1 << 16 rows, not v1's 4096.
_ROW_GROUP_ROWS = {"topk": 1 << 16, "hidden": 1 << 20, "events": 1 << 16, "logits": 1 << 16}
_PART_MAX_BYTES = 256 << 20
# A row given as a dict: its size in the queue, for the byte bound (lists counted apart).
_ROW_BYTES = 256
# What the capture self-check's relative tolerance multiplies (settings.capture_check's
# `tolerance_scale`): selection.score_scale over the keys production selected.
CHECK_TOLERANCE_SCALE = "mean_abs_selected_score"
# While rows arrive, the manifest's sent and written counts are at most this old on disk.
_MANIFEST_EVERY_S = 1.0
# The least a manifest file holds. A run's manifest is rewritten by a second file and a
# rename, which a full disk refuses; the file's own padding is then its room to be rewritten
# in place, so that a run's last manifest counts the rows that did not fit. 8 KiB holds a
# run's manifest with some dozens of parts; a larger one is padded to twice its length.
_MANIFEST_ROOM = 8 << 10
# The errors of a disk that has no room: the manifest is then rewritten in place.
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _now_ms() -> int:
    return int(time.time() * 1000)


def write_json_atomically(path: Path, document: Any) -> None:
    """Writes JSON under a temporary name and renames it: readers see old or new, never half.
    The file keeps room for its own growth (`_padded`), for `rewrite_json_in_place`. A
    temporary file the disk could not hold is removed: its blocks are what a full disk lacks."""
    tmp = path.with_name(f"{path.name}.{threading.get_ident()}{TMP_SUFFIX}")
    try:
        tmp.write_bytes(_padded(json.dumps(document, indent=2).encode()))
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def rewrite_json_in_place(path: Path, document: Any) -> None:
    """Overwrites the file at `path` with `document`, padded to the file's own length, so the
    write needs no block the file does not hold: what a full disk still allows (not on a
    copy-on-write file system, whose overwrites take new blocks). A reader may see it half
    written, and a document longer than the file cannot be written: OSError(ENOSPC)."""
    text = json.dumps(document, indent=2).encode()
    with Path(path).open("r+b") as f:
        size = os.fstat(f.fileno()).st_size
        if len(text) + 1 > size:
            why = f"manifest of {len(text)} bytes outgrew its room of {size}"
            raise OSError(errno.ENOSPC, why, str(path))
        f.write(_padded(text, size))
        f.flush()


def _padded(text: bytes, size: int | None = None) -> bytes:
    """`text`, a newline, and JSON whitespace up to `size` bytes (by default twice its length,
    at least `_MANIFEST_ROOM`): readers skip it, and a rewrite in place has room to grow."""
    if size is None:
        size = max(_MANIFEST_ROOM, 2 * len(text) + 1)
    return text + b"\n" + b" " * (size - len(text) - 1)


class _Columns:
    def __init__(self, columns: dict, rows: int) -> None:
        self.columns, self.rows = columns, rows


# Turns a shipment's host arrays into batches: (table, columns, rows).
Decode = Callable[[list[np.ndarray]], list[tuple[str, dict, int]]]


class _Deferred:
    """Rows still on their way from the device: `counted` are the rows per table known (and
    counted as sent) when it was queued; rows of other tables are counted when decoded."""

    def __init__(self, shipment: Shipment, decode: Decode, counted: dict[str, int]) -> None:
        self.shipment, self.decode, self.counted = shipment, decode, counted


class ByteBudget:
    """Bytes queued for writing, bounded: a writer takes room before queueing and gives it
    back once its worker has handled what it queued."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._room = threading.Condition()

    def take(self, nbytes: int, *, wait_s: float, stop: Callable[[], bool]) -> bool:
        """Takes `nbytes` of room, waiting up to `wait_s` for it (0: not at all) while `stop()`
        is false. One batch larger than the whole bound still passes an empty queue: the
        bound limits what waits, not what a single capture may be."""
        deadline = time.monotonic() + wait_s
        with self._room:
            while self.used and self.used + nbytes > self.capacity:
                left = deadline - time.monotonic()
                if left <= 0 or stop():
                    return False
                self._room.wait(min(left, _MANIFEST_EVERY_S))
            self.used += nbytes
            return True

    def give_back(self, nbytes: int) -> None:
        with self._room:
            self.used -= nbytes
            self._room.notify_all()


class _Table:
    """Rows of one table: buffered, written in batches, rolled into parts by size."""

    def __init__(self, run_dir: Path, name: str, run_id: str, on_part: Any, footer: Any = None) -> None:
        self.run_dir, self.name, self.run_id, self.on_part = run_dir, name, run_id, on_part
        self.footer = footer  # () -> further footer keys of a new part, or None
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
        self.file_hashes: dict[str, str] = {}
        self.unhashed = 0  # completed parts without a content hash (no xxhash)
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
            metadata = {format.META_RUN_ID: self.run_id, **(self.footer() if self.footer else {})}
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
            digest = content_hash(f)
        self.part_path.replace(self.run_dir / self.relative)
        if digest is None:
            self.unhashed += 1
        else:
            self.file_hashes[self.relative] = digest
        self.files.append(self.relative)
        self.rows += self.part_rows
        self.part, self.part_path, self.part_rows = None, None, 0
        self.on_part()

    def close(self) -> None:
        if not self.closed:
            self.flush()
            self.finish_part()
            self.closed = True


def content_hash(f: Any) -> str | None:
    """The content hash of the file open as `f`, read from its start as it is on disk:
    `xxh3-64:` and 16 hex digits (schemas/src/content_hash.rs, the same XXH3-64 with seed 0);
    None without the `xxhash` package."""
    if xxhash is None:
        return None
    f.seek(0)
    h = xxhash.xxh3_64()
    while chunk := f.read(1 << 20):
        h.update(chunk)
    return f"xxh3-64:{h.intdigest():016x}"


def _column(value: Any, kind: pa.DataType, rows: int) -> pa.Array:
    if value is None:
        return pa.nulls(rows, kind)
    if isinstance(value, Lists):
        offsets = pa.array(value.offsets, pa.int32())
        return pa.ListArray.from_arrays(offsets, pa.array(value.values, kind.value_type), type=kind)
    if isinstance(value, (np.ndarray, list)):
        if len(value) != rows:
            raise ValueError(f"column of {len(value)} rows in a batch of {rows}")
        return pa.array(value, kind)
    # One scalar for every row (the run id, a layer number): built by Arrow, not from a list
    # of `rows` Python objects, which cost 0.35 ms per 8192 rows on the writer's thread,
    # holding the GIL the traced forward needs.
    return pa.repeat(pa.scalar(value, kind), rows)


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
        budget: ByteBudget | None = None,
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
        # The producer lost rows of this run before they were made (`lose_rows`): it closes
        # incomplete, whatever was written.
        self.lost = False
        self._lock = threading.Lock()  # counts and the manifest document
        # The manifest's file: one writer at a time, so an older copy never replaces a newer.
        self._file_lock = threading.Lock()
        self._ready = threading.Condition()  # the queue
        self._queue: deque = deque()
        self.budget = budget or ByteBudget(queue_bytes)
        self._closing = False
        self._died = False  # the worker stopped on an exception: nothing more is queued
        self._shipments_pending = 0  # shipments queued and not yet decoded (or dropped)
        self._final_written = False  # the final manifest is on disk: no earlier state replaces it
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
            "conventions": [],
            "deviations": [],
            **identity,
            "settings": settings,
            "tables": {},
            "counters": {},
        }
        run_id = identity["run_id"]
        footers = {"topk": self._band_footer}
        self.tables = {
            name: _Table(self.run_dir, name, run_id, self._write_manifest, footers.get(name))
            for name in definitions.TABLES
        }
        self._write_manifest()
        try:
            self._worker = threading.Thread(
                target=self._run, name=f"shadowtrace-writer-{run_id}", daemon=True
            )
            self._worker.start()
        except BaseException as e:
            # The manifest is on disk: it says the run never started (nothing will close it).
            with contextlib.suppress(Exception):
                self.count("step_open_failed")
                self.lose_rows(f"step_open_failed: the run's writer could not start: {type(e).__name__}: {e}")
                self._write_manifest()
            raise

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

    def send_shipment(self, shipment: Shipment, decode: Decode, counted: dict[str, int]) -> bool:
        """Queues rows still being copied from the device: `decode` turns the shipment's
        arrays into batches on the worker. `counted` says how many rows of which tables it
        holds, counted as sent now (dropped, if it is); rows of other tables (events, whose
        number the device decides) are counted when decoded. When the whole shipment is
        dropped, those are decoded here and sent on their own, so no row is lost unseen."""
        if self._put(None, _Deferred(shipment, decode, counted), counted, shipment.nbytes):
            return True
        try:
            batches = decode(shipment.arrays())
        except Exception as e:
            with self._lock:
                self.counters["undecoded_shipments"] = self.counters.get("undecoded_shipments", 0) + 1
                self.errors.append(f"dropped shipment: {e}")
            return False
        for table, columns, rows in batches:
            if table not in counted:
                self.send_columns(table, columns, rows)
        return False

    def _put(self, table: str | None, payload: Any, rows: int | dict[str, int], nbytes: int) -> bool:
        per_table = rows if isinstance(rows, dict) else {table: rows}
        if any(t not in self.tables for t in per_table):
            with self._lock:
                self.rejected += sum(per_table.values())
            return False
        with self._lock:
            for t, n in per_table.items():
                self.sent[t] += n
        stopped = lambda: bool(self.errors or self._closing or self._died)  # noqa: E731
        wait_s = 0.0 if self.mode == "lossy" else self.queue_timeout_s
        taken = not stopped() and self.budget.take(nbytes, wait_s=wait_s, stop=stopped)
        if taken:
            with self._ready:
                if not (self._closing or self._died):
                    self._queue.append((table, payload, rows, nbytes))
                    self._shipments_pending += isinstance(payload, _Deferred)
                    self._ready.notify_all()
                    return True
            self.budget.give_back(nbytes)
        timed_out = not taken and self.mode == "blocking" and not stopped()
        with self._lock:
            for t, n in per_table.items():
                self.dropped[t] += n
            if timed_out:
                self.counters["queue_wait_timeouts"] = self.counters.get("queue_wait_timeouts", 0) + 1
        return False

    def close(self, *, interrupted: bool = False, wait: bool = True, timeout_s: float | None = None) -> dict:
        """Hands the run over to the worker, which writes what is queued, finishes every table
        and the manifest: `complete` when every row sent was written or counted as dropped
        and the run was not `interrupted` (its request stopped half way). With `wait` False
        it returns at once with the manifest as it stands; else as `wait_closed`."""
        with self._ready:
            self.interrupted = self.interrupted or interrupted
            first = not (self._closing or self._died)
            if first:
                self._closing = True
                self._queue.append((None, _CLOSE, 0, 0))
                self._ready.notify_all()
        if first:
            # What was sent, on disk now: the worker may write the run a second later, and a
            # SIGKILL in between would otherwise leave a manifest that says nothing was sent.
            # Best effort (the worker's final write is the one that counts): never raises.
            with contextlib.suppress(Exception):
                self._write_manifest()
        if not wait:
            return self.manifest
        return self.wait_closed(timeout_s)

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    @property
    def died(self) -> bool:
        """Whether the worker stopped on an exception: the manifest on disk may then lag the
        counts in memory until `wait_closed` writes it once more."""
        return self._died

    def wait_closed(self, timeout_s: float | None = None) -> dict:
        """Waits at most `timeout_s` (default: the flush deadline) for a closed run to be
        written, and returns its manifest. A run still being written then stays
        `incomplete`, with what was left counted as `unflushed_rows` (TimeoutError)."""
        timeout = self.flush_timeout_s if timeout_s is None else timeout_s
        if not self._finished.wait(max(0.0, timeout)):
            with self._lock:
                self.counters["flush_timeouts"] = self.counters.get("flush_timeouts", 0) + 1
            self._write_manifest()
            raise TimeoutError(
                f"run {self.manifest['run_id']}: rows not written within {timeout:.1f} s "
                f"(counted as unflushed_rows; the run stays incomplete)"
            )
        if self._died:
            # The rows refused since the worker died are counted in memory; off the forward's
            # path now, one more try to put them on disk (the disk may have room again).
            try:
                self._write_manifest(final=True)
            except Exception as e:
                with self._lock:
                    self.errors.append(f"manifest: {e}")
        if self.errors:
            raise RuntimeError(f"run {self.manifest['run_id']}: writer failed: {self.errors[0]}")
        return self.manifest

    # --- the worker ---------------------------------------------------------------------

    def _run(self) -> None:
        """The worker: everything it does under one guard, so that it cannot die unseen."""
        try:
            self._write_all()
        except Exception as e:
            self._die(e)
        finally:
            self._finished.set()

    def _die(self, error: Exception) -> None:
        """What a dead worker leaves: its death counted, the room of every row still queued
        back in the budget (the process's other runs wait on it), those rows counted as
        dropped, later rows refused, and the run incomplete and interrupted."""
        with self._ready:
            self._died = True
            queued, self._queue = self._queue, deque()
            self._shipments_pending = 0  # those queued are counted undecoded below
        with self._lock:
            self.errors.append(f"writer died: {type(error).__name__}: {error}")
            self.counters["writer_died"] = 1
            self.interrupted = True
            for table, payload, rows, _ in queued:
                if payload is _CLOSE:
                    continue
                for t, n in (rows if isinstance(rows, dict) else {table: rows}).items():
                    self.dropped[t] += n
                if isinstance(payload, _Deferred):
                    self.counters["undecoded_shipments"] = self.counters.get("undecoded_shipments", 0) + 1
            self.manifest["status"] = "incomplete"  # a final write that failed may have said complete
            self.manifest["closed_unix_ms"] = None
        self.budget.give_back(sum(item[3] for item in queued))
        # Where the disk refuses even the manifest, the counts stay right in memory, and
        # `wait_closed` tries once more.
        with contextlib.suppress(Exception):
            self._write_manifest(final=True)

    def _write_all(self) -> None:
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
                if isinstance(payload, _Deferred):
                    try:
                        self._write_deferred(payload)
                    finally:
                        with self._ready:
                            self._shipments_pending -= 1
                elif not self.errors:
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
                self.budget.give_back(nbytes)
            if time.monotonic() - self._last_manifest >= _MANIFEST_EVERY_S:
                self._write_manifest()
        try:
            for t in self.tables.values():
                t.close()
        except Exception as e:
            with self._lock:
                self.errors.append(str(e))
        self._write_manifest(final=True)

    def _write_deferred(self, payload: _Deferred) -> None:
        """Waits for a shipment's copy, decodes it and writes its batches; rows it cannot
        write are counted as dropped (those of tables counted at queueing, exactly)."""
        written: dict[str, int] = {}
        try:
            if self.errors:
                raise RuntimeError(self.errors[0])
            batches = payload.decode(payload.shipment.arrays())
            with self._lock:
                for table, _, rows in batches:
                    if table not in payload.counted:
                        self.sent[table] += rows
            for table, columns, rows in batches:
                self.tables[table].push_columns(columns, rows)
                written[table] = written.get(table, 0) + rows
        except Exception as e:
            with self._lock:
                if not self.errors:
                    self.errors.append(f"shipment: {e}")
                self.counters["undecoded_shipments"] = self.counters.get("undecoded_shipments", 0) + 1
        # Rows counted at queueing and not written: a failure's, or those a decoder left out.
        with self._lock:
            for table, rows in payload.counted.items():
                self.dropped[table] += max(0, rows - written.get(table, 0))

    # --- the manifest's changes: the only ones, from either thread -----------------------

    def count(self, name: str, n: int = 1) -> None:
        """Adds n to the manifest counter `name`."""
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def lose_rows(self, reason: str) -> None:
        """The producer lost rows of this run that were never sent, so that no table count can
        name them (a hook failed before a forward's first row; the producer counts what it
        lost): the run closes `incomplete`, and `settings.rows_lost_reason` keeps the first
        reason."""
        with self._lock:
            self.lost = True
            self.manifest["settings"].setdefault("rows_lost_reason", reason)

    def set_counters(self, values: dict[str, int]) -> None:
        """Sets manifest counters to totals counted elsewhere (the run's, the process's)."""
        with self._lock:
            self.counters.update(values)

    def _band_footer(self) -> dict[str, str]:
        """The boundary band rule for a new top-k part's footer, from the settings as they
        are when the part opens; none where the run records no relative band."""
        with self._lock:
            settings = self.manifest["settings"]
            if "boundary_band_scale" not in settings:
                return {}
            rule = {
                "band": settings.get("boundary_band"),
                "scale": settings["boundary_band_scale"],
                "stored": settings.get("boundary_stored"),
            }
        return {format.META_BOUNDARY_BAND: json.dumps(rule, sort_keys=True)}

    def set_setting(self, key: str, value: Any, *, keep: bool = False) -> None:
        """Records `settings.<key>`; with `keep`, only when not yet recorded."""
        with self._lock:
            settings = self.manifest["settings"]
            if not (keep and key in settings):
                settings[key] = value

    def capture_check(
        self,
        layer: int,
        source: str,
        tolerance: float,
        rows: int,
        disagree: int,
        first_token: int | None,
        *,
        unchecked: int = 0,
        short: dict[str, Any] | None = None,
        short_rule: dict[str, float] | None = None,
    ) -> None:
        """Adds one indexer call's capture self-check (`selection`: production's selection
        against its own scores) to `settings.capture_check`: per layer, the informative
        rows checked, those that disagree and the first of them, and the informative rows it
        could not check (`unchecked`: a non-finite k-th or selected score), never among the
        rows checked; `source` says where production's scores came from, `tolerance` is the
        check's, relative to `tolerance_scale`. `short`: of the rows that disagree, those
        whose selection is production's top keys short of some (`rows`; a top-k kernel that
        drops winners, not a misread), with the figures that decided them at their least
        telling (`kept_top`, `recall`: shares of k; `worst_rank_beyond_k`), recorded per
        layer as `short_of_winners` and `short_*`, under `short_rule` (the least shares of k
        a short row keeps, as `short_of_winners_rule`)."""
        with self._lock:
            check = self.manifest["settings"].setdefault(
                "capture_check",
                {"run": True, "tolerance": tolerance, "tolerance_scale": CHECK_TOLERANCE_SCALE,
                 "sources": [], "layers": {}},
            )  # fmt: skip
            if short_rule is not None:
                check.setdefault("short_of_winners_rule", short_rule)
            if source not in check["sources"]:
                check["sources"].append(source)
            # The loosest tolerance any call of the run was checked with.
            check["tolerance"] = max(check["tolerance"], tolerance)
            entry = check["layers"].setdefault(
                str(layer), {"rows": 0, "disagree": 0, "first_token": None, "unchecked": 0}
            )
            entry["rows"] += rows
            entry["disagree"] += disagree
            entry["unchecked"] += unchecked
            first = entry["first_token"]
            if first_token is not None and (first is None or first_token < first):
                entry["first_token"] = first_token
            if short is not None:
                entry["short_of_winners"] = entry.get("short_of_winners", 0) + short["rows"]
                if short["rows"]:
                    for key, pick in (("kept_top", min), ("recall", min), ("worst_rank_beyond_k", max)):
                        name = f"short_{key}"
                        entry[name] = short[key] if entry.get(name) is None else pick(entry[name], short[key])

    def capture_check_not_run(self, why: str) -> None:
        """Records that this run has no capture self-check, and why (`settings.capture_check`
        with `run` false; the fields a reader of checks that ran expects are there, empty)."""
        with self._lock:
            self.manifest["settings"]["capture_check"] = {
                "run": False, "why": why, "tolerance": 0.0, "sources": [], "layers": {},
            }  # fmt: skip

    def tag(self, key: str, value: str) -> None:
        """Sets the run's tag `key`."""
        with self._lock:
            self.manifest["tags"][key] = value

    def prompt_length_at_least(self, length: int) -> None:
        """Raises the prompt's recorded length to `length` (engines see a prompt in pieces)."""
        with self._lock:
            prompt = self.manifest["prompt"]
            prompt["length"] = max(prompt["length"], length)

    def refuse_shadow(self, why: str) -> None:
        """Records that the run has no shadow, and why (`settings.shadow_refused`)."""
        with self._lock:
            self.manifest["settings"]["shadow_refused"] = why
            self.manifest["shadow"] = {"precision": None, "modes": []}
            self.manifest["dtypes"]["shadow"] = None

    def add_conventions(
        self, conventions: list[dict], merge: Callable[[list[dict], list[dict]], None]
    ) -> None:
        """Adds numerics conventions to the run's by `merge(recorded, conventions)` (the
        adapters' rule, shadowtrace_hooks.adapters.engine.merge_conventions)."""
        with self._lock:
            merge(self.manifest["conventions"], conventions)

    def _sent_changed(self) -> bool:
        """Whether rows were sent since the manifest on disk counted them."""
        listed = self.manifest["tables"]
        return any(listed.get(name, {}).get("sent_rows") != n for name, n in self.sent.items())

    def _write_manifest(self, *, final: bool = False) -> None:
        """Rewrites manifest.json from the live counts (either thread may call it). Once the
        final manifest is on disk, a later non-final write (the closing thread's, late) is
        skipped: it would replace the run's last word with an earlier state."""
        with self._file_lock:
            if self._final_written and not final:
                return
            path = self.run_dir / "manifest.json"
            try:
                write_json_atomically(path, self._manifest_now(final=final))
            except OSError as e:
                if e.errno not in _DISK_FULL or not path.exists():
                    raise
                # The disk is full: the run's counts go into the room its manifest holds.
                self.count("manifest_rewritten_in_place")
                rewrite_json_in_place(path, self._manifest_now(final=final))
            self._final_written = final

    def _manifest_now(self, *, final: bool) -> dict:
        """Brings the manifest up to date with the live counts and returns a copy of it, taken
        under the lock: json's encoder with an indent walks the dicts in Python, slowly enough
        for the forward's thread to change one half way (which raises in the encoder)."""
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
                if t.file_hashes:
                    m["tables"][name]["file_hashes"] = dict(t.file_hashes)
            m["counters"] = {
                "dropped_rows": sum(self.dropped.values()),
                "rejected_rows": self.rejected,
                "writer_errors": len(self.errors),
                **self.counters,
            }
            unhashed = sum(t.unhashed for t in self.tables.values())
            if unhashed:
                m["counters"]["parts_unhashed"] = unhashed
            if unflushed and not final:
                m["counters"]["unflushed_rows"] = unflushed
            if self._shipments_pending and not final:
                m["counters"]["unflushed_shipments"] = self._shipments_pending
            if self.interrupted:
                m["counters"]["interrupted"] = 1
            if final and not self.errors and not self.interrupted:
                # A run that lost rows before they were sent is closed, and incomplete.
                m["status"] = "incomplete" if self.lost else "complete"
                m["closed_unix_ms"] = _now_ms()
            return copy.deepcopy(m)
