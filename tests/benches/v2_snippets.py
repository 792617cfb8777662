"""The README's own DuckDB and polars snippets over a v2 run's topk files, timed: the
per-layer Jaccard aggregation a user runs on the same files `shadowtrace analyze` reads.

The snippets are read from the README (`<!-- snippet: duckdb-jaccard -->` and
`<!-- snippet: polars-jaccard -->`) and run as written, only the path changed. Prints each
repetition as `seconds ENGINE N` (`--repeat R`, default 1) and, per engine, the layers it
returned and the first layer's mean Jaccard, so the caller can check the work was done.
"""

import argparse
import re
import time
from pathlib import Path

import duckdb
import polars as pl

README = Path(__file__).resolve().parents[2] / "README.md"


def snippet(name: str) -> str:
    found = re.search(rf"<!-- snippet: {name} -->\n```\w*\n(.*?)```", README.read_text(), re.S)
    if not found:
        raise SystemExit(f"{README}: no snippet {name}")
    return found.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a v2 run directory (its topk/ is read)")
    parser.add_argument("--repeat", type=int, default=1, help="times to run each query")
    args = parser.parse_args()
    files = f"{args.run_dir.parent}/{args.run_dir.name}/topk/*.parquet"
    sql = snippet("duckdb-jaccard").replace("runs/*/topk/*.parquet", files)
    code = snippet("polars-jaccard").replace("runs/*/topk/*.parquet", files)
    if files not in sql or files not in code:
        raise SystemExit("the README's snippets no longer read runs/*/topk/*.parquet")
    for _ in range(max(args.repeat, 1)):
        start = time.perf_counter()
        rows = duckdb.sql(sql).fetchall()
        print(f"seconds duckdb {time.perf_counter() - start:.4f}")
    print(f"duckdb layers {len(rows)}, first layer mean Jaccard {rows[0][2]:.4f}")
    for _ in range(max(args.repeat, 1)):
        scope: dict = {}
        start = time.perf_counter()
        exec(code, scope)
        print(f"seconds polars {time.perf_counter() - start:.4f}")
    frame: pl.DataFrame = scope["per_layer"]
    print(f"polars layers {frame.height}, first layer mean Jaccard {frame['jaccard'][0]:.4f}")


if __name__ == "__main__":
    main()
