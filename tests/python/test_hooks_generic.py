"""Any HF decoder's hidden states: the generic adapter on transformers 5.24's `qwen3_5_moe`
(Gated DeltaNet layers with recurrent state, a gated full-attention layer, MoE), traced by
environment alone in a subprocess and read by the Rust analyzer; and the models it
refuses, each with one line that says why while the model runs on untraced."""

from pathlib import Path

import pytest
import torch
from test_hooks_family import bitwise, run_family
from test_hooks_transformers import analyze, assert_nothing_disabled, manifests

LENGTH = 100


def test_qwen3_5_moe_is_traced_with_logits_generate_and_recurrent_state_identical(tmp_path: Path) -> None:
    untraced, _ = run_family(tmp_path, "qwen3_5_moe", LENGTH, "--generate", "3")
    traced, runs = run_family(
        tmp_path, "qwen3_5_moe", LENGTH, "--generate", "3", SHADOWTRACE="1", SHADOWTRACE_MODE="local,free"
    )
    assert bitwise(traced["logits"], untraced["logits"])
    assert torch.equal(traced["ids"], untraced["ids"])
    assert bitwise(traced["gen_logits"], untraced["gen_logits"])
    # KV of the attention layer, convolution windows and recurrent states of the others
    assert len(traced["cache"]) == len(untraced["cache"]) > 4
    assert all(bitwise(a, b) for a, b in zip(traced["cache"], untraced["cache"], strict=True))

    forward, generate = manifests(runs)
    for manifest in (forward, generate):
        assert manifest["status"] == "complete"
        assert_nothing_disabled(manifest)
        assert manifest["model"]["architecture"] == "qwen3_5_moe_text"
        assert "structure found at run time" in manifest["settings"]["adapter"]
    # 4 layers x (layer_in + attn_out, mlp_out, layer_out in both modes) x every token
    assert forward["tables"]["hidden"]["rows"] == 4 * 7 * LENGTH
    assert forward["tables"]["topk"]["rows"] == 0
    assert forward["tables"]["logits"]["rows"] == LENGTH
    assert generate["counters"]["shadow_skipped_decode_steps"] == 2

    run, _ = analyze(runs)["runs"]
    assert run["onset"] is None
    assert run["hidden_verdict"] is None
    assert run["logits"]["argmax_agreement"] > 0.9
    sites = {(h["layer"], h["site"], h["shadow_mode"]) for h in run["hidden"]}
    for layer in range(4):
        for site in ("attn_out", "mlp_out", "layer_out"):
            assert {(layer, site, "local"), (layer, site, "free")} <= sites
    # an fp32 shadow of bf16 layers: each layer's own error is bf16 rounding, not more
    assert max(h["rel_l2_err"]["p95"] for h in run["hidden"] if h["shadow_mode"] == "local") < 0.05


def test_a_nan_planted_in_a_gated_deltanet_layer_is_located_there(tmp_path: Path) -> None:
    _, runs = run_family(
        tmp_path, "qwen3_5_moe", LENGTH, "--nan-layer", "1", "--nan-token", "42", SHADOWTRACE="1"
    )
    (manifest,) = manifests(runs)
    assert_nothing_disabled(manifest)
    (run,) = analyze(runs)["runs"]
    onset = run["onset"]
    assert (onset["step"], onset["layer"], onset["site"], onset["token"], onset["kind"]) == (
        0,
        1,
        "layer_out",
        42,
        "nan",
    )
    assert onset["shadow_finite"] is True


def refused_line(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("shadowtrace:")]


def test_an_encoder_decoder_is_refused_with_one_line_and_runs_untraced(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from conftest import transformers_path
    from test_hooks_family import TRACE, VERSION

    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE") and k != "PYTHONPATH"}
    outputs = {}
    for traced in (False, True):
        env = {**clean, **transformers_path(VERSION), "SHADOWTRACE_DIR": str(tmp_path / "runs")}
        if traced:
            env["SHADOWTRACE"] = "1"
        out = tmp_path / f"t5-{traced}.pt"
        done = subprocess.run(
            [sys.executable, TRACE, "t5", "40", out], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr[-4000:]
        outputs[traced] = (torch.load(out), refused_line(done.stderr))
    assert bitwise(outputs[True][0]["logits"], outputs[False][0]["logits"])
    assert outputs[False][1] == []
    (line,) = outputs[True][1]
    assert "T5ForConditionalGeneration is an encoder-decoder model" in line
    assert line.endswith("not traced")
    assert not (tmp_path / "runs").exists()


def test_a_shadow_below_production_precision_is_refused_and_production_traced_alone(tmp_path: Path) -> None:
    _, runs = run_family(tmp_path, "qwen3_5_moe", 40, "--fp32", SHADOWTRACE="1", SHADOWTRACE_SHADOW="bf16")
    (manifest,) = manifests(runs)
    assert manifest["status"] == "complete"
    assert "production runs in fp32, above the shadow's bf16" in manifest["settings"]["shadow_refused"]
    assert manifest["counters"]["shadow_refused"] == 1
    assert manifest["shadow"] == {"precision": None, "modes": []}
    assert manifest["dtypes"]["shadow"] is None
    # production alone: 4 layers x 4 sites x every token, no shadow mode
    assert manifest["tables"]["hidden"]["rows"] == 4 * 4 * 40
    (run,) = analyze(runs)["runs"]
    assert {h["shadow_mode"] for h in run["hidden"]} == {"none"}


def test_an_indexer_scope_shadow_of_a_model_without_an_indexer_is_refused_not_claimed(tmp_path: Path) -> None:
    _, runs = run_family(tmp_path, "qwen3_5_moe", 40, SHADOWTRACE="1", SHADOWTRACE_SHADOW_SCOPE="indexer")
    (manifest,) = manifests(runs)
    assert manifest["status"] == "complete"
    assert "SHADOWTRACE_SHADOW_SCOPE=indexer" in manifest["settings"]["shadow_refused"]
    assert manifest["counters"]["shadow_refused"] == 1
    assert manifest["shadow"] == {"precision": None, "modes": []}
    assert manifest["tables"]["hidden"]["rows"] == 4 * 4 * 40


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantized_decoder_weights_refuse_the_shadow_naming_the_weight(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """The check on a real model's structure (transformers' own Qwen3.5-MoE, the release in
    this environment), without running it: FP8 or integer codes cannot run on this CPU."""
    from shadowtrace_hooks import session, startup
    from shadowtrace_hooks.adapters import hf, hf_generic
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
        num_experts_per_tok=2, linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=16,
        linear_value_head_dim=16,
    )  # fmt: skip
    model = Qwen3_5MoeForCausalLM(config).to(torch.bfloat16)
    proj = model.model.layers[1].mlp.shared_expert.down_proj
    proj.weight = torch.nn.Parameter(proj.weight.data.to(dtype), requires_grad=False)
    sess = startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)})
    assert sess is not None
    try:
        tracer = hf_generic.GenericTracer.attach(model, sess, None, hf._Inputs(type(model).forward, "cache"))
    finally:
        session.stop()
    assert tracer is not None
    assert tracer.dtype is None
    assert "layers.1.mlp.shared_expert.down_proj.weight" in tracer.shadow_refused
    assert "cannot upcast quantized codes" in tracer.shadow_refused


def test_a_rotary_that_takes_no_text_positions_refuses_the_shadow_up_front_with_one_line(
    tmp_path: Path,
) -> None:
    """transformers 5.17's Qwen3.5 rotary wants multimodal positions [3, batch, tokens]: the
    shadow re-run, which builds cos/sin from the text positions, raised in every layer (each
    counted, each capture disabled). The adapter now asks the rotary once, up front, refuses
    the shadow with one line, and traces production alone, whole."""
    import transformers

    untraced, _ = run_family(tmp_path, "qwen3_5_moe", LENGTH, version=transformers.__version__)
    traced, runs = run_family(
        tmp_path, "qwen3_5_moe", LENGTH, version=transformers.__version__, SHADOWTRACE="1",
        SHADOWTRACE_MODE="local,free",
    )  # fmt: skip
    assert bitwise(traced["logits"], untraced["logits"])
    (manifest,) = manifests(runs)
    assert manifest["status"] == "complete"
    assert_nothing_disabled(manifest)
    assert manifest["counters"]["shadow_refused"] == 1
    refused = manifest["settings"]["shadow_refused"]
    assert "rotary embedding" in refused
    assert "takes no text positions" in refused
    assert "production is traced alone" in refused
    # production's rows are whole: layer_in, attn_out, mlp_out and layer_out of 4 layers
    assert manifest["tables"]["hidden"]["rows"] == 4 * 4 * LENGTH
