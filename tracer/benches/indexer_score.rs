//! Indexer-score throughput: query rows per second over 8192 keys, 32 heads,
//! D = 128 (GLM-5's indexer), for each precision, on the CPU and, where
//! libtorch sees one, a CUDA device. On CUDA it also runs the FP8 dot
//! products on the tensor cores (`_scaled_mm`) beside the fp32 emulation and
//! prints their speed ratio, how far their scores differ, and how much their
//! top-2048 selections overlap — all from one run.
//!
//! Run (release, without the demo's polars):
//! `cargo bench -p shadowtrace-tracer --no-default-features --bench indexer_score`
//! Environment: `SHADOWTRACE_BENCH_CPU_ROWS` (default 32) and
//! `SHADOWTRACE_BENCH_CUDA_ROWS` (default 8192) query rows per timed call.

#![allow(clippy::print_stdout, reason = "a benchmark prints its figures")]

use std::time::Instant;

use shadowtrace_schemas::selection::overlap;
use shadowtrace_tracer::indexer::{
    DotProduct, Fp8Indexer, Precision, index_scores, topk_with_margin,
};
use tch::{Device, Kind, Tensor};

const KEYS: i64 = 8192;
const HEADS: i64 = 32;
const DIM: i64 = 128;
const TOPK: i64 = 2048;

struct Inputs {
    q: Tensor,
    k: Tensor,
    w: Tensor,
    pos: Tensor,
}

fn inputs(rows: i64, device: Device) -> Inputs {
    tch::manual_seed(0);
    let opts = (Kind::Float, device);
    Inputs {
        q: Tensor::randn([rows, HEADS, DIM], opts),
        k: Tensor::randn([KEYS, DIM], opts),
        w: Tensor::randn([rows, HEADS], opts) * (HEADS as f64).powf(-0.5),
        // The last rows of a KEYS-token prefill: each sees (almost) every key.
        pos: Tensor::arange_start(KEYS - rows, KEYS, (Kind::Int64, device)),
    }
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Median seconds of `reps` calls, after one warm-up call.
fn time(device: Device, reps: usize, mut f: impl FnMut() -> Tensor) -> (f64, Tensor) {
    let mut out = f();
    sync(device);
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        out = f();
        sync(device);
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    (times[reps / 2], out)
}

fn scores(x: &Inputs, p: Precision) -> Tensor {
    index_scores(&x.q, &x.k, &x.w, &x.pos, p).unwrap_or_else(|e| panic!("{}: {e}", p.name()))
}

fn run(device: Device, rows: i64, reps: usize) {
    let x = inputs(rows, device);
    let mut precisions = vec![
        Precision::Fp32,
        Precision::Bf16,
        Precision::Fp8(Fp8Indexer::trtllm()),
        Precision::Fp8(Fp8Indexer::deepseek_reference()),
    ];
    let scaled = Fp8Indexer {
        dot: DotProduct::ScaledMm,
        ..Fp8Indexer::trtllm()
    };
    if device.is_cuda() {
        precisions.push(Precision::Fp8(scaled));
    }
    println!(
        "indexer score on {device:?}: {rows} query rows x {KEYS} keys, {HEADS} heads, D = {DIM}, median of {reps}"
    );
    let mut timed = Vec::new();
    for p in precisions {
        let (secs, out) = time(device, reps, || scores(&x, p));
        println!(
            "  {:<58} {:>12.0} rows/s  ({:.3} ms per call)",
            p.name(),
            rows as f64 / secs,
            secs * 1e3
        );
        timed.push((p, secs, out));
    }
    if device.is_cuda() {
        let emulated = timed
            .iter()
            .find(|(p, ..)| *p == Precision::Fp8(Fp8Indexer::trtllm()))
            .map(|t| (t.1, t.2.shallow_clone()));
        let tensor_cores = timed
            .iter()
            .find(|(p, ..)| *p == Precision::Fp8(scaled))
            .map(|t| (t.1, t.2.shallow_clone()));
        if let (Some((t_emu, s_emu)), Some((t_mm, s_mm))) = (emulated, tensor_cores) {
            println!(
                "  _scaled_mm vs fp32 emulation: {:.2}x faster",
                t_emu / t_mm
            );
            compare(&s_emu, &s_mm, &x.pos);
        }
    }
}

/// How far the tensor-core scores are from the emulated ones, and what that
/// does to the top-2048 selection.
fn compare(emulated: &Tensor, tensor_cores: &Tensor, pos: &Tensor) {
    let finite = emulated.isfinite();
    let zero = Tensor::zeros_like(emulated);
    let a = emulated.where_self(&finite, &zero);
    let b = tensor_cores.where_self(&finite, &zero);
    let row_scale = a.abs().amax([1], true).clamp_min(1e-30);
    let rel = ((&a - &b).abs() / &row_scale).amax([1], false);
    let rel = Vec::<f32>::try_from(rel.to_device(Device::Cpu)).unwrap_or_default();
    let worst = rel.iter().fold(0.0_f32, |m, v| m.max(*v));
    let mean = rel.iter().sum::<f32>() / rel.len().max(1) as f32;
    println!(
        "  max |score difference| / row max |score|: mean over rows {mean:.3e}, worst row {worst:.3e}"
    );
    let visible = pos + 1;
    let (Ok(sa), Ok(sb)) = (
        topk_with_margin(emulated, TOPK, &visible),
        topk_with_margin(tensor_cores, TOPK, &visible),
    ) else {
        return;
    };
    let rows = emulated.size()[0];
    let mut jaccard = Vec::new();
    for t in 0..rows {
        if let (Ok(ra), Ok(rb)) = (sa.row(t, emulated, None), sb.row(t, tensor_cores, None)) {
            jaccard.push(overlap(&rb.indices, &ra.indices).jaccard());
        }
    }
    let mean = jaccard.iter().sum::<f64>() / jaccard.len().max(1) as f64;
    let min = jaccard.iter().copied().fold(1.0_f64, f64::min);
    println!(
        "  top-{TOPK} Jaccard, _scaled_mm vs emulation: mean {mean:.4}, min {min:.4} over {} rows",
        jaccard.len()
    );
}

fn env_rows(name: &str, default: i64) -> i64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    tch::set_num_threads(std::thread::available_parallelism().map_or(1, |n| n.get() as i32));
    run(Device::Cpu, env_rows("SHADOWTRACE_BENCH_CPU_ROWS", 32), 5);
    if tch::Cuda::is_available() {
        run(
            Device::Cuda(0),
            env_rows("SHADOWTRACE_BENCH_CUDA_ROWS", 8192),
            20,
        );
    } else {
        println!("no CUDA device visible to libtorch: GPU figures skipped");
    }
}
