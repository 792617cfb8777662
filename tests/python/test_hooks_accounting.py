"""What a run's manifest says it lost, against the test's own count of what each forward
produced (never the writer's `sent_rows`), for the faults issue 28 held out: a process killed
just after a forward returns, a step that cannot open, top-k lists that cannot be made.

The traced model is the tiny random GLM-5 of tests/python/tiny_models.py (3 layers, every
site, a local fp32 shadow, in this process): a forward of T tokens produces 12 T hidden rows
(4 sites x 3 layers), 3 T top-k rows, T logits rows and 6 events (the two KV sentinel checks
per layer).
"""

import json
import logging
import threading
import time
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


@pytest.mark.parametrize("where", ["_logits", "_ship", "close_runs"])
def test_an_exit_in_the_bookkeeping_after_a_forward_leaves_its_run_interrupted_and_whole(
    traced: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A serving engine's SIGTERM handler raises SystemExit wherever the main thread is, so
    also in the hooks' own work after the model's forward returned (the logits capture, the
    shipment, the close). The request did not finish being recorded: its run must say
    `interrupted`, and the exit flush must still write or count every row it produced.
    Before, an exit inside the close left the run unreachable, incomplete without the word."""
    import tiny_models
    from shadowtrace_hooks import session
    from shadowtrace_hooks.adapters import hf

    real = getattr(hf._Tracer, where)
    calls = []

    # The call after the forward returned: _ship runs once per layer inside it, close_runs
    # once as the step opens. The exit lands once; the calls after it are the real ones.
    after_forward = {"_logits": 1, "_ship": LAYERS + 1, "close_runs": 2}[where]

    def cut(self: object, *args: object, **kwargs: object) -> None:
        calls.append(where)
        if len(calls) != after_forward:
            return real(self, *args, **kwargs)
        if where == "close_runs":
            real(self, *args, **kwargs)  # the run is handed over; the exit lands just after
        raise SystemExit(143)

    monkeypatch.setattr(hf._Tracer, where, cut)
    model, ids = tiny_models.glm(layers=LAYERS), tiny_models.prompt(LENGTH)
    with pytest.raises(SystemExit), torch.no_grad():
        model(ids)
    assert len(calls) >= after_forward
    session.stop()
    (m,) = manifests(traced, settle=False)
    (run_dir,) = traced.iterdir()
    expected = produced()
    if where == "close_runs":  # the close finished: nothing was cut
        assert m["status"] == "complete", m["counters"]
    else:
        assert m["status"] == "incomplete"
        assert m["counters"]["interrupted"] == 1
    for table in ("hidden", "topk"):
        assert m["tables"][table]["rows"] == parts(run_dir, table) == expected[table]
    logits = m["tables"]["logits"]
    assert logits["rows"] == (0 if where == "_logits" else expected["logits"])


def failing_step(monkeypatch: pytest.MonkeyPatch, fails: object) -> list[bool]:
    """`_Step.__init__` (its `.cpu()` included) raises where `fails(decode)`; returns, per
    step opened, whether it failed."""
    from shadowtrace_hooks.adapters import hf

    real, seen = hf._Step.__init__, []

    def init(self: object, positions: torch.Tensor, decode: bool, *args: object, **kwargs: object) -> None:
        seen.append(bool(fails(decode)))
        if seen[-1]:
            raise RuntimeError("CUDA error: an illegal memory access (planted at the step's .cpu())")
        real(self, positions, decode, *args, **kwargs)

    monkeypatch.setattr(hf._Step, "__init__", init)
    return seen


def test_a_step_that_cannot_open_leaves_its_run_saying_so(
    traced: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill's step fails to open after its run was opened: none of the forward's
    captures run. Before issue 28 the run read complete with 0 of its rows, the failure
    counted only in the process (`process.hook_errors`)."""
    import tiny_models

    seen = failing_step(monkeypatch, lambda decode: True)
    model, ids = tiny_models.glm(layers=LAYERS), tiny_models.prompt(LENGTH)
    with torch.no_grad():
        model(ids)
    assert seen == [True]
    (m,) = manifests(traced)
    written = sum(t["rows"] for t in m["tables"].values())
    counted = sum(t["dropped_rows"] for t in m["tables"].values())
    missing = sum(produced().values()) - written - counted
    assert missing == sum(produced().values())  # nothing of the forward was recorded
    # The run says it lacks a step: a counter the analyzer takes for a loss (not judged).
    assert m["counters"]["step_open_failed"] == 1


def test_decode_steps_that_cannot_open_are_counted_in_the_run_they_belong_to(
    traced: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In generate, the run stays open across steps: each decode step that cannot open loses
    that step's rows of the run. Before issue 28 only the process counted them."""
    import tiny_models

    seen = failing_step(monkeypatch, lambda decode: decode)
    model, ids = tiny_models.glm(layers=LAYERS), tiny_models.prompt(LENGTH)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False)
    failed = sum(seen)
    assert (failed, seen[0]) == (2, False)
    (m,) = manifests(traced)
    assert m["counters"]["step_open_failed"] == failed
    # The prefill's rows, and none of the failed steps' (each would add a query row per layer).
    assert m["tables"]["topk"]["rows"] == LAYERS * LENGTH


def test_a_step_that_fails_before_its_run_opens_is_counted_in_the_next_run(
    traced: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward whose step fails before any run of it opens has no manifest of its own: the
    process counts it, and every run closed afterwards carries the count."""
    import tiny_models
    from shadowtrace_hooks import session

    real_open, calls = session.Session.open_run, []

    def open_run(self: session.Session, **kwargs: object) -> session.Run:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("planted: the run's directory cannot be made")
        return real_open(self, **kwargs)

    monkeypatch.setattr(session.Session, "open_run", open_run)
    model, ids = tiny_models.glm(layers=LAYERS), tiny_models.prompt(LENGTH)
    with torch.no_grad():
        model(ids)
        model(ids)
    (m,) = manifests(traced)
    assert m["counters"]["process.step_open_failed"] == 1
    assert "step_open_failed" not in m["counters"]  # its own forward was whole


def test_top_k_lists_that_cannot_be_made_are_counted_logged_once_and_their_reason_recorded(
    traced: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The work that gap-codes a comparison's lists raises (in `transfer._fill`): its rows are
    counted (`topk_lists_lost_rows`), and, before issue 28, the reason went nowhere."""
    import tiny_models
    from shadowtrace_hooks import selection, session

    def broken(*args: object) -> None:
        raise RuntimeError("planted: nonzero ran out of memory")

    monkeypatch.setattr(selection, "_gap_coded", broken)
    monkeypatch.setattr(session, "_warned", set(), raising=False)
    model, ids = tiny_models.glm(layers=LAYERS), tiny_models.prompt(LENGTH)
    with caplog.at_level(logging.WARNING, logger="shadowtrace"), torch.no_grad():
        model(ids)
        model(ids)
    ms = manifests(traced)
    assert len(ms) == 2
    for m in ms:
        assert m["counters"]["topk_lists_lost_rows"] == produced()["topk"]
        assert m["tables"]["topk"]["rows"] == 0
        assert m["tables"]["topk"]["dropped_rows"] == produced()["topk"]
        assert "planted: nonzero ran out of memory" in m["settings"]["topk_lists_lost_reason"]
    lines = [r.getMessage() for r in caplog.records if "top-k rows lost" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "planted" in lines[0]
