//! The DSA lightning indexer's score in three precisions, and top-k with
//! the k-th score margin. Math and engine differences:
//! `../shared/reference/dsa_numerics.md` sections 1 and 2.
//!
//! For query t (at position `pos[t]`), key s and H heads of dimension D:
//!
//! ```text
//! I[t, s] = sum_h w[t, h] * D^-1/2 * relu(q[t, h] . k[s])     for s <= pos[t], else -inf
//! ```
//!
//! where `w` already carries the H^-1/2 factor (`weights_proj(x) * H^-1/2`).
//! The FP8 production path quantizes q per (token, head) block of 128 and k
//! per token, folds the q scale and D^-1/2 into `w`, accumulates the FP8 dot
//! products in fp32, and applies the k scale last:
//!
//! ```text
//! I[t, s] = k_scale[s] * sum_h (w[t, h] * q_scale[t, h] * D^-1/2) * relu(q8[t, h] . k8[s])
//! ```
//!
//! Engine variants are parameters ([`Fp8Indexer`]), not forks.

pub mod reference;
mod score;
mod topk;

pub use score::{hadamard_matrix, index_scores};
pub use topk::{TopkSelection, topk_with_margin};

use crate::fp8::{Fp8Format, QuantSpec, ScaleFormat};

/// How the FP8 dot products are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DotProduct {
    /// Dequantized FP8 values multiplied in fp32: every product is exact
    /// (4-bit by 4-bit significands), only the fp32 accumulation rounds.
    Emulated,
    /// `torch._scaled_mm` on the tensor cores (CUDA, Hopper or newer), whose
    /// FP8 accumulation is not plain fp32 — the production kernel's numerics.
    ScaledMm,
}

/// An engine's FP8 indexer: what it does before the dot products.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Indexer {
    /// Sylvester Hadamard rotation (orthonormal, over D) of q and k before
    /// quantization. Exact arithmetic leaves the score unchanged; it spreads
    /// outliers before the cast.
    pub hadamard: bool,
    /// Quantization of q and k (e4m3fn; scale format; amax clamp).
    pub quant: QuantSpec,
    /// How the dot products run.
    pub dot: DotProduct,
}

impl Fp8Indexer {
    /// DeepSeek's reference `Indexer.forward`: Hadamard, ue8m0, clamp 1e-4.
    #[must_use]
    pub fn deepseek_reference() -> Fp8Indexer {
        Fp8Indexer::ue8m0(true, 1e-4)
    }

    /// SGLang's DSA indexer: Hadamard, ue8m0, clamp 1e-4.
    #[must_use]
    pub fn sglang() -> Fp8Indexer {
        Fp8Indexer::ue8m0(true, 1e-4)
    }

    /// TensorRT-LLM's current indexer: no Hadamard (dropped in PR #11899),
    /// ue8m0, clamp 1e-12.
    #[must_use]
    pub fn trtllm() -> Fp8Indexer {
        Fp8Indexer::ue8m0(false, 1e-12)
    }

    /// vLLM's sparse indexer: no Hadamard, ue8m0, clamp 1e-4 (K cache).
    #[must_use]
    pub fn vllm() -> Fp8Indexer {
        Fp8Indexer::ue8m0(false, 1e-4)
    }

    /// The variant an engine name stands for: `deepseek_reference`, `sglang`,
    /// `trtllm` or `vllm`.
    #[must_use]
    pub fn named(name: &str) -> Option<Fp8Indexer> {
        Some(match name {
            "deepseek_reference" => Fp8Indexer::deepseek_reference(),
            "sglang" => Fp8Indexer::sglang(),
            "trtllm" => Fp8Indexer::trtllm(),
            "vllm" => Fp8Indexer::vllm(),
            _ => return None,
        })
    }

    fn ue8m0(hadamard: bool, amax_clamp: f32) -> Fp8Indexer {
        Fp8Indexer {
            hadamard,
            quant: QuantSpec {
                format: Fp8Format::E4m3fn,
                scale: ScaleFormat::Ue8m0,
                amax_clamp,
            },
            dot: DotProduct::Emulated,
        }
    }
}

/// The precision of an indexer score computation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Precision {
    /// fp32 inputs and math: the shadow reference.
    Fp32,
    /// q, k and w rounded to bf16 (a BF16 model's activations), math in fp32,
    /// as HF transformers computes it.
    Bf16,
    /// The production FP8 path of an engine.
    Fp8(Fp8Indexer),
}

impl Precision {
    /// A short name for tables and benchmarks.
    #[must_use]
    pub fn name(&self) -> String {
        match self {
            Precision::Fp32 => "fp32".to_owned(),
            Precision::Bf16 => "bf16".to_owned(),
            Precision::Fp8(v) => format!(
                "fp8({}{}, {}, clamp {:e}, {})",
                if v.hadamard { "hadamard, " } else { "" },
                v.quant.format.name(),
                v.quant.scale.name(),
                v.quant.amax_clamp,
                match v.dot {
                    DotProduct::Emulated => "emulated",
                    DotProduct::ScaledMm => "_scaled_mm",
                }
            ),
        }
    }
}
