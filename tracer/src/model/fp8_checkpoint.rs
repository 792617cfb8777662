//! A synthetic checkpoint laid out as the published FP8 ones are: sharded
//! safetensors (one shard per decoder layer, one for the embeddings and
//! head, one for the MTP layer), `model.safetensors.index.json`, FP8 e4m3
//! linears with their 128x128 `weight_scale_inv` blocks, the rest BF16 (the
//! router's correction bias fp32). Written tensor by tensor, drawn on the
//! device, so a full-width layer (about 10 GB for GLM-5.1) never sits in host
//! memory whole. The reference engine reads it as it reads a real one: this
//! is how the full-size sweep is measured without the real weights.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use tch::{Device, Kind, Tensor};

use super::ModelError;
use super::synthetic::{Init, SyntheticParams, TensorSpec, tensor_specs};
use crate::fp8::quant::quantize_blocks;
use crate::fp8::{Fp8Format, QuantSpec, ScaleFormat, WEIGHT_BLOCK};

/// The index file of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// How a tensor is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// FP8 e4m3 with a `<name>_scale_inv` of 128x128 block scales.
    Fp8,
    /// BF16.
    Bf16,
    /// fp32.
    F32,
}

/// How the published FP8 checkpoints store `name`: the attention, MLP and
/// expert projections and the indexer's `wq_b` in FP8 (and `wk` for
/// DeepSeek-V3.2, whose FP8 checkpoint holds it in FP8; GLM-5.1's in BF16),
/// the router's correction bias in fp32, everything else in BF16.
#[must_use]
pub fn stored(name: &str, deepseek: bool) -> Stored {
    let fp8 = (name.ends_with("_proj.weight") && !name.ends_with("weights_proj.weight"))
        || name.ends_with("kv_a_proj_with_mqa.weight")
        || name.ends_with("indexer.wq_b.weight")
        || (deepseek && name.ends_with("indexer.wk.weight"));
    if fp8 {
        Stored::Fp8
    } else if name.ends_with("e_score_correction_bias") {
        Stored::F32
    } else {
        Stored::Bf16
    }
}

/// One tensor as stored: name, safetensors dtype, shape.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    name: String,
    dtype: &'static str,
    shape: Vec<i64>,
}

impl Entry {
    fn bytes(&self) -> u64 {
        let n: i64 = self.shape.iter().product();
        let width = match self.dtype {
            "F8_E4M3" => 1,
            "BF16" => 2,
            _ => 4,
        };
        n.unsigned_abs() * width
    }
}

/// What was written.
#[derive(Debug, Clone, PartialEq)]
pub struct Written {
    /// Shard files, in order.
    pub shards: Vec<PathBuf>,
    /// Bytes of tensor data.
    pub bytes: u64,
}

/// The bytes a checkpoint of `config` takes as [`write_fp8`] writes it (the
/// MTP layer's stub included), to check against the disk before writing.
#[must_use]
pub fn planned_bytes(config: &Value) -> u64 {
    let deepseek = config.get("model_type").and_then(Value::as_str) == Some("deepseek_v32");
    let specs = tensor_specs(config, &SyntheticParams::default());
    specs
        .iter()
        .chain(&mtp_specs(config))
        .flat_map(|s| entries(s, deepseek))
        .map(|e| e.bytes())
        .sum()
}

fn entries(spec: &TensorSpec, deepseek: bool) -> Vec<Entry> {
    match stored(&spec.name, deepseek) {
        Stored::Fp8 => {
            let blocks: Vec<i64> = spec.shape.iter().map(|d| (d + 127) / 128).collect();
            vec![
                Entry {
                    name: spec.name.clone(),
                    dtype: "F8_E4M3",
                    shape: spec.shape.clone(),
                },
                Entry {
                    name: format!("{}_scale_inv", spec.name),
                    dtype: "F32",
                    shape: blocks,
                },
            ]
        }
        Stored::Bf16 => vec![Entry {
            name: spec.name.clone(),
            dtype: "BF16",
            shape: spec.shape.clone(),
        }],
        Stored::F32 => vec![Entry {
            name: spec.name.clone(),
            dtype: "F32",
            shape: spec.shape.clone(),
        }],
    }
}

/// The MTP layer after the decoder layers (`num_nextn_predict_layers`): the
/// tensors that only it has, enough for a loader to have to skip it.
fn mtp_specs(config: &Value) -> Vec<TensorSpec> {
    let int = |k: &str| config.get(k).and_then(Value::as_i64).unwrap_or(0);
    let (h, layers) = (int("hidden_size"), int("num_hidden_layers"));
    (0..int("num_nextn_predict_layers"))
        .flat_map(|m| {
            let l = layers + m;
            let p = |name: &str| format!("model.layers.{l}.{name}");
            [
                TensorSpec {
                    name: p("eh_proj.weight"),
                    shape: vec![h, 2 * h],
                    init: Init::Normal(0.02),
                    layer: Some(l),
                },
                TensorSpec {
                    name: p("enorm.weight"),
                    shape: vec![h],
                    init: Init::Ones(Vec::new()),
                    layer: Some(l),
                },
                TensorSpec {
                    name: p("hnorm.weight"),
                    shape: vec![h],
                    init: Init::Ones(Vec::new()),
                    layer: Some(l),
                },
                TensorSpec {
                    name: p("shared_head.norm.weight"),
                    shape: vec![h],
                    init: Init::Ones(Vec::new()),
                    layer: Some(l),
                },
            ]
        })
        .collect()
}

/// The bytes of one drawn tensor as stored, with its scales for FP8:
/// `(data, scale data)`.
fn encode(x: &Tensor, how: Stored, scale: ScaleFormat) -> Result<(Vec<u8>, Vec<u8>), String> {
    let err = |e: tch::TchError| e.to_string();
    let host = |t: &Tensor| t.f_to_device(Device::Cpu).and_then(|t| t.f_contiguous());
    match how {
        Stored::Bf16 => {
            let bits = host(&x.f_to_kind(Kind::BFloat16).map_err(err)?)
                .and_then(|t| t.f_view_dtype(Kind::Int16))
                .map_err(err)?;
            let v = Vec::<i16>::try_from(bits.f_flatten(0, -1).map_err(err)?).map_err(err)?;
            Ok((v.iter().flat_map(|b| b.to_le_bytes()).collect(), Vec::new()))
        }
        Stored::F32 => {
            let v = Vec::<f32>::try_from(host(x).and_then(|t| t.f_flatten(0, -1)).map_err(err)?)
                .map_err(err)?;
            Ok((v.iter().flat_map(|b| b.to_le_bytes()).collect(), Vec::new()))
        }
        Stored::Fp8 => {
            let (rows, cols) = (x.size()[0], x.size()[1]);
            let up = |v: i64| (v + 127) / 128 * 128;
            let padded = x
                .f_constant_pad_nd([0, up(cols) - cols, 0, up(rows) - rows])
                .map_err(err)?;
            let spec = QuantSpec {
                format: Fp8Format::E4m3fn,
                scale,
                amax_clamp: 1e-12,
            };
            let q = quantize_blocks(&padded, WEIGHT_BLOCK, spec).map_err(|e| e.to_string())?;
            let values = q
                .values
                .f_narrow(0, 0, rows)
                .and_then(|t| t.f_narrow(1, 0, cols))
                .and_then(|t| t.f_contiguous())
                .and_then(|t| t.f_view_dtype(Kind::Uint8))
                .map_err(err)?;
            let data = Vec::<u8>::try_from(
                host(&values)
                    .and_then(|t| t.f_flatten(0, -1))
                    .map_err(err)?,
            )
            .map_err(err)?;
            let scales = Vec::<f32>::try_from(
                host(&q.scales)
                    .and_then(|t| t.f_flatten(0, -1))
                    .map_err(err)?,
            )
            .map_err(err)?;
            Ok((data, scales.iter().flat_map(|b| b.to_le_bytes()).collect()))
        }
    }
}

/// Writes `config` (with `params` recorded) and seeded weights for it into
/// `dir` as a sharded FP8 checkpoint, drawing on `device`; `progress(shard,
/// shards, bytes written so far, bytes in all)` after each shard.
///
/// # Errors
/// A file that cannot be written, or a tensor that cannot be drawn.
pub fn write_fp8(
    dir: &Path,
    config: &Value,
    params: &SyntheticParams,
    seed: i64,
    device: Device,
    mut progress: impl FnMut(usize, usize, u64, u64),
) -> Result<Written, ModelError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| ModelError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut config = config.clone();
    if let Some(object) = config.as_object_mut() {
        object.insert("synthetic_params".to_owned(), params.to_json());
    }
    let config_path = dir.join("config.json");
    std::fs::write(
        &config_path,
        serde_json::to_string_pretty(&config).unwrap_or_default(),
    )
    .map_err(io(&config_path))?;
    let deepseek = config.get("model_type").and_then(Value::as_str) == Some("deepseek_v32");
    let scale = if deepseek {
        ScaleFormat::Ue8m0
    } else {
        ScaleFormat::Fp32
    };
    // Shards: the embeddings, final norm and head; each layer; the MTP layer.
    let mut groups: BTreeMap<i64, Vec<TensorSpec>> = BTreeMap::new();
    for spec in tensor_specs(&config, params)
        .into_iter()
        .chain(mtp_specs(&config))
    {
        groups
            .entry(spec.layer.unwrap_or(-1))
            .or_default()
            .push(spec);
    }
    let total: u64 = planned_bytes(&config);
    let n = groups.len();
    tch::manual_seed(seed);
    let mut weight_map = serde_json::Map::new();
    let (mut shards, mut written) = (Vec::new(), 0_u64);
    for (i, specs) in groups.values().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        let path = dir.join(&file);
        let stored_entries: Vec<Entry> = specs.iter().flat_map(|s| entries(s, deepseek)).collect();
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".to_owned(), json!({"format": "pt"}));
        let mut offset = 0_u64;
        for e in &stored_entries {
            header.insert(
                e.name.clone(),
                json!({"dtype": e.dtype, "shape": e.shape, "data_offsets": [offset, offset + e.bytes()]}),
            );
            weight_map.insert(e.name.clone(), file.clone().into());
            offset += e.bytes();
        }
        let mut text = serde_json::to_string(&header).unwrap_or_default();
        while !text.len().is_multiple_of(8) {
            text.push(' ');
        }
        let mut out = BufWriter::new(File::create(&path).map_err(io(&path))?);
        out.write_all(&(text.len() as u64).to_le_bytes())
            .and_then(|()| out.write_all(text.as_bytes()))
            .map_err(io(&path))?;
        for spec in specs {
            let how = stored(&spec.name, deepseek);
            let x = spec.init.draw(&spec.shape, device);
            let (data, scales) = encode(&x, how, scale).map_err(|what| ModelError::Weights {
                path: PathBuf::from(&spec.name),
                what,
            })?;
            out.write_all(&data)
                .and_then(|()| out.write_all(&scales))
                .map_err(io(&path))?;
        }
        out.flush().map_err(io(&path))?;
        written += offset;
        shards.push(path);
        progress(i + 1, n, written, total);
    }
    let index = dir.join(INDEX_FILE);
    let doc = json!({"metadata": {"total_size": written}, "weight_map": weight_map});
    std::fs::write(
        &index,
        serde_json::to_string_pretty(&doc).unwrap_or_default(),
    )
    .map_err(io(&index))?;
    Ok(Written {
        shards,
        bytes: written,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_fp8_checkpoints_store_linears_in_fp8_and_the_rest_in_bf16() {
        let l = "model.layers.3.";
        for name in [
            "self_attn.q_a_proj.weight",
            "self_attn.kv_a_proj_with_mqa.weight",
            "mlp.experts.7.down_proj.weight",
            "self_attn.indexer.wq_b.weight",
        ] {
            assert_eq!(stored(&format!("{l}{name}"), false), Stored::Fp8, "{name}");
        }
        for name in [
            "self_attn.indexer.weights_proj.weight",
            "self_attn.indexer.wk.weight",
            "mlp.gate.weight",
            "input_layernorm.weight",
        ] {
            assert_eq!(stored(&format!("{l}{name}"), false), Stored::Bf16, "{name}");
        }
        assert_eq!(
            stored("model.layers.3.self_attn.indexer.wk.weight", true),
            Stored::Fp8
        );
        assert_eq!(
            stored("model.layers.3.mlp.gate.e_score_correction_bias", false),
            Stored::F32
        );
    }

    #[test]
    fn a_full_width_glm_layer_is_about_ten_gigabytes() {
        let one = planned_bytes(&super::super::synthetic::glm51_full_config(1, 0));
        let two = planned_bytes(&super::super::synthetic::glm51_full_config(2, 0));
        let layer = two - one;
        // 256 experts x 3 x 6144 x 2048 FP8 bytes, plus attention and scales.
        assert!((9_800_000_000..10_300_000_000).contains(&layer), "{layer}");
    }
}
