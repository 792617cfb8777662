"""An exit that lands while a run is being closed. A serving engine's SIGTERM handler raises
SystemExit between any two bytecodes of the main thread, so also inside the hooks' own
bookkeeping after a forward returned. The run must stay reachable by the exit flush, which
writes it incomplete and `interrupted`, every row it captured written or counted."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from shadowtrace_hooks import session
from shadowtrace_hooks.writer import RunWriter

MODEL = {"name": "t", "architecture": "glm_moe_dsa", "config_hash": "0" * 64, "revision": None,
         "num_layers": 1, "index_topk": 4}  # fmt: skip
ENGINE = {"name": "transformers", "version": "test", "commit": None, "variant": None}
DEVICE = {"kind": "cpu", "name": "cpu", "index": None}
DTYPES = {"prod": "bf16", "shadow": None}


def exit_at(monkeypatch: pytest.MonkeyPatch, run: session.Run, point: str) -> None:
    """Makes the first call at `point` of closing `run` raise SystemExit, as a signal handler
    running there would."""
    fired = []

    def once(real):
        def call(*args, **kwargs):
            if not fired:
                fired.append(point)
                raise SystemExit(143)
            return real(*args, **kwargs)

        return call

    if point == "ship":
        monkeypatch.setattr(run, "ship", once(run.ship))
    elif point == "counters":
        monkeypatch.setattr(run.writer, "set_counters", once(run.writer.set_counters))
    else:
        monkeypatch.setattr(RunWriter, "close", once(RunWriter.close))


def run_with_logits(tmp_path: Path) -> tuple[session.Session, session.Run]:
    """A session into `tmp_path` and one run holding three rows of logits, not yet shipped."""
    settings = session.Settings.from_environ({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)})
    sess = session.start(settings)
    try:
        run = sess.open_run(token_ids=[1, 2, 3], model=MODEL, engine=ENGINE, device=DEVICE, dtypes=DTYPES)
        run.step = 0
        run.logits(torch.randn(3, 5), None, np.arange(3))
    except BaseException:
        session.stop()  # no session outlives a test that failed to set it up
        raise
    return sess, run


@pytest.mark.parametrize("point", ["ship", "counters", "writer close"])
def test_an_exit_inside_close_run_leaves_the_run_to_the_exit_flush_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    sess, run = run_with_logits(tmp_path)
    try:
        exit_at(monkeypatch, run, point)
        with pytest.raises(SystemExit):
            sess.close_run(run)
        assert run in sess.open_runs, "a run whose close was cut must stay reachable"
        assert run.cut
    finally:
        session.stop()
    assert run.writer.finished
    manifest = json.loads((run.writer.run_dir / "manifest.json").read_text())
    assert manifest["status"] == "incomplete"
    assert manifest["counters"]["interrupted"] == 1
    assert manifest["counters"]["closed_at_exit"] == 1
    assert manifest["tables"]["logits"]["rows"] == 3, "the rows captured before the exit are written"


def test_a_run_closed_whole_leaves_the_open_runs_and_is_not_cut(tmp_path: Path) -> None:
    sess, run = run_with_logits(tmp_path)
    try:
        sess.close_run(run)
        assert run not in sess.open_runs
        assert not run.cut
    finally:
        session.stop()
    manifest = json.loads((run.writer.run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert "interrupted" not in manifest["counters"]
