"""The reference engine's FP8 production path against transformers' own (issue 26, item 5):
one FP8 checkpoint, converted by transformers' fine-grained FP8 code (tiny_fp8) and written by
its `save_pretrained` (e4m3 codes, 128x128 block scales in fp32 or ue8m0), run by transformers
(FP8Linear, FP8Experts; the kernel emulated on the CPU from its definition, tiny_fp8.emu_matmul)
and by `shadowtrace-run --path fp8-checkpoint`, compared layer by layer.

The tolerance is measured, not chosen: the control is transformers' same FP8 path with its
GEMMs accumulated in fp64 instead of fp32, two FP8 implementations that differ only in
accumulation order. Any such difference moves some activation across an e4m3 rounding
boundary in the next FP8 linear (3 mantissa bits), so the two part by far more than the GEMM
error itself; the engine may depart from transformers by no more than ACCUMULATION_FACTOR
times what the control departs, per layer. The engine's other production path (`--path fp8`,
every weight re-quantized in its own blocks with ue8m0 scales) must fail that bound: the
test can tell a wrong FP8 implementation from a right one.
"""

import json
import subprocess
from pathlib import Path

import pytest
import tiny_fp8
import tiny_models
import torch
from conftest import binary
from safetensors.torch import load_file

T = 256  # below index_topk: every key selected, the layers' outputs do not hang on top-k ties
# Rust against transformers may be at most this many times the control's departure (median
# and 90th percentile of the per-token relative L2 error, per layer), plus FLOOR where the
# control is exactly 0. Measured at T = 256: Rust 0 to 3e-3 (most rows bit-identical), the
# control 0 to 2.7e-2; the re-quantizing path 3.3e-2 to 8.3e-2 (median).
ACCUMULATION_FACTOR = 2.0
FLOOR = 1e-6
# Greedy ids from the last logits: the engine's agreement with transformers may fall short of
# the control's by at most this share of tokens.
ARGMAX_SLACK = 0.02


def emu_matmul_fp64(input, weight, weight_scale_inv, block_size, output_dtype, activation_scale=None):
    """tiny_fp8.emu_matmul with the products summed in fp64: the accumulation-order control."""
    shape = input.shape
    a = tiny_fp8._quant_act(input.reshape(-1, shape[-1]), block_size[1])
    w = tiny_fp8.reference_weight(weight, weight_scale_inv, block_size)
    out = a.double() @ w.double().t()
    return out.to(output_dtype).view(*shape[:-1], weight.shape[0])


def fp8_checkpoint(tmp: Path, family: str, scale_fmt: str) -> torch.nn.Module:
    """transformers' FP8 model of `family`, saved to tmp/fp8 by its own save_pretrained."""
    _, model, _ = tiny_fp8.fp8_model(family, scale_fmt=scale_fmt)
    model.save_pretrained(tmp / "fp8")
    # tiny_models casts the whole model to bf16, RoPE frequencies included; a checkpoint's
    # load computes them in fp32 from the config, as the engine does.
    fresh = {"glm": tiny_models.glm, "deepseek": tiny_models.deepseek}[family](
        len(model.model.layers), dtype=torch.float32, **tiny_fp8.DIMS
    )
    for name in ("inv_freq", "original_inv_freq"):
        setattr(model.model.rotary_emb, name, getattr(fresh.model.rotary_emb, name).clone())
    return model


def hf_forward(model: torch.nn.Module, ids: torch.Tensor, matmul) -> tuple[dict, torch.Tensor]:
    """Each layer's output (fp32) and the logits of transformers' FP8 path on `matmul`."""
    outs: dict[int, torch.Tensor] = {}
    handles = [
        layer.register_forward_hook(
            lambda m, a, out, i=i: outs.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0].float())
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with tiny_fp8.kernel(matmul), torch.no_grad():
            logits = model(ids).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    return outs, logits


def engine(tmp: Path, path: str) -> dict[str, torch.Tensor]:
    run = subprocess.run(
        [binary("shadowtrace-run"), "--model", tmp / "fp8", tmp / "ids.json", "--path", path,
         "--dump", tmp / f"{path}.safetensors"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return load_file(tmp / f"{path}.safetensors")


def departure(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """Median and 90th percentile of the per-token relative L2 error of got against want."""
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    return float(err.median()), float(err.quantile(0.9))


def within(got: tuple[float, float], control: tuple[float, float]) -> bool:
    return all(g <= ACCUMULATION_FACTOR * c + FLOOR for g, c in zip(got, control, strict=True))


@pytest.mark.parametrize("family", ["glm", "deepseek"])
@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_the_reference_fp8_checkpoint_path_agrees_with_transformers_fp8_within_accumulation_order(
    tmp_path: Path, family: str, scale_fmt: str
) -> None:
    model = fp8_checkpoint(tmp_path, family, scale_fmt)
    ids = tiny_models.prompt(T)
    (tmp_path / "ids.json").write_text(json.dumps(ids[0].tolist()))
    hf, hf_logits = hf_forward(model, ids, tiny_fp8.emu_matmul)
    control, control_logits = hf_forward(model, ids, emu_matmul_fp64)
    rust = engine(tmp_path, "fp8-checkpoint")

    for i, want in hf.items():
        floor = departure(control[i], want)
        got = departure(rust[f"layer_out.{i}"], want)
        assert within(got, floor), (i, "engine", got, "control", floor)
    agree = float((rust["logits"].argmax(-1) == hf_logits.argmax(-1)).float().mean())
    control_agree = float((control_logits.argmax(-1) == hf_logits.argmax(-1)).float().mean())
    assert agree >= control_agree - ARGMAX_SLACK, (agree, control_agree)

    # The first layer sees identical inputs: only accumulation order may differ there.
    first = rust["layer_out.0"]
    assert (first != hf[0]).any(-1).float().mean() <= (control[0] != hf[0]).any(-1).float().mean() + 0.02

    # The power of the check: re-quantizing the stored weights departs by far more.
    requantized = engine(tmp_path, "fp8")
    assert not within(departure(requantized["layer_out.0"], hf[0]), departure(control[0], hf[0]))
