"""The writer is off the traced forward's path: closing a run hands its batches over and
returns before they are encoded, rows still on their way from the device are decoded on
the writer's thread, and only the flush at exit waits for them."""

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from shadowtrace_hooks import session, writer
from shadowtrace_hooks.transfer import Packet
from shadowtrace_hooks.writer import RunWriter

IDENTITY = {
    "run_id": "off-path",
    "model": {"name": "t", "architecture": "glm_moe_dsa", "config_hash": "0" * 64, "revision": None,
              "num_layers": 1, "index_topk": 4},
    "engine": {"name": "transformers", "version": "test", "commit": None, "variant": None},
    "device": {"kind": "cpu", "name": "cpu", "index": None},
    "dtypes": {"prod": "bf16", "shadow": None},
    "parallelism": {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "rank": 0, "world_size": 1},
    "shadow": {"precision": None, "modes": []},
    "prompt": {"kind": None, "length": 8, "token_hash": "", "salt_id": None},
    "settings": {}, "tags": {}, "injections": [],
}  # fmt: skip


def logits_batch(rows: int) -> dict:
    ids = np.arange(rows * 2, dtype=np.int32).reshape(rows, 2)
    from shadowtrace_hooks import stats

    top_ids, top_lp = stats.logits_lists(ids, -np.ones((rows, 2), dtype=np.float32))
    return {
        "step": 0,
        "token": np.arange(rows, dtype=np.int32),
        "prod_top_ids": top_ids,
        "prod_top_logprobs": top_lp,
    }


@pytest.fixture
def encoding_blocked(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Encoding (building Arrow batches) waits for `release`; `entered` says it began."""
    entered, release = threading.Event(), threading.Event()
    real = writer._Table.push_columns

    def blocked(self: writer._Table, columns: dict, rows: int) -> None:
        entered.set()
        assert release.wait(30), "the test never released the encoder"
        real(self, columns, rows)

    monkeypatch.setattr(writer._Table, "push_columns", blocked)
    return entered, release


def test_close_returns_before_the_batches_are_encoded(
    tmp_path: Path, encoding_blocked: tuple[threading.Event, threading.Event]
) -> None:
    entered, release = encoding_blocked
    w = RunWriter(tmp_path / "run", IDENTITY)
    assert w.send_columns("logits", logits_batch(8), 8)
    assert entered.wait(10), "the worker should have started encoding"
    started = time.monotonic()
    manifest = w.close(wait=False)
    assert time.monotonic() - started < 1.0
    assert manifest["status"] == "incomplete"
    assert not w.finished, "close returned while the batch was still being encoded"
    release.set()
    final = w.wait_closed(30)
    assert final["status"] == "complete"
    assert final["tables"]["logits"]["rows"] == 8


def test_closing_a_request_in_a_session_returns_and_the_exit_flush_writes_it(
    tmp_path: Path, encoding_blocked: tuple[threading.Event, threading.Event]
) -> None:
    entered, release = encoding_blocked
    settings = session.Settings.from_environ({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)})
    sess = session.start(settings)
    try:
        run = sess.open_run(token_ids=[1, 2, 3], model=IDENTITY["model"], engine=IDENTITY["engine"],
                            device=IDENTITY["device"], dtypes=IDENTITY["dtypes"])  # fmt: skip
        run.step = 0
        run.logits(torch.randn(3, 5), None, np.arange(3))
        started = time.monotonic()
        sess.close_run(run)  # ships the packet and hands the run over
        assert time.monotonic() - started < 1.0
        assert entered.wait(10)
        assert not run.writer.finished
        assert run.writer in sess.closing
    finally:
        release.set()
        session.stop()  # the exit flush: waits for every closed run
    assert run.writer.finished
    assert run.writer.manifest["status"] == "complete"
    assert run.writer.manifest["tables"]["logits"]["rows"] == 3


def test_a_shipment_is_decoded_on_the_writers_thread_and_its_events_counted_when_decoded(
    tmp_path: Path,
) -> None:
    packet = Packet()
    slot = packet.add(torch.tensor([1.0, 2.0, 3.0]))
    threads: list[str] = []

    def decode(arrays: list[np.ndarray]) -> list[tuple[str, dict, int]]:
        threads.append(threading.current_thread().name)
        events = {"seq": 0, "step": 0, "layer": 0, "site": "layer_out", "path": "prod", "kind": ["nan"],
                  "token": [int(arrays[slot][1])], "channel": [0], "count": [1]}  # fmt: skip
        return [("logits", logits_batch(3), 3), ("events", events, 1)]

    w = RunWriter(tmp_path / "run", IDENTITY)
    assert w.send_shipment(packet.ship(), decode, {"logits": 3})
    assert w.sent["logits"] == 3
    manifest = w.close()
    assert threads == [f"shadowtrace-writer-{IDENTITY['run_id']}"]
    assert manifest["tables"]["events"] == {**manifest["tables"]["events"], "rows": 1, "sent_rows": 1}
    assert manifest["tables"]["logits"]["rows"] == 3


def test_a_dropped_shipment_counts_its_rows_and_its_events_too(tmp_path: Path) -> None:
    packet = Packet()
    packet.add(torch.zeros(1000))  # 4000 bytes against a queue of 1 byte that is already full

    def decode(arrays: list[np.ndarray]) -> list[tuple[str, dict, int]]:
        events = {"seq": 0, "step": 0, "layer": 0, "site": "layer_out", "path": "prod", "kind": ["nan"],
                  "token": [0], "channel": [0], "count": [1]}  # fmt: skip
        return [("logits", logits_batch(3), 3), ("events", events, 1)]

    budget = writer.ByteBudget(1)
    budget.take(1, wait_s=0, stop=lambda: False)  # another run holds the whole queue
    w = RunWriter(tmp_path / "run", IDENTITY, queue_mode="lossy", budget=budget)
    assert not w.send_shipment(packet.ship(), decode, {"logits": 3})
    budget.give_back(1)
    manifest = w.close()
    assert manifest["tables"]["logits"]["dropped_rows"] == 3
    # the events, whose number only the device knew, were decoded on the spot and sent on
    # their own: the queue still full, they were dropped too, and counted
    events = manifest["tables"]["events"]
    assert (events["sent_rows"], events["dropped_rows"], events["rows"]) == (1, 1, 0)


def test_a_comparison_whose_lists_were_lost_drops_its_rows_counted_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The top-k lists' work failing (selection.ListsLost) costs that comparison's rows,
    counted as dropped and as topk_lists_lost_rows in the manifest on disk; the writer keeps
    writing the same shipment's other rows and every later shipment, and the run completes."""
    from shadowtrace_hooks import selection

    def lost(*_: object) -> None:
        raise RuntimeError("CUDA error: out of memory in nonzero")

    settings = session.Settings.from_environ({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)})
    run = session.Run(RunWriter(tmp_path / "run", IDENTITY), settings)
    positions = np.arange(6, dtype=np.int32)
    scores = torch.arange(36, dtype=torch.float32).view(6, 6)
    with monkeypatch.context() as m:
        m.setattr(selection, "_gap_coded", lost)
        run.topk(0, 0, 4, positions, torch.arange(6), scores.topk(4).indices, scores, {"raw": scores})
    run.logits(torch.randn(6, 10), None, positions)
    run.ship()
    run.logits(torch.randn(6, 10), None, positions)
    run.ship()
    manifest = run.writer.close()
    topk, logits = manifest["tables"]["topk"], manifest["tables"]["logits"]
    assert (topk["sent_rows"], topk["rows"], topk["dropped_rows"]) == (6, 0, 6)
    assert (logits["sent_rows"], logits["rows"]) == (12, 12)
    assert manifest["counters"]["topk_lists_lost_rows"] == 6
    assert manifest["status"] == "complete", manifest.get("errors")
