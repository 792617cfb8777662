"""Every notebook runs headless on the demo's report without a cell error."""

from pathlib import Path

import nbformat
import pytest
from conftest import REPO
from nbclient import NotebookClient

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks_to_run() -> None:
    assert [p.name for p in NOTEBOOKS] == [
        "01_grid_at_a_glance.ipynb",
        "02_one_run_in_depth.ipynb",
        "03_glm_vs_deepseek.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_on_the_demo_report(
    path: Path, demo_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHADOWTRACE_REPORT", str(demo_root / "report"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.get("outputs") for cell in code), "notebooks are committed without outputs"
    resources = {"metadata": {"path": str(path.parent)}}
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources=resources).execute()
