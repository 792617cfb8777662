//! The tch numerics on a CUDA device: block quantization bit for bit
//! against PyTorch's golden casts, scores against the golden torch math, and
//! the tensor-core `_scaled_mm` path against the fp32 emulation.
//!
//! These need a GPU, so they are ignored by default; run them on one with
//! `cargo test -p shadowtrace-tracer --test cuda_matches_cpu -- --ignored`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

mod common;

use common::{GOLDEN, doubles, floats};
use shadowtrace_tracer::fp8::quant;
use shadowtrace_tracer::indexer::{DotProduct, Fp8Indexer, Precision, index_scores};
use tch::{Device, Kind, Tensor};

/// As in `indexer_scores_match_reference`: fp32 accumulation against float64.
const FP32_SCORE_REL_TOL: f64 = 1e-5;
/// Hopper's FP8 tensor-core accumulation keeps fewer than fp32's bits within
/// a dot product; over D = 128 terms this bounds its departure from the
/// fp32 emulation, relative to the row's largest score.
const SCALED_MM_REL_TOL: f64 = 2e-3;

fn cuda() -> Device {
    assert!(
        tch::Cuda::is_available(),
        "these tests need a CUDA device visible to libtorch"
    );
    Device::Cuda(0)
}

fn to_cpu_f32(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_device(Device::Cpu).contiguous().view([-1])).unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn block_quantization_on_cuda_matches_pytorch_bit_for_bit() {
    let device = cuda();
    for case in &GOLDEN.block_quant.cases {
        let input = &GOLDEN.block_quant.inputs[&case.input];
        let x = Tensor::from_slice(&floats(&input.bits))
            .view([input.shape[0] as i64, input.shape[1] as i64])
            .to_device(device);
        let q = quant::quantize_blocks(&x, (case.block[0], case.block[1]), case.spec()).unwrap();
        let codes = Vec::<u8>::try_from(
            q.values
                .view_dtype(Kind::Uint8)
                .to_device(Device::Cpu)
                .contiguous()
                .view([-1]),
        )
        .unwrap();
        // CUDA arithmetic does not keep a NaN's sign (x / NaN gives the
        // canonical +NaN), so any NaN code stands for any other; every other
        // code must match to the bit.
        let format = common::format(&case.format);
        for (i, (&got, &want)) in codes.iter().zip(&case.values).enumerate() {
            let both_nan = format.decode(got).is_nan() && format.decode(want).is_nan();
            assert!(
                got == want || both_nan,
                "{}: code {i}: got {got:#04x}, want {want:#04x}",
                case.name
            );
        }
        for (i, (got, &want)) in to_cpu_f32(&q.scales).iter().zip(&case.scales).enumerate() {
            let want = f32::from_bits(want);
            let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
            assert!(same, "{}: scale {i}: got {got}, want {want}", case.name);
        }
    }
}

struct Golden {
    q: Tensor,
    k: Tensor,
    w: Tensor,
    pos: Tensor,
}

fn golden_inputs(device: Device) -> Golden {
    let g = &GOLDEN.indexer;
    Golden {
        q: Tensor::from_slice(&floats(&g.q))
            .view([g.t as i64, g.h as i64, g.d as i64])
            .to_device(device),
        k: Tensor::from_slice(&floats(&g.k))
            .view([g.s as i64, g.d as i64])
            .to_device(device),
        w: Tensor::from_slice(&floats(&g.w))
            .view([g.t as i64, g.h as i64])
            .to_device(device),
        pos: Tensor::from_slice(&g.q_pos).to_device(device),
    }
}

fn max_rel_err(got: &[f32], want: &[f64], keys: usize) -> f64 {
    let mut worst = 0.0_f64;
    for (g, w) in got.chunks(keys).zip(want.chunks(keys)) {
        let scale = w
            .iter()
            .filter(|v| v.is_finite())
            .fold(1e-30_f64, |m, v| m.max(v.abs()));
        for (&gv, &wv) in g.iter().zip(w) {
            if wv.is_finite() {
                worst = worst.max((f64::from(gv) - wv).abs() / scale);
            } else {
                assert_eq!(gv, f32::NEG_INFINITY, "masked keys stay -inf");
            }
        }
    }
    worst
}

#[test]
#[ignore = "needs a CUDA device"]
fn scores_on_cuda_match_the_golden_torch_math() {
    let x = golden_inputs(cuda());
    let keys = GOLDEN.indexer.s;
    for (name, precision) in [
        ("fp32", Precision::Fp32),
        ("bf16", Precision::Bf16),
        ("fp8_trtllm", Precision::Fp8(Fp8Indexer::trtllm())),
        (
            "fp8_deepseek_reference",
            Precision::Fp8(Fp8Indexer::deepseek_reference()),
        ),
    ] {
        let got = to_cpu_f32(&index_scores(&x.q, &x.k, &x.w, &x.pos, precision).unwrap());
        let err = max_rel_err(&got, &doubles(&GOLDEN.indexer.scores_f64[name]), keys);
        // cuBLAS may run fp32 matmuls in TF32 when allowed; libtorch's default keeps fp32.
        assert!(err <= FP32_SCORE_REL_TOL, "{name}: rel err {err:.3e}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn scaled_mm_departs_from_the_emulation_by_at_most_its_accumulation_error() {
    let x = golden_inputs(cuda());
    let emulated = Fp8Indexer::trtllm();
    let tensor_cores = Fp8Indexer {
        dot: DotProduct::ScaledMm,
        ..emulated
    };
    let a = to_cpu_f32(&index_scores(&x.q, &x.k, &x.w, &x.pos, Precision::Fp8(emulated)).unwrap());
    let b =
        to_cpu_f32(&index_scores(&x.q, &x.k, &x.w, &x.pos, Precision::Fp8(tensor_cores)).unwrap());
    let a64: Vec<f64> = a.iter().map(|v| f64::from(*v)).collect();
    let err = max_rel_err(&b, &a64, GOLDEN.indexer.s);
    assert!(err <= SCALED_MM_REL_TOL, "rel err {err:.3e}");
}

/// The production linears' block-scaled GEMM on the tensor cores against its
/// exact fp32 emulation, on identical FP8 codes and scales
/// (`fp8::gemm::quantize` makes them once): whatever differs is the tensor
/// cores' accumulation. Per output row, ‖tensor cores − emulation‖ over
/// ‖emulation‖, at GLM-5.1's linear shapes (q_a, kv_b-like, o_proj, an
/// expert's down projection) and a short ragged batch.
#[test]
#[ignore = "needs a CUDA device"]
fn the_fp8_gemm_on_the_tensor_cores_departs_from_its_emulation_by_its_accumulation_error_alone() {
    use shadowtrace_tracer::fp8::gemm;
    let device = cuda();
    tch::manual_seed(0);
    for (m, k, n) in [
        (8192, 6144, 2048),
        (8192, 512, 28672),
        (8192, 16384, 6144),
        (8192, 2048, 6144),
        (100, 6144, 576),
    ] {
        let x = Tensor::randn([m, k], (Kind::Float, device));
        let w = Tensor::randn([n, k], (Kind::Float, device)) * 0.02;
        let op = gemm::quantize(&x, &w).unwrap();
        let tensor_cores = gemm::scaled_mm(&op).unwrap();
        let emulated = gemm::emulate(&op).unwrap();
        let per_row = (&tensor_cores - &emulated).norm_scalaropt_dim(2, [-1], false)
            / emulated.norm_scalaropt_dim(2, [-1], false);
        let (median, max) = (
            per_row.median().double_value(&[]),
            per_row.max().double_value(&[]),
        );
        println!("fp8 gemm {m}x{k}x{n}: per-row rel L2 median {median:.3e}, max {max:.3e}");
        assert!(max <= SCALED_MM_REL_TOL, "{m}x{k}x{n}: max {max:.3e}");
    }
}
