//! The indexer score in every precision against the golden torch math
//! (float64 over the values each precision sees), for the tch path and the
//! ndarray reference, and the two paths against each other.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

mod common;

use common::{GOLDEN, doubles, floats};
use ndarray::{Array2, Array3};
use shadowtrace_tracer::fp8::ScaleFormat;
use shadowtrace_tracer::indexer::{Fp8Indexer, Precision, index_scores, reference};
use tch::{Device, Kind, Tensor};

/// Largest score error, relative to the row's largest |score|, of an fp32
/// computation against float64 truth: D = 128 products summed over H heads
/// in fp32 lose a few units in the last place (2^-24 each).
const FP32_SCORE_REL_TOL: f64 = 1e-5;

struct Inputs {
    q: Array3<f32>,
    k: Array2<f32>,
    w: Array2<f32>,
    pos: Vec<i64>,
}

impl Inputs {
    fn golden() -> Inputs {
        let g = &GOLDEN.indexer;
        Inputs {
            q: Array3::from_shape_vec((g.t, g.h, g.d), floats(&g.q)).unwrap(),
            k: Array2::from_shape_vec((g.s, g.d), floats(&g.k)).unwrap(),
            w: Array2::from_shape_vec((g.t, g.h), floats(&g.w)).unwrap(),
            pos: g.q_pos.clone(),
        }
    }

    fn random(t: usize, h: usize, s: usize, seed: i64) -> Inputs {
        tch::manual_seed(seed);
        let opts = (Kind::Float, Device::Cpu);
        let q = Tensor::randn([t as i64, h as i64, 128], opts);
        let _ = q.narrow(2, 5, 1).f_mul_scalar_(25.0).unwrap(); // an outlier channel
        let pos: Vec<i64> = (0..t)
            .map(|i| (s as i64 - 1) * (i as i64 + 1) / t as i64)
            .collect();
        Inputs {
            q: Array3::from_shape_vec((t, h, 128), Vec::<f32>::try_from(q.view([-1])).unwrap())
                .unwrap(),
            k: Array2::from_shape_vec(
                (s, 128),
                Vec::<f32>::try_from(Tensor::randn([s as i64, 128], opts).view([-1])).unwrap(),
            )
            .unwrap(),
            w: Array2::from_shape_vec(
                (t, h),
                Vec::<f32>::try_from(
                    (Tensor::randn([t as i64, h as i64], opts) * (h as f64).powf(-0.5)).view([-1]),
                )
                .unwrap(),
            )
            .unwrap(),
            pos,
        }
    }

    fn tch(&self, precision: Precision) -> Vec<f32> {
        let (t, h, d) = self.q.dim();
        let q = Tensor::from_slice(self.q.as_slice().unwrap()).view([t as i64, h as i64, d as i64]);
        let k =
            Tensor::from_slice(self.k.as_slice().unwrap()).view([self.k.nrows() as i64, d as i64]);
        let w = Tensor::from_slice(self.w.as_slice().unwrap()).view([t as i64, h as i64]);
        let pos = Tensor::from_slice(&self.pos);
        Vec::<f32>::try_from(
            index_scores(&q, &k, &w, &pos, precision)
                .unwrap()
                .view([-1]),
        )
        .unwrap()
    }

    fn reference(&self, precision: Precision) -> Vec<f32> {
        reference::index_scores(
            self.q.view(),
            self.k.view(),
            self.w.view(),
            &self.pos,
            precision,
        )
        .unwrap()
        .into_raw_vec_and_offset()
        .0
    }

    fn keys(&self) -> usize {
        self.k.nrows()
    }
}

/// Checks `got` against `want` row by row: -inf exactly where `want` is
/// -inf, elsewhere within `rel_tol` of the row's largest |score|.
fn assert_close(label: &str, got: &[f32], want: &[f64], keys: usize, rel_tol: f64) {
    assert_eq!(got.len(), want.len(), "{label}: length");
    for (row, (g, w)) in got.chunks(keys).zip(want.chunks(keys)).enumerate() {
        let scale = w
            .iter()
            .filter(|v| v.is_finite())
            .fold(1e-30_f64, |m, v| m.max(v.abs()));
        for (s, (&gv, &wv)) in g.iter().zip(w).enumerate() {
            if wv == f64::NEG_INFINITY {
                assert_eq!(
                    gv,
                    f32::NEG_INFINITY,
                    "{label}: [{row}, {s}] must be masked"
                );
            } else {
                let err = (f64::from(gv) - wv).abs() / scale;
                assert!(
                    err <= rel_tol,
                    "{label}: [{row}, {s}] got {gv}, want {wv}, rel err {err:.3e} > {rel_tol:e}"
                );
            }
        }
    }
}

fn golden_precisions() -> Vec<(String, Precision)> {
    let mut out = vec![
        ("fp32".to_owned(), Precision::Fp32),
        ("bf16".to_owned(), Precision::Bf16),
    ];
    for (name, v) in &GOLDEN.indexer.variants {
        let preset = Fp8Indexer::named(name).unwrap_or_else(|| {
            // Variants with no engine preset are described fully in the file.
            let mut p = Fp8Indexer::vllm();
            p.hadamard = v.hadamard;
            p.quant.scale = if v.scale_format == "fp32" {
                ScaleFormat::Fp32
            } else {
                ScaleFormat::Ue8m0
            };
            p.quant.amax_clamp = v.amax_clamp as f32;
            p
        });
        out.push((format!("fp8_{name}"), Precision::Fp8(preset)));
    }
    out
}

#[test]
fn engine_presets_match_the_variants_the_golden_file_describes() {
    for (name, v) in &GOLDEN.indexer.variants {
        if let Some(p) = Fp8Indexer::named(name) {
            assert_eq!(p.hadamard, v.hadamard, "{name}");
            assert_eq!(p.quant.scale.name(), v.scale_format, "{name}");
            assert_eq!(p.quant.amax_clamp, v.amax_clamp as f32, "{name}");
        }
    }
}

#[test]
fn scores_match_the_golden_torch_math_in_every_precision() {
    let inputs = Inputs::golden();
    for (name, precision) in golden_precisions() {
        let want = doubles(&GOLDEN.indexer.scores_f64[&name]);
        assert_close(
            &format!("tch {name}"),
            &inputs.tch(precision),
            &want,
            inputs.keys(),
            FP32_SCORE_REL_TOL,
        );
        assert_close(
            &format!("reference {name}"),
            &inputs.reference(precision),
            &want,
            inputs.keys(),
            FP32_SCORE_REL_TOL,
        );
    }
}

#[test]
fn tch_and_reference_agree_on_random_inputs_in_every_precision() {
    let inputs = Inputs::random(24, 8, 300, 9);
    for (name, precision) in golden_precisions() {
        let reference: Vec<f64> = inputs
            .reference(precision)
            .into_iter()
            .map(f64::from)
            .collect();
        assert_close(
            &format!("tch vs reference, {name}"),
            &inputs.tch(precision),
            &reference,
            inputs.keys(),
            FP32_SCORE_REL_TOL,
        );
    }
}

#[test]
fn the_fp8_path_departs_from_fp32_by_a_quantization_sized_error() {
    // Not a tolerance test: a sanity bound that FP8 is neither identical to
    // fp32 (it quantized) nor wildly off (it is the same score).
    let inputs = Inputs::golden();
    let fp32 = inputs.tch(Precision::Fp32);
    let fp8 = inputs.tch(Precision::Fp8(Fp8Indexer::trtllm()));
    let finite: Vec<(f32, f32)> = fp32
        .iter()
        .zip(&fp8)
        .filter(|(a, _)| a.is_finite())
        .map(|(a, b)| (*a, *b))
        .collect();
    let scale = finite.iter().fold(0.0_f32, |m, (a, _)| m.max(a.abs()));
    let worst = finite
        .iter()
        .fold(0.0_f32, |m, (a, b)| m.max((a - b).abs()))
        / scale;
    assert!(worst > 1e-4 && worst < 0.1, "relative FP8 error {worst}");
}

#[test]
fn a_key_after_the_query_position_is_masked_and_its_own_position_is_not() {
    let inputs = Inputs::golden();
    let scores = inputs.tch(Precision::Fp32);
    let s = inputs.keys();
    for (t, &p) in inputs.pos.iter().enumerate() {
        let row = &scores[t * s..(t + 1) * s];
        let p = p as usize;
        assert!(row[p].is_finite(), "query {t} sees its own position {p}");
        assert!(
            row[p + 1..].iter().all(|v| *v == f32::NEG_INFINITY),
            "query {t} sees nothing after {p}"
        );
    }
}

#[test]
fn scaled_mm_off_cuda_is_an_error_not_a_panic() {
    let inputs = Inputs::golden();
    let (t, h, d) = inputs.q.dim();
    let q = Tensor::from_slice(inputs.q.as_slice().unwrap()).view([t as i64, h as i64, d as i64]);
    let k = Tensor::from_slice(inputs.k.as_slice().unwrap()).view([inputs.keys() as i64, d as i64]);
    let w = Tensor::from_slice(inputs.w.as_slice().unwrap()).view([t as i64, h as i64]);
    let mut variant = Fp8Indexer::trtllm();
    variant.dot = shadowtrace_tracer::indexer::DotProduct::ScaledMm;
    let err = index_scores(
        &q,
        &k,
        &w,
        &Tensor::from_slice(&inputs.pos),
        Precision::Fp8(variant),
    )
    .unwrap_err();
    assert!(err.to_string().contains("CUDA for _scaled_mm"), "{err}");
}
