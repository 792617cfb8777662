"""The reliability suite: faults against a traced process and against the tools that read
its runs. Each fault records a row of the table conftest prints at the end of the session,
from independent counts (`account`): the fault, runs, whether the traced engine survived,
rows sent (what the forwards produced, by the test's own count of rows per forward, never the
writer's `sent_rows`), rows written (in part files on disk), rows counted (by a manifest:
dropped, sent and not written in an incomplete run, or missing from a run that names the
loss by a counter) and rows lost silently (what no manifest counts, whatever the run's status;
a line on stderr is not accounting). Zero engine crashes are asserted fault by fault, and
zero silent losses wherever a manifest can be written at all: a forward whose run could
open no file (an unwritable directory, a disk already full) shows its loss as silent, and its
test pins that number.

The traced process is a tiny random GLM-5 (tests/python/trace_tiny.py) traced by SHADOWTRACE=1
alone: 3 layers, every site, a local fp32 shadow, so every forward of T tokens sends
16 T + 6 rows (hidden: layer_in, attn_out, mlp_out, layer_out per layer; topk: one per layer;
logits: one per token; events: the two KV sentinel checks per layer).
"""

import errno
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, binary

TRACE = REPO / "tests" / "python" / "trace_tiny.py"
LENGTH = 600
ROWS_PER_FORWARD = 16 * LENGTH + 2 * 3
RESULTS: list[dict] = []  # the suite's table, printed by conftest


def hooks_path() -> dict[str, str]:
    """PYTHONPATH for a traced subprocess: the hooks this test process imported where they
    are a source tree (PYTHONPATH=hooks/src), so that the suite tests that code and not the
    wheel installed in the virtualenv; nothing where they are the installed wheel."""
    import shadowtrace_hooks

    root = Path(shadowtrace_hooks.__file__).resolve().parents[1]
    return {} if "site-packages" in root.parts else {"PYTHONPATH": str(root)}


def traced(tmp: Path, runs: Path, *args: str, preexec: object = None, **env: str) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE") and k != "PYTHONPATH"}
    environ = {**clean, **hooks_path(), "SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(runs), **env}
    out = tmp / f"out-{len(list(tmp.glob('out-*')))}.pt"
    return subprocess.Popen(
        [sys.executable, TRACE, "glm", str(LENGTH), out, *args], env=environ, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=preexec,
    )  # fmt: skip


def rows_per_forward(tokens: int = LENGTH, layers: int = 3) -> dict[str, int]:
    """What one forward of the tiny model over `tokens` tokens produces, per table: the
    test's own count, never the writer's."""
    return {"hidden": 4 * layers * tokens, "topk": layers * tokens, "logits": tokens, "events": 2 * layers}


# Counters by which a manifest names a loss it cannot number: the rows missing from such a
# run are "counted (named)", not lost silently. Events are counted when their shipment is
# decoded (unflushed_shipments, undecoded_shipments); a capture that failed (hook_errors,
# sites_disabled), a step that could not open (step_open_failed) or a hook that failed before
# the forward's first row (forward_failed_before_rows) produced none of its rows.
NAMING = ("unflushed_shipments", "undecoded_shipments", "hook_errors", "sites_disabled", "step_open_failed",
          "forward_failed_before_rows")  # fmt: skip
_RUN_ID = re.compile(r"-(\d{3})(?:-s\d+)?-rank\d+-pid(\d+)$")


def account(
    runs: Path,
    forwards: int | None,
    *,
    processes: int = 1,
    per_forward: dict[str, int] | None = None,
) -> dict:
    """Rows per fault from independent counts. Expected: `processes` processes of `forwards`
    forwards each, every forward producing `per_forward` (`rows_per_forward()` by default).
    Against it, what is on disk: rows in the part files, and what the manifests count (rows
    dropped, rows sent and not written in an incomplete run, and the rows missing from a run
    that names its loss by a counter of NAMING). What no manifest counts is lost silently,
    whatever the run's status and whatever the process printed: a line on stderr is not
    accounting.

    `forwards` are those the test knows returned (their request numbers 0 .. forwards - 1
    in each process). A later forward, which the fault may have cut half way, produced rows
    the test cannot know: its run is held to its own manifest's count when it is incomplete
    (the writer's word, the only one there is; counted as `cut`), to the full count when
    complete. With `forwards` None (a cut trace of the reference engine) every run is. A
    returned forward with no manifest at all lost its rows silently, unless a later run of
    its process counts it (`process.step_open_failed`)."""
    per_forward = per_forward or rows_per_forward()
    out = {"runs": 0, "complete": 0, "sent": 0, "written": 0, "counted": 0, "named": 0, "silent": 0,
           "incomplete": [], "cut": 0, "no_manifest": 0}  # fmt: skip
    seen: set[tuple[str, int]] = set()
    no_run: dict[str, int] = {}  # pid -> forwards its process counted lost before any run opened
    for path in sorted(runs.glob("*/manifest.json")) if runs.exists() else []:
        m = json.loads(path.read_text())
        out["runs"] += 1
        found = _RUN_ID.search(m["run_id"])
        n, pid = (int(found.group(1)), found.group(2)) if found else (0, m["run_id"])
        seen.add((pid, n))
        counters = m["counters"]
        no_run[pid] = max(no_run.get(pid, 0), counters.get("process.step_open_failed", 0))
        complete = m["status"] == "complete"
        out["complete"] += complete
        if not complete:
            out["incomplete"].append(m)
        own = forwards is None or (n >= forwards and not complete)
        out["cut"] += own
        names = any(counters.get(c, 0) for c in NAMING)
        for table, t in m["tables"].items():
            written = sum(pq.read_metadata(f).num_rows for f in (path.parent / table).glob("*.parquet"))
            assert written == t["rows"] or not complete, (m["run_id"], table)
            expected = t.get("sent_rows", 0) if own else per_forward.get(table, 0)
            unflushed = 0 if complete else max(0, t.get("sent_rows", 0) - t["rows"] - t["dropped_rows"])
            missing = max(0, expected - written - t["dropped_rows"] - unflushed)
            out["sent"] += expected
            out["written"] += written
            out["counted"] += min(expected, t["dropped_rows"] + unflushed)
            out["named" if names else "silent"] += missing
    if forwards is not None:
        whole = sum(per_forward.values())
        pids = {p for p, _ in seen}
        for pid in pids:
            lost = sum((pid, n) not in seen for n in range(forwards))
            named = min(lost, no_run.get(pid, 0))
            out["sent"] += lost * whole
            out["named"] += named * whole
            out["silent"] += (lost - named) * whole
            out["no_manifest"] += lost - named
        lost = max(0, processes - len(pids)) * forwards  # processes that left no run
        out["sent"] += lost * whole
        out["silent"] += lost * whole
        out["no_manifest"] += lost
    out["counted"] += out["named"]
    return out


def record(fault: str, survived: bool, acc: dict, forwards: int | str) -> None:
    """A row of the suite's table, from `account`'s independent counts: "rows sent" is what
    the forwards produced by the test's own count (a forward cut by the fault, by its run's
    count: `forwards` says how many), "rows counted" what the manifests count (those they
    name without a number said apart), "lost silently" what no manifest counts."""
    counted = acc["counted"] if not acc.get("named") else f"{acc['counted']} ({acc['named']} named)"
    if acc.get("cut"):
        forwards = f"{forwards} ({acc['cut']} cut)"
    RESULTS.append({"fault": fault, "forwards": forwards, "survived": survived, "runs": acc["runs"],
                    "sent": acc["sent"], "written": acc["written"], "counted": counted,
                    "silent": acc["silent"]})  # fmt: skip


def wait_for(proc: subprocess.Popen, line: str, timeout: float = 300) -> int:
    """Reads the traced process's progress until `line`; returns the `done` lines read."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    done = 0
    while time.monotonic() < deadline:
        got = proc.stdout.readline()
        done += got.startswith("done ")
        if got.strip() == line:
            return done
        if not got and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {line!r}: {proc.stderr.read()[-3000:]}")
    raise AssertionError(f"no {line!r} within {timeout} s")


@pytest.mark.parametrize(
    ("fault", "sig", "args", "code"),
    [
        ("SIGKILL mid-forward (Python writer)", signal.SIGKILL, (), -signal.SIGKILL),
        ("SIGTERM mid-forward (Python writer)", signal.SIGTERM, (), 128 + signal.SIGTERM),
        ("SIGTERM under an engine's SystemExit handler", signal.SIGTERM, ("--engine-sigterm",), 128 + 15),
    ],
)
def test_a_kill_mid_forward_keeps_every_finished_forward_and_counts_the_rest(
    tmp_path: Path, fault: str, sig: int, args: tuple, code: int
) -> None:
    runs = tmp_path / "runs"
    proc = traced(tmp_path, runs, "--forwards", "4", *args)
    done = wait_for(proc, "done 0")
    time.sleep(0.3)  # inside the second forward, or a later one on a fast machine
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    done += out.count("done ")
    assert proc.returncode == code, err[-3000:]
    assert "terminate called" not in err
    acc = account(runs, done)
    record(fault, True, acc, done)
    finished = [m for m in (json.loads(p.read_text()) for p in runs.glob("*/manifest.json"))
                if m["status"] == "complete"]  # fmt: skip
    # A forward hands its run to the writer when it returns (it printed `done`; one more may
    # have returned before printing), and closing does not wait for the writer. SIGTERM runs
    # the exit flush: every returned forward's run is complete, every row readable. SIGKILL
    # leaves no time for it: a returned forward's run may still have been being written, and
    # then stays incomplete with what it did not write counted, never lost silently.
    if sig == signal.SIGKILL:
        assert len(finished) <= done + 1 < 4
        assert len(finished) + len(acc["incomplete"]) >= done
    else:
        assert done <= len(finished) <= done + 1 < 4
        assert len(acc["incomplete"]) <= 1
    assert all(sum(t["rows"] for t in m["tables"].values()) == ROWS_PER_FORWARD for m in finished)
    assert acc["silent"] == 0
    if sig == signal.SIGTERM and acc["incomplete"]:
        assert acc["incomplete"][0]["counters"]["interrupted"] == 1


def killed_after_return(tmp: Path, delay_s: float, sig: int = signal.SIGKILL) -> bool:
    """A traced process killed `delay_s` after its first forward returned (it printed `done 0`;
    the next forward is running): whether that forward's run is whole on disk, complete with
    every row in the part files its manifest lists."""
    runs = tmp / "runs"
    proc = traced(tmp, runs, "--forwards", "8", "--digest-only")
    try:
        wait_for(proc, "done 0")
        time.sleep(delay_s)
        proc.send_signal(sig)
        proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.communicate()
    for path in runs.glob("*/manifest.json"):
        found = _RUN_ID.search(path.parent.name)
        if found and int(found.group(1)) == 0:
            written, _, m = on_disk(path.parent)
            return m["status"] == "complete" and written == ROWS_PER_FORWARD
    return False


# How long after a forward returns its rows are readable on disk (issue 42, item 4): the run is
# handed to its writer's thread as the forward returns, and the next forward runs meanwhile.
# Measured with tests/python/durability_probe.py (a SIGKILL that long after `done 0`, the
# 9,606 rows of a 600-token forward of the tiny GLM-5), on the 2-core machine of the test suite
# at a load average of 15 to 19: whole in 0 of 2 trials at 0 and 100 ms, 1 of 2 at 250 ms,
# 2 of 2 at 500 ms and 1 s. The bound below is three times the longest of those; a SIGKILL
# sooner leaves a manifest that counts what it did not write (unflushed_rows, the test above).
DURABLE_WITHIN_S = 1.5


def test_a_forwards_rows_are_readable_on_disk_within_the_stated_bound_of_its_return(tmp_path: Path) -> None:
    for trial in range(3):
        assert killed_after_return(tmp_path / f"trial-{trial}", DURABLE_WITHIN_S), (
            f"trial {trial}: the first forward's run was not whole {DURABLE_WITHIN_S} s after it returned"
        )


def small_disk(tmp: Path) -> tuple[Path, object]:
    """A directory on a 256 KiB tmpfs (ENOSPC when full: about two runs fit) where mounting
    one is allowed, else a plain directory and a process limit that fails writes to any file
    past 64 KiB with EFBIG (each run's larger parts)."""
    mount = tmp / "small-disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", mount], capture_output=True)
    if done.returncode == 0:
        return mount, None

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    return mount, limit


def digest(out: str) -> str:
    return next(line.split()[1] for line in out.splitlines() if line.startswith("logits "))


@pytest.fixture(scope="module")
def reference_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny GLM-5 checkpoint of 12 layers and a 2200-token prompt: the reference engine
    traces it in tens of seconds on the CPU, time to be killed half way."""
    import tiny_models

    root = tmp_path_factory.mktemp("reference")
    tiny_models.glm(layers=12).save_pretrained(root / "model")
    (root / "prompt.json").write_text(json.dumps(tiny_models.prompt(2200)[0].tolist()))
    return root / "model", root / "prompt.json"


@pytest.mark.parametrize(
    ("fault", "sig", "code"),
    [
        ("SIGKILL mid-trace (Rust writer)", signal.SIGKILL, -signal.SIGKILL),
        ("SIGTERM mid-trace (Rust writer)", signal.SIGTERM, 128 + signal.SIGTERM),
    ],
)
def test_a_kill_mid_trace_of_the_reference_engine_leaves_a_run_that_says_what_it_lost(
    tmp_path: Path, reference_checkpoint: tuple[Path, Path], fault: str, sig: int, code: int
) -> None:
    model, prompt = reference_checkpoint
    runs = tmp_path / "runs"
    proc = subprocess.Popen(
        [binary("shadowtrace-run"), "--model", model, "--out", runs, prompt],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # Until the writer's manifest says rows were sent: the trace is half way through.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            manifests = list(runs.glob("*/manifest.json"))
            tables = json.loads(manifests[0].read_text())["tables"] if manifests else {}
            if tables.get("hidden", {}).get("sent_rows", 0) > 0:
                break
            time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == code, err[-3000:]
    acc = account(runs, None)  # a cut trace: its rows are its own count
    record(fault, True, acc, 1)
    (manifest,) = (json.loads(p.read_text()) for p in runs.glob("*/manifest.json"))
    assert manifest["status"] == "incomplete"
    assert acc["silent"] == 0
    if sig == signal.SIGTERM:
        # Stopped at a layer boundary: everything sent was written, the cut is said.
        assert manifest["counters"]["interrupted"] == 1
        assert acc["written"] == acc["sent"] > 0
    else:
        out = subprocess.run([binary("shadowtrace"), "inspect", runs], capture_output=True, text=True)
        assert "INCOMPLETE" in out.stdout


def test_a_full_disk_leaves_the_engine_running_and_counts_what_it_could_not_write(tmp_path: Path) -> None:
    untraced = subprocess.run(
        [sys.executable, TRACE, "glm", str(LENGTH), "-", "--digest-only", "--forwards", "4"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    disk, limit = small_disk(tmp_path)
    try:
        proc = traced(tmp_path, disk / "runs", "--forwards", "4", "--digest-only", preexec=limit)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert digest(out) == digest(untraced.stdout)
        acc = account(disk / "runs", 4)
    finally:
        if limit is None:
            subprocess.run(["umount", disk], check=True)
    record(f"disk full ({'256 KiB tmpfs' if limit is None else 'EFBIG past 64 KiB'})", True, acc, 4)
    assert acc["runs"] + acc["no_manifest"] == 4
    # Some forward's rows did not fit. Only a manifest counts them (a line on stderr is not
    # accounting). A run that opened is whole, written or counted, wherever the disk filled:
    # its manifest holds the room of its own rewrites (`rewrite_json_in_place`). Before, a
    # run whose last manifest did not fit lost the rows sent since the one on disk, silently
    # (22814 rows in one run of this test, with a manifest rewritten after its opening). A
    # forward whose run could open no file at all (no manifest, and no later run of the
    # process could be written to count it) still loses its rows silently: the table shows
    # it, and the test says so (xfail) until a process reserves the room of such a count.
    assert acc["counted"] + acc["silent"] > 0
    assert acc["silent"] <= acc["no_manifest"] * ROWS_PER_FORWARD, acc
    if acc["silent"]:
        silent, no_manifest = acc["silent"], acc["no_manifest"]
        pytest.xfail(f"full disk: {silent} rows lost silently ({no_manifest} forwards with no manifest)")


def test_an_unwritable_directory_leaves_the_engine_running_and_says_so_once(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    proc = traced(tmp_path, blocker / "runs", "--forwards", "2")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    lines = [x for x in err.splitlines() if "shadowtrace" in x]
    assert len(lines) == 1, lines
    assert "Not a directory" in lines[0] or "NotADirectoryError" in lines[0]
    acc = account(blocker / "runs", 2)
    record("unwritable directory", True, acc, 2)
    # No manifest can be written: the one line is the only word of the two forwards' rows,
    # and a line is not accounting. The table says so, and this pins it.
    assert acc["silent"] == 2 * ROWS_PER_FORWARD
    assert acc["no_manifest"] == 2


def test_eight_processes_trace_into_one_directory_without_collision(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    procs = [traced(tmp_path, runs) for _ in range(8)]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    acc = account(runs, 1, processes=8)
    record("eight processes, one directory", True, acc, 8)
    assert (acc["runs"], acc["complete"]) == (8, 8)
    assert acc["written"] == 8 * ROWS_PER_FORWARD
    assert acc["silent"] == 0


def test_the_lossy_queue_at_its_smallest_counts_every_row_it_drops(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    proc = traced(tmp_path, runs, SHADOWTRACE_QUEUE="lossy")
    proc.communicate(timeout=300)
    assert proc.returncode == 0
    acc = account(runs, 1)
    record("lossy queue", True, acc, 1)
    assert acc["written"] + acc["counted"] == ROWS_PER_FORWARD
    assert acc["silent"] == 0


def on_disk(run_dir: Path) -> tuple[int, int, dict]:
    """A run's rows in complete part files (those its last manifest lists), the rows that
    manifest counts as dropped, and the manifest."""
    m = json.loads((run_dir / "manifest.json").read_text())
    written = sum(pq.read_metadata(run_dir / f).num_rows for t in m["tables"].values() for f in t["files"])
    return written, sum(t["dropped_rows"] for t in m["tables"].values()), m


def logits(rows: int) -> dict:
    """A batch of `rows` logits rows, as the hooks' capture sends them: about 28 bytes a row."""
    from shadowtrace_hooks import stats

    ids = np.arange(rows * 2, dtype=np.int32).reshape(rows, 2)
    top_ids, top_logprobs = stats.logits_lists(ids, -np.ones((rows, 2), dtype=np.float32))
    return {"step": 0, "token": np.arange(rows, dtype=np.int32), "prod_top_ids": top_ids,
            "prod_top_logprobs": top_logprobs}  # fmt: skip


@pytest.fixture
def dead_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, threading.Event, threading.Event]:
    """Under `dead/`, the writer's thread finds the disk full on its manifest writes while
    `full` is set, and its first rows wait in the encoder until `release` is set."""
    from shadowtrace_hooks import writer

    dead = tmp_path / "dead"
    full, release = threading.Event(), threading.Event()
    full.set()
    real_write, real_push = writer.write_json_atomically, writer._Table.push

    def disk(path: Path, document: object) -> None:
        on_worker = threading.current_thread().name.startswith("shadowtrace-writer-")
        if full.is_set() and on_worker and path.parent == dead:
            raise OSError(errno.ENOSPC, "No space left on device (planted)", str(path))
        real_write(path, document)

    def push(self: writer._Table, row: dict) -> None:
        if self.run_dir == dead:
            assert release.wait(30), "the test never released the encoder"
        real_push(self, row)

    monkeypatch.setattr(writer, "write_json_atomically", disk)
    monkeypatch.setattr(writer, "rewrite_json_in_place", disk)  # a disk whose overwrites take room too
    monkeypatch.setattr(writer._Table, "push", push)
    return dead, full, release


@pytest.mark.parametrize("disk_frees", [True, False])
def test_a_writer_whose_thread_dies_counts_it_gives_its_room_back_and_never_stalls_another_run(
    tmp_path: Path, dead_writer: tuple[Path, threading.Event, threading.Event], disk_frees: bool
) -> None:
    """The worker of one run dies on its manifest write (ENOSPC) with rows still queued: the
    death is counted, the queued rows' room goes back to the budget every run of the process
    shares, the dead run refuses (and counts) what is sent to it, and another run of the
    process goes on writing without waiting on the budget. Before issue 28 the thread died
    with a traceback alone, and the other run's rows waited out the queue timeout."""
    from shadowtrace_hooks.writer import _ROW_BYTES, ByteBudget, RunWriter
    from test_hooks_writer import IDENTITY, hidden

    dead_dir, full, release = dead_writer
    budget = ByteBudget(8 * _ROW_BYTES)
    created = time.monotonic()
    dead = RunWriter(dead_dir, {**IDENTITY, "run_id": "dead"}, queue_mode="lossy", budget=budget)
    alive = RunWriter(tmp_path / "alive", {**IDENTITY, "run_id": "alive"}, budget=budget,
                      queue_timeout_s=5.0, flush_timeout_s=10.0)  # fmt: skip
    sent_dead = 8  # the first waits in the encoder, the other 7 in the queue: the budget is full
    for token in range(sent_dead):
        dead.send("hidden", hidden(0, token))
    # Past the manifest's period when the encoder lets go: the worker rewrites it, and dies.
    time.sleep(max(0.0, 1.1 - (time.monotonic() - created)))
    release.set()
    deadline = time.monotonic() + 10
    while dead._worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not dead._worker.is_alive()

    # Batches larger than the room a queue of dead rows would leave: the live run needs them back.
    started, batches, rows = time.monotonic(), 10, 64
    accepted = 0
    while accepted < batches and alive.send_columns("logits", logits(rows), rows):
        accepted += 1  # the first batch dropped (after the queue's 5 s) ends the loop
    took, sent_alive = time.monotonic() - started, batches * rows
    assert accepted == batches, f"a batch of the live run dropped after {took:.1f} s"
    assert took < 1.0, f"the live run waited {took:.1f} s on the budget of a dead one"

    refused = 5
    assert not any(dead.send("hidden", hidden(0, token)) for token in range(refused))
    assert dead.finished, "waiters on a dead writer must not hang"
    if disk_frees:
        full.clear()  # else the last manifest write fails too: only the state in memory can be right
    with pytest.raises(RuntimeError, match="writer failed"):
        dead.close(timeout_s=5)
    memory = dead.manifest
    assert memory["status"] == "incomplete"
    assert memory["counters"]["writer_died"] == 1
    assert memory["counters"]["interrupted"] == 1
    hidden_rows = memory["tables"]["hidden"]
    assert (hidden_rows["sent_rows"], hidden_rows["rows"]) == (sent_dead + refused, 0)
    assert hidden_rows["dropped_rows"] == sent_dead + refused

    assert alive.close()["status"] == "complete"
    assert budget.used == 0, "room still held for rows the dead run will never write"
    written, counted, _ = on_disk(tmp_path / "alive")
    assert (written, counted) == (sent_alive, 0)
    # The table's row from the disk, against the test's own count of rows sent to each run.
    dead_written, dead_counted, dead_manifest = on_disk(dead_dir)
    written, counted = written + dead_written, counted + dead_counted
    sent = sent_dead + refused + sent_alive
    acc = {"runs": 2, "sent": sent, "written": written, "counted": counted,
           "silent": sent - written - counted}  # fmt: skip
    # The worker's writes stay refused either way; the closing thread's last write is not.
    how = "the disk frees" if disk_frees else "the worker's writes refused to the end"
    record(f"the writer's thread dies (manifest ENOSPC, {how}); the other run: "
           f"{batches} batches in {took:.2f} s", True, acc, "-")  # fmt: skip
    assert dead_manifest["counters"]["writer_died"] == 1
    assert dead_manifest["status"] == "incomplete"
    assert acc["silent"] == 0


def test_a_run_whose_disk_fills_after_its_opening_counts_every_row_in_its_manifest_rewritten_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After its opening manifest, every rewrite by a second file and a rename finds the disk
    full (ENOSPC), and so does every part's write. The manifest on disk still counts every
    row sent, as dropped: it is rewritten in the room its own file holds, and says so. Before, the
    manifest on disk stayed the opening one (nothing sent), and every row after it was lost
    silently. The in-place rewrite is the writer's own, on this test's real disk."""
    from shadowtrace_hooks import writer
    from test_hooks_writer import IDENTITY

    full = threading.Event()
    real_write = writer.write_json_atomically

    def disk(path: Path, document: object) -> None:
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device (planted)", str(path))
        real_write(path, document)

    def part(self: writer._Table, batch: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device (planted)", str(self.run_dir))

    monkeypatch.setattr(writer, "write_json_atomically", disk)
    monkeypatch.setattr(writer._Table, "write", part)
    run_dir = tmp_path / "run"
    run = writer.RunWriter(run_dir, IDENTITY, flush_timeout_s=10.0)
    opening = (run_dir / "manifest.json").stat().st_size
    full.set()
    batches, rows = 40, 512
    for _ in range(batches):
        assert run.send_columns("logits", logits(rows), rows)
    with pytest.raises(RuntimeError, match="writer failed"):
        run.close(timeout_s=10)
    written, counted, manifest = on_disk(run_dir)
    sent = batches * rows
    record("the disk fills after a run's opening (planted ENOSPC, manifest rewritten in place)", True,
           {"runs": 1, "sent": sent, "written": written, "counted": counted,
            "silent": sent - written - counted}, "-")  # fmt: skip
    assert manifest["tables"]["logits"]["sent_rows"] == sent
    assert (written, counted) == (0, sent)
    assert manifest["counters"]["manifest_rewritten_in_place"] >= 1
    assert manifest["status"] == "incomplete"
    assert (run_dir / "manifest.json").stat().st_size == opening, "the rewrite took no room"
    assert not list(run_dir.glob("manifest.json.*")), "a temporary manifest left on a full disk"


def test_the_exit_flush_writes_the_manifest_of_a_run_whose_writer_died(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session keeps a run whose writer died among those the exit flush waits for, though
    its worker has finished: the flush writes its manifest once more (the disk has room
    again), and the death is on disk, not only in memory."""
    from shadowtrace_hooks import session, writer
    from test_hooks_writer import IDENTITY

    full = threading.Event()
    full.set()
    real_write = writer.write_json_atomically

    def disk(path: Path, document: object) -> None:
        on_worker = threading.current_thread().name.startswith("shadowtrace-writer-")
        if full.is_set() and on_worker and path.parent.name.startswith("dying"):
            raise OSError(errno.ENOSPC, "No space left on device (planted)", str(path))
        real_write(path, document)

    monkeypatch.setattr(writer, "write_json_atomically", disk)
    monkeypatch.setattr(writer, "rewrite_json_in_place", disk)  # a disk whose overwrites take room too
    settings = session.Settings.from_environ({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)})
    sess = session.start(settings)
    opened = {k: IDENTITY[k] for k in ("model", "engine", "device", "dtypes")}
    try:
        dying = sess.open_run(token_ids=[1, 2, 3], request="dying", **opened)
        dying.step = 0
        dying.logits(torch.randn(3, 5), None, np.arange(3))
        sess.close_run(dying)  # its final manifest write finds the disk full: the worker dies
        deadline = time.monotonic() + 10
        while not dying.writer.finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dying.writer.finished
        sess.close_run(sess.open_run(token_ids=[4, 5], request="next", **opened))
        full.clear()
    finally:
        session.stop()
    manifest = json.loads((dying.writer.run_dir / "manifest.json").read_text())
    assert manifest["counters"]["writer_died"] == 1
    assert manifest["status"] == "incomplete"
    logits = manifest["tables"]["logits"]
    assert (logits["sent_rows"], logits["rows"] + logits["dropped_rows"]) == (3, 3)


def test_settings_recorded_while_the_worker_writes_the_manifest_never_kill_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forward's thread records settings (a shadow kernel's name, a prefix-cache hit)
    while the writer's thread rewrites the manifest: before issue 28 the two shared one dict
    without a lock, and json's encoder raised `dictionary changed size during iteration` in
    the worker, which died."""
    from shadowtrace_hooks import session, shadow, writer
    from shadowtrace_hooks.adapters import hf_prefix
    from test_hooks_writer import IDENTITY, hidden

    monkeypatch.setattr(writer, "_MANIFEST_EVERY_S", 0.005)  # a rewrite after nearly every row
    settings = session.Settings.from_environ({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)})
    run = session.Run(writer.RunWriter(tmp_path / "run", IDENTITY, flush_timeout_s=10.0), settings)
    for i in range(2000):  # a manifest whose serialisation takes a millisecond or two
        shadow.record_kernel(run, f"padding_{i}", "torch ieee")
    # Bounded in time and in work: 4000 settings, a row (so a rewrite) every 10, a pause
    # after each. The interpreter switches threads every microsecond, not every 5 ms, so the
    # forward's thread, woken from its pause, lands in the middle of a rewrite as a busy
    # forward would in a longer one. Before the fix the worker died within some 30 settings.
    sent, recorded, deadline = 0, 0, time.monotonic() + 5.0
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        while time.monotonic() < deadline and recorded < 4000 and run.writer._worker.is_alive():
            if recorded % 10 == 0:
                run.writer.send("hidden", hidden(0, sent % 8))
                sent += 1
            shadow.record_kernel(run, f"shadow_kernel_{recorded}", "torch ieee")
            hf_prefix.tag(run, recorded % 3, [1] * (recorded % 3))
            recorded += 1
            time.sleep(0.0005)
    finally:
        sys.setswitchinterval(interval)
    assert run.writer._worker.is_alive(), "the writer's thread died while the settings changed"
    manifest = run.writer.close()
    assert "writer_died" not in manifest["counters"]
    assert manifest["status"] == "complete"
    assert all(manifest["settings"][f"shadow_kernel_{i}"] == "torch ieee" for i in range(recorded))
    written, counted, _ = on_disk(tmp_path / "run")
    silent = sent - written - counted
    acc = {"runs": 1, "sent": sent, "written": written, "counted": counted, "silent": silent}
    record("the forward records settings while the manifest is written", True, acc, "-")
    assert (written, counted) == (sent, 0)


@pytest.mark.parametrize(
    "error", [RuntimeError("planted"), torch.OutOfMemoryError("CUDA out of memory (planted)")]
)
def test_an_error_inside_a_capture_never_reaches_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    import tiny_models
    from shadowtrace_hooks import session, startup
    from shadowtrace_hooks.adapters import hf

    model, ids = tiny_models.glm(), tiny_models.prompt(64)
    with torch.no_grad():
        untraced = model(ids).logits

    def broken(*args: object, **kwargs: object) -> None:
        raise error

    # The capture that clones a layer's input, outside any guard before issue 16.
    monkeypatch.setattr(hf._Tracer, "_layer_in", broken)
    assert startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)}) is not None
    try:
        with torch.no_grad():
            traced_logits = model(ids).logits
    finally:
        session.stop()
    assert torch.equal(traced_logits, untraced)
    acc = account(tmp_path, 1, per_forward=rows_per_forward(64))
    record(f"{type(error).__name__} inside a capture", True, acc, 1)
    (manifest,) = (json.loads(p.read_text()) for p in tmp_path.glob("*/manifest.json"))
    assert manifest["counters"]["hook_errors"] == 1
    assert manifest["tables"]["topk"]["rows"] == 3 * 64  # the other captures go on
    assert acc["silent"] == 0


def bad_inputs(good: Path, tmp: Path) -> dict[str, Path]:
    """Copies of a good run, each broken one way."""
    cases = {}
    for name in (
        "truncated part",
        "corrupt manifest",
        "foreign parquet",
        "mismatched run id",
        "inflated rows",
    ):
        run = tmp / name.replace(" ", "-")
        shutil.copytree(good, run)
        manifest = json.loads((run / "manifest.json").read_text())
        part = run / manifest["tables"]["hidden"]["files"][0]
        if name == "truncated part":
            part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
        elif name == "corrupt manifest":
            (run / "manifest.json").write_text((run / "manifest.json").read_text()[:200])
        elif name == "foreign parquet":
            import pyarrow as pa

            pq.write_table(pa.table({"x": [1, 2, 3]}), part)
        elif name == "mismatched run id":
            manifest["run_id"] = "someone-else"
            (run / "manifest.json").write_text(json.dumps(manifest))
        else:
            manifest["tables"]["hidden"]["rows"] += 1000
            (run / "manifest.json").write_text(json.dumps(manifest))
        cases[name] = run
    return cases


def test_broken_inputs_are_refused_by_name_never_with_a_panic(tmp_path: Path) -> None:
    good = tmp_path / "good"
    proc = traced(tmp_path, good)
    proc.communicate(timeout=300)
    (run,) = good.iterdir()
    for name, broken in bad_inputs(run, tmp_path).items():
        for command in (["inspect"], ["analyze", "--strict"]):
            out = subprocess.run([binary("shadowtrace"), *command, broken], capture_output=True, text=True)
            assert out.returncode == 2, (name, command, out.stdout, out.stderr)
            assert "panicked" not in out.stderr, (name, out.stderr)
        # The "engine" here is the tool: it survived when it refused by name, exit 2, no panic.
        nothing = {"runs": 1, "sent": 0, "written": 0, "counted": 0, "silent": 0}
        record(f"inspect/analyze: {name}", True, nothing, "-")
