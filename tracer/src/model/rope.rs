//! Rotary position embeddings as HF transformers computes them for these
//! models: the default inverse frequencies or YaRN's, cos/sin in fp32, and
//! two ways of pairing dimensions. The main MLA attention of both models is
//! interleaved (pairs 2i, 2i+1); the indexer is interleaved for GLM and
//! half-split (pairs i, i+R/2, "NeoX") for DeepSeek-V3.2.

use std::f64::consts::PI;

use tch::{Device, Kind, Tensor};

use super::config::RopeParameters;

/// cos and sin `[S, R/2]` (fp32) of positions for a rotary dimension R, and
/// the attention-scaling factor folded into them.
#[derive(Debug)]
pub struct Rope {
    /// cos of each position's angle per pair.
    pub cos: Tensor,
    /// sin of each position's angle per pair.
    pub sin: Tensor,
}

/// Inverse frequencies `[R/2]` and the attention factor for `dim` = R.
#[must_use]
pub fn inv_freq(p: &RopeParameters, dim: i64, max_position_embeddings: f64) -> (Vec<f64>, f64) {
    let base = p.rope_theta;
    let exponents: Vec<f64> = (0..dim / 2).map(|i| (2 * i) as f64 / dim as f64).collect();
    let plain: Vec<f64> = exponents.iter().map(|e| 1.0 / base.powf(*e)).collect();
    if p.rope_type != "yarn" {
        return (plain, 1.0);
    }
    // transformers' _compute_yarn_parameters.
    let factor = p.factor.unwrap_or(1.0);
    let get_mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let attention_factor =
        p.attention_factor
            .unwrap_or_else(|| match (p.mscale, p.mscale_all_dim) {
                (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                    get_mscale(factor, m) / get_mscale(factor, all)
                }
                _ => get_mscale(factor, 1.0),
            });
    let original = p
        .original_max_position_embeddings
        .unwrap_or(max_position_embeddings);
    let (beta_fast, beta_slow) = (p.beta_fast.unwrap_or(32.0), p.beta_slow.unwrap_or(1.0));
    let correction_dim = |rotations: f64| {
        (dim as f64 * (original / (rotations * 2.0 * PI)).ln()) / (2.0 * base.ln())
    };
    let low = correction_dim(beta_fast).floor().max(0.0);
    let high = correction_dim(beta_slow).ceil().min((dim - 1) as f64);
    let high = if low == high { high + 0.001 } else { high };
    let inv: Vec<f64> = plain
        .iter()
        .enumerate()
        .map(|(i, extrapolation)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation_factor = 1.0 - ramp;
            let interpolation = extrapolation / factor;
            interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
        })
        .collect();
    (inv, attention_factor)
}

impl Rope {
    /// cos/sin of `positions` for rotary dimension `dim`, in fp32 as
    /// transformers computes them (fp32 inverse frequencies times positions).
    #[must_use]
    pub fn new(
        p: &RopeParameters,
        dim: i64,
        max_pos: f64,
        positions: &Tensor,
        device: Device,
    ) -> Rope {
        let (inv, scaling) = inv_freq(p, dim, max_pos);
        let inv: Vec<f32> = inv.iter().map(|v| *v as f32).collect();
        let inv = Tensor::from_slice(&inv).to_device(device);
        let angles = positions
            .to_kind(Kind::Float)
            .unsqueeze(1)
            .matmul(&inv.unsqueeze(0));
        Rope {
            cos: angles.cos() * scaling,
            sin: angles.sin() * scaling,
        }
    }

    /// Rotates the last dimension R of `x` `[..., S, (H,) R]` pairwise; the
    /// sequence axis is `seq_dim` of x. Computed in x's kind with cos/sin
    /// cast to it, as transformers does.
    pub fn apply(&self, x: &Tensor, seq_dim: i64, interleaved: bool) -> Tensor {
        let kind = x.kind();
        let shape = |t: &Tensor| {
            let mut size = vec![1_i64; x.dim()];
            size[seq_dim as usize] = t.size()[0];
            let last = size.len() - 1;
            size[last] = t.size()[1];
            t.to_kind(kind).view(size.as_slice())
        };
        let (cos, sin) = (shape(&self.cos), shape(&self.sin));
        let r = x.size()[x.dim() - 1];
        if interleaved {
            let x1 = x.slice(-1, 0, r, 2);
            let x2 = x.slice(-1, 1, r, 2);
            let a = &x1 * &cos - &x2 * &sin;
            let b = &x2 * &cos + &x1 * &sin;
            Tensor::stack(&[a, b], -1).flatten(-2, -1)
        } else {
            let x1 = x.narrow(-1, 0, r / 2);
            let x2 = x.narrow(-1, r / 2, r / 2);
            let a = &x1 * &cos - &x2 * &sin;
            let b = &x2 * &cos + &x1 * &sin;
            Tensor::cat(&[a, b], -1)
        }
    }
}
