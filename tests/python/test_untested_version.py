"""Runs on an engine release newer than any its adapter's layout was checked against (issue
27, item 5): the SGLang stand-in (hooks/tests/standins/sglang.py) installed as 0.5.22's code
but reporting a later release, traced in-process by the hooks and read back by the real
`shadowtrace analyze` and `inspect`. Every run records `settings.untested_engine_version`,
one line says so, and the analyzer shows it; a checked release records nothing."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, binary

sys.path.insert(0, str(REPO / "hooks" / "tests"))
import traced
from standins import sglang as sg

TOKENS = sg.TOPK + 40


@pytest.mark.parametrize("reported", ["0.5.22", "0.5.24rc1"])
def test_a_release_newer_than_the_layout_was_checked_against_is_marked_in_each_run_and_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, reported: str
) -> None:
    for name in ("SGLANG_DSA_FUSE_TOPK", "SGLANG_NSA_FUSE_TOPK"):
        monkeypatch.setenv(name, "0")
    monkeypatch.delenv("SGLANG_DISABLE_DSA_INDEXER_FUSION", raising=False)
    installed = sg.install(monkeypatch, "0.5.22")
    monkeypatch.setattr(sys.modules["sglang"], "__version__", reported)
    with caplog.at_level(logging.WARNING, logger="shadowtrace"):
        traced.start(tmp_path, SHADOWTRACE_SHADOW="fp32")
        try:
            model = installed.models.GlmMoeDsaForCausalLM(sg.glm5_config(index_k_norm_type="rms"))
            engine = sg.Engine(installed, model)
            for name in ("A", "B"):
                request = engine.request(name, TOKENS, seed=3)
                engine.extend([(request, TOKENS)])
        finally:
            traced.stop()
    runs = sorted(p.parent for p in tmp_path.glob("*/manifest.json"))
    assert len(runs) == 2
    lines = [r.getMessage() for r in caplog.records if "newer than" in r.getMessage()]
    settings = [json.loads((run / "manifest.json").read_text())["settings"] for run in runs]
    analyzed = subprocess.run([binary("shadowtrace"), "analyze", *runs], capture_output=True, text=True)
    assert analyzed.returncode == 0, analyzed.stderr
    inspected = subprocess.run([binary("shadowtrace"), "inspect", runs[0]], capture_output=True, text=True)
    assert inspected.returncode == 0, inspected.stderr
    if reported == "0.5.22":
        assert lines == []
        assert all("untested_engine_version" not in s for s in settings)
        assert "untested engine version" not in analyzed.stdout
        return
    why = (
        f"sglang {reported} is newer than 0.5.22, the newest release layout fused_indexer was checked against"
    )
    assert all(s["untested_engine_version"].startswith(why) for s in settings), settings
    assert len(lines) == 1, lines  # once in the process, whatever the runs
    assert lines[0].startswith(f"shadowtrace: {why}")
    # The note wraps at 100 columns: read as one line of words.
    words = " ".join(analyzed.stdout.split())
    assert words.count(f"untested engine version: {why}") == 2, analyzed.stdout
    assert f"untested_engine_version={why}" in inspected.stdout.replace('"', "")
