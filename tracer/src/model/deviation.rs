//! Deviations: known engine behaviours that depart from the model's reference
//! numerics (DESIGN.md, deviation), run on purpose in the reference engine's
//! production path. Each is named after the behaviour, cites the upstream
//! code or report it comes from, and is listed in the run's manifest
//! (`deviations`) as a planted fault is (`injections`).
//!
//! The production path a deviation departs from is the reference engine's:
//! FP8 block-scaled linears and the indexer of `--fp8-indexer` (`none`: no
//! FP8 in the indexer, as transformers computes it; the `suspects` sweep
//! starts there). A deviation changes one thing; several compose
//! (`indexer_rope_neox,hadamard_dropped`). `NAME@L` applies it at layer L
//! alone (a positive control whose layer is known); plain `NAME` at every
//! layer, as an engine does.
//!
//! Whether a deviation changes anything for a model is settled before
//! anything runs ([`Deviation::effect`]): NeoX RoPE on DeepSeek-V3.2, whose
//! indexer RoPE is NeoX already, changes nothing, and the sweep says so
//! instead of reporting noise.
//!
//! The prefix-reuse deviations act on a prefill whose first
//! [`reuse_prefix`] tokens were a cache hit: queries past the prefix read
//! the cached entries of the prefix (those before it were computed by the
//! earlier request, correctly). The prefix is a named parameter
//! ([`PREFIX_REUSE_FRACTION`], [`KV_BLOCK_TOKENS`]) so a report can say what
//! it assumed.

use std::fmt;

use serde_json::{Value, json};
use tch::{Kind, Tensor};

use super::config::{Architecture, ModelConfig};
use super::kernel_deviation::LowPrecision;
use crate::TraceError;
use crate::fp8::ACTIVATION_BLOCK;
use crate::fp8::quant::{dequantize_blocks, quantize_blocks};
use crate::indexer::{Fp8Indexer, Precision, hadamard_matrix, index_scores};

/// Tokens per KV-cache block (page) of the prefix-reuse deviations: the page
/// size of SGLang's and vLLM's DSA caches and of DeepGEMM's paged logits on
/// SM90 (`block_kv = 64`, `../shared/reference/dsa_numerics.md` 2.3).
pub const KV_BLOCK_TOKENS: i64 = 64;

/// The share of a prompt taken as a cache hit by the prefix-reuse
/// deviations: the prefix is the largest whole number of blocks within this
/// share of the prompt.
pub const PREFIX_REUSE_FRACTION: f64 = 0.5;

/// The stride by which the wrong indexer K-cache gather walks pages
/// ([`DeviationKind::KCacheWrongBlocks`]): TensorRT-LLM #16223 describes flat
/// offsets inflated by the compress ratio; DeepSeek-V4's indexer compresses
/// by 4.
pub const GATHER_STRIDE: i64 = 4;

/// One known engine behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeviationKind {
    /// The indexer's RoPE rotates half-split pairs (i, i + R/2), "NeoX".
    IndexerRopeNeox,
    /// The indexer's RoPE rotates adjacent pairs (2i, 2i + 1), "interleaved".
    IndexerRopeInterleaved,
    /// The indexer in FP8 as DeepSeek's reference inference code computes
    /// it: Hadamard rotation, q and k quantized (e4m3, 1x128, ue8m0).
    IndexerFp8,
    /// The FP8 indexer without the Hadamard rotation before quantization.
    HadamardDropped,
    /// Only the indexer's keys quantized to FP8, as its key cache stores them.
    IndexerKCacheFp8,
    /// The head weights `weights_proj(x)` rounded to bf16.
    WeightsProjBf16,
    /// The indexer's logits rounded to bf16 before top-k.
    IndexerLogitsBf16,
    /// Exact ties at the k-th score broken the other way.
    TieOrder,
    /// A NaN in the KV slot reserved for padding rows, read by every query
    /// whose index list has unused entries.
    KvSlotNan,
    /// The zero-RoPE KV writer (`qk_rope_head_dim = 0`) writing padding rows
    /// into the reserved slot: [`DeviationKind::KvSlotNan`] on those models.
    ZeroRopeWriter,
    /// Under prefix reuse, the indexer's cached keys gathered from the wrong
    /// blocks.
    KCacheWrongBlocks,
    /// Under prefix reuse, the last reused block holds the state of the block
    /// before it.
    StalePrefixState,
    /// The logits kernel's per-head terms and head sum held in bf16.
    IndexerLogitsLowprec,
    /// The logits kernel's per-head terms and head sum held in fp16.
    IndexerLogitsLowprecFp16,
    /// The paged-logits kernel returning near-random scores for keys past a
    /// context length (parameter: the length, default [`PAGED_LOGITS_LENGTH`]).
    PagedLogitsPastLen,
    /// The radix top-k's candidate buffer overflowing and silently dropping
    /// winners (parameter: its capacity, default [`TOPK_CANDIDATE_BUFFER`]).
    TopkDropsWinners,
    /// Block-FP8 GEMM rows wrong next to 16-row M-tile boundaries.
    Fp8GemmMtileRows,
    /// The indexer's head reduction returning zeros past a prompt length
    /// (parameter: the length, default [`REDUCTION_ZEROS_LENGTH`]).
    ReductionZerosLarge,
}

impl DeviationKind {
    /// Every deviation, in the order reports list them.
    pub const ALL: [DeviationKind; 18] = [
        DeviationKind::IndexerRopeNeox,
        DeviationKind::IndexerRopeInterleaved,
        DeviationKind::IndexerFp8,
        DeviationKind::HadamardDropped,
        DeviationKind::IndexerKCacheFp8,
        DeviationKind::WeightsProjBf16,
        DeviationKind::IndexerLogitsBf16,
        DeviationKind::TieOrder,
        DeviationKind::KvSlotNan,
        DeviationKind::ZeroRopeWriter,
        DeviationKind::KCacheWrongBlocks,
        DeviationKind::StalePrefixState,
        DeviationKind::IndexerLogitsLowprec,
        DeviationKind::IndexerLogitsLowprecFp16,
        DeviationKind::PagedLogitsPastLen,
        DeviationKind::TopkDropsWinners,
        DeviationKind::Fp8GemmMtileRows,
        DeviationKind::ReductionZerosLarge,
    ];

    /// The name on the command line and in manifests.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            DeviationKind::IndexerRopeNeox => "indexer_rope_neox",
            DeviationKind::IndexerRopeInterleaved => "indexer_rope_interleaved",
            DeviationKind::IndexerFp8 => "indexer_fp8",
            DeviationKind::HadamardDropped => "hadamard_dropped",
            DeviationKind::IndexerKCacheFp8 => "indexer_k_cache_fp8",
            DeviationKind::WeightsProjBf16 => "weights_proj_bf16",
            DeviationKind::IndexerLogitsBf16 => "indexer_logits_bf16",
            DeviationKind::TieOrder => "tie_order",
            DeviationKind::KvSlotNan => "kv_slot_nan",
            DeviationKind::ZeroRopeWriter => "zero_rope_writer",
            DeviationKind::KCacheWrongBlocks => "kcache_wrong_blocks",
            DeviationKind::StalePrefixState => "stale_prefix_state",
            DeviationKind::IndexerLogitsLowprec => "indexer_logits_lowprec",
            DeviationKind::IndexerLogitsLowprecFp16 => "indexer_logits_lowprec_fp16",
            DeviationKind::PagedLogitsPastLen => "paged_logits_past_len",
            DeviationKind::TopkDropsWinners => "topk_drops_winners",
            DeviationKind::Fp8GemmMtileRows => "fp8_gemm_mtile_rows",
            DeviationKind::ReductionZerosLarge => "reduction_zeros_large",
        }
    }

    /// The kind a name stands for.
    #[must_use]
    pub fn named(name: &str) -> Option<DeviationKind> {
        DeviationKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// What production does, in one line.
    #[must_use]
    pub fn behaviour(self) -> &'static str {
        match self {
            DeviationKind::IndexerRopeNeox => {
                "indexer RoPE on half-split pairs (i, i+R/2), NeoX style"
            }
            DeviationKind::IndexerRopeInterleaved => {
                "indexer RoPE on adjacent pairs (2i, 2i+1), interleaved"
            }
            DeviationKind::IndexerFp8 => {
                "indexer q and k in FP8 (Hadamard, e4m3 1x128, ue8m0 scales, clamp 1e-4)"
            }
            DeviationKind::HadamardDropped => {
                "indexer q and k in FP8 without the Hadamard rotation before quantization"
            }
            DeviationKind::IndexerKCacheFp8 => {
                "indexer keys quantized to FP8 as the key cache stores them, queries not"
            }
            DeviationKind::WeightsProjBf16 => {
                "indexer head weights weights_proj(x) rounded to bf16"
            }
            DeviationKind::IndexerLogitsBf16 => "indexer logits rounded to bf16 before top-k",
            DeviationKind::TieOrder => "exact ties at the k-th score broken toward later keys",
            DeviationKind::KvSlotNan => {
                "NaN in the KV slot reserved for padding rows, read by queries whose index list has unused entries"
            }
            DeviationKind::ZeroRopeWriter => {
                "the zero-RoPE KV writer stores padding rows' NaN in the reserved slot (qk_rope_head_dim = 0)"
            }
            DeviationKind::KCacheWrongBlocks => {
                "prefix hit: the indexer's cached keys gathered from pages at GATHER_STRIDE x their offset"
            }
            DeviationKind::StalePrefixState => {
                "prefix hit: the last reused block holds the state of the block before it"
            }
            DeviationKind::IndexerLogitsLowprec => {
                "indexer logits kernel with each head's weighted relu(q.k) and the running head sum in bf16"
            }
            DeviationKind::IndexerLogitsLowprecFp16 => {
                "indexer logits kernel with each head's weighted relu(q.k) and the running head sum in fp16"
            }
            DeviationKind::PagedLogitsPastLen => {
                "paged indexer logits near-random for keys at or past a context length (:LEN, default 4096 \
                 = 64 tokens a block x 64 blocks)"
            }
            DeviationKind::TopkDropsWinners => {
                "radix top-k on an fp16 8-bit coarse key whose threshold bucket overflows the candidate \
                 buffer (:CAPACITY, default 4096): the first candidates in key order kept, later winners dropped"
            }
            DeviationKind::Fp8GemmMtileRows => {
                "block-FP8 GEMM rows next to 16-row M-tile boundaries wrong by 0.078 relative (M >= 56)"
            }
            DeviationKind::ReductionZerosLarge => {
                "the indexer's head reduction returns zeros for prompts longer than a size (:LEN, default \
                 131072), so top-k keeps the trailing keys"
            }
        }
    }

    /// Where the behaviour comes from: upstream file and commit, PR or report.
    #[must_use]
    pub fn source(self) -> &'static str {
        match self {
            DeviationKind::IndexerRopeNeox => {
                "TensorRT-LLM sparse/dsa/params.py @36449222 DSAParams.indexer_rope_interleave = False and \
                 sparse/dsa/indexer.py @047098b7 RotaryEmbedding(is_neox=not indexer_rope_interleave); \
                 PR #12010 (\"hard requirement for GLM5 or it generates garbage after a while\"); \
                 1.3.0rc3/rc4 served GLM-5 through the DeepseekV32 remap with no such knob; \
                 vLLM deepseek_v2.py and SGLang 0.5.23 models/deepseek_v2.py:2118 default the key to False"
            }
            DeviationKind::IndexerRopeInterleaved => {
                "DeepSeek-V3.2-Exp inference/model.py before its fix \"rope in indexer is not \
                 interleaved\" (transformers deepseek_v32/deepseek_files/inference/model.py @220c122b \
                 apply_rotary_emb(..., interleaved=False)); the main MLA RoPE is interleaved, so a \
                 shared rotary module carries the wrong layout into the indexer"
            }
            DeviationKind::IndexerFp8 => {
                "DeepSeek-V3.2 reference Indexer.forward (transformers deepseek_v32/deepseek_files/\
                 inference/model.py @220c122b: rotate_activation, act_quant(q, 128, ue8m0), k_cache fp8, \
                 fp8_index); SGLang nsa/dsa_indexer act_quant"
            }
            DeviationKind::HadamardDropped => {
                "TensorRT-LLM PR #11899 (fused_cat_fp8 replaced rotate_activation + \
                 fp8_quantize_1x128_sf_transpose; issue #13061 open, #15158 closed); vLLM \
                 deepseek_v2.py Indexer (no Hadamard on the fused or unfused path)"
            }
            DeviationKind::IndexerKCacheFp8 => {
                "the indexer K cache of every engine holds FP8 keys with per-token ue8m0 scales: \
                 DeepSeek reference k_cache, vLLM csrc/cache_kernels.cu indexer_k_quant_and_cache_kernel, \
                 TensorRT-LLM fusedCatFp8Scatter.cu; the suspect of TensorRT-LLM #15295 (context 003)"
            }
            DeviationKind::WeightsProjBf16 => {
                "axolotl PR #3832 (bf16 rounding of weights_proj perturbs near-tied index scores enough \
                 to flip top-k); SGLang 0.5.23 dsa_indexer.py weights_proj params_dtype bfloat16 and \
                 _weights_proj_bf16_in_fp32_out returning bf16 on HIP; vLLM deepseek_v2.py bf16 GEMM output"
            }
            DeviationKind::IndexerLogitsBf16 => {
                "DeepGEMM fp8_fp4_mqa_logits (@54e22612, the newer API) with bf16 logits, the Blackwell \
                 path of vLLM's sparse indexer"
            }
            DeviationKind::TieOrder => {
                "TensorRT-LLM cpp/tensorrt_llm/kernels/indexerTopK.cu @36449222 (radix select; exact ties \
                 admitted first-come by atomicAdd); vLLM top_k_per_row_prefill on exact ties, 156-200 \
                 distinct outputs over 200 calls (context 002, topk_ties.py)"
            }
            DeviationKind::KvSlotNan => {
                "SGLang #36207 and PR #36003 (reserved padding slot 0 of the MLA writers), AITER PR #5010 \
                 (context 000); the FP8 TileLang sparse decode maps unused top-k entries to row 0 and a \
                 masked NaN still poisons the softmax (context 001, SGLang #42689, #45988)"
            }
            DeviationKind::ZeroRopeWriter => {
                "SGLang sglang/kernels/ops/kvcache/mla_buffer.py set_mla_kv_buffer_kernel_norope before \
                 the fix of context 001 (GLM-5.3-Flash, qk_rope_head_dim = 0: GSM8K 50% -> 98%); the RoPE \
                 writers skip slot 0 since PR #36003 (0.5.23 mla_buffer.py reserved_skip_index)"
            }
            DeviationKind::KCacheWrongBlocks => {
                "TensorRT-LLM #16223 (context 003, later comments): _compute_slot_mappings in \
                 _torch/attention_backend/sparse/dsa.py walks flat offsets inflated by the compress ratio \
                 under block reuse, and indexerKCacheGatherUnifiedKernel gathers other blocks' keys \
                 without a bounds check"
            }
            DeviationKind::StalePrefixState => {
                "context 004 (SGLang mamba radix cache, state restored at 64-token checkpoints on a \
                 prefix hit) and vLLM #54076 (a hit restores the state from before the hit point while \
                 the attention KV is complete); a DSA model has no recurrent state, so here the cached \
                 state is the KV (latent and indexer keys) of the last reused block"
            }
            DeviationKind::IndexerLogitsLowprec | DeviationKind::IndexerLogitsLowprecFp16 => {
                "DeepGEMM fp8_mqa_logits (sm90_fp8_mqa_logits.cuh @54e22612) sums relu(acc) * weight over \
                 heads in fp32 registers; a kernel holding that epilogue in 16 bits (issue 40, item 4: \
                 fp8_mqa_logits accumulating in lower precision; TensorRT-LLM #15295's remaining suspect)"
            }
            DeviationKind::PagedLogitsPastLen => {
                "vLLM #47827 (GLM-5.2 on GB300: fp8_fp4_paged_mqa_logits wrong from about 4096 = 64 tokens \
                 a block x 64 blocks; two top-k kernels give the same corruption) and #39303 (aiter \
                 deepgemm_fp8_paged_mqa_logits_stage1 on gfx950: near-random top-k past context 2048)"
            }
            DeviationKind::TopkDropsWinners => {
                "SGLang PR #37591 (ROCm topk.hip from topk.cu: the fp16 coarse key collapses a row into \
                 one bucket and the overflowing candidate buffer drops valid winners, recall down to 0.53 \
                 on GLM-5.2 logits) and issue #36807 (fast_topk_v2's 4096-entry candidate buffer)"
            }
            DeviationKind::Fp8GemmMtileRows => {
                "SGLang #28685 and the PR #28471 comment (aiter gemm_a8w8_blockscale_bpreshuffle on gfx950, \
                 ROCm 7.2: sparse wrong rows near 16-row M-tile boundaries at M >= 56, relative error up \
                 to 0.078 at M = 64; GLM-5.1 residual cosine 0.10 at layer 78)"
            }
            DeviationKind::ReductionZerosLarge => {
                "mlx-lm #1454 (cited in llama.cpp PR #27754): the per-head score mx.sum over \
                 [1, 32, 4096, 131072] returns zeros and argpartition picks the trailing top_k positions"
            }
        }
    }
}

/// The context length past which [`DeviationKind::PagedLogitsPastLen`]'s
/// kernel goes wrong by default: 64 tokens a block x 64 blocks (vLLM #47827).
pub const PAGED_LOGITS_LENGTH: i64 = 4096;

/// The candidate buffer of [`DeviationKind::TopkDropsWinners`] by default:
/// SGLang's `fast_topk_v2` shared-memory buffer (#36807).
pub const TOPK_CANDIDATE_BUFFER: i64 = 4096;

/// The prompt length past which [`DeviationKind::ReductionZerosLarge`]'s
/// reduction returns zeros by default: the 131072 keys of mlx-lm #1454.
pub const REDUCTION_ZEROS_LENGTH: i64 = 131_072;

impl DeviationKind {
    /// The default of the kind's parameter (`NAME:VALUE`); `None`: it takes none.
    #[must_use]
    pub fn default_param(self) -> Option<i64> {
        match self {
            DeviationKind::PagedLogitsPastLen => Some(PAGED_LOGITS_LENGTH),
            DeviationKind::TopkDropsWinners => Some(TOPK_CANDIDATE_BUFFER),
            DeviationKind::ReductionZerosLarge => Some(REDUCTION_ZEROS_LENGTH),
            _ => None,
        }
    }
}

/// A deviation as given: a kind, at every layer or at one, with its
/// parameter where the kind takes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deviation {
    /// The behaviour.
    pub kind: DeviationKind,
    /// The one layer it acts in; `None`: every layer.
    pub layer: Option<i64>,
    /// The parameter given (`NAME:VALUE`); `None`: the kind's default.
    pub param: Option<i64>,
}

/// A deviation name that is not known, or a layer that does not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviationError {
    /// An unknown name.
    #[error("unknown deviation {got:?}: expected one of {}", known())]
    Unknown {
        /// The name given.
        got: String,
    },
    /// `NAME@L` whose L is not a layer index.
    #[error("deviation {got:?}: expected NAME or NAME@LAYER with LAYER a non-negative integer")]
    Layer {
        /// The text given.
        got: String,
    },
    /// `NAME:VALUE` on a kind that takes no parameter, or a VALUE that is not
    /// a positive integer.
    #[error(
        "deviation {got:?}: {name} takes {takes}; expected NAME[:VALUE][@LAYER] with VALUE a positive integer"
    )]
    Param {
        /// The text given.
        got: String,
        /// The kind's name.
        name: &'static str,
        /// What it takes.
        takes: String,
    },
    /// A layer the model does not have.
    #[error("deviation {got}: layer {layer} outside the model's {layers} layers")]
    OutsideModel {
        /// The deviation.
        got: String,
        /// Its layer.
        layer: i64,
        /// The model's layers.
        layers: i64,
    },
}

fn known() -> String {
    DeviationKind::ALL
        .iter()
        .map(|k| k.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether a deviation changes anything for a model, settled before it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// It changes production.
    Changes,
    /// The mathematics says it changes nothing here, and why.
    None(String),
}

impl Deviation {
    /// A kind at every layer, with its default parameter.
    #[must_use]
    pub fn everywhere(kind: DeviationKind) -> Deviation {
        Deviation {
            kind,
            layer: None,
            param: None,
        }
    }

    /// The parameter it runs with: the one given, else the kind's default.
    #[must_use]
    pub fn parameter(&self) -> Option<i64> {
        self.param.or_else(|| self.kind.default_param())
    }

    /// Parses `NAME`, `NAME:VALUE`, `NAME@LAYER` or `NAME:VALUE@LAYER`.
    ///
    /// # Errors
    /// An unknown name (the error lists the known ones), a layer that is not
    /// a non-negative integer, or a parameter the kind does not take.
    pub fn parse(text: &str) -> Result<Deviation, DeviationError> {
        let (name, layer) = match text.split_once('@') {
            Some((name, layer)) => {
                let layer = layer
                    .parse::<i64>()
                    .ok()
                    .filter(|l| *l >= 0 && layer.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(|| DeviationError::Layer {
                        got: text.to_owned(),
                    })?;
                (name, Some(layer))
            }
            None => (text, None),
        };
        let (name, value) = match name.split_once(':') {
            Some((name, value)) => (name, Some(value)),
            None => (name, None),
        };
        let kind = DeviationKind::named(name.trim()).ok_or_else(|| DeviationError::Unknown {
            got: name.to_owned(),
        })?;
        let param = match value {
            None => None,
            Some(value) => {
                let bad = || DeviationError::Param {
                    got: text.to_owned(),
                    name: kind.name(),
                    takes: kind.default_param().map_or_else(
                        || "no parameter".to_owned(),
                        |d| format!("a positive integer (default {d})"),
                    ),
                };
                kind.default_param().ok_or_else(bad)?;
                let v = value
                    .parse::<i64>()
                    .ok()
                    .filter(|v| *v > 0 && value.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(bad)?;
                Some(v)
            }
        };
        Ok(Deviation { kind, layer, param })
    }

    /// Parses a comma-separated list (`a,b@2`); an empty list is no deviation.
    ///
    /// # Errors
    /// The first entry that does not parse.
    pub fn parse_list(text: &str) -> Result<Vec<Deviation>, DeviationError> {
        text.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(Deviation::parse)
            .collect()
    }

    /// Checks the deviation's layer against a model of `layers` layers.
    ///
    /// # Errors
    /// A layer outside the model.
    pub fn check(&self, layers: i64) -> Result<(), DeviationError> {
        match self.layer {
            Some(layer) if layer >= layers => Err(DeviationError::OutsideModel {
                got: self.to_string(),
                layer,
                layers,
            }),
            _ => Ok(()),
        }
    }

    /// Whether it acts in layer `i`.
    #[must_use]
    pub fn at(&self, i: i64) -> bool {
        self.layer.is_none_or(|l| l == i)
    }

    /// Whether it changes production of `config` whose FP8 indexer is `base`
    /// (`None`: no FP8 in the indexer) and whose linears are block-scaled
    /// FP8 or not (`fp8_linears`), given the other deviations run with it.
    #[must_use]
    pub fn effect(
        &self,
        config: &ModelConfig,
        base: Option<Fp8Indexer>,
        fp8_linears: bool,
        with: &[Deviation],
    ) -> Effect {
        let arch = config.architecture().ok();
        let reference_interleaved = arch == Some(Architecture::Glm);
        let quantized = base.is_some()
            || with.iter().any(|d| {
                matches!(
                    d.kind,
                    DeviationKind::IndexerFp8 | DeviationKind::HadamardDropped
                )
            });
        let none = |why: &str| Effect::None(why.to_owned());
        match self.kind {
            DeviationKind::IndexerRopeNeox if !reference_interleaved => {
                none("the model's indexer RoPE is NeoX already")
            }
            DeviationKind::IndexerRopeInterleaved if reference_interleaved => {
                none("the model's indexer RoPE is interleaved already")
            }
            DeviationKind::IndexerRopeNeox | DeviationKind::IndexerRopeInterleaved
                if config.qk_rope_head_dim == 0 =>
            {
                none("qk_rope_head_dim = 0: the indexer rotates nothing")
            }
            DeviationKind::IndexerFp8 if base.is_some_and(|b| b.hadamard) => {
                none("the production indexer is this FP8 indexer already")
            }
            DeviationKind::HadamardDropped if base.is_some_and(|b| !b.hadamard) => {
                none("the production FP8 indexer drops the Hadamard already")
            }
            DeviationKind::IndexerKCacheFp8 if quantized => {
                none("the production indexer quantizes its keys to FP8 already")
            }
            DeviationKind::ZeroRopeWriter if config.qk_rope_head_dim > 0 => none(
                "qk_rope_head_dim > 0: the RoPE KV writers skip the reserved slot (SGLang #36003)",
            ),
            DeviationKind::Fp8GemmMtileRows if !fp8_linears => {
                none("production's linears are not block-scaled FP8 GEMMs")
            }
            _ => Effect::Changes,
        }
    }

    /// The manifest's entry: name, layers, behaviour, source, and its
    /// [`Effect`] on the run's model.
    #[must_use]
    pub fn manifest_entry(&self, effect: &Effect) -> Value {
        let mut entry = json!({
            "name": self.kind.name(),
            "layers": self.layer.map_or_else(|| Value::from("all"), |l| json!([l])),
            "behaviour": self.kind.behaviour(),
            "source": self.kind.source(),
            "effect": match effect {
                Effect::Changes => "changes production".to_owned(),
                Effect::None(why) => format!("none: {why}"),
            },
        });
        if let (Some(p), Some(object)) = (self.parameter(), entry.as_object_mut()) {
            object.insert("parameter".to_owned(), p.into());
        }
        entry
    }
}

impl fmt::Display for Deviation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind.name())?;
        if let Some(p) = self.param {
            write!(f, ":{p}")?;
        }
        if let Some(l) = self.layer {
            write!(f, "@{l}")?;
        }
        Ok(())
    }
}

/// The first `P` tokens of an `s`-token prompt taken as a cache hit by the
/// prefix-reuse deviations: the largest multiple of [`KV_BLOCK_TOKENS`]
/// within [`PREFIX_REUSE_FRACTION`] of it; `None` below two blocks (one
/// block has no wrong block to gather and no block before it).
#[must_use]
pub fn reuse_prefix(s: i64) -> Option<i64> {
    let blocks = ((s as f64 * PREFIX_REUSE_FRACTION) as i64) / KV_BLOCK_TOKENS;
    (blocks >= 2).then_some(blocks * KV_BLOCK_TOKENS)
}

/// How the indexer quantizes, after the deviations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum IndexerQuant {
    /// No FP8: q and k in the activation dtype, scores in fp32.
    None,
    /// Keys alone (the key cache), with this quantization.
    Keys(Fp8Indexer),
    /// Queries and keys, with this quantization.
    QueriesAndKeys(Fp8Indexer),
}

/// What production does differently in one layer, from the deviations that
/// act there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AtLayer {
    /// The indexer RoPE's layout, where a deviation sets it.
    pub rope_interleaved: Option<bool>,
    /// [`DeviationKind::IndexerFp8`].
    pub indexer_fp8: bool,
    /// [`DeviationKind::HadamardDropped`].
    pub hadamard_dropped: bool,
    /// [`DeviationKind::IndexerKCacheFp8`].
    pub k_cache_fp8: bool,
    /// [`DeviationKind::WeightsProjBf16`].
    pub weights_proj_bf16: bool,
    /// [`DeviationKind::IndexerLogitsBf16`].
    pub logits_bf16: bool,
    /// [`DeviationKind::TieOrder`].
    pub ties_reversed: bool,
    /// [`DeviationKind::KvSlotNan`], or [`DeviationKind::ZeroRopeWriter`]
    /// on a zero-RoPE model.
    pub pad_slot_nan: bool,
    /// [`DeviationKind::KCacheWrongBlocks`].
    pub wrong_gather: bool,
    /// [`DeviationKind::StalePrefixState`].
    pub stale_prefix: bool,
    /// [`DeviationKind::IndexerLogitsLowprec`] and its fp16 twin.
    pub logits_lowprec: Option<LowPrecision>,
    /// [`DeviationKind::PagedLogitsPastLen`]: the length.
    pub paged_past: Option<i64>,
    /// [`DeviationKind::TopkDropsWinners`]: the candidate buffer's capacity.
    pub topk_buffer: Option<i64>,
    /// [`DeviationKind::Fp8GemmMtileRows`].
    pub mtile_rows: bool,
    /// [`DeviationKind::ReductionZerosLarge`]: the length past which it acts.
    pub zeros_past: Option<i64>,
}

impl AtLayer {
    /// The deviations of `devs` acting in layer `i` of `config`.
    #[must_use]
    pub fn of(devs: &[Deviation], i: i64, config: &ModelConfig) -> AtLayer {
        let mut at = AtLayer::default();
        for d in devs.iter().filter(|d| d.at(i)) {
            match d.kind {
                DeviationKind::IndexerRopeNeox => at.rope_interleaved = Some(false),
                DeviationKind::IndexerRopeInterleaved => at.rope_interleaved = Some(true),
                DeviationKind::IndexerFp8 => at.indexer_fp8 = true,
                DeviationKind::HadamardDropped => at.hadamard_dropped = true,
                DeviationKind::IndexerKCacheFp8 => at.k_cache_fp8 = true,
                DeviationKind::WeightsProjBf16 => at.weights_proj_bf16 = true,
                DeviationKind::IndexerLogitsBf16 => at.logits_bf16 = true,
                DeviationKind::TieOrder => at.ties_reversed = true,
                DeviationKind::KvSlotNan => at.pad_slot_nan = true,
                DeviationKind::ZeroRopeWriter => {
                    at.pad_slot_nan |= config.qk_rope_head_dim == 0;
                }
                DeviationKind::KCacheWrongBlocks => at.wrong_gather = true,
                DeviationKind::StalePrefixState => at.stale_prefix = true,
                DeviationKind::IndexerLogitsLowprec => {
                    at.logits_lowprec = Some(LowPrecision::Bf16);
                }
                DeviationKind::IndexerLogitsLowprecFp16 => {
                    at.logits_lowprec = Some(LowPrecision::Fp16);
                }
                DeviationKind::PagedLogitsPastLen => at.paged_past = d.parameter(),
                DeviationKind::TopkDropsWinners => at.topk_buffer = d.parameter(),
                DeviationKind::Fp8GemmMtileRows => at.mtile_rows = true,
                DeviationKind::ReductionZerosLarge => at.zeros_past = d.parameter(),
            }
        }
        at
    }

    /// Whether the indexer RoPE rotates interleaved pairs: the deviation's
    /// layout, else the model's (GLM interleaved, DeepSeek-V3.2 NeoX).
    #[must_use]
    pub fn indexer_rope_interleaved(&self, arch: Architecture) -> bool {
        self.rope_interleaved.unwrap_or(arch == Architecture::Glm)
    }

    /// The indexer's quantization given production's FP8 indexer `base`.
    #[must_use]
    pub fn indexer_quant(&self, base: Option<Fp8Indexer>) -> IndexerQuant {
        let reference = Fp8Indexer::deepseek_reference();
        let mut quant = match base {
            Some(b) => IndexerQuant::QueriesAndKeys(b),
            None => IndexerQuant::None,
        };
        if self.indexer_fp8 && !matches!(quant, IndexerQuant::QueriesAndKeys(b) if b.hadamard) {
            quant = IndexerQuant::QueriesAndKeys(reference);
        }
        if self.k_cache_fp8 && quant == IndexerQuant::None {
            quant = IndexerQuant::Keys(reference);
        }
        if self.hadamard_dropped {
            let without = |v: Fp8Indexer| Fp8Indexer {
                hadamard: false,
                ..v
            };
            quant = match quant {
                IndexerQuant::None => IndexerQuant::QueriesAndKeys(without(reference)),
                IndexerQuant::Keys(v) => IndexerQuant::Keys(without(v)),
                IndexerQuant::QueriesAndKeys(v) => IndexerQuant::QueriesAndKeys(without(v)),
            };
        }
        quant
    }

    /// Whether any prefix-reuse deviation acts here.
    #[must_use]
    pub fn reuses_prefix(&self) -> bool {
        self.wrong_gather || self.stale_prefix
    }
}

/// `[S]` int64: where each cached key of the prefix `[0, p)` is gathered from
/// by the wrong K-cache gather ([`DeviationKind::KCacheWrongBlocks`]): page
/// `b` of the prefix read from page `b * GATHER_STRIDE` (wrapping within
/// the prefix's pages: the other requests' pages an out-of-range gather
/// reads are, here, other pages of the same prompt); keys from `p` on in
/// place.
pub fn wrong_gather_index(s: i64, p: i64, device: tch::Device) -> Tensor {
    let pages = p / KV_BLOCK_TOKENS;
    let index: Vec<i64> = (0..s)
        .map(|key| {
            if key >= p {
                return key;
            }
            let (page, offset) = (key / KV_BLOCK_TOKENS, key % KV_BLOCK_TOKENS);
            (page * GATHER_STRIDE % pages) * KV_BLOCK_TOKENS + offset
        })
        .collect();
    Tensor::from_slice(&index).to_device(device)
}

/// `[S]` int64: the cache entry each key of an `s`-token prompt is read from
/// under a stale prefix ([`DeviationKind::StalePrefixState`]): keys of the
/// last reused block `[p - B, p)` from the block before it, the rest in place.
pub fn stale_index(s: i64, p: i64, device: tch::Device) -> Tensor {
    let block = KV_BLOCK_TOKENS;
    let index: Vec<i64> = (0..s)
        .map(|key| {
            if (p - block..p).contains(&key) {
                key - block
            } else {
                key
            }
        })
        .collect();
    Tensor::from_slice(&index).to_device(device)
}

/// `scores` `[S, T]` with the rows of queries from `p` on taken from
/// `tail`: the rows the cache hit left to compute.
pub fn splice_tail(scores: &Tensor, tail: &Tensor, p: i64) -> Tensor {
    let s = scores.size()[0];
    let rows = Tensor::arange(s, (Kind::Int64, scores.device()))
        .ge(p)
        .view([s, 1]);
    tail.where_self(&rows, scores)
}

/// Top-`k` key indices `[S, k]` of `scores` `[S, T]` with exact ties broken
/// toward later keys, deterministically (a stable sort over the reversed
/// keys). `torch.topk` leaves its own tie order unspecified, so this differs
/// from production exactly where it breaks a tie the other way, and nowhere
/// else.
pub fn topk_ties_reversed(scores: &Tensor, k: i64) -> Tensor {
    let t = scores.size()[1];
    let (_, reversed) = scores.flip([-1]).sort_stable(true, -1, true);
    -reversed.narrow(1, 0, k) + (t - 1)
}

/// Indexer scores `[T, S]` with the keys alone quantized to FP8 as the key
/// cache stores them ([`DeviationKind::IndexerKCacheFp8`]): q `[T, H, D]`,
/// k `[S, D]` (fp32, after RoPE), w `[T, H]`. With `variant.hadamard` both
/// are rotated first (exact in fp32, so q.k is unchanged but for the keys'
/// quantization); the dequantized keys are scored in fp32.
///
/// # Errors
/// Shapes the quantization or the score do not take; a libtorch failure.
pub fn keys_fp8_scores(
    q: &Tensor,
    k: &Tensor,
    w: &Tensor,
    query_positions: &Tensor,
    variant: Fp8Indexer,
) -> Result<Tensor, TraceError> {
    let (q, keys) = dequantized_operands(q, k, IndexerQuant::Keys(variant))?;
    index_scores(&q, &keys, w, query_positions, Precision::Fp32)
}

/// q `[T, H, D]` and k `[S, D]` (fp32, after RoPE) as an FP8 indexer's dot
/// products see them: rotated by the Hadamard where the variant rotates,
/// then quantized (q per token and head, k per token, 1x128 blocks) and
/// dequantized where `quant` quantizes them. The products of dequantized
/// e4m3 values are exact in fp32, so scoring these is the emulated FP8
/// score up to the order of fp32 additions.
///
/// # Errors
/// A quantization that does not take the shapes (D other than 128); a
/// libtorch failure.
pub fn dequantized_operands(
    q: &Tensor,
    k: &Tensor,
    quant: IndexerQuant,
) -> Result<(Tensor, Tensor), TraceError> {
    let torch = |source| TraceError::Torch {
        op: "dequantized_operands",
        source,
    };
    let (variant, queries) = match quant {
        IndexerQuant::None => return Ok((q.shallow_clone(), k.shallow_clone())),
        IndexerQuant::Keys(v) => (v, false),
        IndexerQuant::QueriesAndKeys(v) => (v, true),
    };
    let (t, h, d) = (q.size()[0], q.size()[1], q.size()[2]);
    let (q, k) = if variant.hadamard {
        let had = hadamard_matrix(d, k.device())?;
        (
            q.f_matmul(&had).map_err(torch)?,
            k.f_matmul(&had).map_err(torch)?,
        )
    } else {
        (q.shallow_clone(), k.shallow_clone())
    };
    let keys = dequantize_blocks(&quantize_blocks(&k, ACTIVATION_BLOCK, variant.quant)?)?;
    let queries = if queries {
        let flat = q.f_reshape([t * h, d]).map_err(torch)?;
        dequantize_blocks(&quantize_blocks(&flat, ACTIVATION_BLOCK, variant.quant)?)?
            .f_view([t, h, d])
            .map_err(torch)?
    } else {
        q
    };
    Ok((queries, keys))
}

/// `x` rounded to bf16 and back to fp32.
pub fn bf16_round(x: &Tensor) -> Tensor {
    x.to_kind(Kind::BFloat16).to_kind(Kind::Float)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_to_their_kinds() {
        for kind in DeviationKind::ALL {
            assert_eq!(DeviationKind::named(kind.name()), Some(kind));
            let d = Deviation::parse(&format!("{}@3", kind.name())).unwrap();
            assert_eq!((d.kind, d.layer), (kind, Some(3)));
            assert_eq!(d.to_string(), format!("{}@3", kind.name()));
        }
    }

    #[test]
    fn an_unknown_name_is_refused_with_the_known_ones() {
        let err = Deviation::parse("rope_neox").unwrap_err().to_string();
        assert!(err.contains("\"rope_neox\""), "{err}");
        for kind in DeviationKind::ALL {
            assert!(err.contains(kind.name()), "{err} lacks {}", kind.name());
        }
        for bad in ["tie_order@", "tie_order@-1", "tie_order@+2", "tie_order@x"] {
            assert!(
                matches!(Deviation::parse(bad), Err(DeviationError::Layer { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_parameter_parses_after_a_colon_for_the_kinds_that_take_one() {
        let d = Deviation::parse("paged_logits_past_len:2048@1").unwrap();
        assert_eq!(
            (d.kind, d.param, d.layer, d.parameter()),
            (
                DeviationKind::PagedLogitsPastLen,
                Some(2048),
                Some(1),
                Some(2048)
            )
        );
        assert_eq!(d.to_string(), "paged_logits_past_len:2048@1");
        let default = Deviation::parse("topk_drops_winners").unwrap();
        assert_eq!((default.param, default.parameter()), (None, Some(4096)));
        assert_eq!(default.to_string(), "topk_drops_winners");
        let entry = default.manifest_entry(&Effect::Changes);
        assert_eq!(entry["parameter"], 4096);
        assert!(
            Deviation::parse("tie_order")
                .unwrap()
                .manifest_entry(&Effect::Changes)
                .get("parameter")
                .is_none()
        );
        for bad in [
            "tie_order:3",
            "paged_logits_past_len:0",
            "paged_logits_past_len:-5",
            "paged_logits_past_len:x@1",
            "paged_logits_past_len:",
        ] {
            let err = Deviation::parse(bad).unwrap_err();
            assert!(matches!(err, DeviationError::Param { .. }), "{bad}: {err}");
        }
        assert!(
            Deviation::parse("tie_order:3")
                .unwrap_err()
                .to_string()
                .contains("takes no parameter")
        );
    }

    #[test]
    fn the_gemm_rows_deviation_needs_block_scaled_linears() {
        let config: ModelConfig =
            serde_json::from_value(crate::model::synthetic::glm51_config(2)).unwrap();
        let d = Deviation::everywhere(DeviationKind::Fp8GemmMtileRows);
        assert_eq!(d.effect(&config, None, true, &[]), Effect::Changes);
        assert!(matches!(
            d.effect(&config, None, false, &[]),
            Effect::None(_)
        ));
    }

    #[test]
    fn a_list_parses_every_entry_and_empty_is_none() {
        let list = Deviation::parse_list("indexer_rope_neox, tie_order@2").unwrap();
        assert_eq!(list.len(), 2);
        assert_eq!(list[1].layer, Some(2));
        assert!(Deviation::parse_list("").unwrap().is_empty());
    }

    #[test]
    fn the_prefix_is_whole_blocks_within_half_the_prompt() {
        assert_eq!(reuse_prefix(3072), Some(1536));
        assert_eq!(
            reuse_prefix(1000),
            Some(448),
            "500 tokens hold 7 whole blocks"
        );
        assert_eq!(
            reuse_prefix(200),
            None,
            "one block is no prefix to get wrong"
        );
    }

    #[test]
    fn the_wrong_gather_reads_strided_pages_of_the_prefix_and_leaves_the_tail() {
        let idx: Vec<i64> = Vec::try_from(wrong_gather_index(640, 320, tch::Device::Cpu)).unwrap();
        // 5 pages: page b reads page 4b mod 5.
        assert_eq!(&idx[0..3], &[0, 1, 2], "page 0 stays");
        assert_eq!(idx[64], 4 * 64, "page 1 reads page 4");
        assert_eq!(idx[128 + 5], 3 * 64 + 5, "page 2 reads page 8 mod 5 = 3");
        assert_eq!(
            &idx[320..323],
            &[320, 321, 322],
            "keys past the prefix in place"
        );
    }

    #[test]
    fn the_stale_index_shifts_the_last_reused_block_alone() {
        let idx: Vec<i64> = Vec::try_from(stale_index(512, 256, tch::Device::Cpu)).unwrap();
        assert_eq!(idx[191], 191);
        assert_eq!(idx[192], 128);
        assert_eq!(idx[255], 191);
        assert_eq!(idx[256], 256);
    }

    #[test]
    fn reversed_ties_keep_the_latest_of_equal_scores_and_change_nothing_else() {
        let scores = Tensor::from_slice(&[3.0_f32, 1.0, 1.0, 0.0, 1.0, 2.0]).view([1, 6]);
        let picked = |k: i64| -> Vec<i64> {
            let mut v = Vec::try_from(topk_ties_reversed(&scores, k).view([-1])).unwrap();
            v.sort_unstable();
            v
        };
        assert_eq!(picked(3), [0, 4, 5], "of the keys tied at 1.0, the last");
        assert_eq!(picked(4), [0, 2, 4, 5], "the last two");
        assert_eq!(
            picked(2),
            [0, 5],
            "no tie at the k-th score: the top-k itself"
        );
    }
}
