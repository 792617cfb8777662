"""The Rust reference engine (`shadowtrace-run`) against HF transformers: tiny GLM-5 and
DeepSeek-V3.2 configs with identical weights (written here as safetensors), fp32 on CPU,
per-layer hidden states, logits and indexer top-k. The prompt is longer than index_topk,
so the sparse regime is exercised; GLM has a shared (GLM-5.2) indexer layer and DeepSeek
YaRN RoPE, so both RoPE pairings and both scalings are covered. The trained checkpoints of
models/ are compared the same way, on held-out text."""

import json
import subprocess
from pathlib import Path

import pytest
import tiny_models
import torch
import trained
from conftest import binary
from safetensors.torch import load_file

LENGTH = 2100
# fp32 against fp32 with different reduction orders (libtorch matmul blocking, the
# layer-by-layer loop): relative to the largest magnitude of the tensor compared.
HIDDEN_REL_TOL = 1e-4
# Top-k keys may differ only where the k-th score is tied within this relative margin.
TIE_REL_TOL = 1e-5

CASES = {
    "glm": (
        lambda: tiny_models.glm(dtype=torch.float32, indexer_types=["full", "shared", "full"]),
        tiny_models.prompt,
    ),
    "deepseek": (
        lambda: tiny_models.deepseek(
            dtype=torch.float32,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 512,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
        tiny_models.prompt,
    ),
    # The trained checkpoints (models/), on held-out text.
    "glm5-tiny": (lambda: trained.load("glm"), trained.prompt),
    "dsv32-tiny": (lambda: trained.load("deepseek"), trained.prompt),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_rust_fp32_path_matches_transformers(tmp_path: Path, name: str) -> None:
    build, prompt = CASES[name]
    model = build()
    model.save_pretrained(tmp_path / "model")
    ids = prompt(LENGTH)
    captured: dict[int, torch.Tensor] = {}
    # transformers' hidden_states end with the final norm's output: the layers' own
    # outputs are taken from the layers.
    streams: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(
            lambda m, a, out, i=i: streams.__setitem__(
                i, (out[0] if isinstance(out, tuple) else out)[0].clone()
            )
        )
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            indexer.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out[0].clone()))
    with torch.no_grad():
        hf = model(ids)
    (tmp_path / "ids.json").write_text(json.dumps(ids[0].tolist()))
    run = subprocess.run(
        [binary("shadowtrace-run"), "--model", tmp_path / "model", tmp_path / "ids.json",
         "--path", "fp32", "--dump", tmp_path / "rust.safetensors"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    rust = load_file(tmp_path / "rust.safetensors")

    for i, want in streams.items():
        got = rust[f"layer_out.{i}"]
        err = float((got - want).abs().max() / want.abs().max())
        assert err <= HIDDEN_REL_TOL, (i, err)
    err = float((rust["logits"] - hf.logits[0]).abs().max() / hf.logits[0].abs().max())
    assert err <= HIDDEN_REL_TOL, ("logits", err)

    for i, want in captured.items():
        scores = rust[f"index_scores.{i}"]
        got = rust[f"topk.{i}"]
        mismatched = 0
        for t in range(2048, LENGTH):  # rows with more visible keys than k
            a, b = set(got[t].tolist()), set(want[t].tolist())
            if a == b:
                continue
            mismatched += 1
            kth = scores[t, got[t]].min()
            for key in a ^ b:
                assert abs(float(scores[t, key] - kth)) <= TIE_REL_TOL * float(scores[t].abs().max()), (
                    i,
                    t,
                    key,
                )
        assert mismatched <= (LENGTH - 2048) // 10, (i, mismatched)


def quantize_128(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A checkpoint's FP8 weight: e4m3 codes by PyTorch's own cast, one fp32 scale per
    128x128 block (weight_scale_inv), and the dequantized values they stand for."""
    rows, cols = weight.shape
    br, bc = -(-rows // 128), -(-cols // 128)
    padded = torch.zeros(br * 128, bc * 128)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(br, 128, bc, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    codes = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    values = (codes.float() * scale[:, None, :, None]).view(br * 128, bc * 128)[:rows, :cols].contiguous()
    return codes.view(br * 128, bc * 128)[:rows, :cols].contiguous(), scale, values


def test_an_fp8_checkpoint_loads_to_exactly_its_dequantized_weights(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = tiny_models.deepseek(layers=2, dtype=torch.float32)
    model.save_pretrained(tmp_path / "ref")
    state = load_file(tmp_path / "ref" / "model.safetensors")
    fp8, dequantized = {}, {}
    for name, tensor in state.items():
        if name.endswith("proj.weight") and "indexer.weights_proj" not in name:
            codes, scale, values = quantize_128(tensor)
            fp8[name], fp8[name.replace(".weight", ".weight_scale_inv")] = codes, scale
            dequantized[name] = values
        else:
            fp8[name] = dequantized[name] = tensor
    for name, tensors in (("fp8", fp8), ("dequantized", dequantized)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((tmp_path / "ref" / "config.json").read_text())
        save_file(tensors, tmp_path / name / "model.safetensors")
    (tmp_path / "ids.json").write_text(json.dumps(tiny_models.prompt(200)[0].tolist()))
    dumps = {}
    for name in ("fp8", "dequantized"):
        out = tmp_path / f"{name}.dump.safetensors"
        run = subprocess.run(
            [binary("shadowtrace-run"), "--model", tmp_path / name, tmp_path / "ids.json",
             "--path", "fp32", "--dump", out],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        dumps[name] = load_file(out)
    assert sum(t.dtype == torch.float8_e4m3fn for t in fp8.values()) > 10
    for key, value in dumps["fp8"].items():
        assert torch.equal(value, dumps["dequantized"][key]), key


def trace_with_fault(tmp_path: Path, fault: dict, length: int = 300) -> dict:
    model = tiny_models.glm(layers=3)
    model.save_pretrained(tmp_path / "glm")
    (tmp_path / "p.json").write_text(json.dumps(tiny_models.prompt(length)[0].tolist()))
    run = subprocess.run(
        [binary("shadowtrace-run"), "--model", tmp_path / "glm", tmp_path / "p.json",
         "--out", tmp_path / "runs", "--fault", json.dumps(fault)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    (run_dir,) = (p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["engine"]["name"] == "shadowtrace-reference"
    assert manifest["injections"] == [fault]
    out = subprocess.run(
        [binary("shadowtrace"), "analyze", tmp_path / "runs", "--format", "json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (analysis,) = json.loads(out.stdout)["runs"]
    return analysis


def test_off_cuda_every_production_linear_is_counted_as_emulated_and_none_as_tensor_cores(
    tmp_path: Path,
) -> None:
    """The manifest says how production's FP8 linears were computed, and counts every
    fallback (it said `emulated` while CUDA ran _scaled_mm, and fell back silently)."""
    model = tiny_models.glm(layers=2)
    model.save_pretrained(tmp_path / "glm")
    (tmp_path / "p.json").write_text(json.dumps(tiny_models.prompt(64)[0].tolist()))
    run = subprocess.run(
        [binary("shadowtrace-run"), "--model", tmp_path / "glm", tmp_path / "p.json",
         "--out", tmp_path / "runs"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    (run_dir,) = (p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    counters = manifest["counters"]
    # 2 layers: q_a, q_b, kv_a, kv_b, o (5), indexer wq_b and wk (2); dense MLP then MoE
    # (gate/up/down of the shared expert and each routed expert used): at least 7 per layer.
    assert counters["fp8_linears_emulated"] >= 14
    assert "fp8_linears_tensor_cores" not in counters
    for fallback in ("fp8_scaled_mm_fallbacks", "fp8_quantize_fallbacks", "fp8_indexer_fallbacks"):
        assert fallback not in counters
    assert "_scaled_mm" in manifest["settings"]["prod_linears"]
    assert "emulation" in manifest["settings"]["prod_linears"]


def test_a_traced_run_locates_a_nan_planted_in_production(tmp_path: Path) -> None:
    fault = {"kind": "non_finite", "layer": 1, "site": "mlp_out", "token": 123, "channel": 5, "value": "nan"}
    analysis = trace_with_fault(tmp_path, fault)
    onset = analysis["onset"]
    assert (onset["layer"], onset["site"], onset["token"], onset["shadow_finite"]) == (
        1,
        "mlp_out",
        123,
        True,
    )


def test_a_nan_in_a_padding_kv_slot_poisons_the_layer_with_the_shadow_finite(tmp_path: Path) -> None:
    analysis = trace_with_fault(tmp_path, {"kind": "kv_slot", "layer": 2, "token": 0})
    # The KV sentinel watch names the poisoned slot where it was written.
    first = analysis["failed_sentinels"][0]
    assert (first["step"], first["layer"], first["check"]) == (0, 2, "kv_slot0_finite")
    assert "first non-finite at slot 0" in first["detail"]
    onset = analysis["onset"]
    assert (onset["layer"], onset["site"], onset["shadow_finite"]) == (2, "attn_out", True)
    assert (
        next(h for h in analysis["hidden"] if h["layer"] == 2 and h["site"] == "attn_out")["nonfinite_tokens"]
        == 300
    )


def test_a_graft_is_tagged_and_announced_and_refused_where_it_cannot_run(tmp_path: Path) -> None:
    """`shadowtrace run --graft`: the run's tags say graft and one line says the output changes
    on purpose; a spec written wrong, a layer past the last, or an untraced pass is refused
    with what was expected (the graft's numerics: tests/it/grafts.rs)."""
    model = trained.folder("glm")
    (tmp_path / "ids.json").write_text(json.dumps(trained.prompt(300)[0].tolist()))

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [binary("shadowtrace-run"), "--model", model, tmp_path / "ids.json", *extra],
            capture_output=True, text=True, check=False,
        )  # fmt: skip

    done = run("--out", str(tmp_path / "runs"), "--graft", "indexer@1,layer_out@2")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("graft ")]
    assert lines == [
        "graft indexer@1,layer_out@2: production takes the local shadow's value there, "
        "so its output changes on purpose (tags.graft)"
    ]
    (manifest,) = (tmp_path / "runs").glob("*/manifest.json")
    assert json.loads(manifest.read_text())["tags"]["graft"] == "indexer@1,layer_out@2"
    for extra, needle in (
        (["--out", str(tmp_path / "a"), "--graft", "kv@1"],
         'graft "kv@1": expected a site among indexer, attn_out, mlp_out, layer_out'),
        (["--out", str(tmp_path / "b"), "--graft", "indexer@3"],
         "graft indexer@3: the model has 3 layers (0 to 2)"),
        (["--graft", "indexer@1"], "--graft runs in traced passes only"),
    ):  # fmt: skip
        refused = run(*extra)
        assert refused.returncode != 0
        assert needle in refused.stderr, refused.stderr
