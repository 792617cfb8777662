//! On-disk bytes per `topk` row (prod + shadow), against the entropy bound.
//!
//! Selection: 2048 of 8192 keys, uniformly random and sorted (the worst case
//! for delta encoding: real indexers favour nearby and sink tokens); the
//! shadow keeps 95% of prod's members and swaps the rest for unselected keys.
//! The bound is log2 C(8192, 2048) bits for prod plus, for the shadow given
//! prod, log2 C(2048, m) + log2 C(6144, m) bits with m = 102 swapped members.
//!
//! Run: `cargo bench -p shadowtrace-tracer --bench topk_bytes --profile dev`
//! (bytes do not depend on the optimisation level, and the dev profile
//! reuses the test build instead of compiling polars again).

#![allow(clippy::print_stdout, reason = "a benchmark prints its figures")]

use std::fs::File;

use parquet::file::reader::{FileReader, SerializedFileReader};
use shadowtrace_schemas::Table;
use shadowtrace_tracer::record::{Selection, SelectionUnit, TopkRow};
use shadowtrace_tracer::synth::{SplitMix64, SynthSpec, realistic_selection_pair};
use shadowtrace_tracer::writer::part_path;
use shadowtrace_tracer::{RunWriter, WriterOptions};

const KEYS: i32 = 8192;
const K: i32 = 2048;
const RECALL: f64 = 0.95;
const ROWS: i32 = 8192;

fn log2_binomial(n: u64, k: u64) -> f64 {
    (1..=k)
        .map(|i| ((n - k + i) as f64 / i as f64).log2())
        .sum()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("topk-bytes");
    let spec = SynthSpec::demo("topk-bytes");
    let writer = RunWriter::create(&dir, spec.identity(), WriterOptions::default())?;
    let mut rng = SplitMix64(42);
    // Every row is a query that sees all KEYS keys (the last position).
    for _ in 0..ROWS {
        let (prod, shadow) = realistic_selection_pair(KEYS, K, RECALL, &mut rng);
        let selection = |indices, rng: &mut SplitMix64| Selection {
            indices,
            kth_score: Some(1.0 + rng.next_f32()),
            kth_margin: Some(1e-3 * rng.next_f32()),
            boundary: None,
        };
        let _ = writer.send(TopkRow {
            step: 0,
            layer: 0,
            token: KEYS - 1,
            indexer_layer: 0,
            unit: SelectionUnit::TOKEN,
            k: K,
            visible: KEYS,
            prod: selection(prod, &mut rng),
            shadow: Some(("raw".to_owned(), selection(shadow, &mut rng))),
            boundary_band: None,
        });
    }
    writer.close()?;

    let path = dir.join(part_path(Table::Topk, 0));
    let file_bytes = std::fs::metadata(&path)?.len();
    let reader = SerializedFileReader::new(File::open(&path)?)?;
    let mut per_column = std::collections::BTreeMap::<String, i64>::new();
    for rg in reader.metadata().row_groups() {
        for chunk in rg.columns() {
            *per_column
                .entry(chunk.column_path().parts()[0].clone())
                .or_default() += chunk.compressed_size();
        }
    }
    let rows = f64::from(ROWS);
    let swapped = ((1.0 - RECALL) * f64::from(K)).round() as u64;
    let prod_bound = log2_binomial(KEYS as u64, K as u64) / 8.0;
    let shadow_bound =
        (log2_binomial(K as u64, swapped) + log2_binomial((KEYS - K) as u64, swapped)) / 8.0;
    let list_bytes = |name: &str| per_column.get(name).copied().unwrap_or(0) as f64 / rows;

    println!(
        "topk storage, {ROWS} rows: {K} of {KEYS} keys, shadow recall {RECALL} ({swapped} members swapped)"
    );
    println!(
        "  file                     {:>9.1} bytes/row  ({file_bytes} bytes)",
        file_bytes as f64 / rows
    );
    println!(
        "  prod_indices             {:>9.1} bytes/row",
        list_bytes("prod_indices")
    );
    println!(
        "  shadow_indices           {:>9.1} bytes/row",
        list_bytes("shadow_indices")
    );
    println!(
        "  raw (2 x {K} x 4 bytes)   {:>9.1} bytes/row",
        f64::from(2 * K * 4)
    );
    println!(
        "  entropy bound            {:>9.1} bytes/row  (prod {prod_bound:.1} + shadow given prod {shadow_bound:.1})",
        prod_bound + shadow_bound
    );
    println!(
        "  file / bound             {:>9.2}",
        file_bytes as f64 / rows / (prod_bound + shadow_bound)
    );
    Ok(())
}
