//! The golden numerics vectors (`tests/golden/numerics_v1.json`, written by
//! `tests/golden/make_golden.py` from PyTorch's casts and torch math).

#![allow(dead_code, reason = "each test binary uses part of the golden file")]

use std::collections::BTreeMap;
use std::sync::LazyLock;

use serde::Deserialize;
use shadowtrace_tracer::fp8::{Fp8Format, QuantSpec, ScaleFormat};

#[derive(Debug, Deserialize)]
pub(crate) struct Golden {
    pub(crate) torch_version: String,
    pub(crate) codes: BTreeMap<String, Vec<u32>>,
    pub(crate) casts: Casts,
    pub(crate) block_quant: BlockQuant,
    pub(crate) indexer: IndexerGolden,
    pub(crate) topk: Vec<TopkCase>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Casts {
    pub(crate) input: Vec<u32>,
    pub(crate) e4m3fn: Vec<u8>,
    pub(crate) e5m2: Vec<u8>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct BlockQuant {
    pub(crate) inputs: BTreeMap<String, Matrix>,
    pub(crate) cases: Vec<BlockCase>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Matrix {
    pub(crate) shape: Vec<usize>,
    pub(crate) bits: Vec<u32>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct BlockCase {
    pub(crate) name: String,
    pub(crate) input: String,
    pub(crate) format: String,
    pub(crate) scale_format: String,
    pub(crate) amax_clamp: f64,
    pub(crate) block: [usize; 2],
    pub(crate) values: Vec<u8>,
    pub(crate) scales: Vec<u32>,
}

impl BlockCase {
    pub(crate) fn spec(&self) -> QuantSpec {
        QuantSpec {
            format: format(&self.format),
            scale: match self.scale_format.as_str() {
                "fp32" => ScaleFormat::Fp32,
                "ue8m0" => ScaleFormat::Ue8m0,
                other => panic!("unknown scale format {other}"),
            },
            amax_clamp: self.amax_clamp as f32,
        }
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct IndexerGolden {
    pub(crate) t: usize,
    pub(crate) s: usize,
    pub(crate) h: usize,
    pub(crate) d: usize,
    pub(crate) q: Vec<u32>,
    pub(crate) k: Vec<u32>,
    pub(crate) w: Vec<u32>,
    pub(crate) q_pos: Vec<i64>,
    pub(crate) variants: BTreeMap<String, Variant>,
    pub(crate) scores_f64: BTreeMap<String, Vec<u64>>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Variant {
    pub(crate) hadamard: bool,
    pub(crate) scale_format: String,
    pub(crate) amax_clamp: f64,
}

#[derive(Debug, Deserialize)]
pub(crate) struct TopkCase {
    pub(crate) name: String,
    pub(crate) k: usize,
    pub(crate) visible: usize,
    pub(crate) scores: Vec<u32>,
    pub(crate) torch_topk_indices: Vec<i64>,
    pub(crate) torch_topk_values: Vec<u32>,
    pub(crate) kth_score: u32,
    pub(crate) next_score: u32,
}

pub(crate) fn format(name: &str) -> Fp8Format {
    Fp8Format::ALL
        .into_iter()
        .find(|f| f.name() == name)
        .unwrap_or_else(|| panic!("unknown format {name}"))
}

pub(crate) fn floats(bits: &[u32]) -> Vec<f32> {
    bits.iter().map(|&b| f32::from_bits(b)).collect()
}

pub(crate) fn doubles(bits: &[u64]) -> Vec<f64> {
    bits.iter().map(|&b| f64::from_bits(b)).collect()
}

/// The golden file: `SHADOWTRACE_GOLDEN` when set (test binaries copied to
/// another machine), else the repository's copy.
pub(crate) static GOLDEN: LazyLock<Golden> = LazyLock::new(|| {
    let path = std::env::var("SHADOWTRACE_GOLDEN").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/golden/numerics_v1.json"
        )
        .to_owned()
    });
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
});
