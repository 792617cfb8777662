//! The indexer score and top-k in plain Rust over `ndarray`: no libtorch,
//! sequential fp32 accumulation, a butterfly Walsh-Hadamard transform. The
//! tch path is checked against it (and both against the golden vectors).

use half::bf16;
use ndarray::{Array2, Array3, ArrayView2, ArrayView3};

use super::Precision;
use crate::TraceError;
use crate::fp8::reference::quantize_blocks;

/// Same contract as [`super::index_scores`], on arrays.
///
/// # Errors
/// Shapes that do not fit, or D other than 128 for FP8.
pub fn index_scores(
    q: ArrayView3<'_, f32>,
    k: ArrayView2<'_, f32>,
    w: ArrayView2<'_, f32>,
    query_positions: &[i64],
    precision: Precision,
) -> Result<Array2<f32>, TraceError> {
    let (t, h, d) = q.dim();
    let s = k.nrows();
    if k.ncols() != d || w.dim() != (t, h) || query_positions.len() != t {
        return Err(TraceError::Shape {
            op: "reference::index_scores",
            what: "inputs",
            expected: format!("k [S, {d}], w [{t}, {h}], {t} positions"),
            got: format!(
                "k {:?}, w {:?}, {} positions",
                k.dim(),
                w.dim(),
                query_positions.len()
            ),
        });
    }
    let scale = (d as f32).powf(-0.5);
    // (q values, k values, per (t, h) weight, per s factor) as the precision sees them.
    let (qv, kv, weight, k_factor): (Array3<f32>, Array2<f32>, Array2<f32>, Vec<f32>) =
        match precision {
            Precision::Fp32 => (
                q.to_owned(),
                k.to_owned(),
                w.mapv(|x| x * scale),
                vec![1.0; s],
            ),
            Precision::Bf16 => {
                let r = |x: f32| bf16::from_f32(x).to_f32();
                (q.mapv(r), k.mapv(r), w.mapv(|x| r(x) * scale), vec![1.0; s])
            }
            Precision::Fp8(variant) => {
                if d != 128 {
                    return Err(TraceError::Shape {
                        op: "reference::index_scores",
                        what: "head dim",
                        expected: "128 (one FP8 block per head)".to_owned(),
                        got: d.to_string(),
                    });
                }
                let mut q2 = q
                    .to_owned()
                    .into_shape_with_order((t * h, d))
                    .map_err(|e| shape_err(&e))?;
                let mut k2 = k.to_owned();
                if variant.hadamard {
                    q2.rows_mut()
                        .into_iter()
                        .for_each(|mut r| walsh_hadamard(r.as_slice_mut().unwrap_or(&mut [])));
                    k2.rows_mut()
                        .into_iter()
                        .for_each(|mut r| walsh_hadamard(r.as_slice_mut().unwrap_or(&mut [])));
                }
                let q8 = quantize_blocks(q2.view(), crate::fp8::ACTIVATION_BLOCK, variant.quant)?;
                let k8 = quantize_blocks(k2.view(), crate::fp8::ACTIVATION_BLOCK, variant.quant)?;
                let q_values = q8
                    .values
                    .mapv(|c| variant.quant.format.decode(c))
                    .into_shape_with_order((t, h, d))
                    .map_err(|e| shape_err(&e))?;
                let k_values = k8.values.mapv(|c| variant.quant.format.decode(c));
                let folded = Array2::from_shape_fn((t, h), |(ti, hi)| {
                    w[[ti, hi]] * q8.scales[[ti * h + hi, 0]] * scale
                });
                let k_scales = k8.scales.column(0).to_vec();
                (q_values, k_values, folded, k_scales)
            }
        };
    let mut out = Array2::<f32>::from_elem((t, s), f32::NEG_INFINITY);
    for ti in 0..t {
        for si in 0..s {
            if si as i64 > query_positions[ti] {
                continue;
            }
            let mut total = 0.0_f32;
            for hi in 0..h {
                let mut dot = 0.0_f32;
                for di in 0..d {
                    dot += qv[[ti, hi, di]] * kv[[si, di]];
                }
                total += weight[[ti, hi]] * dot.max(0.0);
            }
            out[[ti, si]] = total * k_factor[si];
        }
    }
    Ok(out)
}

fn shape_err(e: &ndarray::ShapeError) -> TraceError {
    TraceError::Shape {
        op: "reference::index_scores",
        what: "reshape",
        expected: "a contiguous array".to_owned(),
        got: e.to_string(),
    }
}

/// In-place orthonormal Walsh-Hadamard transform (Sylvester order) of a
/// power-of-two-length vector: the butterfly, independent of any matmul.
pub fn walsh_hadamard(v: &mut [f32]) {
    let n = v.len();
    let mut half = 1;
    while half < n {
        for start in (0..n).step_by(2 * half) {
            for i in start..start + half {
                let (a, b) = (v[i], v[i + half]);
                v[i] = a + b;
                v[i + half] = a - b;
            }
        }
        half *= 2;
    }
    let norm = (n as f32).sqrt();
    v.iter_mut().for_each(|x| *x /= norm);
}

/// One row's top-k: (key positions best first, k-th score, margin to the
/// (k+1)-th), or the visible keys in order for a dense row (scores `None`).
/// Ties are broken by the lower key position, deterministically.
#[must_use]
pub fn topk_row(scores: &[f32], k: usize, visible: usize) -> (Vec<i64>, Option<f32>, Option<f32>) {
    if visible <= k {
        return ((0..visible as i64).collect(), None, None);
    }
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let kth = scores[order[k - 1]];
    let next = order.get(k).map_or(f32::NEG_INFINITY, |&i| scores[i]);
    (
        order[..k].iter().map(|&i| i as i64).collect(),
        Some(kth),
        Some(kth - next),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walsh_hadamard_is_orthonormal_and_self_inverse() {
        let original: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
        let mut v = original.clone();
        walsh_hadamard(&mut v);
        let norm = |x: &[f32]| x.iter().map(|a| a * a).sum::<f32>();
        assert!((norm(&v) - norm(&original)).abs() < 1e-4);
        walsh_hadamard(&mut v);
        for (a, b) in v.iter().zip(&original) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn topk_row_breaks_ties_by_position_and_reports_the_margin() {
        let scores = [1.0, 3.0, 2.0, 2.0, 0.5];
        let (idx, kth, margin) = topk_row(&scores, 2, 5);
        assert_eq!(idx, [1, 2]);
        assert_eq!((kth, margin), (Some(2.0), Some(0.0)));
        assert_eq!(
            topk_row(&scores, 8, 5).0,
            [0, 1, 2, 3, 4],
            "dense: every visible key"
        );
    }
}
