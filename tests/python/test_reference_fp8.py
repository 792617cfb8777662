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

import contextlib
import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import tiny_fp8
import tiny_models
import torch
import trained
from conftest import binary
from safetensors.torch import load_file

sys.path.insert(0, str(trained.MODELS / "train"))
import quantize_fp8

T = 256  # below index_topk: every key selected, the layers' outputs do not hang on top-k ties
# Rust against transformers may be at most this many times the control's departure (median
# and 90th percentile of the per-token relative L2 error, per layer), plus FLOOR where the
# control is exactly 0. Measured at T = 256: Rust 0 to 3e-3 (most rows bit-identical), the
# control 0 to 2.7e-2; the re-quantizing path 3.3e-2 to 8.3e-2 (median).
ACCUMULATION_FACTOR = 2.0
FLOOR = 1e-6
# On the trained checkpoints the control is exactly 0 through layer 1 (fp64 and fp32
# accumulation round to the same bf16 everywhere there), while the engine's own summation
# order (of the experts, in attention) rounds a token differently now and then (trained GLM,
# token 190 of layer 0: 157 of 256 elements one ulp apart after o_proj's FP8 activation
# quantization), which attention and routing carry into later tokens: p90 2.3e-3 at layer 1,
# 1.7e-2 at layer 2, against FP8's own departure from bf16 of 3.4e-2 to 7e-2. There the
# bound is: the median token bit-identical, and the 90th percentile under TRAINED_SHARE of
# what FP8 itself changes (transformers' FP8 model against its bf16 one).
TRAINED_SHARE = 0.5
# Greedy ids from the last logits: the engine's agreement with transformers may fall short of
# the control's by at most this share of tokens.
ARGMAX_SLACK = 0.02


def fp8_checkpoint(tmp: Path, family: str, scale_fmt: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' FP8 model of `family`, saved to tmp/fp8 by its own save_pretrained, and
    the bf16 model it was converted from. `family` "trained-glm" / "trained-deepseek": the
    committed trained checkpoint, converted by its recipe (models/train/quantize_fp8.py) and
    saved with transformers' squeezed expert scales (its down_proj [256, 128] scales are
    written [2], not [2, 1]: the engine reads both)."""
    if family.startswith("trained-"):
        name = trained.NAMES[family.removeprefix("trained-")]
        bf16 = trained.load(family.removeprefix("trained-"), torch.bfloat16)
        model, _ = tiny_fp8.convert(copy.deepcopy(bf16), scale_fmt, quantize_fp8.RECIPES[name][1])
        model.save_pretrained(tmp / "fp8")
        return bf16, model
    bf16, model, _ = tiny_fp8.fp8_model(family, scale_fmt=scale_fmt)
    model.save_pretrained(tmp / "fp8")
    return tiny_fp8.fp32_rope(bf16, family), tiny_fp8.fp32_rope(model, family)


def engine(tmp: Path, path: str) -> dict[str, torch.Tensor]:
    # One thread: libtorch's two on a busy two-core machine rounded the engine's attention and
    # indexer scores otherwise now and then (one of seven runs beside other processes), and the
    # trained GLM carries such a difference to a 90th percentile twice the uncontended one,
    # past TRAINED_SHARE. One thread gives the uncontended result, every time.
    run = subprocess.run(
        [binary("shadowtrace-run"), "--model", tmp / "fp8", tmp / "ids.json", "--path", path,
         "--dump", tmp / f"{path}.safetensors"],
        capture_output=True, text=True, check=False, env={**untraced(), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return load_file(tmp / f"{path}.safetensors")


def first(output: object) -> torch.Tensor:
    """A module's output tensor: the first element of a tuple."""
    return output[0] if isinstance(output, tuple) else output


def untraced() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE")}


def departure(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """Median and 90th percentile of the per-token relative L2 error of got against want."""
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    return float(err.median()), float(err.quantile(0.9))


def within(got: tuple[float, float], control: tuple[float, float]) -> bool:
    return all(g <= ACCUMULATION_FACTOR * c + FLOOR for g, c in zip(got, control, strict=True))


@pytest.mark.parametrize(
    ("family", "scale_fmt"),
    [
        *((f, s) for f in ("glm", "deepseek") for s in ("float", "ue8m0")),
        ("trained-glm", "float"),
        ("trained-deepseek", "ue8m0"),
    ],
)
def test_the_reference_fp8_checkpoint_path_agrees_with_transformers_fp8_within_accumulation_order(
    tmp_path: Path, family: str, scale_fmt: str
) -> None:
    bf16, model = fp8_checkpoint(tmp_path, family, scale_fmt)
    is_trained = family.startswith("trained-")
    ids = trained.prompt(T) if is_trained else tiny_models.prompt(T)
    (tmp_path / "ids.json").write_text(json.dumps(ids[0].tolist()))
    # A ue8m0 checkpoint's activations take DeepSeek's power-of-two scales in both.
    quant = tiny_fp8.QUANT_ACT[scale_fmt]
    hf, hf_logits = tiny_fp8.layer_outputs(model, ids, tiny_fp8.kernel_emulated(scale_fmt))
    control, control_logits = tiny_fp8.layer_outputs(
        model, ids, tiny_fp8.kernel(functools.partial(tiny_fp8.emu_matmul_fp64, quant=quant))
    )
    own = tiny_fp8.layer_outputs(bf16, ids, contextlib.nullcontext())[0] if is_trained else {}
    rust = engine(tmp_path, "fp8-checkpoint")

    for i, want in hf.items():
        floor = departure(control[i], want)
        got = departure(rust[f"layer_out.{i}"], want)
        if is_trained and not within(got, floor):
            fp8_own = departure(own[i], want)
            assert got[0] == 0.0, (i, "engine median", got, "control", floor)
            assert got[1] <= TRAINED_SHARE * fp8_own[1], (i, "engine", got, "fp8 itself", fp8_own)
            continue
        assert within(got, floor), (i, "engine", got, "control", floor)
    agree = float((rust["logits"].argmax(-1) == hf_logits.argmax(-1)).float().mean())
    control_agree = float((control_logits.argmax(-1) == hf_logits.argmax(-1)).float().mean())
    assert agree >= control_agree - ARGMAX_SLACK, (agree, control_agree)

    # The first layer sees identical inputs: only accumulation order may differ there.
    first = rust["layer_out.0"]
    assert (first != hf[0]).any(-1).float().mean() <= (control[0] != hf[0]).any(-1).float().mean() + 0.02

    requantized = engine(tmp_path, "fp8")
    if scale_fmt == "float":
        # The power of the check: re-quantizing the stored weights departs by far more.
        assert not within(departure(requantized["layer_out.0"], hf[0]), departure(control[0], hf[0]))
        return
    # ue8m0: the stored codes times power-of-two block scales re-quantize to themselves, and
    # the activations take the same power-of-two rule, so the engines' re-quantizing path is
    # the checkpoint's, bit for bit. The power of the check: transformers' own kernel, whose
    # activation scales stay fp32 (amax / 448), departs from the engine by far more.
    assert torch.equal(requantized["layer_out.0"], first)
    fp32_scales, _ = tiny_fp8.layer_outputs(model, ids, tiny_fp8.kernel_emulated("float"))
    assert not within(departure(first, fp32_scales[0]), departure(control[0], hf[0]))


def test_a_traced_fp8_checkpoint_records_transformers_fp8_against_its_dequantized_fp32(
    tmp_path: Path,
) -> None:
    """`shadowtrace run --prod fp8-checkpoint`: production is transformers' FP8 path, the
    local shadow its dequantized fp32 recompute. The first layer's recorded errors are those
    the test computes from transformers alone: its FP8 model's outputs against the test's own
    dequantized fp32 model (tiny_fp8.dequantized_fp32) on the same input."""
    bf16, model = fp8_checkpoint(tmp_path, "glm", "float")
    ids = tiny_models.prompt(T)
    (tmp_path / "ids.json").write_text(json.dumps(ids[0].tolist()))
    ref = tiny_fp8.fp32_rope(tiny_fp8.dequantized_fp32(bf16, model), "glm")
    prod, want = {}, {}
    for out, m in ((prod, model), (want, ref)):
        layer = m.model.layers[0]
        handles = [
            block.register_forward_hook(
                lambda mod, a, o, site=site, out=out: out.__setitem__(site, first(o)[0].float())
            )
            for site, block in (("attn_out", layer.self_attn), ("mlp_out", layer.mlp))
        ]
        with tiny_fp8.kernel_emulated(), torch.no_grad():
            m(ids)
        for h in handles:
            h.remove()
    run = subprocess.run(
        [binary("shadowtrace-run"), "--model", tmp_path / "fp8", tmp_path / "ids.json",
         "--out", tmp_path / "runs", "--prod", "fp8-checkpoint", "--fp8-indexer", "none"],
        capture_output=True, text=True, check=False, env={**untraced(), "SHADOWTRACE_MODE": "local"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    (run_dir,) = (p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["settings"]["prod_linears"].startswith("as the FP8 checkpoint stores them")
    counters = manifest["counters"]
    assert counters["fp8_linears_emulated"] >= 3 * 10  # 10 FP8 linears a layer at least
    assert not {"fp8_scaled_mm_fallbacks", "fp8_quantize_fallbacks", "fp8_indexer_fallbacks"} & set(counters)
    rows = pq.read_table(run_dir / "hidden").to_pylist()
    for site in ("attn_out", "mlp_out"):
        p, s = prod[site], want[site]
        expected = ((p - s).norm(dim=-1) / s.norm(dim=-1)).tolist()
        got = sorted((r for r in rows if (r["layer"], r["site"], r["shadow_mode"]) == (0, site, "local")),
                     key=lambda r: r["token"])  # fmt: skip
        assert [r["token"] for r in got] == list(range(T)), site
        for t, r in enumerate(got):
            # fp32 shadows with other reduction orders (1e-7 of the vector) under an error ~0.05
            assert r["rel_l2_err"] == pytest.approx(expected[t], rel=1e-4), (
                site,
                t,
                r["rel_l2_err"],
                expected[t],
            )


def test_production_as_an_fp8_checkpoint_is_refused_on_a_checkpoint_without_fp8_weights(
    tmp_path: Path,
) -> None:
    tiny_models.glm(layers=1).save_pretrained(tmp_path / "bf16")
    (tmp_path / "ids.json").write_text(json.dumps(tiny_models.prompt(16)[0].tolist()))
    run = subprocess.run(
        [binary("shadowtrace-run"), "--model", tmp_path / "bf16", tmp_path / "ids.json",
         "--out", tmp_path / "runs", "--prod", "fp8-checkpoint"],
        capture_output=True, text=True, check=False, env=untraced(),
    )  # fmt: skip
    assert run.returncode == 2
    assert "no FP8 weight (no *_scale_inv tensor)" in run.stderr, run.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
