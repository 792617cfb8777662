//! Indexer scores on tch tensors (CPU or CUDA).

use tch::{Device, Kind, Tensor};

use super::{DotProduct, Precision};
use crate::TraceError;
use crate::fp8::quant::quantize_blocks;

const OP: &str = "index_scores";

fn torch(source: tch::TchError) -> TraceError {
    TraceError::Torch { op: OP, source }
}

/// Query rows scored at once, so that [rows, H, S] intermediates stay near
/// 256 MiB whatever the prompt length; a multiple of 16, as `_scaled_mm`
/// needs for its row count.
fn chunk_rows(heads: i64, keys: i64) -> i64 {
    (((64 << 20) / (heads * keys).max(1)) / 16 * 16).max(16)
}

/// `n` rounded up to a multiple of 16.
fn round_up_16(n: i64) -> i64 {
    (n + 15) / 16 * 16
}

/// `x` with zero rows appended along dim 0 up to `rows`.
fn pad_rows(x: &Tensor, rows: i64) -> Result<Tensor, TraceError> {
    let extra = rows - x.size()[0];
    if extra == 0 {
        return Ok(x.shallow_clone());
    }
    let mut pad = vec![0_i64; 2 * x.dim()];
    pad[2 * x.dim() - 1] = extra;
    x.f_constant_pad_nd(pad.as_slice()).map_err(torch)
}

/// Indexer scores `[T, S]` (fp32) of queries `q` `[T, H, D]` against keys `k`
/// `[S, D]` with head weights `w` `[T, H]` (H^-1/2 folded in), causally
/// masked: key s is visible to query t iff `s <= query_positions[t]`;
/// invisible keys score -inf. All inputs fp32 on one device.
///
/// # Errors
/// Shapes or kinds that do not fit; D other than 128 for FP8 (one
/// quantization block per head); `_scaled_mm` requested off CUDA; any
/// libtorch failure.
pub fn index_scores(
    q: &Tensor,
    k: &Tensor,
    w: &Tensor,
    query_positions: &Tensor,
    precision: Precision,
) -> Result<Tensor, TraceError> {
    let (t, h, d, s) = check_inputs(q, k, w, query_positions)?;
    let (q, k, w) = match precision {
        Precision::Fp32 | Precision::Fp8(_) => {
            (q.shallow_clone(), k.shallow_clone(), w.shallow_clone())
        }
        Precision::Bf16 => (bf16_round(q)?, bf16_round(k)?, bf16_round(w)?),
    };
    let visible = Tensor::f_arange(s, (Kind::Int64, k.device()))
        .and_then(|keys| {
            keys.f_unsqueeze(0)?
                .f_le_tensor(&query_positions.f_unsqueeze(1)?)
        })
        .map_err(torch)?;
    let scores = match precision {
        Precision::Fp32 | Precision::Bf16 => chunked(t, h, s, |rows| {
            let qc = q.f_narrow(0, rows.0, rows.1)?;
            let dots = qc.f_reshape([rows.1 * h, d])?.f_matmul(&k.f_tr()?)?;
            let weighted = dots
                .f_view([rows.1, h, s])?
                .f_relu()?
                .f_mul(&w.f_narrow(0, rows.0, rows.1)?.f_unsqueeze(2)?)?;
            weighted
                .f_sum_dim_intlist(1, false, Kind::Float)?
                .f_mul_scalar((d as f64).powf(-0.5))
        })?,
        Precision::Fp8(variant) => {
            if d != 128 {
                return Err(TraceError::Shape {
                    op: OP,
                    what: "head dim",
                    expected: "128 (one FP8 block per head)".to_owned(),
                    got: d.to_string(),
                });
            }
            if variant.dot == DotProduct::ScaledMm && !k.device().is_cuda() {
                return Err(TraceError::Shape {
                    op: OP,
                    what: "device",
                    expected: "CUDA for _scaled_mm".to_owned(),
                    got: format!("{:?}", k.device()),
                });
            }
            let (q_in, k_in) = if variant.hadamard {
                let had = hadamard_matrix(d, k.device())?;
                (
                    q.f_matmul(&had).map_err(torch)?,
                    k.f_matmul(&had).map_err(torch)?,
                )
            } else {
                (q.shallow_clone(), k.shallow_clone())
            };
            // _scaled_mm takes row and column counts in multiples of 16:
            // pad with zero queries and keys, and cut them off the result.
            let (tp, sp) = match variant.dot {
                DotProduct::Emulated => (t, s),
                DotProduct::ScaledMm => (round_up_16(t), round_up_16(s)),
            };
            let (q_in, k_in, w) = (
                pad_rows(&q_in, tp)?,
                pad_rows(&k_in, sp)?,
                pad_rows(&w, tp)?,
            );
            let block = crate::fp8::ACTIVATION_BLOCK;
            let q8 = quantize_blocks(
                &q_in.f_reshape([tp * h, d]).map_err(torch)?,
                block,
                variant.quant,
            )?;
            let k8 = quantize_blocks(&k_in, block, variant.quant)?;
            let folded = w
                .f_mul(&q8.scales.f_view([tp, h]).map_err(torch)?)
                .and_then(|x| x.f_mul_scalar((d as f64).powf(-0.5)))
                .map_err(torch)?;
            let k_scale = k8.scales.f_view([1, sp]).map_err(torch)?;
            let k_t = match variant.dot {
                DotProduct::Emulated => k8.values.f_to_kind(Kind::Float).and_then(|x| x.f_tr()),
                // _scaled_mm wants its second operand column-major: the
                // transpose of a contiguous [S, D] is exactly that.
                DotProduct::ScaledMm => k8.values.f_tr(),
            }
            .map_err(torch)?;
            let one = Tensor::f_ones([1], (Kind::Float, k.device())).map_err(torch)?;
            chunked(tp, h, sp, |rows| {
                let qc = q8.values.f_narrow(0, rows.0 * h, rows.1 * h)?;
                let dots = match variant.dot {
                    DotProduct::Emulated => qc.f_to_kind(Kind::Float)?.f_matmul(&k_t)?,
                    DotProduct::ScaledMm => qc.f_internal_scaled_mm(
                        &k_t,
                        &one,
                        &one,
                        None::<Tensor>,
                        None::<Tensor>,
                        Kind::Float,
                        false,
                    )?,
                };
                let weighted = dots
                    .f_view([rows.1, h, sp])?
                    .f_relu()?
                    .f_mul(&folded.f_narrow(0, rows.0, rows.1)?.f_unsqueeze(2)?)?;
                weighted
                    .f_sum_dim_intlist(1, false, Kind::Float)?
                    .f_mul(&k_scale)
            })?
            .f_narrow(0, 0, t)
            .and_then(|x| x.f_narrow(1, 0, s))
            .map_err(torch)?
        }
    };
    scores
        .f_masked_fill(&visible.f_logical_not().map_err(torch)?, f64::NEG_INFINITY)
        .map_err(torch)
}

/// Runs `f` over query-row chunks `(start, len)` and concatenates the results.
fn chunked(
    t: i64,
    h: i64,
    s: i64,
    f: impl Fn((i64, i64)) -> Result<Tensor, tch::TchError>,
) -> Result<Tensor, TraceError> {
    let step = chunk_rows(h, s);
    let mut parts = Vec::new();
    let mut start = 0;
    while start < t {
        let len = step.min(t - start);
        parts.push(f((start, len)).map_err(torch)?);
        start += len;
    }
    if parts.is_empty() {
        return Tensor::f_zeros([0, s], (Kind::Float, Device::Cpu)).map_err(torch);
    }
    Tensor::f_cat(&parts, 0).map_err(torch)
}

fn bf16_round(x: &Tensor) -> Result<Tensor, TraceError> {
    x.f_to_kind(Kind::BFloat16)
        .and_then(|b| b.f_to_kind(Kind::Float))
        .map_err(torch)
}

/// The orthonormal Sylvester Hadamard matrix of order `n` (a power of two),
/// `H_n / sqrt(n)`, fp32.
///
/// # Errors
/// When `n` is not a power of two.
pub fn hadamard_matrix(n: i64, device: Device) -> Result<Tensor, TraceError> {
    if n <= 0 || n & (n - 1) != 0 {
        return Err(TraceError::Shape {
            op: "hadamard_matrix",
            what: "order",
            expected: "a power of two".to_owned(),
            got: n.to_string(),
        });
    }
    let size = n as usize;
    let entries: Vec<f32> = (0..size * size)
        .map(|ij| {
            let (i, j) = (ij / size, ij % size);
            // Sylvester: H[i][j] = (-1)^popcount(i & j).
            if (i & j).count_ones() % 2 == 0 {
                1.0
            } else {
                -1.0
            }
        })
        .collect();
    Tensor::f_from_slice(&entries)
        .and_then(|t| t.f_view([n, n]))
        .and_then(|t| t.f_mul_scalar(1.0 / (n as f64).sqrt()))
        .and_then(|t| t.f_to_device(device))
        .map_err(|source| TraceError::Torch {
            op: "hadamard_matrix",
            source,
        })
}

fn check_inputs(
    q: &Tensor,
    k: &Tensor,
    w: &Tensor,
    pos: &Tensor,
) -> Result<(i64, i64, i64, i64), TraceError> {
    let bad = |what: &'static str, expected: String, t: &Tensor| TraceError::Shape {
        op: OP,
        what,
        expected,
        got: format!("{:?} {:?} on {:?}", t.kind(), t.size(), t.device()),
    };
    let qs = q.size();
    if qs.len() != 3 || q.kind() != Kind::Float {
        return Err(bad("q", "fp32 [T, H, D]".to_owned(), q));
    }
    let (t, h, d) = (qs[0], qs[1], qs[2]);
    let ks = k.size();
    if ks.len() != 2 || ks[1] != d || k.kind() != Kind::Float || k.device() != q.device() {
        return Err(bad("k", format!("fp32 [S, {d}] on {:?}", q.device()), k));
    }
    if w.size() != [t, h] || w.kind() != Kind::Float || w.device() != q.device() {
        return Err(bad("w", format!("fp32 [{t}, {h}] on {:?}", q.device()), w));
    }
    if pos.size() != [t] || pos.kind() != Kind::Int64 || pos.device() != q.device() {
        return Err(bad(
            "query_positions",
            format!("int64 [{t}] on {:?}", q.device()),
            pos,
        ));
    }
    Ok((t, h, d, ks[0]))
}
