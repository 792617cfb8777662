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
    """A directory holding the run that `shadowtrace demo` writes."""
    root = tmp_path_factory.mktemp("demo")
    subprocess.run(
        [binary("shadowtrace"), "demo", "--out", root],
        check=True,
        capture_output=True,
        env={**os.environ, "PATH": f"{binary('shadowtrace').parent}:{os.environ['PATH']}"},
    )
    return root


@pytest.fixture(scope="session")
def demo_run(demo_root: Path) -> Path:
    (run,) = [p.parent for p in demo_root.glob("*/manifest.json")]
    return run
