//! Analyze throughput on a GLM-5.1-sized top-k trace written as v2, side by
//! side with what a user would otherwise run on the same files, and on the
//! files a v1 trace would have written.
//!
//! The trace: 78 layers x 8192 query tokens, k = 2048 of up to 8192 visible
//! keys, prod and shadow selections, in two workloads
//! (`SHADOWTRACE_BENCH_WORKLOAD`: `easy`, `degraded` or `both`, the default):
//! - `easy`: the shadow swaps 2% of prod's keys, every one among keys tied at
//!   the k-th score (boundary churn): a healthy layer;
//! - `degraded`: the shadow swaps 11.1% (Jaccard near 0.8, a degraded
//!   layer's); on a quarter of the rows every swapped key is at the boundary,
//!   on the rest 16 of them are, so the difference lists are about 5.5 times
//!   the easy ones' and the boundary lists long on a quarter of the rows.
//!
//! Anchors, each timed on the same selections:
//! - the README's DuckDB and polars snippets over the same v2 files
//!   (`v2_snippets.py`): the per-layer aggregation of the stored counts
//!   alone, with no check of the counts against their lists;
//! - polars `list.set_intersection`/`set_union` over v1-style full lists
//!   (`polars_jaccard.py`): the set algebra a user writes without v2.
//!
//! shadowtrace's side is the release `shadowtrace analyze` process a user
//! runs (the benchmark builds it first), timed whole: it computes recall,
//! the churn-free variants and the distributions, and checks every summary
//! against its lists; timed twice, checking every part (`--recheck`), and
//! analysing the same run again with each part's check remembered from an
//! earlier call (`--check-memo`, what a second analyze of a trace does). The anchors' side is the query alone, without Python's
//! start or imports. Then `SHADOWTRACE_BENCH_RUNS` v2 runs of that size are
//! analysed in one call (the grid case). The benchmark fails when a run, row
//! or summary check it claims to have analysed is missing from the binary's
//! JSON, or when an anchor returned no layers.
//!
//! Run inside `./dev`'s environment (it calls `python` with polars and
//! DuckDB), release: `cargo bench -p shadowtrace-e2e --bench analyze_throughput`
//! Environment: `SHADOWTRACE_BENCH_LAYERS` (78), `SHADOWTRACE_BENCH_TOKENS`
//! (8192), `SHADOWTRACE_BENCH_RUNS` (10), `SHADOWTRACE_BENCH_REPEATS` (5:
//! each side of the one-run comparison is timed this often and compared by
//! the medians), `SHADOWTRACE_BENCH_WORKLOAD` (both),
//! `SHADOWTRACE_BENCH_DIR` (a directory to keep the traces in between runs;
//! default a temporary one).

#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark prints its figures and stops on failure"
)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use shadowtrace_analyzer::metrics::topk_check;
use shadowtrace_schemas::stats::Summary;
use shadowtrace_tracer::record::{Boundary, Selection, SelectionUnit, TopkRow};
use shadowtrace_tracer::synth::{
    SplitMix64, SynthSpec, realistic_selection_pair, symmetric_difference,
};
use shadowtrace_tracer::{RunWriter, WriterOptions};

const K: i32 = 2048;

/// The allocator the `shadowtrace` binary runs with (`analyzer/src/main.rs`),
/// so the in-process figures are the binary's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn env(name: &str, default: i32) -> i32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The selections a trace holds (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Workload {
    Easy,
    Degraded,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::Easy => "easy",
            Workload::Degraded => "degraded",
        }
    }

    /// The share of prod's keys the shadow keeps.
    fn recall(self) -> f64 {
        match self {
            Workload::Easy => 0.98,
            // J = r / (2 - r) = 0.8.
            Workload::Degraded => 1.6 / 1.8,
        }
    }

    /// How many of a row's swapped keys lie at the boundary (churn).
    fn at_boundary(self, token: i32, swapped: usize) -> usize {
        match self {
            Workload::Easy => swapped,
            Workload::Degraded if token % 4 == 0 => swapped,
            Workload::Degraded => swapped.min(16),
        }
    }
}

/// Writes run `run_id` in trace format `version`; the selections depend on
/// `seed` and the workload only, so two versions of one seed hold the same
/// selections.
fn write_trace(
    dir: &Path,
    run_id: &str,
    version: u32,
    (seed, workload): (u64, Workload),
    layers: i32,
    tokens: i32,
) {
    // A trace kept from an earlier call is reused only when it was closed
    // complete: one cut short would time fewer rows than it claims.
    if let Ok(text) = std::fs::read_to_string(dir.join("manifest.json")) {
        let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
        if manifest["status"] == "complete" {
            return;
        }
        println!("{}: incomplete, written again", dir.display());
        std::fs::remove_dir_all(dir).unwrap();
    }
    let spec = SynthSpec {
        layers,
        tokens,
        k: K,
        ..SynthSpec::demo(run_id)
    };
    let options = WriterOptions {
        schema_version: version,
        ..WriterOptions::default()
    };
    let start = Instant::now();
    let writer = RunWriter::create(dir, spec.identity(), options).unwrap();
    let mut rng = SplitMix64(seed);
    for layer in 0..layers {
        for token in 0..tokens {
            let visible = token + 1;
            let (prod, shadow) = realistic_selection_pair(visible, K, workload.recall(), &mut rng);
            let dense = visible <= K;
            let mut swapped: Vec<i32> = if dense {
                Vec::new()
            } else {
                symmetric_difference(&prod, &shadow)
            };
            swapped.truncate(workload.at_boundary(token, swapped.len()));
            let selection = |indices: Vec<i32>| Selection {
                indices,
                kth_score: (!dense).then_some(1.0),
                kth_margin: (!dense).then_some(0.0),
                boundary: (!dense).then(|| Boundary {
                    indices: swapped.clone(),
                    scores: vec![1.0; swapped.len()],
                }),
            };
            let _ = writer.send(TopkRow {
                step: 0,
                layer,
                token,
                indexer_layer: layer,
                unit: SelectionUnit::TOKEN,
                k: K,
                visible,
                prod: selection(prod),
                shadow: Some(("raw".to_owned(), selection(shadow))),
                boundary_band: (!dense).then_some(1e-3),
            });
        }
    }
    writer.close().unwrap();
    println!(
        "wrote {} (v{version}, {layers} x {tokens} topk rows) in {:.1} s",
        dir.display(),
        start.elapsed().as_secs_f64()
    );
}

/// Cores and load average: the figures depend on what else the machine runs.
fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    let load = std::fs::read_to_string("/proc/loadavg").map_or_else(
        |_| "unknown".to_owned(),
        |l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    );
    format!("{cores} cores, load average {load} (1, 5, 15 min)")
}

fn topk_bytes(run: &Path) -> u64 {
    std::fs::read_dir(run.join("topk"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

/// The bytes of the summary check's columns ([`topk_check::COLUMNS`]) in
/// the run's top-k parts, as stored and after decompression: what a first
/// analyze must decompress and decode whatever reads it.
fn check_column_bytes(run: &Path) -> (u64, u64) {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let mut bytes = (0, 0);
    for entry in std::fs::read_dir(run.join("topk")).unwrap() {
        let file = std::fs::File::open(entry.unwrap().path()).unwrap();
        let reader = SerializedFileReader::new(file).unwrap();
        for group in reader.metadata().row_groups() {
            for column in group.columns() {
                let top = column.column_path().parts()[0].as_str();
                if topk_check::COLUMNS.contains(&top) {
                    bytes.0 += u64::try_from(column.compressed_size()).unwrap();
                    bytes.1 += u64::try_from(column.uncompressed_size()).unwrap();
                }
            }
        }
    }
    bytes
}

/// The median of `times`, as the analyzer's summaries compute it.
fn median(times: &[f64]) -> f64 {
    Summary::of(times.to_vec()).map_or(f64::NAN, |s| s.p50)
}

fn seconds_list(times: &[f64]) -> String {
    times
        .iter()
        .map(|t| format!("{t:.3}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The `shadowtrace` binary as a user installs it: built here in release,
/// beside this benchmark, so the figures are the shipped binary's (its
/// allocator, no libtorch in the process) and never a stale build's.
fn release_binary() -> PathBuf {
    // Cargo names the executable it built: right whatever the target
    // directory, build directory or target triple.
    let out = Command::new(env!("CARGO"))
        .args(["build", "--release", "-p", "shadowtrace-analyzer"])
        .args([
            "--bin",
            "shadowtrace",
            "--message-format=json-render-diagnostics",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("run cargo");
    assert!(
        out.status.success(),
        "cargo build --release -p shadowtrace-analyzer"
    );
    let bin = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "shadowtrace")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .expect("cargo names the shadowtrace executable it built");
    assert!(bin.is_file(), "{} was not built", bin.display());
    bin
}

/// How an analyze call comes by its summary check.
#[derive(Clone, Copy)]
enum Check<'a> {
    /// Every part decoded and checked (`--recheck`).
    Decoded,
    /// Checked and remembered in the memo `dir`, which holds none of them.
    Remembering(&'a Path),
    /// Every part's check taken from the memo `dir`, none decoded.
    Remembered(&'a Path),
}

/// Runs `shadowtrace analyze RUNS --format json` and fails unless every run
/// and every one of its rows and summaries came back, the summaries checked
/// or remembered as `check` says; returns the seconds the process took.
fn timed_analyze(bin: &Path, runs: &[PathBuf], rows_per_run: usize, check: Check<'_>) -> f64 {
    let mut command = Command::new(bin);
    command.arg("analyze").args(runs).args(["--format", "json"]);
    match check {
        Check::Decoded => command.arg("--recheck"),
        Check::Remembering(dir) | Check::Remembered(dir) => command.arg("--check-memo").arg(dir),
    };
    let start = Instant::now();
    let out = command.output().expect("run shadowtrace");
    let secs = start.elapsed().as_secs_f64();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let analysis: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(analysis["skipped"], serde_json::json!([]), "no run skipped");
    let analysed = analysis["runs"].as_array().unwrap();
    assert_eq!(analysed.len(), runs.len(), "every run analysed");
    let count = |v: &serde_json::Value| usize::try_from(v.as_u64().unwrap()).unwrap();
    for run in analysed {
        let rows: usize = run["topk"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| {
                count(&l["informative_rows"])
                    + count(&l["dense_rows"])
                    + count(&l["rows_without_shadow"])
            })
            .sum();
        assert_eq!(
            rows, rows_per_run,
            "{}: every topk row analysed",
            run["run_id"]
        );
        let summary = &run["topk_summary_check"];
        assert_eq!(
            count(&summary["rows_checked"]),
            rows_per_run,
            "every summary checked"
        );
        let (parts, remembered) = (
            count(&summary["parts"]),
            count(&summary["parts_remembered"]),
        );
        match check {
            Check::Decoded | Check::Remembering(_) => {
                assert_eq!(remembered, 0, "every part decoded and checked");
            }
            Check::Remembered(_) => assert_eq!(remembered, parts, "every part's check remembered"),
        }
        assert_eq!(
            count(&summary["rows_disagreeing"]),
            0,
            "the writer's summaries agree"
        );
    }
    secs
}

/// The `seconds NAME N` lines of a timing script, by name.
fn script_times(stdout: &str, name: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("seconds "))
        .filter_map(|l| l.strip_prefix(name))
        .map(|s| s.trim().parse().unwrap())
        .collect()
}

fn python_script(script: &str, args: &[&std::ffi::OsStr]) -> String {
    let python = std::env::var("SHADOWTRACE_PYTHON").unwrap_or_else(|_| "python".to_owned());
    let out = Command::new(&python)
        .arg(script)
        .args(args)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn main() {
    let workloads: Vec<Workload> = match std::env::var("SHADOWTRACE_BENCH_WORKLOAD").as_deref() {
        Ok("easy") => vec![Workload::Easy],
        Ok("degraded") => vec![Workload::Degraded],
        Ok("both") | Err(_) => vec![Workload::Easy, Workload::Degraded],
        Ok(other) => {
            panic!("SHADOWTRACE_BENCH_WORKLOAD: expected easy, degraded or both, got {other}")
        }
    };
    for workload in workloads {
        println!("== workload {} ==", workload.name());
        bench(workload);
    }
}

fn bench(workload: Workload) {
    let layers = env("SHADOWTRACE_BENCH_LAYERS", 78);
    let tokens = env("SHADOWTRACE_BENCH_TOKENS", 8192);
    let runs = env("SHADOWTRACE_BENCH_RUNS", 10).max(1);
    let repeats = usize::try_from(env("SHADOWTRACE_BENCH_REPEATS", 5).max(1)).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let root = std::env::var("SHADOWTRACE_BENCH_DIR")
        .map_or_else(|_| tmp.path().to_owned(), PathBuf::from)
        .join(format!("glm51-{layers}x{tokens}-{}", workload.name()));
    let v2_runs: Vec<PathBuf> = (0..runs)
        .map(|i| {
            let id = format!("glm51-v2-{i}");
            let dir = root.join("v2").join(&id);
            write_trace(&dir, &id, 2, (1 + i as u64, workload), layers, tokens);
            dir
        })
        .collect();
    let v1_run = root.join("v1").join("glm51-v1-0");
    write_trace(&v1_run, "glm51-v1-0", 1, (1, workload), layers, tokens);
    let rows_per_run = (layers * tokens) as usize;
    let rows = rows_per_run as f64;
    println!(
        "trace: {rows} topk rows per run; topk Parquet v2 {:.3} GB, v1 {:.3} GB (same selections)",
        topk_bytes(&v2_runs[0]) as f64 / 1e9,
        topk_bytes(&v1_run) as f64 / 1e9
    );
    let (stored, decompressed) = check_column_bytes(&v2_runs[0]);
    println!(
        "the summary check's columns: {:.3} GB stored, {:.3} GB after decompression (what a first analyze decompresses and decodes)",
        stored as f64 / 1e9,
        decompressed as f64 / 1e9
    );

    // Each side repeated (the first call is often the slowest: a binary just
    // built, files this side has not read yet): the ratio and the targets
    // are taken on the medians, and every time is printed.
    let bin = release_binary();
    println!("shadowtrace: {}", bin.display());
    println!("machine: {}", machine());
    let rust_times: Vec<f64> = (0..repeats)
        .map(|_| timed_analyze(&bin, &v2_runs[..1], rows_per_run, Check::Decoded))
        .collect();
    let rust_secs = median(&rust_times);
    println!(
        "shadowtrace analyze (v2, one run, the whole process, every summary decoded and checked: --recheck): median {rust_secs:.2} s of {}, {:.0} rows/s",
        seconds_list(&rust_times),
        rows / rust_secs,
    );
    // The same run analysed again: the check remembered from the first call.
    let memo = tmp.path().join("check-memo");
    let first = timed_analyze(&bin, &v2_runs[..1], rows_per_run, Check::Remembering(&memo));
    let memo_times: Vec<f64> = (0..repeats)
        .map(|_| timed_analyze(&bin, &v2_runs[..1], rows_per_run, Check::Remembered(&memo)))
        .collect();
    let memo_secs = median(&memo_times);
    println!(
        "shadowtrace analyze (the same run again, each part's check remembered from the first call, which took {first:.2} s): median {memo_secs:.3} s of {}, {:.0} rows/s",
        seconds_list(&memo_times),
        rows / memo_secs,
    );
    // Where analyze's time goes: the check of every summary against its
    // lists, timed alone on the same run.
    let v2_run = shadowtrace_analyzer::Run::open(&v2_runs[0]).unwrap();
    let start = Instant::now();
    let check = topk_check::check_run(&v2_run, None).unwrap().unwrap();
    let check_secs = start.elapsed().as_secs_f64();
    assert_eq!(check.rows_checked, rows_per_run, "every summary checked");
    println!(
        "  the summary check alone (every row's differences and boundary candidates decoded), in this process after the timed calls: {check_secs:.2} s"
    );

    let repeat = repeats.to_string();
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    // The README's snippets over the same v2 files: the aggregation alone.
    let stdout = python_script(
        concat!(env!("CARGO_MANIFEST_DIR"), "/benches/v2_snippets.py"),
        &[v2_runs[0].as_os_str(), "--repeat".as_ref(), repeat.as_ref()],
    );
    for engine in ["duckdb", "polars"] {
        let times = script_times(&stdout, engine);
        assert_eq!(times.len(), repeats, "one time per repetition: {stdout}");
        assert!(
            stdout.contains(&format!("{engine} layers {layers},")),
            "{engine} aggregated every layer: {stdout}"
        );
        let secs = median(&times);
        let (first, remembered) = (rust_secs / secs, memo_secs / secs);
        println!(
            "README {engine} snippet over the same v2 files (stored counts, no check): median {secs:.3} s of {}",
            seconds_list(&times),
        );
        println!(
            "  first analyze (--recheck, every summary checked) / {engine}: {first:.1}x (goal <= 5x: {}); remembered analyze / {engine}: {remembered:.1}x (goal <= 2x: {})",
            verdict(first <= 5.0),
            verdict(remembered <= 2.0)
        );
    }

    let stdout = python_script(
        concat!(env!("CARGO_MANIFEST_DIR"), "/benches/polars_jaccard.py"),
        &[
            v1_run.join("topk").as_os_str(),
            "--repeat".as_ref(),
            repeat.as_ref(),
        ],
    );
    let py_times = script_times(&stdout, "");
    assert_eq!(py_times.len(), repeats, "one time per repetition: {stdout}");
    assert!(
        stdout.contains(&format!("layers {layers},")),
        "polars aggregated every layer: {stdout}"
    );
    let py_secs = median(&py_times);
    println!(
        "python polars set_intersection/set_union over v1 full lists: median {py_secs:.2} s of {}, {:.0} rows/s",
        seconds_list(&py_times),
        rows / py_secs
    );
    print!(
        "{}",
        stdout
            .lines()
            .filter(|l| !l.starts_with("seconds"))
            .map(|l| format!("  polars: {l}\n"))
            .collect::<String>()
    );
    let ratio = py_secs / rust_secs;
    println!(
        "ratio of medians: shadowtrace over v2 is {ratio:.1}x the speed of polars' set algebra over v1's full lists (target >= 20x: {}; mostly the format's doing: see the v2 anchors above); first calls {:.1}x",
        verdict(ratio >= 20.0),
        py_times[0] / rust_times[0]
    );
    println!(
        "rows/s target >= 184000: {}",
        verdict(rows / rust_secs >= 184_000.0)
    );

    println!("machine: {}", machine());
    let all_secs = timed_analyze(&bin, &v2_runs, rows_per_run, Check::Decoded);
    println!(
        "shadowtrace analyze ({runs} runs in one call): {all_secs:.2} s, {:.0} rows/s (target {runs} GLM-5.1-sized runs < 60 s: {})",
        rows * runs as f64 / all_secs,
        if layers == 78 && tokens == 8192 && runs >= 10 {
            verdict(all_secs < 60.0)
        } else {
            "not measured at full size"
        }
    );
}
