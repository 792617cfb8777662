"""The `shadowtrace` command line as a user meets it: exit codes and messages."""

import json
import shutil
import subprocess
from pathlib import Path

from conftest import binary


def shadowtrace(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("shadowtrace"), *map(str, args)], capture_output=True, text=True, check=False
    )


def test_inspect_prints_identity_tables_and_status(demo_run: Path) -> None:
    out = shadowtrace("inspect", demo_run)
    assert out.returncode == 0, out.stderr
    assert "status     complete" in out.stdout
    assert "hidden   complete" in out.stdout


def test_inspect_json_lists_every_part_file(demo_run: Path) -> None:
    out = shadowtrace("inspect", "--format", "json", demo_run)
    assert out.returncode == 0, out.stderr
    (run,) = json.loads(out.stdout)["runs"]
    assert run["manifest"]["status"] == "complete"
    assert [Path(p["path"]).name for p in run["files"]["topk"]] == ["part-00000.parquet"]


def test_inspect_reports_a_bad_run_by_file_and_still_prints_the_good_ones(
    demo_run: Path, tmp_path: Path
) -> None:
    shutil.copytree(demo_run, tmp_path / "good")
    shutil.copytree(demo_run, tmp_path / "bad")
    part = tmp_path / "bad" / "topk" / "part-00000.parquet"
    part.write_bytes(part.read_bytes()[:100])
    out = shadowtrace("inspect", tmp_path)
    assert out.returncode == 2
    assert f"parquet file {part}: truncated or not Parquet" in out.stderr
    assert "status     complete" in out.stdout


def test_inspect_of_a_path_without_runs_says_so() -> None:
    out = shadowtrace("inspect", "/nonexistent/runs")
    assert out.returncode == 2
    assert "/nonexistent/runs: no shadowtrace run found" in out.stderr


def test_an_unknown_command_names_the_program_it_looked_for() -> None:
    out = shadowtrace("frobnicate")
    assert out.returncode == 2
    assert "no program shadowtrace-frobnicate" in out.stderr
