//! Faults planted in the production path, as positive controls: each is a
//! known cause at a known place, which a trace must lead back to. Every
//! planted fault is recorded in the run's manifest (`injections`).

use serde::{Deserialize, Serialize};

use super::Model;

/// Sites a [`Fault::NonFinite`] can be planted at: the production tensors
/// the layer exposes.
pub const NON_FINITE_SITES: [&str; 3] = ["attn_out", "mlp_out", "layer_out"];

/// One planted fault; `layer` is the decoder layer it acts in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// A NaN (or ±Inf) written into one element of the production tensor at
    /// a site (`attn_out`, `mlp_out` or `layer_out`), token and channel.
    NonFinite {
        /// Layer.
        layer: i64,
        /// Site.
        site: String,
        /// Token.
        token: i64,
        /// Channel.
        channel: i64,
        /// Which value: `nan`, `pos_inf` or `neg_inf` (the events' kinds).
        value: NonFiniteValue,
    },
    /// A NaN written into the latent KV of one token (a reserved padding slot
    /// that masked reads still touch: the score of a NaN key is NaN before
    /// the mask is added, and poisons every query's softmax).
    KvSlot {
        /// Layer.
        layer: i64,
        /// The slot's token.
        token: i64,
    },
    /// One linear layer's FP8 weight scale off by `factor` (a wrong
    /// `weight_scale_inv` block, or a scale format mix-up).
    Fp8Scale {
        /// Layer.
        layer: i64,
        /// The linear's name within the layer, for example `self_attn.o_proj`.
        linear: String,
        /// The factor applied to the dequantized weight.
        factor: f64,
    },
    /// One channel of the layer's input multiplied by `factor`: the kind of
    /// outlier channel that saturates an FP8 block's scale.
    Outlier {
        /// Layer.
        layer: i64,
        /// Channel.
        channel: i64,
        /// Factor.
        factor: f64,
    },
    /// Noise of relative size `scale` added to the indexer's keys, seeded by
    /// the layer ([`seeded_normal`]): every forward draws the same.
    IndexerKey {
        /// Layer.
        layer: i64,
        /// Noise size relative to the keys' standard deviation.
        scale: f64,
    },
}

/// A non-finite value, named as the `events` table names its kinds (JSON has
/// no NaN literal).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NonFiniteValue {
    /// NaN.
    Nan,
    /// +Inf.
    PosInf,
    /// -Inf.
    NegInf,
}

impl NonFiniteValue {
    /// The value itself.
    #[must_use]
    pub fn value(self) -> f64 {
        match self {
            NonFiniteValue::Nan => f64::NAN,
            NonFiniteValue::PosInf => f64::INFINITY,
            NonFiniteValue::NegInf => f64::NEG_INFINITY,
        }
    }
}

/// A fault that does not fit the model or the prompt it would be planted in:
/// refused before anything runs, since an index past a tensor's end panics
/// inside libtorch, and a site, linear or indexer that does not exist would
/// plant nothing without a word.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FaultError {
    /// A layer the model does not have.
    #[error("layer {got} outside the model's {layers} layers")]
    Layer {
        /// The fault's layer.
        got: i64,
        /// The model's layers.
        layers: i64,
    },
    /// A channel past the hidden size.
    #[error("channel {got} outside the model's hidden size {hidden}")]
    Channel {
        /// The fault's channel.
        got: i64,
        /// The model's hidden size.
        hidden: i64,
    },
    /// A token past the prompt.
    #[error("token {got} outside the prompt's {tokens} tokens")]
    Token {
        /// The fault's token.
        got: i64,
        /// The prompt's length.
        tokens: i64,
    },
    /// A site a non-finite value cannot be planted at.
    #[error("site {got}: expected attn_out, mlp_out or layer_out")]
    Site {
        /// The fault's site.
        got: String,
    },
    /// A linear the layer does not have.
    #[error("linear {got}: no such linear in layer {layer}")]
    Linear {
        /// The fault's linear.
        got: String,
        /// Its layer.
        layer: i64,
    },
    /// An indexer fault in a layer that reuses the previous top-k.
    #[error("layer {layer} runs no indexer of its own (it reuses the previous layer's top-k)")]
    NoIndexer {
        /// The fault's layer.
        layer: i64,
    },
}

impl Fault {
    /// Checks every index the fault carries against `model` (layer, channel,
    /// site, linear, indexer) and, given the prompt's length, its token.
    ///
    /// # Errors
    /// The first index that does not fit.
    pub fn check(&self, model: &Model, tokens: Option<i64>) -> Result<(), FaultError> {
        let c = &model.config;
        let layer = self.layer();
        if !(0..c.num_hidden_layers).contains(&layer) {
            return Err(FaultError::Layer {
                got: layer,
                layers: c.num_hidden_layers,
            });
        }
        let channel = |got: i64| {
            if (0..c.hidden_size).contains(&got) {
                Ok(())
            } else {
                Err(FaultError::Channel {
                    got,
                    hidden: c.hidden_size,
                })
            }
        };
        let token = |got: i64| match tokens {
            Some(n) if !(0..n).contains(&got) => Err(FaultError::Token { got, tokens: n }),
            _ => Ok(()),
        };
        match self {
            Fault::NonFinite {
                site,
                token: t,
                channel: ch,
                ..
            } => {
                if !NON_FINITE_SITES.contains(&site.as_str()) {
                    return Err(FaultError::Site { got: site.clone() });
                }
                channel(*ch)?;
                token(*t)
            }
            Fault::KvSlot { token: t, .. } => token(*t),
            Fault::Fp8Scale { linear, .. } => {
                if model.has_tensor(&format!("model.layers.{layer}.{linear}.weight")) {
                    Ok(())
                } else {
                    Err(FaultError::Linear {
                        got: linear.clone(),
                        layer,
                    })
                }
            }
            Fault::Outlier { channel: ch, .. } => channel(*ch),
            Fault::IndexerKey { .. } if !c.runs_indexer(layer) => {
                Err(FaultError::NoIndexer { layer })
            }
            Fault::IndexerKey { .. } => Ok(()),
        }
    }

    /// The layer the fault acts in.
    #[must_use]
    pub fn layer(&self) -> i64 {
        match self {
            Fault::NonFinite { layer, .. }
            | Fault::KvSlot { layer, .. }
            | Fault::Fp8Scale { layer, .. }
            | Fault::Outlier { layer, .. }
            | Fault::IndexerKey { layer, .. } => *layer,
        }
    }
}

/// Standard normal noise of `shape`, the same for one `seed` on every call:
/// Box-Muller on a sine hash of each element's index, so a fault draws the
/// same noise in every forward (a graft's or a bisection's re-run included)
/// and leaves torch's global generator alone.
pub fn seeded_normal(shape: &[i64], seed: i64, device: tch::Device) -> tch::Tensor {
    use tch::{Kind, Tensor};
    let n: i64 = shape.iter().product();
    let i = Tensor::arange(n, (Kind::Double, device));
    let uniform = |salt: f64| {
        ((&i * 12.9898 + salt + seed as f64 * 78.233).sin() * 43_758.545_3)
            .frac()
            .abs()
            .clamp(1e-12, 1.0)
    };
    let (u1, u2) = (uniform(0.0), uniform(0.5));
    ((u1.log() * -2.0).sqrt() * (u2 * std::f64::consts::TAU).cos())
        .to_kind(Kind::Float)
        .view(shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_noise_repeats_for_its_seed_and_is_standard_normal() {
        let a = seeded_normal(&[300, 400], 1, tch::Device::Cpu);
        assert_eq!(a, seeded_normal(&[300, 400], 1, tch::Device::Cpu));
        assert_ne!(a, seeded_normal(&[300, 400], 2, tch::Device::Cpu));
        // 120000 draws: the mean's standard error is 0.003, the std's 0.002.
        let mean = a.mean(tch::Kind::Double).double_value(&[]);
        let std = a.std(true).double_value(&[]);
        assert!(mean.abs() < 0.015, "{mean}");
        assert!((std - 1.0).abs() < 0.01, "{std}");
        // Tails as a normal's: P(|z| > 3) = 0.0027.
        let tail = a
            .abs()
            .gt(3.0)
            .to_kind(tch::Kind::Double)
            .mean(tch::Kind::Double);
        let tail = tail.double_value(&[]);
        assert!((0.0017..0.0037).contains(&tail), "{tail}");
    }
}
