//! Block quantization on tch tensors (CPU or CUDA). Only fallible `f_*`
//! calls: a traced engine must get an error, never a panic.

use tch::{Kind, Tensor};

use super::{QuantSpec, ScaleFormat};
use crate::TraceError;

/// A block-quantized tensor.
#[derive(Debug)]
pub struct Quantized {
    /// FP8 values, the shape of the input (`Kind::Float8e4m3fn` or `Float8e5m2`).
    pub values: Tensor,
    /// One fp32 scale per block: `[rows / block_rows, cols / block_cols]`.
    pub scales: Tensor,
    /// The block shape used.
    pub block: (i64, i64),
}

fn torch(op: &'static str) -> impl Fn(tch::TchError) -> TraceError {
    move |source| TraceError::Torch { op, source }
}

/// Quantizes a 2-D fp32 tensor in blocks: per block, `amax` clamped below by
/// `spec.amax_clamp`, `scale = amax / max` (rounded up to a power of two for
/// ue8m0), then `x / scale` clamped to ±max and cast. NaN propagates into the
/// block's scale and values, as in PyTorch.
///
/// # Errors
/// When `x` is not a 2-D fp32 tensor whose sides divide by the block's.
pub fn quantize_blocks(
    x: &Tensor,
    block: (usize, usize),
    spec: QuantSpec,
) -> Result<Quantized, TraceError> {
    const OP: &str = "quantize_blocks";
    let (br, bc) = (block.0 as i64, block.1 as i64);
    let size = x.size();
    if size.len() != 2 || size[0] % br != 0 || size[1] % bc != 0 || x.kind() != Kind::Float {
        return Err(TraceError::Shape {
            op: OP,
            what: "input",
            expected: format!("fp32 [rows, cols] with rows % {br} == 0 and cols % {bc} == 0"),
            got: format!("{:?} {size:?}", x.kind()),
        });
    }
    let (rows, cols) = (size[0], size[1]);
    let max = f64::from(spec.format.max());
    let blocks = x
        .f_view([rows / br, br, cols / bc, bc])
        .and_then(|t| t.f_permute([0, 2, 1, 3]))
        .map_err(torch(OP))?;
    let amax = blocks
        .f_abs()
        .and_then(|t| t.f_amax([-2, -1], true))
        .map_err(torch(OP))?;
    let amax = amax
        .f_clamp_min(f64::from(spec.amax_clamp))
        .map_err(torch(OP))?;
    // A one-element tensor on the device, not a scalar: CUDA divides by a
    // scalar as a multiply by its reciprocal, one ulp off IEEE division and
    // off the CPU; tensor by tensor division is IEEE on both.
    let divisor = Tensor::f_full([1], max, (Kind::Float, x.device())).map_err(torch(OP))?;
    let mut scale = amax.f_div(&divisor).map_err(torch(OP))?;
    if spec.scale == ScaleFormat::Ue8m0 {
        scale = round_up_pow2(&scale)?;
    }
    let scaled = blocks
        .f_div(&scale)
        .and_then(|t| t.f_clamp(-max, max))
        .map_err(torch(OP))?;
    // Back to the input layout before the cast: fp8 tensors support few ops.
    let values = scaled
        .f_permute([0, 2, 1, 3])
        .and_then(|t| t.f_reshape([rows, cols]))
        .and_then(|t| t.f_to_kind(spec.format.kind()))
        .map_err(torch(OP))?;
    let scales = scale.f_reshape([rows / br, cols / bc]).map_err(torch(OP))?;
    Ok(Quantized {
        values,
        scales,
        block: (br, bc),
    })
}

/// The fp32 tensor a quantized tensor stands for: `value * scale` per block.
///
/// # Errors
/// When libtorch refuses an operation.
pub fn dequantize_blocks(q: &Quantized) -> Result<Tensor, TraceError> {
    const OP: &str = "dequantize_blocks";
    let (br, bc) = q.block;
    let size = q.values.size();
    let (rows, cols) = (size[0], size[1]);
    q.values
        .f_to_kind(Kind::Float)
        .and_then(|v| v.f_view([rows / br, br, cols / bc, bc]))
        .and_then(|v| v.f_mul(&q.scales.f_view([rows / br, 1, cols / bc, 1])?))
        .and_then(|v| v.f_reshape([rows, cols]))
        .map_err(torch(OP))
}

/// The ue8m0 rule on a tensor of positive scales, from the fp32 bits, exactly
/// as [`super::round_up_pow2`]; non-finite scales pass through.
fn round_up_pow2(scale: &Tensor) -> Result<Tensor, TraceError> {
    const OP: &str = "round_up_pow2";
    let run = || -> Result<Tensor, tch::TchError> {
        let bits = scale.f_contiguous()?.f_view_dtype(Kind::Int)?;
        let exponent = bits
            .f_bitwise_right_shift_tensor_scalar(23)?
            .f_bitwise_and(0xFF)?;
        let carry = bits
            .f_bitwise_and(0x7F_FFFF)?
            .f_ne(0)?
            .f_to_kind(Kind::Int)?;
        let rounded = exponent
            .f_add(&carry)?
            .f_bitwise_left_shift_tensor_scalar(23)?
            .f_view_dtype(Kind::Float)?;
        rounded.f_where_self(&scale.f_isfinite()?, scale)
    };
    run().map_err(torch(OP))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::Fp8Format;

    fn spec(scale: ScaleFormat) -> QuantSpec {
        QuantSpec {
            format: Fp8Format::E4m3fn,
            scale,
            amax_clamp: 1e-4,
        }
    }

    #[test]
    fn the_tensor_ue8m0_rule_is_the_scalar_rule_bit_for_bit_on_every_edge() {
        // Two definitions of one number (issue 28, item 7): the device rule is
        // pinned to the scalar one on the edges of the fp32 bit layout.
        let mut edges = vec![
            0.0_f32,
            f32::from_bits(1),           // the smallest subnormal
            f32::from_bits(0x007F_FFFF), // the largest subnormal
            f32::MIN_POSITIVE,
            f32::from_bits(f32::MIN_POSITIVE.to_bits() + 1),
            0.5,
            1.0,
            f32::from_bits(1.0_f32.to_bits() + 1),
            f32::from_bits(2.0_f32.to_bits() - 1),
            3.0 / 448.0,
            1.0 / 448.0,
            1e-4 / 448.0,
            f32::from_bits(f32::MAX.to_bits() - 1),
            f32::MAX,
            f32::INFINITY,
            f32::NAN,
        ];
        edges.extend((0..200).map(|i| 1.37_f32.powi(i - 100)));
        let scalar: Vec<u32> = edges
            .iter()
            .map(|&x| super::super::round_up_pow2(x).to_bits())
            .collect();
        let tensor = round_up_pow2(&Tensor::from_slice(&edges)).unwrap();
        let got: Vec<f32> = Vec::<f32>::try_from(&tensor).unwrap();
        let got: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
        assert_eq!(got, scalar);
    }

    #[test]
    fn a_block_max_lands_on_the_format_max_with_fp32_scales() {
        let x = Tensor::from_slice(&[1.0_f32, -3.0, 0.5, 2.0])
            .f_view([1, 4])
            .unwrap();
        let q = quantize_blocks(&x, (1, 4), spec(ScaleFormat::Fp32)).unwrap();
        let values = Vec::<f32>::try_from(q.values.to_kind(Kind::Float).view([-1])).unwrap();
        assert_eq!(values[1], -448.0);
        let scale = Vec::<f32>::try_from(q.scales.view([-1])).unwrap();
        assert_eq!(scale, [3.0 / 448.0]);
    }

    #[test]
    fn ue8m0_dequantizes_exactly_where_the_values_are_representable() {
        // With a power-of-two scale, value * scale reproduces every input
        // that is an e4m3 value times that scale.
        let x = Tensor::from_slice(&[0.5_f32, -1.0, 0.25, 1.5, 0.0, 0.75, -0.125, 1.0])
            .f_view([2, 4])
            .unwrap();
        let q = quantize_blocks(&x, (1, 4), spec(ScaleFormat::Ue8m0)).unwrap();
        let back = dequantize_blocks(&q).unwrap();
        assert!(back.equal(&x), "{back}");
    }

    #[test]
    fn a_misshapen_input_is_an_error_that_says_what_was_expected() {
        let x = Tensor::zeros([3, 100], (Kind::Float, tch::Device::Cpu));
        let err = quantize_blocks(&x, (1, 128), spec(ScaleFormat::Fp32)).unwrap_err();
        assert!(err.to_string().contains("cols % 128 == 0"), "{err}");
        assert!(err.to_string().contains("[3, 100]"), "{err}");
    }
}
