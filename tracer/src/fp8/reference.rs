//! Block quantization in plain Rust over `ndarray`: the libtorch-free
//! reference the tch path is checked against, bit for bit.

use ndarray::{Array2, ArrayView2};

use super::{Fp8Format, QuantSpec, ScaleFormat, round_up_pow2};
use crate::TraceError;

/// A block-quantized matrix: FP8 codes and one scale per block.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedRef {
    /// FP8 codes, the shape of the input.
    pub values: Array2<u8>,
    /// One scale per block.
    pub scales: Array2<f32>,
    /// The format of the codes.
    pub format: Fp8Format,
    /// The block shape.
    pub block: (usize, usize),
}

/// Same contract as [`super::quant::quantize_blocks`].
///
/// # Errors
/// When the matrix sides do not divide by the block's.
pub fn quantize_blocks(
    x: ArrayView2<'_, f32>,
    block: (usize, usize),
    spec: QuantSpec,
) -> Result<QuantizedRef, TraceError> {
    let (rows, cols) = x.dim();
    let (br, bc) = block;
    if br == 0 || bc == 0 || rows % br != 0 || cols % bc != 0 {
        return Err(TraceError::Shape {
            op: "reference::quantize_blocks",
            what: "input",
            expected: format!("[rows, cols] with rows % {br} == 0 and cols % {bc} == 0"),
            got: format!("[{rows}, {cols}]"),
        });
    }
    let max = spec.format.max();
    let mut values = Array2::<u8>::zeros((rows, cols));
    let mut scales = Array2::<f32>::zeros((rows / br, cols / bc));
    for ((bi, bj), scale_slot) in scales.indexed_iter_mut() {
        let block_view = x.slice(ndarray::s![bi * br..(bi + 1) * br, bj * bc..(bj + 1) * bc]);
        let scale = block_scale(block_view.iter().copied(), spec);
        *scale_slot = scale;
        for ((i, j), &v) in block_view.indexed_iter() {
            values[[bi * br + i, bj * bc + j]] = spec.format.encode((v / scale).clamp(-max, max));
        }
    }
    Ok(QuantizedRef {
        values,
        scales,
        format: spec.format,
        block,
    })
}

/// The scale of one block. NaN anywhere makes the amax NaN, as `torch.amax`
/// does (`f32::max` would skip it).
#[must_use]
pub fn block_scale(block: impl Iterator<Item = f32>, spec: QuantSpec) -> f32 {
    let amax = block.fold(0.0_f32, |m, v| {
        if m.is_nan() || v.is_nan() {
            f32::NAN
        } else {
            m.max(v.abs())
        }
    });
    let clamped = if amax.is_nan() {
        amax
    } else {
        amax.max(spec.amax_clamp)
    };
    let scale = clamped / spec.format.max();
    match spec.scale {
        ScaleFormat::Fp32 => scale,
        ScaleFormat::Ue8m0 => round_up_pow2(scale),
    }
}

/// The fp32 matrix a quantized matrix stands for.
#[must_use]
pub fn dequantize_blocks(q: &QuantizedRef) -> Array2<f32> {
    let (br, bc) = q.block;
    Array2::from_shape_fn(q.values.dim(), |(i, j)| {
        q.format.decode(q.values[[i, j]]) * q.scales[[i / br, j / bc]]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_all_zero_block_gets_the_clamped_scale() {
        let x = Array2::<f32>::zeros((1, 128));
        let spec = QuantSpec {
            format: Fp8Format::E4m3fn,
            scale: ScaleFormat::Fp32,
            amax_clamp: 1e-4,
        };
        let q = quantize_blocks(x.view(), (1, 128), spec).unwrap();
        assert_eq!(q.scales[[0, 0]], 1e-4_f32 / 448.0);
        assert!(q.values.iter().all(|&c| c == 0));
    }

    #[test]
    fn a_nan_poisons_only_its_own_block() {
        let mut x = Array2::<f32>::ones((1, 256));
        x[[0, 3]] = f32::NAN;
        let spec = QuantSpec {
            format: Fp8Format::E4m3fn,
            scale: ScaleFormat::Ue8m0,
            amax_clamp: 1e-4,
        };
        let q = quantize_blocks(x.view(), (1, 128), spec).unwrap();
        assert!(q.scales[[0, 0]].is_nan());
        assert_eq!(q.scales[[0, 1]], round_up_pow2(1.0 / 448.0));
        assert!(
            q.values
                .slice(ndarray::s![0, ..128])
                .iter()
                .all(|&c| c & 0x7F == 0x7F),
            "NaN codes"
        );
    }
}
