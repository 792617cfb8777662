//! The reference engine on synthetic checkpoints: shapes the HF conformance
//! test (tests/python/test_reference_engine.py) does not reach, and bad input.

use shadowtrace_tracer::model::{Model, ModelError, Numerics, synthetic};
use tch::{Device, Kind};

fn ids(n: i64) -> Vec<i64> {
    (0..n).map(|i| (i * 37) % 256).collect()
}

#[test]
fn a_glm_5_3_flash_shape_without_rotary_dimensions_runs() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = synthetic::glm51_config(2);
    config["qk_rope_head_dim"] = 0.into();
    synthetic::write(dir.path(), &config, 3).unwrap();
    let model = Model::open(dir.path(), Device::Cpu).unwrap();
    for numerics in [Numerics::Plain(Kind::Float), Numerics::Fp8Emulated] {
        let out = tch::no_grad(|| model.forward(&ids(64), numerics)).unwrap();
        assert_eq!(out.logits.size(), [64, 256]);
        assert_eq!(
            out.logits.isfinite().all().int64_value(&[]),
            1,
            "{numerics:?}"
        );
    }
}

#[test]
fn shared_indexer_layers_reuse_the_previous_selection() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = synthetic::glm51_config(3);
    config["indexer_types"] = serde_json::json!(["full", "shared", "full"]);
    synthetic::write(dir.path(), &config, 4).unwrap();
    let model = Model::open(dir.path(), Device::Cpu).unwrap();
    let out = tch::no_grad(|| model.forward(&ids(40), Numerics::Plain(Kind::Float))).unwrap();
    assert!(out.layers[1].index_scores.is_none());
    assert!(out.layers[1].topk.equal(&out.layers[0].topk));
    assert!(out.layers[2].index_scores.is_some());
}

#[test]
fn an_unsupported_architecture_is_refused_with_its_model_type() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = synthetic::glm51_config(1);
    config["model_type"] = "llama".into();
    synthetic::write(dir.path(), &config, 5).unwrap();
    let err = Model::open(dir.path(), Device::Cpu).unwrap_err();
    assert!(
        matches!(err, ModelError::Unsupported { ref got, .. } if got == "llama"),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("expected glm_moe_dsa or deepseek_v32"),
        "{err}"
    );
}

#[test]
fn a_directory_without_weights_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        synthetic::glm51_config(1).to_string(),
    )
    .unwrap();
    let err = Model::open(dir.path(), Device::Cpu).unwrap_err();
    assert!(err.to_string().contains("no *.safetensors file"), "{err}");
}

#[test]
fn a_fault_whose_indices_do_not_fit_the_model_or_prompt_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    synthetic::write(&model, &synthetic::glm51_config(2), 6).unwrap();
    let prompt = dir.path().join("p.json");
    std::fs::write(&prompt, serde_json::to_string(&ids(24)).unwrap()).unwrap();
    // hidden_size 256, 2 layers, 24 prompt tokens.
    let cases = [
        (
            r#"{"kind":"non_finite","layer":1,"site":"mlp_out","token":3,"channel":256,"value":"nan"}"#,
            "channel 256 outside the model's hidden size 256",
        ),
        (
            r#"{"kind":"non_finite","layer":1,"site":"mlp_out","token":24,"channel":0,"value":"nan"}"#,
            "token 24 outside the prompt's 24 tokens",
        ),
        (
            r#"{"kind":"non_finite","layer":1,"site":"indexer","token":3,"channel":0,"value":"nan"}"#,
            "site indexer: expected attn_out, mlp_out or layer_out",
        ),
        (
            r#"{"kind":"outlier","layer":0,"channel":-1,"factor":100.0}"#,
            "channel -1 outside the model's hidden size 256",
        ),
        (
            r#"{"kind":"kv_slot","layer":-1,"token":0}"#,
            "layer -1 outside the model's 2 layers",
        ),
        (
            r#"{"kind":"kv_slot","layer":0,"token":30}"#,
            "token 30 outside the prompt's 24 tokens",
        ),
        (
            r#"{"kind":"fp8_scale","layer":0,"linear":"self_attn.nope","factor":2.0}"#,
            "linear self_attn.nope: no such linear in layer 0",
        ),
    ];
    for (fault, expected) in cases {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_shadowtrace-run"))
            .arg("--model")
            .arg(&model)
            .arg(&prompt)
            .arg("--out")
            .arg(dir.path().join("runs"))
            .args(["--fault", fault])
            .env_remove("SHADOWTRACE")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{fault}: {stderr}");
        assert!(stderr.contains(expected), "{fault}: {stderr}");
        assert!(!stderr.contains("panicked"), "{fault}: {stderr}");
    }
}
