"""Fixtures: the Rust binaries and a run they wrote."""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "schemas" / "v1"


def binary(name: str) -> Path:
    """A Rust binary built by `./dev test` (SHADOWTRACE_BIN_DIR)."""
    bin_dir = os.environ.get("SHADOWTRACE_BIN_DIR")
    if not bin_dir:
        pytest.fail("SHADOWTRACE_BIN_DIR is not set: run these tests through `./dev test`")
    path = Path(bin_dir) / name
    if not path.is_file():
        pytest.fail(f"{path} does not exist: build it with `cargo build --bin {name}`")
    return path


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `shadowtrace demo` writes: runs/ (a grid of runs) and report/."""
    root = tmp_path_factory.mktemp("demo")
    subprocess.run(
        # 1k and 3k tokens: below and above index_topk, the cells the tests read.
        [binary("shadowtrace"), "demo", "--out", root, "--lengths", "1024,3072"],
        check=True,
        capture_output=True,
        env={**os.environ, "PATH": f"{binary('shadowtrace').parent}:{os.environ['PATH']}"},
    )
    return root


@pytest.fixture(scope="session")
def demo_runs(demo_root: Path) -> Path:
    """The demo's directory of runs."""
    return demo_root / "runs"


@pytest.fixture(scope="session")
def demo_run(demo_runs: Path) -> Path:
    """The demo run with planted faults."""
    return demo_runs / "glm-tool-3k"
