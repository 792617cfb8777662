"""What a run's manifest says it lost, against the test's own count of what each forward
produced (never the writer's `sent_rows`), for the faults issue 28 held out: a process killed
just after a forward returns.

The traced model is the tiny random GLM-5 of tests/python/tiny_models.py (3 layers, every
site, a local fp32 shadow, in this process): a forward of T tokens produces 12 T hidden rows
(4 sites x 3 layers), 3 T top-k rows, T logits rows and 6 events (the two KV sentinel checks
per layer).
"""

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

LAYERS, LENGTH = 3, 64


def produced(tokens: int = LENGTH, forwards: int = 1) -> dict[str, int]:
    """The rows per table that `forwards` forwards of `tokens` tokens produce (the test's count)."""
    per = {"hidden": 4 * LAYERS * tokens, "topk": LAYERS * tokens, "logits": tokens, "events": 2 * LAYERS}
    return {t: n * forwards for t, n in per.items()}


def manifests(root: Path, *, settle: bool = True) -> list[dict]:
    """The runs' manifests on disk; with `settle`, once every closed run is written."""
    from shadowtrace_hooks import session

    if settle and session.current() is not None:
        session.current().wait_closed(time.monotonic() + 30)
    return [json.loads(p.read_text()) for p in sorted(root.glob("*/manifest.json"))]


def parts(run_dir: Path, table: str) -> int:
    """Rows in the table's complete part files on disk, listed in the manifest or not."""
    return sum(pq.read_metadata(f).num_rows for f in (run_dir / table).glob("*.parquet"))


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[Path]:
    """Tracing on in this process (SHADOWTRACE=1 into tmp_path/runs), stopped afterwards."""
    from shadowtrace_hooks import session, startup

    runs = tmp_path / "runs"
    assert startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(runs)}) is not None
    try:
        yield runs
    finally:
        session.stop()


def test_a_sigkill_just_after_a_forward_returns_leaves_a_manifest_counting_what_it_lost(
    traced: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forward returns and its run is closed, but the writer's thread has not written a
    row yet (held here in its first batch): what a SIGKILL at that moment leaves is the disk
    as it stands. Before issue 28 that was the manifest of the run's opening, `sent_rows` 0,
    and the whole forward was lost without a count; now closing writes the manifest, which
    counts every row sent and not written (`unflushed_rows`) and the shipments not decoded
    yet (`unflushed_shipments`: the events the device sizes, no count can name them yet)."""
    import tiny_models
    from shadowtrace_hooks import writer

    held, entered = threading.Event(), threading.Event()
    real_push = writer._Table.push_columns

    def push_columns(self: writer._Table, columns: dict, rows: int) -> None:
        entered.set()
        assert held.wait(60), "the test never let the writer go"
        real_push(self, columns, rows)

    monkeypatch.setattr(writer._Table, "push_columns", push_columns)
    model, ids = tiny_models.glm(layers=LAYERS), tiny_models.prompt(LENGTH)
    try:
        with torch.no_grad():
            model(ids)
        assert entered.wait(10)
        (killed,) = manifests(traced, settle=False)  # the disk as a SIGKILL now leaves it
    finally:
        held.set()
    (run_dir,) = traced.iterdir()
    expected = produced()
    assert killed["status"] == "incomplete"
    counters, tables = killed["counters"], killed["tables"]
    unflushed = 0
    for table in ("hidden", "topk", "logits"):  # counted when sent: every row is named
        t = tables[table]
        assert t["sent_rows"] == expected[table], (table, t)
        assert t["rows"] == parts(run_dir, table) == 0
        unflushed += t["sent_rows"] - t["rows"] - t["dropped_rows"]
    assert unflushed == expected["hidden"] + expected["topk"] + expected["logits"]
    # Events are counted when their shipment is decoded: those not decoded yet are flagged.
    events = tables["events"]
    unflushed += events["sent_rows"] - events["rows"] - events["dropped_rows"]
    assert counters["unflushed_rows"] == unflushed
    assert events["sent_rows"] == expected["events"] or counters["unflushed_shipments"] > 0


def test_the_close_time_manifest_never_replaces_the_final_one(tmp_path: Path) -> None:
    """Closing writes the manifest from the forward's thread while the worker may already be
    writing the final one: the earlier state must never land after it."""
    from shadowtrace_hooks import writer
    from test_hooks_writer import IDENTITY, hidden

    for i in range(20):
        w = writer.RunWriter(tmp_path / f"run{i}", IDENTITY, flush_timeout_s=10.0)
        for token in range(i):
            w.send("hidden", hidden(0, token))
        w.close(wait=False)
        w.wait_closed()
        on_disk = json.loads((tmp_path / f"run{i}" / "manifest.json").read_text())
        assert on_disk["status"] == "complete", on_disk["counters"]
        assert "unflushed_rows" not in on_disk["counters"]
        assert on_disk["tables"]["hidden"]["rows"] == i
