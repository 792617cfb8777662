"""Tracing a test's own code in-process: activation as SHADOWTRACE=1 would do it, and the
runs read back."""

import itertools
import json
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from shadowtrace_hooks import session, startup


def start(out: Path, **env: str) -> session.Session:
    """Tracing into `out`, with every query row's full production list kept (the tests
    compare selections key by key)."""
    env = {"SHADOWTRACE_TOPK_LISTS": "all", **env}
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
        if table == "topk":
            rows = [with_key_lists(r) for r in rows]
        found.append({"manifest": manifest, "rows": rows})
    return found


def conventions(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A run's recorded conventions (the manifest's top-level `conventions`), by name, in
    the order they were recorded."""
    return {c["name"]: c for c in run["manifest"]["conventions"]}


def keys(gaps: list[int] | None) -> list[int] | None:
    """A gap-coded list's keys: its running sum."""
    return None if gaps is None else list(itertools.accumulate(gaps))


def with_key_lists(row: dict[str, Any]) -> dict[str, Any]:
    """A topk row with each path's selection and boundary keys decoded from the format v2
    columns (`prod_indices`, `shadow_indices`, `*_boundary_indices`), after checking that
    its summary counts are those of its lists."""
    prod = keys(row["prod_gaps"])
    out = {**row, "prod_indices": prod, "shadow_indices": None}
    for path in ("prod", "shadow"):
        out[f"{path}_boundary_indices"] = keys(row[f"{path}_boundary_gaps"])
    if prod is not None:
        assert len(prod) == row["prod_selected"], row
    if row["shadow_only_gaps"] is not None:
        prod_only, shadow_only = keys(row["prod_only_gaps"]), keys(row["shadow_only_gaps"])
        assert len(prod_only) == row["prod_selected"] - row["shared"], row
        assert len(shadow_only) == row["shadow_selected"] - row["shared"], row
        if prod is not None:
            assert set(prod_only) <= set(prod), row
            assert not set(shadow_only) & set(prod), row
            out["shadow_indices"] = sorted((set(prod) - set(prod_only)) | set(shadow_only))
    return out


def stop() -> None:
    session.stop()


def written(timeout_s: float = 30.0) -> None:
    """Waits for the runs closed so far to be on disk (closing a run returns at once)."""
    sess = session.current()
    assert sess is not None
    sess.wait_closed(time.monotonic() + timeout_s)
