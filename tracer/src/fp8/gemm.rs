//! The block-scaled FP8 GEMM of production linears, `x @ weight.T` with
//! 1x128 activation blocks and 128x128 weight blocks (e4m3, ue8m0 scales),
//! computed two ways from the same FP8 codes and scales:
//!
//! - [`scaled_mm`]: the tensor cores (`torch._scaled_mm` with block-wise
//!   scales, as production kernels multiply), CUDA only;
//! - [`emulate`]: the codes dequantized and multiplied in fp32, an exact
//!   emulation with plain fp32 accumulation.
//!
//! [`quantize`] makes the shared operands, so the two can be compared on
//! identical inputs: whatever differs between them is the tensor cores'
//! accumulation, never the quantization. Only fallible `f_*` calls.

use tch::{Kind, Tensor};

use super::quant::{Quantized, dequantize_blocks, quantize_blocks};
use super::{Fp8Format, QuantSpec, ScaleFormat};
use crate::TraceError;

/// The production linears' quantization: e4m3, ue8m0 scales, amax clamp 1e-4.
pub const SPEC: QuantSpec = QuantSpec {
    format: Fp8Format::E4m3fn,
    scale: ScaleFormat::Ue8m0,
    amax_clamp: 1e-4,
};

/// Activations quantized as an FP8 checkpoint's kernel quantizes them
/// ([`stored`]): e4m3 per token in 1x128 groups, with the scales of the
/// checkpoint's `scale_fmt`:
/// - fp32 (`float`): `amax / 448`, each kept at or above 1e-12 (amax
///   448e-12) as transformers' fine-grained FP8 kernel keeps them (fp32 on
///   Hopper, for its Triton kernel and DeepGEMM's SM90 recipe alike);
/// - ue8m0: DeepSeek's reference `act_quant` (DeepSeek-V3.2-Exp
///   `inference/kernel.py` @3b99a53, `round_scale = scale_fmt is not None`,
///   which `linear()` passes for a checkpoint whose config says `ue8m0`):
///   amax clamped at 1e-4, the scale `fast_round_scale` makes of it,
///   2^ceil(log2(amax / 448)), a power of two.
///
/// An all-zero group gets zero codes whatever the floor.
#[must_use]
pub fn checkpoint_activations(scale: ScaleFormat) -> QuantSpec {
    QuantSpec {
        format: Fp8Format::E4m3fn,
        scale,
        amax_clamp: match scale {
            ScaleFormat::Fp32 => 448e-12,
            ScaleFormat::Ue8m0 => 1e-4,
        },
    }
}

/// Both operands of one GEMM, block-quantized, zero-padded to what
/// `_scaled_mm` takes (rows of `x` to 16, the inner and output sides to 128),
/// with the unpadded output shape.
#[derive(Debug)]
pub struct Operands {
    /// `x` `[M', K']` in 1x128 blocks.
    pub x: Quantized,
    /// `weight` `[N', K']` in 128x128 blocks.
    pub weight: Quantized,
    /// Rows of the result.
    pub m: i64,
    /// Columns of the result.
    pub n: i64,
}

fn torch(op: &'static str) -> impl Fn(tch::TchError) -> TraceError {
    move |source| TraceError::Torch { op, source }
}

/// Quantizes `x` `[M, K]` and `weight` `[N, K]` as production linears do.
///
/// # Errors
/// When libtorch refuses an operation.
pub fn quantize(x: &Tensor, weight: &Tensor) -> Result<Operands, TraceError> {
    const OP: &str = "fp8 gemm quantize";
    let (m, k, n) = (x.size()[0], x.size()[1], weight.size()[0]);
    let up = |v: i64, to: i64| (v + to - 1) / to * to;
    let (mp, kp, np) = (up(m, 16), up(k, 128), up(n, 128));
    let xp = x
        .f_to_kind(Kind::Float)
        .and_then(|t| t.f_constant_pad_nd([0, kp - k, 0, mp - m]))
        .map_err(torch(OP))?;
    let wp = weight
        .f_to_kind(Kind::Float)
        .and_then(|t| t.f_constant_pad_nd([0, kp - k, 0, np - n]))
        .map_err(torch(OP))?;
    Ok(Operands {
        x: quantize_blocks(&xp, (1, 128), SPEC)?,
        weight: quantize_blocks(&wp, (128, 128), SPEC)?,
        m,
        n,
    })
}

/// Quantizes `x` `[M, K]` with `activation` (1x128 blocks) against `weight`
/// `[N, K]` as an FP8 checkpoint stores it: `weight` holds its e4m3 codes
/// times `scale_inv` (`[ceil(N/128), ceil(K/128)]`, one fp32 scale per
/// 128x128 block) as the loader multiplied them out, so each code comes back
/// exactly by division (the product was rounded once, to within 2^-24 of
/// itself, and e4m3 neighbours lie 2^-4 apart) and the weight is never
/// re-quantized with scales of its own. A zero scale (a block of zeros) gives
/// zero codes.
///
/// # Errors
/// A scale grid that is not `weight`'s, or when libtorch refuses an operation.
pub fn stored(
    x: &Tensor,
    weight: &Tensor,
    scale_inv: &Tensor,
    activation: QuantSpec,
) -> Result<Operands, TraceError> {
    const OP: &str = "fp8 gemm stored weight";
    let (m, k, n) = (x.size()[0], x.size()[1], weight.size()[0]);
    let up = |v: i64, to: i64| (v + to - 1) / to * to;
    let (mp, kp, np) = (up(m, 16), up(k, 128), up(n, 128));
    let grid = vec![np / 128, kp / 128];
    if scale_inv.size() != grid {
        return Err(TraceError::Shape {
            op: OP,
            what: "weight_scale_inv",
            expected: format!("{grid:?}: one scale per 128x128 block of the weight [{n}, {k}]"),
            got: format!("{:?}", scale_inv.size()),
        });
    }
    let run = || -> Result<(Tensor, Tensor, Tensor), tch::TchError> {
        let scales = scale_inv.f_to_kind(Kind::Float)?;
        let divisor = scales
            .f_masked_fill(&scales.f_eq(0.0)?, 1.0)?
            .f_repeat_interleave_self_int(128, Some(0), None)?
            .f_repeat_interleave_self_int(128, Some(1), None)?;
        let max = f64::from(Fp8Format::E4m3fn.max());
        let codes = weight
            .f_to_kind(Kind::Float)?
            .f_constant_pad_nd([0, kp - k, 0, np - n])?
            .f_div(&divisor)?
            .f_clamp(-max, max)?
            .f_to_kind(Fp8Format::E4m3fn.kind())?;
        let xp = x
            .f_to_kind(Kind::Float)?
            .f_constant_pad_nd([0, kp - k, 0, mp - m])?;
        Ok((xp, codes, scales))
    };
    let (xp, codes, scales) = run().map_err(torch(OP))?;
    Ok(Operands {
        x: quantize_blocks(&xp, (1, 128), activation)?,
        weight: Quantized {
            values: codes,
            scales,
            block: (128, 128),
        },
        m,
        n,
    })
}

/// The GEMM on the tensor cores: `_scaled_mm` with the activation's 1x128
/// scales and the weight's 128x128 block scales repeated over its 128 output
/// rows (the 1x128-by-1x128 scaling `_scaled_mm` takes, with the same
/// numbers). fp32 output `[M, N]`.
///
/// # Errors
/// Off CUDA, or when the device refuses (`_scaled_mm` needs compute
/// capability 8.9 or newer for block-wise scales).
pub fn scaled_mm(op: &Operands) -> Result<Tensor, TraceError> {
    const OP: &str = "fp8 gemm _scaled_mm";
    let run = || -> Result<Tensor, tch::TchError> {
        // scale_a (M, K/128) M-major; scale_b (K/128, N) row-major.
        let scale_a = op.x.scales.f_tr()?.f_contiguous()?.f_tr()?;
        let scale_b = op
            .weight
            .scales
            .f_repeat_interleave_self_int(128, Some(0), None)?
            .f_tr()?
            .f_contiguous()?;
        let out = op.x.values.f_internal_scaled_mm(
            &op.weight.values.f_tr()?,
            &scale_a,
            &scale_b,
            None::<Tensor>,
            None::<Tensor>,
            Kind::Float,
            false,
        )?;
        out.f_narrow(0, 0, op.m)?.f_narrow(1, 0, op.n)
    };
    run().map_err(torch(OP))
}

/// The GEMM emulated: both operands dequantized (exact: the scales are
/// powers of two) and multiplied in fp32. fp32 output `[M, N]`.
///
/// # Errors
/// When libtorch refuses an operation.
pub fn emulate(op: &Operands) -> Result<Tensor, TraceError> {
    const OP: &str = "fp8 gemm emulate";
    let x = dequantize_blocks(&op.x)?;
    let w = dequantize_blocks(&op.weight)?;
    x.f_matmul(&w.f_tr().map_err(torch(OP))?)
        .and_then(|y| y.f_narrow(0, 0, op.m))
        .and_then(|y| y.f_narrow(1, 0, op.n))
        .map_err(torch(OP))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// Every finite e4m3 code, by PyTorch's own cast of its value.
    fn all_codes(rows: i64, cols: i64) -> Tensor {
        let values: Vec<f32> = (0..=255_u8)
            .map(|c| Fp8Format::E4m3fn.decode(c))
            .filter(|v| v.is_finite())
            .collect();
        let table = Tensor::from_slice(&values);
        let n = table.size()[0];
        let pick = Tensor::arange(rows * cols, (Kind::Int64, Device::Cpu)).remainder(n);
        table
            .index_select(0, &pick)
            .view([rows, cols])
            .to_kind(Fp8Format::E4m3fn.kind())
    }

    #[test]
    fn a_stored_weight_multiplies_the_checkpoint_codes_never_requantized_ones() {
        // Scales with full fp32 mantissas, as transformers' Fp8Quantize makes them
        // (amax / 448), so the code times its scale rounds; a zero scale (a zero block).
        let (n, k) = (200, 300);
        let codes = all_codes(n, k);
        let scales = Tensor::from_slice(&[
            1.234_567_9e-4_f32,
            3.1e-3,
            0.0,
            7.777_777e-5,
            2.0e-6,
            5.5e-2,
        ])
        .view([2, 3]);
        let codes32 = codes.to_kind(Kind::Float);
        let _ = codes32.narrow(0, 0, 128).narrow(1, 256, 44).fill_(0.0);
        let codes = codes32.to_kind(Fp8Format::E4m3fn.kind());
        let expanded = scales
            .repeat_interleave_self_int(128, Some(0), None)
            .repeat_interleave_self_int(128, Some(1), None)
            .narrow(0, 0, n)
            .narrow(1, 0, k);
        // What the loader holds: each code times its scale, rounded once in fp32.
        let weight = codes.to_kind(Kind::Float) * &expanded;
        let x = Tensor::randn([5, k], (Kind::Float, Device::Cpu));
        let op = stored(
            &x,
            &weight,
            &scales,
            checkpoint_activations(ScaleFormat::Fp32),
        )
        .unwrap();
        let got = op.weight.values.narrow(0, 0, n).narrow(1, 0, k);
        assert!(
            got.view_dtype(Kind::Uint8)
                .equal(&codes.view_dtype(Kind::Uint8)),
            "the codes came back changed"
        );
        // The emulated GEMM multiplies exactly the loader's values.
        let back = dequantize_blocks(&op.weight)
            .unwrap()
            .narrow(0, 0, n)
            .narrow(1, 0, k);
        assert!(back.equal(&weight));
        let wrong = scales.narrow(0, 0, 1);
        let err = stored(&x, &weight, &wrong, SPEC).unwrap_err();
        assert!(err.to_string().contains("[2, 3]"), "{err}");
    }

    /// DeepSeek-V3.2-Exp `inference/kernel.py` (@3b99a53) `act_quant` with
    /// `scale_fmt` set, written out here from its source rather than taken
    /// from the code under test: `amax = max(max|x|, 1e-4)`;
    /// `fast_log2_ceil(amax * fp8_max_inv)` from the fp32 bits (exponent -
    /// 127, plus one where the mantissa is not zero); `fast_pow2` of that.
    fn deepseek_round_scale(amax: f32) -> f32 {
        let fp8_max_inv = 1.0_f32 / 448.0;
        let v = amax.max(1e-4) * fp8_max_inv;
        let bits = v.to_bits();
        let exp = ((bits >> 23) & 0xFF) as i32 - 127 + i32::from(bits & 0x7F_FFFF != 0);
        f32::from_bits(((exp + 127) as u32) << 23)
    }

    #[test]
    fn a_ue8m0_checkpoint_quantizes_activations_with_deepseeks_power_of_two_scales() {
        // Rows whose amax sits on the edges of the rule: exactly 448 (scale 1), one
        // ulp above (2), 3 (3/448 -> 2^-7), zeros and 1e-6 (clamped to 1e-4 -> 2^-22),
        // 1000 (-> 4), then random rows.
        let k = 256;
        let x = Tensor::randn([10, k], (Kind::Float, Device::Cpu)) * 0.3;
        for (row, amax) in [448.0_f32, 448.000_03, 3.0, 0.0, 1e-6, 1000.0]
            .into_iter()
            .enumerate()
        {
            let mut r = x.get(row as i64);
            let _ = r.fill_(0.0);
            let _ = r.get(7).fill_(f64::from(amax));
            let _ = r.get(200).fill_(-f64::from(amax) / 3.0);
        }
        let weight = Tensor::randn([128, k], (Kind::Float, Device::Cpu)) * 0.05;
        let scales = Tensor::full([1, 2], 1.0 / 448.0, (Kind::Float, Device::Cpu));
        let codes = (&weight * 448.0)
            .clamp(-448.0, 448.0)
            .to_kind(Fp8Format::E4m3fn.kind());
        let weight = codes.to_kind(Kind::Float) / 448.0;
        let op = stored(
            &x,
            &weight,
            &scales,
            checkpoint_activations(ScaleFormat::Ue8m0),
        )
        .unwrap();
        let got = op.x.scales.narrow(0, 0, 10);
        let mut want = Vec::new();
        for row in 0..10 {
            for block in 0..2 {
                let amax = x
                    .get(row)
                    .narrow(0, block * 128, 128)
                    .abs()
                    .max()
                    .double_value(&[]);
                want.push(deepseek_round_scale(amax as f32));
            }
        }
        let want = Tensor::from_slice(&want).view([10, 2]);
        assert!(
            got.view_dtype(Kind::Int).equal(&want.view_dtype(Kind::Int)),
            "scales {got:?} against the reference's {want:?}"
        );
        let first: Vec<f32> = Vec::try_from(want.select(1, 0).narrow(0, 0, 6)).unwrap();
        assert_eq!(
            first,
            [1.0, 2.0, 2f32.powi(-7), 2f32.powi(-22), 2f32.powi(-22), 4.0]
        );
        // Codes: x over its scale, clamped, by PyTorch's own e4m3 cast.
        let expanded = want.repeat_interleave_self_int(128, Some(1), None);
        let codes = (&x / &expanded)
            .clamp(-448.0, 448.0)
            .to_kind(Fp8Format::E4m3fn.kind());
        assert!(
            op.x.values
                .narrow(0, 0, 10)
                .view_dtype(Kind::Uint8)
                .equal(&codes.view_dtype(Kind::Uint8)),
            "activation codes"
        );
        // The GEMM: dequantized activations times the stored weight, in f64 here.
        let product = (codes.to_kind(Kind::Double) * expanded.to_kind(Kind::Double))
            .matmul(&weight.to_kind(Kind::Double).tr());
        let y = emulate(&op).unwrap().to_kind(Kind::Double);
        let err = (&y - &product).abs().max().double_value(&[]);
        assert!(err <= 1e-5 * product.abs().max().double_value(&[]), "{err}");
        // transformers' fp32 scales are not powers of two: amax 3 gives 3/448.
        let fp32 = stored(
            &x,
            &weight,
            &scales,
            checkpoint_activations(ScaleFormat::Fp32),
        )
        .unwrap();
        assert_eq!(fp32.x.scales.double_value(&[2, 0]) as f32, 3.0_f32 / 448.0);
    }
}
