//! Checkpoint weights from safetensors files: BF16, F16 and F32 as they are,
//! FP8 e4m3 with their 128x128 `weight_scale_inv` blocks as real checkpoints
//! store them. Read here rather than through tch, which knows no FP8 dtype.
//! A sharded checkpoint is read through its `model.safetensors.index.json`
//! (every shard it names must be there), shard by shard, and only the
//! tensors asked for are kept; tensors of layers past `num_hidden_layers`
//! (the MTP layers of `num_nextn_predict_layers`) are never asked for. FP8
//! codes are moved to the device before they are multiplied out, so a
//! full-width layer is dequantized where it runs.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tch::{Kind, Tensor};

use super::ModelError;
use crate::fp8::Fp8Format;

#[derive(Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<i64>,
    data_offsets: [usize; 2],
}

/// Where each tensor of a checkpoint lives.
#[derive(Debug)]
pub struct Checkpoint {
    files: BTreeMap<String, PathBuf>,
}

impl Checkpoint {
    /// Indexes the safetensors files of `dir`.
    ///
    /// # Errors
    /// No safetensors file, or an unreadable index.
    pub fn open(dir: &Path) -> Result<Checkpoint, ModelError> {
        let index = dir.join("model.safetensors.index.json");
        if index.is_file() {
            return Checkpoint::from_index(dir, &index);
        }
        let mut files = BTreeMap::new();
        let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|source| ModelError::Io {
                path: dir.to_owned(),
                source,
            })?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        shards.sort();
        if shards.is_empty() {
            return Err(ModelError::Weights {
                path: dir.to_owned(),
                what: "no *.safetensors file".to_owned(),
            });
        }
        for shard in shards {
            for name in header(&shard)?.0.keys() {
                files.insert(name.clone(), shard.clone());
            }
        }
        Ok(Checkpoint { files })
    }

    /// The shards a `model.safetensors.index.json` names (`weight_map`).
    fn from_index(dir: &Path, index: &Path) -> Result<Checkpoint, ModelError> {
        let bad = |what: String| ModelError::Weights {
            path: index.to_owned(),
            what,
        };
        let text = std::fs::read(index).map_err(|source| ModelError::Io {
            path: index.to_owned(),
            source,
        })?;
        let doc: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let map = doc
            .get("weight_map")
            .and_then(serde_json::Value::as_object)
            .ok_or_else(|| bad("no weight_map object".to_owned()))?;
        let mut files = BTreeMap::new();
        for (name, shard) in map {
            let shard = shard
                .as_str()
                .ok_or_else(|| bad(format!("{name}: the shard is not a file name")))?;
            let path = dir.join(shard);
            if !path.is_file() {
                return Err(bad(format!("{name}: shard {shard} is missing")));
            }
            files.insert(name.clone(), path);
        }
        Ok(Checkpoint { files })
    }

    /// The names that start with `prefix`.
    #[must_use]
    pub fn names_with_prefix(&self, prefix: &str) -> Vec<String> {
        self.files
            .range(prefix.to_owned()..)
            .take_while(|(name, _)| name.starts_with(prefix))
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// The tensors named, as fp32 on `device`: FP8 weights multiplied out by
    /// their `<name>_scale_inv` blocks there, each with its scales (fp32) under
    /// that name, so a weight the checkpoint stores in FP8 says so.
    ///
    /// # Errors
    /// A missing tensor, an unsupported dtype, or a truncated file.
    pub fn load(
        &self,
        names: &[String],
        device: tch::Device,
    ) -> Result<BTreeMap<String, Tensor>, ModelError> {
        let mut by_file: BTreeMap<&PathBuf, Vec<&String>> = BTreeMap::new();
        for name in names {
            let file = self.files.get(name).ok_or_else(|| ModelError::Weights {
                path: PathBuf::from(name),
                what: "not in the checkpoint".to_owned(),
            })?;
            by_file.entry(file).or_default().push(name);
        }
        let mut out = BTreeMap::new();
        for (file, wanted) in by_file {
            let (entries, data_start) = header(file)?;
            let io = |source| ModelError::Io {
                path: file.clone(),
                source,
            };
            let mut handle = File::open(file).map_err(io)?;
            for name in wanted {
                let entry = &entries[name.as_str()];
                let [a, b] = entry.data_offsets;
                // Only this tensor's bytes: a layer at a time from a shard of many.
                let mut data = vec![0_u8; b.saturating_sub(a)];
                handle
                    .seek(SeekFrom::Start((data_start + a) as u64))
                    .and_then(|_| handle.read_exact(&mut data))
                    .map_err(io)?;
                out.insert(
                    name.clone(),
                    decode(file, name, entry, &data)?.to_device(device),
                );
            }
        }
        let fp8: Vec<String> = out
            .iter()
            .filter(|(_, t)| t.kind() == Kind::Uint8)
            .map(|(name, _)| name.clone())
            .collect();
        for name in fp8 {
            let scale_name = format!("{name}_scale_inv");
            let mut scale = self.load(std::slice::from_ref(&scale_name), device)?;
            let scale = scale
                .remove(&scale_name)
                .ok_or_else(|| ModelError::Weights {
                    path: PathBuf::from(&scale_name),
                    what: "not in the checkpoint".to_owned(),
                })?;
            let scale = scale_grid(&scale_name, &out[&name], &scale)?;
            let values = dequantize(&out[&name], &scale);
            out.insert(name, values);
            // Kept beside the values: a production path that runs the checkpoint as
            // stored multiplies these codes and scales, never re-quantized ones.
            out.insert(scale_name, scale);
        }
        Ok(out)
    }
}

fn header(path: &Path) -> Result<(BTreeMap<String, Entry>, usize), ModelError> {
    let bad = |what: &str| ModelError::Weights {
        path: path.to_owned(),
        what: what.to_owned(),
    };
    let io = |source| ModelError::Io {
        path: path.to_owned(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let mut len_bytes = [0_u8; 8];
    file.read_exact(&mut len_bytes)
        .map_err(|_| bad("shorter than the 8-byte header length"))?;
    let len = usize::try_from(u64::from_le_bytes(len_bytes))
        .ok()
        .filter(|&l| l < 1 << 30)
        .ok_or_else(|| bad("header length past 1 GiB: not a safetensors file"))?;
    let mut json = vec![0_u8; len];
    file.read_exact(&mut json)
        .map_err(|_| bad("header past the end of the file"))?;
    let mut value: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&json).map_err(|e| bad(&format!("header: {e}")))?;
    value.remove("__metadata__");
    let entries = value
        .into_iter()
        .map(|(k, v)| {
            serde_json::from_value(v)
                .map(|e| (k.clone(), e))
                .map_err(|e| bad(&format!("{k}: {e}")))
        })
        .collect::<Result<_, _>>()?;
    Ok((entries, 8 + len))
}

fn decode(path: &Path, name: &str, entry: &Entry, data: &[u8]) -> Result<Tensor, ModelError> {
    let kind = match entry.dtype.as_str() {
        "BF16" => Kind::BFloat16,
        "F16" => Kind::Half,
        "F32" => Kind::Float,
        // FP8 codes stay bytes until their scale is applied; ue8m0 scales
        // (transformers' float8_e8m0fnu) are decoded from their bytes below.
        "F8_E4M3" | "F8_E8M0" => Kind::Uint8,
        other => {
            return Err(ModelError::Weights {
                path: path.to_owned(),
                what: format!("{name}: dtype {other}, expected BF16, F16, F32, F8_E4M3 or F8_E8M0"),
            });
        }
    };
    let tensor =
        Tensor::f_from_data_size(data, &entry.shape, kind).map_err(|e| ModelError::Weights {
            path: path.to_owned(),
            what: format!("{name}: {e}"),
        })?;
    Ok(if entry.dtype == "F8_E8M0" {
        let table: Vec<f32> = (0..=255_u8).map(ue8m0).collect();
        Tensor::from_slice(&table)
            .index_select(0, &tensor.to_kind(Kind::Int64).flatten(0, -1))
            .view(entry.shape.as_slice())
    } else if kind == Kind::Uint8 {
        tensor
    } else {
        tensor.to_kind(Kind::Float)
    })
}

/// A ue8m0 byte's value: 2^(byte - 127), the byte 255 NaN (the e8m0fnu format
/// of `torch.float8_e8m0fnu`, which has no zero, sign or infinity).
fn ue8m0(byte: u8) -> f32 {
    match byte {
        255 => f32::NAN,
        // 2^-127 is an fp32 subnormal: the mantissa's top bit.
        0 => f32::from_bits(0x0040_0000),
        b => f32::from_bits(u32::from(b) << 23),
    }
}

/// The scales of FP8 codes `[R, C]` as one fp32 scale per 128x128 block,
/// `[ceil(R/128), ceil(C/128)]`: a grid as stored, the grid with its size-1
/// dimensions squeezed (transformers 5.17's `save_pretrained` writes each
/// expert's scales of a bank so: `SplitModulelist` squeezes every chunk, a
/// `[256, 128]` down_proj's `[2, 1]` becoming `[2]`), or one scale for every
/// block (a per-tensor scale).
fn scale_grid(name: &str, codes: &Tensor, scale: &Tensor) -> Result<Tensor, ModelError> {
    let size = codes.size();
    let grid = [(size[0] + 127) / 128, (size[1] + 127) / 128];
    let scale = scale.to_kind(Kind::Float);
    if scale.numel() == 1 {
        return Ok(scale.reshape([1, 1]).expand(grid, false).contiguous());
    }
    let squeezed: Vec<i64> = grid.iter().copied().filter(|&d| d != 1).collect();
    if scale.size() == squeezed {
        return Ok(scale.reshape(grid));
    }
    if scale.size() != grid {
        return Err(ModelError::Weights {
            path: PathBuf::from(name),
            what: format!(
                "shape {:?}, expected {grid:?} (one scale per 128x128 block of {size:?}), \
                 {squeezed:?} (the same squeezed) or one scale",
                scale.size()
            ),
        });
    }
    Ok(scale)
}

/// FP8 e4m3 codes `[R, C]` times their per-128x128-block scales, in fp32 (the
/// product rounded once, as a kernel's dequantization rounds it; dividing it by
/// its scale gives the code back exactly: see `gemm::stored`).
fn dequantize(codes: &Tensor, scale_inv: &Tensor) -> Tensor {
    let table: Vec<f32> = (0..=255_u8).map(|c| Fp8Format::E4m3fn.decode(c)).collect();
    let values = Tensor::from_slice(&table)
        .to_device(codes.device())
        .index_select(0, &codes.to_kind(Kind::Int64).flatten(0, -1));
    let size = codes.size();
    let (rows, cols) = (size[0], size[1]);
    let scale = scale_inv
        .to_kind(Kind::Float)
        .repeat_interleave_self_int(128, Some(0), None)
        .narrow(0, 0, rows)
        .repeat_interleave_self_int(128, Some(1), None)
        .narrow(1, 0, cols);
    values.view([rows, cols]) * scale
}
