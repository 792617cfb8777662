"""What a user would write without shadowtrace: per-row top-k Jaccard with polars.

Reads the topk Parquet files of one run, computes |P & S| / |P | S| per informative row
(visible > k) with list.set_intersection / list.set_union, and the mean per layer, with
polars' streaming engine so memory stays bounded. Prints the wall time of each
repetition as `seconds N` (`--repeat R`, default 1; the first is often the slowest).
"""

import argparse
import time
from pathlib import Path

import polars as pl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("topk_dir", type=Path, help="a v1 run's topk directory")
    parser.add_argument("--repeat", type=int, default=1, help="times to run the query")
    args = parser.parse_args()
    files = sorted(str(p) for p in args.topk_dir.glob("*.parquet"))
    if not files:
        parser.error(f"{args.topk_dir}: no Parquet files")
    for _ in range(max(args.repeat, 1)):
        per_layer = one(files)
    print(f"layers {per_layer.height}, first layer mean Jaccard {per_layer['jaccard'][0]:.4f}")


def one(files: list[str]) -> pl.DataFrame:
    start = time.perf_counter()
    prod, shadow = pl.col("prod_indices"), pl.col("shadow_indices")
    jaccard = prod.list.set_intersection(shadow).list.len() / prod.list.set_union(shadow).list.len()
    per_layer = (
        pl.scan_parquet(files)
        .filter(pl.col("visible") > pl.col("k"))
        .select("layer", jaccard.alias("jaccard"))
        .group_by("layer")
        .agg(pl.col("jaccard").mean())
        .sort("layer")
        .collect(engine="streaming")
    )
    seconds = time.perf_counter() - start
    print(f"seconds {seconds:.3f}")
    return per_layer


if __name__ == "__main__":
    main()
