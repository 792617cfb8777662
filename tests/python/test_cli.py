"""The `shadowtrace` command line as a user meets it: exit codes and messages."""

import json
import shutil
import subprocess
from pathlib import Path

import polars as pl
import pytest
from conftest import binary
from shadowtrace_hooks import writer


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
    assert run["manifest"]["run_id"] == "glm-tool-3k"
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


def test_analyze_names_the_planted_faults_with_their_rules(demo_runs: Path) -> None:
    out = shadowtrace("analyze", demo_runs)
    assert out.returncode == 0, out.stderr
    assert "top-k: first layer whose mean Jaccard" in out.stdout
    assert "non-finite onset:  step 0, layer 2, mlp_out, token 2500: nan (shadow finite there)" in out.stdout
    assert "top-k divergence:  layer 1: mean Jaccard" in out.stdout


def test_analyze_fail_on_exits_1_only_for_the_named_verdict(demo_runs: Path) -> None:
    assert shadowtrace("analyze", demo_runs, "--fail-on", "nonfinite").returncode == 1
    assert shadowtrace("analyze", demo_runs, "--fail-on", "topk").returncode == 1
    assert shadowtrace("analyze", demo_runs, "--fail-on", "hidden").returncode == 0
    # The DeepSeek control has no metric verdict; its one verdict is the convention the demo's
    # TensorRT-LLM indexer breaks: no Hadamard before FP8, where DeepSeek-V3.2's reference has it.
    control = demo_runs / "ds-tool-3k"
    for verdict in ("nonfinite", "topk", "hidden"):
        assert shadowtrace("analyze", control, "--fail-on", verdict).returncode == 0, verdict
    out = shadowtrace("analyze", control, "--fail-on", "convention")
    assert out.returncode == 1
    assert "convention mismatch: indexer hadamard: engine false, model true" in out.stdout


def test_analyze_json_carries_every_verdict_and_threshold(demo_runs: Path) -> None:
    out = shadowtrace("analyze", demo_runs, "--format", "json", "--topk-threshold", "0.5")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["thresholds"]["topk_jaccard"] == 0.5
    runs = {r["run_id"]: r for r in doc["runs"]}
    assert runs["glm-tool-3k"]["onset"]["layer"] == 2
    assert runs["glm-tool-3k"]["topk_verdict"] is None, "the perturbed layer keeps more than half its keys"
    assert all(r["hidden_verdict"] is None for r in runs.values())


def test_analyze_rejects_a_threshold_out_of_range(demo_runs: Path) -> None:
    out = shadowtrace("analyze", demo_runs, "--topk-threshold", "1.5")
    assert out.returncode == 2
    assert "--topk-threshold: expected a value in [0, 1], got 1.5" in out.stderr


def test_analyze_strict_fails_on_a_bad_run_that_lenient_mode_skips(demo_run: Path, tmp_path: Path) -> None:
    shutil.copytree(demo_run, tmp_path / "good")
    shutil.copytree(demo_run, tmp_path / "bad")
    (tmp_path / "bad" / "manifest.json").write_text("{")
    lenient = shadowtrace("analyze", tmp_path)
    assert lenient.returncode == 0
    assert "warning: skipped manifest" in lenient.stderr
    assert "1 run, 1 skipped" in lenient.stdout
    strict = shadowtrace("analyze", tmp_path, "--strict")
    assert strict.returncode == 2
    assert "corrupt" in strict.stderr


def test_the_demo_report_holds_markdown_plots_and_metrics(demo_root: Path) -> None:
    report = demo_root / "report"
    text = (report / "report.md").read_text()
    assert text.startswith("# shadowtrace report")
    assert "![plots/topk_jaccard_vs_layer.svg](plots/topk_jaccard_vs_layer.svg)" in text
    # A heatmap per run with informative rows (the 3k cells), as a PNG a screen shows whole.
    heatmaps = sorted(p.name for p in (report / "plots").glob("overlap_heatmap_*.png"))
    cells = [f"{m}-{k}-3k" for m in ("glm", "ds") for k in ("tool", "no-tool")]
    assert heatmaps == sorted(f"overlap_heatmap_{c}.png" for c in cells)
    for name in heatmaps:
        png = (report / "plots" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        width = int.from_bytes(png[16:20], "big")
        assert width <= 1600, (name, width)
        assert len(png) < 150_000, (name, len(png))  # the hand-drawn SVG heatmap was 2.1 MB
    for name in ("topk_jaccard_vs_layer.svg", "hidden_error_vs_layer.svg"):
        assert (report / "plots" / name).stat().st_size < 100_000
    layers = pl.read_parquet(report / "metrics" / "topk_layers.parquet")
    glm = layers.filter((pl.col("run_id") == "glm-tool-3k") & (pl.col("layer") == 1))
    assert glm["jaccard_no_churn_mean"][0] < 0.8


def test_the_demo_report_ends_with_the_bisection_of_its_planted_faults(demo_root: Path) -> None:
    """Issue 30: the demo's planted faults, bisected (the NaN is named at its site and layer;
    the indexer-key noise of the demo moves no argmax past the floor, and the section says so),
    and one line per model on whether grafting the fp32 indexer heals the clean path."""
    text = (demo_root / "report" / "report.md").read_text()
    section = text.split("## Bisection (trained weights)")[1]
    lines = [line[2:] for line in section.splitlines() if line.startswith("- ")]
    faults = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in lines[:3]}
    assert faults["a NaN at layer 2 mlp_out, token 2500"].startswith(
        "grafting the fp32 mlp_out at layer 2 restores argmax agreement"
    )
    assert "no indexer or attn_out graft does" in faults["a NaN at layer 2 mlp_out, token 2500"]
    assert faults["noise on the indexer's keys at layer 1"].startswith(
        "production already meets the target ungrafted"
    )
    assert "Target: restored = argmax agreement with the reference >=" in section
    heals = [line for line in lines if "grafting the fp32 indexer at every layer" in line]
    assert [line.split(":")[0] for line in heals] == ["glm-5.1-shaped", "deepseek-v3.2-shaped"]


def test_env_prints_each_variable_with_its_value_or_default() -> None:
    out = shadowtrace("env", "--format", "json")
    assert out.returncode == 0, out.stderr
    values = json.loads(out.stdout)
    assert values["SHADOWTRACE"] is False
    assert values["SHADOWTRACE_TOKENS"] == {"kind": "all"}


def edited_copy(run: Path, to: Path, edit: object) -> Path:
    """A copy of `run` at `to` whose manifest `edit` changed."""
    shutil.copytree(run, to)
    manifest = json.loads((to / "manifest.json").read_text())
    edit(manifest)  # type: ignore[operator]
    (to / "manifest.json").write_text(json.dumps(manifest))
    return to


def test_inspect_reports_a_manifest_claiming_more_rows_than_its_files_hold(
    demo_run: Path, tmp_path: Path
) -> None:
    held = json.loads((demo_run / "manifest.json").read_text())["tables"]["hidden"]["rows"]
    edited_copy(demo_run, tmp_path / "inflated", lambda m: m["tables"]["hidden"].update(rows=held + 7))
    out = shadowtrace("inspect", tmp_path / "inflated")
    assert out.returncode == 2, out.stderr
    assert f"table hidden: the manifest says {held + 7} rows, its listed files hold {held}" in out.stderr


def test_fail_on_does_not_pass_when_no_run_could_be_judged(demo_run: Path, tmp_path: Path) -> None:
    """Without --strict, bad runs are skipped; when every run is bad (unreadable, incomplete,
    hook-errored), --fail-on has nothing to judge and exits 2, never 0."""
    edited_copy(demo_run, tmp_path / "unreadable", lambda m: m.pop("model"))
    edited_copy(demo_run, tmp_path / "incomplete", lambda m: m.update(status="incomplete"))
    edited_copy(demo_run, tmp_path / "errored", lambda m: m["counters"].update(hook_errors=3))
    out = shadowtrace("analyze", tmp_path, "--fail-on", "hidden")
    assert out.returncode == 2, out.stdout
    counted = "1 unreadable, 1 incomplete, 1 with data not measured"
    assert f"--fail-on: no run could be judged: {counted}" in out.stderr
    assert shadowtrace("analyze", tmp_path).returncode == 0, "without --fail-on it only reports"
    assert shadowtrace("analyze", tmp_path, "--fail-on", "nonfinite").returncode == 1, "a verdict still fails"
    shutil.copytree(demo_run, tmp_path / "good")
    # One good run beside them: the others' verdicts are still not judged, and do not pass
    # unless partial data is accepted.
    out = shadowtrace("analyze", tmp_path, "--fail-on", "hidden")
    assert out.returncode == 2, out.stderr
    assert ": hidden divergence not judged: counted hook_errors = 3" in out.stderr
    assert ": hidden divergence not judged: the run is incomplete" in out.stderr
    assert "2 verdicts not judged" in out.stderr
    assert shadowtrace("analyze", tmp_path, "--fail-on", "hidden", "--allow-partial").returncode == 0


def test_a_top_k_part_of_many_row_groups_analyses_as_one_of_a_single_group(
    demo_run: Path, tmp_path: Path
) -> None:
    """Parts over 65,536 rows hold several row groups (the writers' group size): each column is
    then read as several chunks. The same rows regrouped small give the same analysis, on the
    summary-only path and on the paths that read the lists (a churn band narrower or wider than the
    recorded one)."""
    import pyarrow.parquet as pq

    regrouped = tmp_path / "regrouped" / demo_run.name
    shutil.copytree(demo_run, regrouped)
    parts = sorted((regrouped / "topk").glob("*.parquet"))
    assert parts
    for part in parts:
        footer = pq.read_metadata(part).metadata
        table = pq.read_table(part)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **footer})
        pq.write_table(table, part, row_group_size=max(1, table.num_rows // 7))
        assert pq.read_metadata(part).num_row_groups >= 7
    # A rewrite of a part records its new bytes' content hash, as its writer would have.
    manifest = json.loads((regrouped / "manifest.json").read_text())
    for part in parts:
        with part.open("rb") as f:
            manifest["tables"]["topk"]["file_hashes"][f"topk/{part.name}"] = writer.content_hash(f)
    (regrouped / "manifest.json").write_text(json.dumps(manifest))
    for extra in ([], ["--churn-band", "5e-5"], ["--churn-band", "2e-4"]):
        # --recheck: both decoded and checked here, neither taken from an earlier analyze
        one = shadowtrace("analyze", demo_run, "--format", "json", "--recheck", *extra)
        many = shadowtrace("analyze", regrouped, "--format", "json", "--recheck", *extra)
        assert many.returncode == 0, many.stderr
        runs = [json.loads(out.stdout)["runs"][0] for out in (one, many)]
        for run in runs:
            run.pop("dir", None)
        assert runs[0]["topk"]
        assert runs[0] == runs[1]


def churn_keys_recounted(run: Path, factor: float) -> dict[int, float]:
    """Per layer, the mean churn keys per informative row (more keys visible than k, a
    shadow) recounted from the run's Parquet lists: either path's candidates whose offset from
    its k-th score lies within `factor` times the row's recorded band."""
    import numpy as np
    import pyarrow.parquet as pq

    t = pq.read_table(run / "topk").to_pydict()
    per_layer: dict[int, list[int]] = {}
    for i, layer in enumerate(t["layer"]):
        if t["visible"][i] <= t["k"][i] or t["shadow_selected"][i] is None:
            continue
        reach = factor * t["boundary_band"][i]
        churn: set[int] = set()
        for path in ("prod", "shadow"):
            keys = np.cumsum(t[f"{path}_boundary_gaps"][i])
            offsets = t[f"{path}_boundary_offsets"][i]
            churn |= {int(key) for key, off in zip(keys, offsets, strict=True) if abs(off) <= reach}
        per_layer.setdefault(layer, []).append(len(churn))
    return {layer: sum(n) / len(n) for layer, n in per_layer.items()}


def test_the_churn_band_is_relative_and_narrows_or_widens_within_the_stored_lists(demo_run: Path) -> None:
    """The reference engine records a relative band (issue 28, item 4): the manifest says
    relative to what, and how far the lists reach. `--churn-band` narrows it, or widens it up
    to that reach, with churn equal to a recount from the Parquet lists; beyond it is refused."""
    settings = json.loads((demo_run / "manifest.json").read_text())["settings"]
    band, stored = settings["boundary_band"], settings["boundary_stored"]
    assert settings["boundary_band_scale"] == "mean_abs_reference_topk_score"
    assert stored == pytest.approx(2 * band)
    means = {}
    for factor in (0.5, 1.0, 2.0):
        out = shadowtrace("analyze", demo_run, "--format", "json", "--churn-band", f"{factor * band!r}")
        assert out.returncode == 0, out.stderr
        got = {
            layer["layer"]: layer["churn_keys_mean"] for layer in json.loads(out.stdout)["runs"][0]["topk"]
        }
        assert got == pytest.approx(churn_keys_recounted(demo_run, factor), rel=1e-9), factor
        means[factor] = got
    recorded = shadowtrace("analyze", demo_run, "--format", "json")
    assert {
        layer["layer"]: layer["churn_keys_mean"] for layer in json.loads(recorded.stdout)["runs"][0]["topk"]
    } == (pytest.approx(means[1.0], rel=1e-9))
    assert sum(means[0.5].values()) < sum(means[1.0].values()) < sum(means[2.0].values())
    beyond = shadowtrace("analyze", demo_run, "--churn-band", f"{3 * band!r}")
    assert beyond.returncode != 0
    assert "its boundary lists reach 2e-4" in beyond.stderr, beyond.stderr


def test_analyze_remembers_each_parts_summary_check_and_says_so(demo_run: Path, tmp_path: Path) -> None:
    """The top-k summary check runs once per part (issue 28, item 6): a second analyze of the
    same bytes takes it from the memo, prints how many parts it took, and gives the same
    analysis; --recheck decodes every part again and prints nothing of the memo."""
    run = tmp_path / demo_run.name
    shutil.copytree(demo_run, run)
    memo = tmp_path / "memo"
    first = shadowtrace("analyze", run, "--format", "json", "--check-memo", memo)
    assert first.returncode == 0, first.stderr
    assert "remembered" not in first.stderr
    second = shadowtrace("analyze", run, "--format", "json", "--check-memo", memo)
    parts = len(list((run / "topk").glob("*.parquet")))
    assert f"top-k summary check: {parts} of {parts} parts remembered" in second.stderr, second.stderr
    analyses = [json.loads(out.stdout) for out in (first, second)]
    checks = [a["runs"][0].pop("topk_summary_check") for a in analyses]
    assert checks[1]["parts_remembered"] == parts
    assert {**checks[1], "parts_remembered": 0} == checks[0]
    assert analyses[0] == analyses[1], "the same analysis otherwise"
    again = shadowtrace("analyze", run, "--format", "json", "--recheck")
    assert "remembered" not in again.stderr
    assert json.loads(again.stdout)["runs"][0]["topk_summary_check"] == checks[0]


def test_demo_refuses_arguments_it_cannot_run_before_tracing_the_grid(tmp_path: Path) -> None:
    """The suspects section runs after the grid: its arguments are checked before, not minutes
    into the demo; so is the folder of trained checkpoints."""
    for extra, needle in ((["--suspects-lengths", "0"], "--suspects-lengths 0"),
                          (["--models", str(tmp_path / "none")],
                           f"no trained checkpoint at {tmp_path / 'none' / 'glm5-tiny'}")):  # fmt: skip
        out = tmp_path / extra[0].strip("-")
        done = shadowtrace("demo", "--out", out, *extra)
        # Exit 2 and `error:`, as every other tool says bad input.
        assert done.returncode == 2
        assert done.stderr.startswith("error: "), done.stderr
        assert needle in done.stderr, done.stderr
        assert not (out / "runs").exists(), "the grid was traced first"


def test_a_capture_inconsistent_run_fails_every_fail_on_and_prints_its_verdict_first(
    demo_run: Path, tmp_path: Path
) -> None:
    """The adapter's self-check found recorded selections production's own scores contradict
    (issue 27): whatever verdict --fail-on asks for, the run fails, and the verdict is the
    first line of its analysis."""

    def misread(m: dict) -> None:
        m["settings"]["capture_check"] = {
            "tolerance": 1e-3,
            "sources": ["recomputed: production's FP8 q, k and scales with its head weights, scored in fp32"],
            "layers": {"0": {"rows": 10, "disagree": 0, "first_token": None},
                       "2": {"rows": 10, "disagree": 9, "first_token": 2049}},
        }  # fmt: skip

    edited_copy(demo_run, tmp_path / "misread", misread)
    for verdict in ("hidden", "nonfinite", "topk", "convention"):
        assert shadowtrace("analyze", tmp_path, "--fail-on", verdict).returncode == 1, verdict
    out = shadowtrace("analyze", tmp_path)
    assert out.returncode == 0, out.stderr
    run_lines = out.stdout.split("run glm-tool-3k:")[1].splitlines()
    assert run_lines[1].startswith("  CAPTURE INCONSISTENT at layer 2: 9 of 10 informative rows (90.0%)")
    assert "top-k divergence:  not judged: capture inconsistent at layer 2 (9 of 10 rows)" in out.stdout
    inspected = shadowtrace("inspect", tmp_path)
    assert "CAPTURE    CAPTURE INCONSISTENT at layer 2" in inspected.stdout


def test_an_unreadable_capture_check_is_a_broken_run_for_inspect_and_every_fail_on(
    demo_run: Path, tmp_path: Path
) -> None:
    """A `settings.capture_check` that cannot be read is not "no check" (issue 42): whether the
    adapter read the engine right is unknown, so `inspect` fails on it and every --fail-on
    exits 2 (not judged), as a capture found inconsistent fails every --fail-on."""

    def garble(m: dict) -> None:
        m["settings"]["capture_check"] = {"tolerance": "tight", "layers": {}}

    edited_copy(demo_run, tmp_path / "garbled", garble)
    passed = 0
    for verdict in ("hidden", "nonfinite", "topk", "convention", "any"):
        # A verdict the run has still fails (1); one it passes is now not judged (2).
        before = shadowtrace("analyze", demo_run, "--fail-on", verdict).returncode
        out = shadowtrace("analyze", tmp_path, "--fail-on", verdict)
        assert out.returncode == (2 if before == 0 else before), (verdict, out.stderr)
        if before == 0:
            passed += 1
            assert "capture self-check not judged: settings.capture_check unreadable" in out.stderr
    assert passed >= 2, "the check can fail: verdicts the intact run passes"
    out = shadowtrace("analyze", tmp_path)
    assert out.returncode == 0, out.stderr
    assert "  CAPTURE SELF-CHECK UNREADABLE: settings.capture_check unreadable" in out.stdout
    inspected = shadowtrace("inspect", tmp_path)
    assert inspected.returncode == 2
    assert "settings.capture_check unreadable" in inspected.stderr


def test_analyze_refuses_a_hidden_site_outside_the_vocabulary(tmp_path: Path) -> None:
    """A typo would find no capture, and the hidden verdict would have nothing to judge."""
    out = shadowtrace("analyze", tmp_path, "--hidden-site", "bogus")
    assert out.returncode == 2, out.stderr
    expected = 'unknown hidden-state site "bogus": expected one of layer_in, attn_out, mlp_out, layer_out'
    assert expected in out.stderr


def test_analyze_exits_2_when_no_run_could_be_read_with_or_without_fail_on(tmp_path: Path) -> None:
    """CI that runs a plain `analyze` must not go green when nothing was read."""
    run = tmp_path / "garbage"
    (run / "hidden").mkdir(parents=True)
    (run / "manifest.json").write_text("{ not json")
    for extra in ([], ["--fail-on", "any"]):
        out = shadowtrace("analyze", tmp_path, *extra)
        assert out.returncode == 2, (extra, out.stderr)
        assert "error: no run could be read (1 skipped)" in out.stderr


def test_fail_on_prints_which_run_and_verdicts_failed_it(demo_run: Path) -> None:
    out = shadowtrace("analyze", demo_run, "--fail-on", "any")
    assert out.returncode == 1, out.stderr
    fail = [line for line in out.stderr.splitlines() if line.startswith("FAIL (--fail-on any): ")]
    assert len(fail) == 1, out.stderr
    assert fail[0].startswith("FAIL (--fail-on any): glm-tool-3k "), out.stderr
    assert "topk@L1 (J " in fail[0], fail[0]
    assert "nonfinite@L" in fail[0], fail[0]


def test_analyze_summary_prints_one_line_per_run(demo_runs: Path) -> None:
    out = shadowtrace("analyze", demo_runs, "--summary")
    lines = out.stdout.splitlines()
    assert any(line.startswith("glm-tool-3k FAIL ") and "topk@L1 (J " in line for line in lines), out.stdout
    assert all(line.split(" ")[1] in ("FAIL", "PASS", "NOT") for line in lines), out.stdout
    verdict = json.loads(shadowtrace("analyze", demo_runs, "--format", "json").stdout)["verdict"]
    assert sorted(verdict["kinds"]) == ["cache", "capture", "convention", "hidden", "nonfinite", "topk"]
    assert verdict["status"] == "fail"
