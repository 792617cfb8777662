"""What a user would write without shadowtrace: per-row top-k Jaccard with polars.

Reads the topk Parquet files of one run, computes |P & S| / |P | S| per informative row
(visible > k) with list.set_intersection / list.set_union, and the mean per layer, with
polars' streaming engine so memory stays bounded. Prints the wall time as `seconds N`.
"""

import sys
import time
from pathlib import Path

import polars as pl


def main() -> None:
    files = sorted(str(p) for p in Path(sys.argv[1]).glob("*.parquet"))
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
    print(f"layers {per_layer.height}, first layer mean Jaccard {per_layer['jaccard'][0]:.4f}")


if __name__ == "__main__":
    main()
