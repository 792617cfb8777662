"""Fixtures: the Rust binaries and a run they wrote."""

import json
import os
import re
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
import transformers
import upstream

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "schemas" / "v1"
# What format v2 redefines (topk, the manifest); the rest is v1's.
SCHEMAS_V2 = REPO / "schemas" / "v2"
# The transformers releases the HF adapter is executed on: the virtualenv's (5.17.0 in .venv;
# on the engines' torch, the release the engines bring: ./dev), 5.24 (the last without
# `kernels`) and the newest (with it: DeepSeek-V3.2's RoPE function is a hub-kernel module
# there). 5.17 is executed wherever its requirements can be met (transformers_path).
TRANSFORMERS = list(dict.fromkeys([transformers.__version__, "5.17.0", "5.24.0", "5.25.0"]))
# On the engines' torch releases (./dev's test_on_torch) the HF adapter runs on the release the
# environment brings alone: the releases installed apart run on .venv's torch, and each engine
# torch would add minutes of CI for transformers code that torch does not change.
if os.environ.get("SHADOWTRACE_TEST_OWN_TRANSFORMERS") == "1":
    TRANSFORMERS = [transformers.__version__]


def transformers_path(version: str) -> dict[str, str]:
    """PYTHONPATH for a subprocess running `version` of transformers: the virtualenv's own
    release, or the release installed apart (tests/python/upstream.py). A release whose
    requirements this environment cannot meet (transformers refuses them at import) skips the
    test, saying which."""
    if version == transformers.__version__:
        return {}
    unmet = upstream.unmet("transformers", version)
    if unmet:
        pytest.skip(f"transformers {version} cannot run beside this environment: requires {'; '.join(unmet)}")
    return {"PYTHONPATH": str(upstream.site("transformers", version))}


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
        # 1k and 3k tokens: below and above index_topk, the cells the tests read. The suspects
        # section is left out (minutes of sweeps no test here reads; its text is pinned by
        # tracer/tests/suspects_demo_section.rs, the sweep by tracer/tests/suspects_sweep.rs).
        [
            binary("shadowtrace"),
            "demo",
            "--out",
            root,
            "--models",
            REPO / "models",
            "--lengths",
            "1024,3072",
            "--no-suspects",
        ],
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


# The files that read the demo's grid (the `demo_root` fixture): under pytest-xdist (`./dev test`
# runs two workers) they share one worker, so the grid (minutes) is run once.
DEMO_FILES = (
    "test_cli.py", "test_format_contract.py", "test_notebooks.py", "test_sql_without_shadowtrace.py",
)  # fmt: skip
# A file whose fixtures outlive a test (a traced model, a run, an installed release) keeps its
# tests on one worker, so the fixture is built once.
SHARED_FIXTURE = re.compile(r"""scope=["'](module|package|session)["']""")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Work units for xdist's workers: the demo's files, one unit; a file with a shared fixture,
    one unit; any other test, a unit of its own, so a long file is spread over both workers.
    (xdist's own `loadgroup` cannot do this on pytest 9: the group it appends to a test's id
    never reaches the id it schedules by.)"""
    from xdist.scheduler import LoadScopeScheduling

    rootdir = Path(str(config.rootpath))

    @cache
    def shares_fixtures(path: str) -> bool:
        file = rootdir / path
        return file.is_file() and SHARED_FIXTURE.search(file.read_text()) is not None

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.rsplit("/", 1)[-1] in DEMO_FILES:
                return "the demo's grid"
            return path if shares_fixtures(path) else nodeid

    return Units(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A file that reads the demo's grid and is not in DEMO_FILES would run the grid again on
    the other worker: refused here, so the list cannot fall behind the tests."""
    readers = {item.path.name for item in items if "demo_root" in getattr(item, "fixturenames", ())}
    unlisted = sorted(readers - set(DEMO_FILES))
    if unlisted:
        raise pytest.UsageError(f"{', '.join(unlisted)} read the demo's grid: list in conftest.DEMO_FILES")


# The reliability suite's rows, handed over by the pytest-xdist worker that ran them.
WORKER_RESULTS: list[dict] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist worker, hand the reliability suite's rows to the controller, which prints."""
    import sys

    workeroutput = getattr(session.config, "workeroutput", None)
    module = sys.modules.get("test_reliability")
    if workeroutput is not None and module is not None:
        workeroutput["reliability"] = json.dumps(module.RESULTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """xdist's controller: a worker ended; keep the reliability rows it ran."""
    WORKER_RESULTS.extend(json.loads(getattr(node, "workeroutput", {}).get("reliability", "[]")))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The reliability suite's table (tests/python/test_reliability.py), when it ran, in this
    process or on xdist's workers."""
    import sys

    module = sys.modules.get("test_reliability")
    results = [*getattr(module, "RESULTS", []), *WORKER_RESULTS]
    if not results:
        return
    write = terminalreporter.write_line
    write("")
    write("reliability suite: rows per fault; produced by the test's own count of each forward's rows,")
    write("written and counted from the manifests on disk (counted: dropped, unflushed, or missing from a")
    write("run whose counters name the loss); lost silently: what no manifest counts (a log line does not)")
    columns = {
        "fault": "fault", "forwards": "forwards", "runs": "runs", "survived": "engine survived",
        "sent": "rows produced", "written": "rows written", "counted": "rows counted",
        "silent": "lost silently",
    }  # fmt: skip
    rows = [list(columns.values())]
    for r in results:
        rows.append([("yes" if r[k] else "NO") if k == "survived" else str(r[k]) for k in columns])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    for row in rows:
        write("  " + "  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)))


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[Path]:
    """Tracing on in this process (SHADOWTRACE=1 into tmp_path/runs), stopped afterwards."""
    from shadowtrace_hooks import session, startup

    runs = tmp_path / "runs"
    assert startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(runs)}) is not None
    try:
        yield runs
    finally:
        session.stop()
