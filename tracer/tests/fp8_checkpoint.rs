//! The FP8 checkpoint writer and the sharded loader together: a small
//! GLM-shaped checkpoint written as the published ones are (FP8 linears with
//! `weight_scale_inv` blocks, one shard per layer, an index, an MTP layer
//! after the decoder layers) reads back through its index and runs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use shadowtrace_tracer::model::fp8_checkpoint::write_fp8;
use shadowtrace_tracer::model::synthetic::{self, SyntheticParams};
use shadowtrace_tracer::model::{Model, Numerics};
use tch::{Device, Kind};

#[test]
fn a_sharded_fp8_checkpoint_with_an_mtp_layer_reads_through_its_index_and_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let mut config = synthetic::glm51_config(2);
    config["num_nextn_predict_layers"] = 1.into();
    let mut shards_done = Vec::new();
    let written = tch::no_grad(|| {
        write_fp8(
            tmp.path(),
            &config,
            &SyntheticParams::default(),
            3,
            Device::Cpu,
            |i, n, _, _| shards_done.push((i, n)),
        )
    })
    .unwrap();
    // Embeddings and head, two layers, the MTP layer.
    assert_eq!(written.shards.len(), 4, "{:?}", written.shards);
    assert_eq!(shards_done.last(), Some(&(4, 4)));
    let index: serde_json::Value = serde_json::from_slice(
        &std::fs::read(tmp.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let names: Vec<&String> = index["weight_map"].as_object().unwrap().keys().collect();
    assert!(
        names.iter().any(|n| n.starts_with("model.layers.2.")),
        "the MTP layer is in the index"
    );
    assert!(
        names
            .iter()
            .any(|n| n.as_str() == "model.layers.1.self_attn.q_a_proj.weight_scale_inv"),
        "FP8 linears carry their scale blocks"
    );

    let model = Model::open(tmp.path(), Device::Cpu).unwrap();
    assert_eq!(model.config.num_hidden_layers, 2);
    let ids: Vec<i64> = (0..48).map(|i| (i * 37) % 256).collect();
    let out = tch::no_grad(|| model.forward(&ids, Numerics::Plain(Kind::Float))).unwrap();
    assert_eq!(out.layers.len(), 2, "the MTP layer is not run");
    assert_eq!(out.logits.size(), [48, 256]);
    assert_eq!(out.logits.isfinite().all().int64_value(&[]), 1);
}

#[test]
fn the_committed_deepseek_fp8_checkpoint_is_ue8m0_and_the_glm_one_is_not() {
    // Production's FP8 path quantizes activations in the checkpoint's scale format:
    // power-of-two scales for DeepSeek-V3.2's ue8m0, as its reference linear does.
    let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models");
    let format = |name: &str| {
        Model::open(&models.join(name), Device::Cpu)
            .unwrap()
            .checkpoint_scale_format()
    };
    use shadowtrace_tracer::fp8::ScaleFormat;
    assert_eq!(format("dsv32-tiny-fp8"), ScaleFormat::Ue8m0);
    assert_eq!(format("glm5-tiny-fp8"), ScaleFormat::Fp32);
    assert_eq!(
        format("glm5-tiny"),
        ScaleFormat::Fp32,
        "no quantization_config"
    );
}
