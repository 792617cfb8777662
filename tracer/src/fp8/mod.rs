//! FP8 numerics of the production path: the two formats, block scaling with
//! fp32 or ue8m0 scales, quantization and dequantization.
//!
//! Two implementations of the same functions:
//! - [`quant`]: tch tensors, CPU or CUDA, what the tracer runs;
//! - [`reference`]: plain Rust over `ndarray`, independent of libtorch, the
//!   cross-check in tests.
//!
//! Both are checked bit for bit against PyTorch's own casts and a torch
//! reference (`tests/golden/numerics_v1.json`, from `tests/golden/make_golden.py`).

mod format;
pub mod gemm;
pub mod quant;
pub mod reference;

pub use format::Fp8Format;

/// How a block's scale is represented.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScaleFormat {
    /// `amax / max` as an fp32 value.
    Fp32,
    /// The smallest power of two >= `amax / max` (an 8-bit exponent, no
    /// mantissa): dequantization is then exact. DeepSeek-V3.2's indexer and
    /// every engine's indexer path use it.
    Ue8m0,
}

impl ScaleFormat {
    /// The name used in golden vectors and manifests.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            ScaleFormat::Fp32 => "fp32",
            ScaleFormat::Ue8m0 => "ue8m0",
        }
    }
}

/// How a tensor is block-quantized.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantSpec {
    /// Target format.
    pub format: Fp8Format,
    /// Scale representation.
    pub scale: ScaleFormat,
    /// Lower bound on a block's amax before the scale is derived, so an
    /// all-zero block gets a finite scale. Engines differ: 1e-4 (DeepSeek
    /// reference, SGLang, vLLM's K cache), 1e-10 (vLLM's fused Q), 1e-12
    /// (TensorRT-LLM).
    pub amax_clamp: f32,
}

/// Rounds a positive scale up to a power of two, exactly, from its bits (the
/// ue8m0 rule). Non-finite scales pass through unchanged.
#[must_use]
pub fn round_up_pow2(scale: f32) -> f32 {
    if !scale.is_finite() {
        return scale;
    }
    let bits = scale.to_bits();
    let exponent = (bits >> 23) & 0xFF;
    let mantissa = bits & 0x7F_FFFF;
    f32::from_bits((exponent + u32::from(mantissa != 0)) << 23)
}

/// Block shape: 1 x 128 for activations (one scale per token and 128
/// channels), 128 x 128 for weights.
pub const ACTIVATION_BLOCK: (usize, usize) = (1, 128);
/// See [`ACTIVATION_BLOCK`].
pub const WEIGHT_BLOCK: (usize, usize) = (128, 128);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ue8m0_rounds_up_to_a_power_of_two() {
        assert_eq!(round_up_pow2(1.0), 1.0);
        assert_eq!(round_up_pow2(1.000_000_1), 2.0);
        assert_eq!(round_up_pow2(0.75), 1.0);
        assert_eq!(round_up_pow2(3.0 / 448.0), 2_f32.powi(-7));
        assert!(round_up_pow2(f32::NAN).is_nan());
        assert_eq!(round_up_pow2(f32::INFINITY), f32::INFINITY);
    }
}
