"""Tracing a test's own code in-process: activation as SHADOWTRACE=1 would do it, and the
runs read back."""

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from shadowtrace_hooks import session, startup


def start(out: Path, **env: str) -> session.Session:
    sess = startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(out), **env})
    assert sess is not None
    return sess


def runs(out: Path, table: str = "topk") -> list[dict[str, Any]]:
    """Every run under `out`: its manifest and the rows of `table`, ordered by run id."""
    found = []
    for path in sorted(out.glob("*/manifest.json")):
        manifest = json.loads(path.read_text())
        files = manifest["tables"][table]["files"]
        rows = pq.read_table([path.parent / f for f in files]).to_pylist() if files else []
        found.append({"manifest": manifest, "rows": rows})
    return found


def stop() -> None:
    session.stop()
