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
