"""The README's DuckDB, polars and Spark SQL snippets over v2 runs give what
`shadowtrace analyze` gives: per run and layer, the mean Jaccard and churn-free Jaccard
of the top-k selections, and the non-finite onset. The snippets are read from the README
and run as written (only the path changed), so the README cannot rot."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import polars as pl
import pytest
from conftest import REPO, binary

README = REPO / "README.md"
TOLERANCE = 1e-12  # means of the same f64 values summed in another order


def snippet(name: str) -> str:
    """The code block after `<!-- snippet: NAME -->` in the README."""
    text = README.read_text()
    found = re.search(rf"<!-- snippet: {name} -->\n```\w*\n(.*?)```", text, re.S)
    assert found, f"README has no snippet {name}"
    return found.group(1)


def analysis(runs: Path) -> dict:
    out = subprocess.run(
        [binary("shadowtrace"), "analyze", runs, "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def analyzer_layers(a: dict, metric: str) -> dict[tuple[str, int], float]:
    return {
        (run["run_id"], layer["layer"]): layer[metric]["mean"]
        for run in a["runs"]
        for layer in run["topk"]
        if layer[metric] is not None
    }


def assert_layers_equal(got: dict, expected: dict) -> None:
    assert expected, "the runs have informative top-k rows"
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=TOLERANCE, abs=TOLERANCE), key


def test_readme_duckdb_jaccard_equals_the_analyzer(demo_runs: Path) -> None:
    sql = snippet("duckdb-jaccard").replace("runs/*/topk", f"{demo_runs}/*/topk")
    rows = duckdb.sql(sql).fetchall()
    a = analysis(demo_runs)
    for column, metric in [(2, "jaccard"), (3, "jaccard_no_churn")]:
        got = {(r[0], r[1]): r[column] for r in rows}
        assert_layers_equal(got, analyzer_layers(a, metric))


def test_readme_polars_jaccard_equals_the_analyzer(demo_runs: Path) -> None:
    code = snippet("polars-jaccard").replace("runs/*/topk", f"{demo_runs}/*/topk")
    scope: dict = {}
    # The README's own snippet, run as a user would.
    exec(code, scope)
    frame: pl.DataFrame = scope["per_layer"]
    a = analysis(demo_runs)
    for metric in ["jaccard", "jaccard_no_churn"]:
        got = {(r["run_id"], r["layer"]): r[metric] for r in frame.iter_rows(named=True)}
        assert_layers_equal(got, analyzer_layers(a, metric))


def spark_session():
    """A local Spark session, or a failure saying what is missing: never a skip."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        pytest.fail("pyspark is not installed: `pip install -r requirements-dev.txt` installs it")
    if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
        pytest.fail("Java is absent: Spark needs a Java 17+ runtime on PATH or in JAVA_HOME")
    return (
        SparkSession.builder.master("local[2]")
        .appName("shadowtrace-readme")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )


def test_readme_spark_sql_churn_free_jaccard_and_onset_equal_the_analyzer(
    demo_runs: Path,
) -> None:
    spark = spark_session()
    try:
        for table in ["topk", "hidden", "events"]:
            spark.read.parquet(f"{demo_runs}/*/{table}").createOrReplaceTempView(table)
        jaccard_sql, onset_sql = [s for s in snippet("spark-sql").split(";") if s.strip()]
        jaccard = spark.sql(jaccard_sql).collect()
        onset = spark.sql(onset_sql).collect()
    finally:
        spark.stop()
    a = analysis(demo_runs)
    got = {(r["run_id"], r["layer"]): r["jaccard_no_churn"] for r in jaccard}
    assert_layers_equal(got, analyzer_layers(a, "jaccard_no_churn"))
    expected_onset = {
        run["run_id"]: (run["onset"]["seq"], run["onset"]["layer"], run["onset"]["site"])
        for run in a["runs"]
        if run["onset"] is not None
    }
    assert expected_onset, "the demo plants a non-finite value"
    assert {r["run_id"]: (r["seq"], r["layer"], r["site"]) for r in onset} == expected_onset


@pytest.fixture(scope="module")
def serving_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Runs the vLLM stand-in's hooks wrote (hooks/tests/standins/vllm.py): production's
    boundary from the dequant scores, so churn is known, as the serving engines record it."""
    sys.path.insert(0, str(REPO / "hooks" / "tests"))
    from test_adapter_vllm import _trace_rank

    runs = tmp_path_factory.mktemp("vllm")
    with pytest.MonkeyPatch.context() as mp:
        _trace_rank(mp, runs, None)
    return runs


def snippet_layers(runs: Path, tool: str) -> dict[str, dict]:
    """The DuckDB or polars snippet over `runs`: per metric, {(run_id, layer): value}."""
    names = ("jaccard", "jaccard_no_churn", "churn_unknown_rows")
    if tool == "duckdb":
        rows = duckdb.sql(snippet("duckdb-jaccard").replace("runs/*/topk", f"{runs}/*/topk")).fetchall()
        return {m: {(r[0], r[1]): r[c] for r in rows} for c, m in enumerate(names, start=2)}
    scope: dict = {}
    exec(snippet("polars-jaccard").replace("runs/*/topk", f"{runs}/*/topk"), scope)
    frame: pl.DataFrame = scope["per_layer"]
    return {m: {(r["run_id"], r["layer"]): r[m] for r in frame.iter_rows(named=True)} for m in names}


@pytest.fixture(scope="module")
def serving_run_without_prod_scores(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The vLLM stand-in's runs where the adapter could not read production's FP8 operands
    (`_fp8_v32` gives none, as when the engine's layout is not understood): production's scores,
    and so its boundary candidates and the churn, are unknown on every shadow row."""
    sys.path.insert(0, str(REPO / "hooks" / "tests"))
    from shadowtrace_hooks.adapters import vllm as vllm_adapter
    from test_adapter_vllm import _trace_rank

    runs = tmp_path_factory.mktemp("vllm-no-prod-scores")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_adapter, "_fp8_v32", lambda *args: None)
        _trace_rank(mp, runs, None)
    return runs


@pytest.mark.parametrize("tool", ["duckdb", "polars"])
def test_readme_snippets_give_unknown_churn_as_null_and_count_it_as_the_analyzer_does(
    serving_run_without_prod_scores: Path, tool: str
) -> None:
    """Rows whose churn is unknown (issue 28, item 4): the snippets give no churn-free Jaccard
    for them (null, where treating null churn as 0 passed the plain Jaccard off as churn-free)
    and count them per layer as the analyzer does."""
    runs = serving_run_without_prod_scores
    a = analysis(runs)
    got = snippet_layers(runs, tool)
    layers = [
        (run["run_id"], layer) for run in a["runs"] for layer in run["topk"] if layer["informative_rows"]
    ]
    assert layers, "the serving run has informative rows"
    for run_id, layer in layers:
        key = (run_id, layer["layer"])
        assert layer["churn_unknown_rows"] == layer["informative_rows"], "no production scores: no churn"
        assert got["churn_unknown_rows"][key] == layer["churn_unknown_rows"]
        assert got["jaccard_no_churn"][key] is None
        assert got["jaccard"][key] == pytest.approx(layer["jaccard"]["mean"], rel=TOLERANCE, abs=TOLERANCE)


@pytest.mark.parametrize("tool", ["duckdb", "polars"])
def test_readme_snippets_equal_the_analyzer_on_a_serving_engines_run(serving_run: Path, tool: str) -> None:
    """The same snippets over runs the Python hooks wrote for a serving engine (issue 28,
    item 4): their churn columns, and the analyzer's recount from the boundary lists, agree."""
    a = analysis(serving_run)
    known = [layer for run in a["runs"] for layer in run["topk"] if layer["informative_rows"] > 0]
    assert known, "the serving run has informative rows"
    assert all(layer["churn_unknown_rows"] == 0 for layer in known), "churn is known on the serving rows"
    got = snippet_layers(serving_run, tool)
    assert set(got.pop("churn_unknown_rows").values()) == {0}
    for metric, values in got.items():
        assert_layers_equal(values, analyzer_layers(a, metric))
