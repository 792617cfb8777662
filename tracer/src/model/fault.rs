//! Faults planted in the production path, as positive controls: each is a
//! known cause at a known place, which a trace must lead back to. Every
//! planted fault is recorded in the run's manifest (`injections`).

use serde::{Deserialize, Serialize};

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
    /// Seeded noise of relative size `scale` added to the indexer's keys.
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

impl Fault {
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
