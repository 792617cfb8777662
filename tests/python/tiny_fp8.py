"""Tiny FP8 GLM-5 models built by transformers' own fine-grained FP8 code, and the FP8
kernel emulated on the CPU from its definition (issue 26).

The model: `tiny_models.glm`'s bf16 model converted by `FineGrainedFP8HfQuantizer`'s own
pre-load step (its `modules_to_not_convert` defaults and `replace_with_fp8_linear`), its bf16
weights quantized by transformers' own `Fp8Quantize`, then the quantizer's post-load step
(ue8m0 scales cast to float8_e8m0fnu). `from_pretrained` cannot serve here: without a GPU the
quantizer loads an FP8 checkpoint dequantized (bf16), with no FP8 left to trace.

The kernel: `kernels-community/finegrained-fp8` is fetched from a hub at run time, which no
test reaches, so its three entry points are replaced by an emulation written from the
kernel's definition: activations quantized per token in 1x128 groups to e4m3 with an fp32
scale amax/448, weights times their block scales, products summed in fp32. It is installed
through the module global `load_finegrained_fp8_kernel` returns once set.

`reference_weight` is the test's own dequantization (codes times scales, edge blocks
cropped), written here and never taken from the hooks.
"""

import contextlib
import copy
import functools
from collections.abc import Iterator

import tiny_models
import torch
import transformers.integrations.finegrained_fp8 as ff
from transformers import FineGrainedFP8Config
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

E4M3 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(E4M3).max  # 448
# kv_lora_rank 64 makes kv_b_proj's K a partial 128-block, as GLM-5's 576-row kv_a_proj is.
DIMS = dict(moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=64)


def reference_weight(codes: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """[N, K] e4m3 codes times their scales in fp32: one scale per tensor (block None or
    one value), or one per block of the cdiv grid, edge blocks cropped."""
    w32, s32 = codes.to(torch.float32), scale.to(torch.float32)  # e8m0 -> fp32 is exact
    if block is None or s32.numel() == 1:
        return w32 * s32.reshape(())
    bn, bk = block
    n, k = w32.shape
    return w32 * s32.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def _quant_act(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per token and `group` columns: e4m3 codes with an fp32 scale amax/448, dequantized
    again (the values whose products the kernel sums)."""
    m, k = x.shape
    xp = torch.nn.functional.pad(x.to(torch.float32), (0, (-k) % group)).view(m, -1, group)
    scale = (xp.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (xp / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return (q.to(torch.float32) * scale).view(m, -1)[:, :k]


def _quant_act_ue8m0(x: torch.Tensor, group: int) -> torch.Tensor:
    """DeepSeek-V3.2-Exp `inference/kernel.py` `act_quant` as its `linear()` calls it for a
    checkpoint whose `scale_fmt` is ue8m0 (`round_scale`): per token and `group` columns,
    amax clamped at 1e-4, the scale `fast_pow2(fast_log2_ceil(amax * (1 / 448)))` taken
    from the fp32 bits (exponent - 127, plus one where the mantissa is not zero), codes
    clamp(x / scale) in e4m3, dequantized again."""
    m, k = x.shape
    xp = torch.nn.functional.pad(x.to(torch.float32), (0, (-k) % group)).view(m, -1, group)
    amax = xp.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    bits = (amax * torch.tensor(1 / FP8_MAX, dtype=torch.float32)).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    scale = ((exponent + 127) << 23).view(torch.float32)
    q = (xp / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return (q.to(torch.float32) * scale).view(m, -1)[:, :k]


# Activation quantization by the checkpoint's scale_fmt: transformers' kernel for "float",
# DeepSeek's reference for "ue8m0" (the engines' definition the reference engine follows).
QUANT_ACT = {"float": _quant_act, "ue8m0": _quant_act_ue8m0}


def emu_matmul(
    input, weight, weight_scale_inv, block_size, output_dtype, activation_scale=None, quant=_quant_act
):
    """matmul_2d(input [..., K], weight [N, K] e4m3, scales, block_size, output_dtype,
    activation_scale) -> [..., N] in output_dtype."""
    shape = input.shape
    x = input.reshape(-1, shape[-1])
    if activation_scale is not None:  # static: one fp32 scale per tensor
        a = (x.float() / activation_scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3).float() * activation_scale
    else:
        a = quant(x, block_size[1] if block_size is not None else shape[-1])
    out = a @ reference_weight(weight, weight_scale_inv, block_size).t()
    return out.to(output_dtype).view(*shape[:-1], weight.shape[0])


def emu_matmul_fp64(
    input, weight, weight_scale_inv, block_size, output_dtype, activation_scale=None, quant=_quant_act
):
    """`emu_matmul` with the products summed in fp64: the same FP8 path in another
    accumulation order (the control of the reference engine's FP8 agreement)."""
    shape = input.shape
    a = quant(input.reshape(-1, shape[-1]), block_size[1])
    out = a.double() @ reference_weight(weight, weight_scale_inv, block_size).double().t()
    return out.to(output_dtype).view(*shape[:-1], weight.shape[0])


def per_expert(matmul):
    """The kernel's batched and grouped entry points over a 2-D `matmul` (`emu_matmul`'s
    signature), one expert at a time: matmul_batched(x [S, K], w [E, N, K], s [E, ...],
    expert_ids [S]) and matmul_grouped(x [S, K] sorted by expert, w, s, offsets: cumsum),
    both -> [S, N]."""

    def batched(x, w, s, block_size=None, expert_ids=None):
        out = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
        for e in expert_ids.unique().tolist():
            if e < w.shape[0]:  # expert parallelism's sentinels: the caller masks them
                rows = expert_ids == e
                out[rows] = matmul(x[rows], w[e], s[e], block_size, x.dtype)
        return out

    def grouped(x, w, s, offsets=None, tokens_per_expert=None, block_size=None):
        out = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, end in enumerate(offsets.tolist()):
            if end > start:
                out[start:end] = matmul(x[start:end], w[e], s[e], block_size, x.dtype)
            start = end
        return out

    return batched, grouped


@contextlib.contextmanager
def kernel(matmul, batched=None, grouped=None) -> Iterator[None]:
    """transformers' FP8 kernel entry points are `matmul` (and, unless given, `per_expert`
    of it) within the block, through the module global `load_finegrained_fp8_kernel`
    returns once set."""
    saved = ff._FINEGRAINED_FP8
    loops = per_expert(matmul)
    batched, grouped = batched or loops[0], grouped or loops[1]
    ff._FINEGRAINED_FP8 = ff.FineGrainedFP8(matmul=matmul, batched_matmul=batched, grouped_matmul=grouped)
    try:
        yield
    finally:
        ff._FINEGRAINED_FP8 = saved


def kernel_emulated(scale_fmt: str = "float"):
    """transformers' FP8 kernel entry points are the emulation within the block, its
    activations quantized as `scale_fmt` checkpoints define (QUANT_ACT)."""
    if scale_fmt == "float":
        return kernel(emu_matmul)
    return kernel(functools.partial(emu_matmul, quant=QUANT_ACT[scale_fmt]))


def _quantize_padded(qop, key: str, value: torch.Tensor, block: int = 128) -> dict:
    """Fp8Quantize passes shapes that do not tile by the block through unquantized
    (finegrained_fp8.py, _quantize_one): pad to whole blocks, quantize with transformers'
    op, crop the codes (the scale grid is the cdiv grid real checkpoints have)."""
    rows, cols = value.shape[-2:]
    padded = torch.nn.functional.pad(value.float(), (0, (-cols) % block, 0, (-rows) % block)).to(value.dtype)
    out = qop.convert({key: padded})
    return {k: (v[..., :rows, :cols].contiguous() if v.dtype == E4M3 else v) for k, v in out.items()}


EXPERTS_AT_ONCE = 8


def _quantized(qop, key: str, value: torch.Tensor) -> dict:
    """`key`'s codes and scales by transformers' Fp8Quantize, shapes that do not tile by
    the block padded first (`_quantize_padded`)."""
    out = qop.convert({key: value})
    for k in [k for k in out if k.endswith(("weight", "_proj")) and out[k].dtype != E4M3]:
        out.update(_quantize_padded(qop, k, out[k]))
    return out


def convert(model: torch.nn.Module, scale_fmt: str = "float", skip: list[str] | None = None):
    """Converts a bf16 GLM-5 `model` to transformers' fine-grained FP8 in place, by
    transformers' code (the quantizer's pre-load step, `Fp8Quantize`, the post-load step), a
    module at a time so that its bf16 weight is freed as its FP8 one arrives: a model at
    GLM-5's widths converts on one GPU. Returns (model, quantizer). `skip`: the checkpoint's
    own modules_to_not_convert, which replaces transformers' defaults (lm_head among them)."""
    cfg = FineGrainedFP8Config(
        weight_block_size=[128, 128],
        activation_scheme="dynamic",
        scale_fmt=scale_fmt,
        modules_to_not_convert=skip,
    )
    quantizer = FineGrainedFP8HfQuantizer(cfg, pre_quantized=True)
    src = dict(model.state_dict())  # the bf16 tensors, held until each is quantized
    quantizer._process_model_before_weight_loading(model)
    qop = ff.Fp8Quantize(quantizer)
    for name, mod in list(model.named_modules()):
        if isinstance(mod, ff.FP8Linear):
            keys = [f"{name}.weight"]
        elif isinstance(mod, ff.FP8Experts):
            keys = [f"{name}.gate_up_proj", f"{name}.down_proj"]
        else:
            continue
        new = {}
        for key in keys:
            value = src.pop(key)
            # An expert bank a few experts at a time: Fp8Quantize's fp32 temporaries of a
            # whole GLM-5 bank (256 x 4096 x 6144) would not fit beside the model.
            pieces = value.split(EXPERTS_AT_ONCE) if isinstance(mod, ff.FP8Experts) else (value,)
            outs = [_quantized(qop, key, piece) for piece in pieces]
            new.update({k: torch.cat([o[k] for o in outs]) if len(outs) > 1 else outs[0][k] for k in outs[0]})
        if isinstance(mod, ff.FP8Linear) and mod.bias is not None:  # kept as it was (a vision tower's)
            new[f"{name}.bias"] = src.pop(f"{name}.bias")
        model.load_state_dict(new, strict=False, assign=True)
    del src
    missing = [k for k, v in model.state_dict().items() if v.is_meta]
    assert not missing, missing
    quantizer._process_model_after_weight_loading(model)
    model.config.quantization_config = cfg
    return model, quantizer


def fp8_model(
    family: str = "glm", layers: int = 3, scale_fmt: str = "float", skip: list[str] | None = None, **overrides
):
    """(bf16 model, its FP8 conversion, the quantizer) of `family` (`glm`: glm_moe_dsa,
    `deepseek`: deepseek_v32), the FP8 one by transformers' code (`convert`). `skip`: the
    checkpoint's own modules_to_not_convert: an FP8 lm_head, as some checkpoints have."""
    build = {"glm": tiny_models.glm, "deepseek": tiny_models.deepseek}[family]
    bf16 = build(layers, **{**DIMS, **overrides})
    model, quantizer = convert(copy.deepcopy(bf16), scale_fmt, skip)
    return bf16, model, quantizer


def fp32_rope(model: torch.nn.Module, family: str) -> torch.nn.Module:
    """tiny_models casts the whole model to bf16, RoPE frequencies included; a checkpoint's
    load computes them in fp32 from the config, as the reference engine does: put those back
    (a `family` model of DIMS's widths)."""
    build = {"glm": tiny_models.glm, "deepseek": tiny_models.deepseek}[family]
    fresh = build(len(model.model.layers), dtype=torch.float32, **DIMS)
    for name in ("inv_freq", "original_inv_freq"):
        setattr(model.model.rotary_emb, name, getattr(fresh.model.rotary_emb, name).clone())
    return model


def layer_outputs(model: torch.nn.Module, ids: torch.Tensor, kernel) -> tuple[dict, torch.Tensor]:
    """Each decoder layer's output and the logits of one forward (fp32, on the host), its
    FP8 modules on the entry points `kernel` (a context, as `kernel(...)` makes) installs."""
    outs: dict[int, torch.Tensor] = {}

    def keep(i: int):
        return lambda m, a, out: outs.__setitem__(
            i, (out[0] if isinstance(out, tuple) else out)[0].float().cpu()
        )

    handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    try:
        with kernel, torch.no_grad():
            logits = model(ids).logits[0].float().cpu()
    finally:
        for h in handles:
            h.remove()
    return outs, logits


def fp8_glm(layers: int = 3, scale_fmt: str = "float", skip: list[str] | None = None, **overrides):
    """`fp8_model` of a tiny GLM-5."""
    return fp8_model("glm", layers, scale_fmt, skip, **overrides)


def per_tensor(bf16: torch.nn.Module, fp8: torch.nn.Module, path: str) -> None:
    """Replaces the FP8Linear at `path` by transformers' per-tensor FP8Linear (block_size
    None: one fp32 scale), its bf16 weight quantized by transformers' Fp8Quantize."""
    old = fp8.get_submodule(path)
    cfg = FineGrainedFP8Config(weight_block_size=None, activation_scheme="dynamic")
    qop = ff.Fp8Quantize(FineGrainedFP8HfQuantizer(cfg, pre_quantized=True))
    out = qop.convert({"w.weight": bf16.get_submodule(path).weight.detach()})
    new = ff.FP8Linear(old.in_features, old.out_features, block_size=None)
    with torch.no_grad():
        new.weight = torch.nn.Parameter(out["w.weight"], requires_grad=False)
        new.weight_scale_inv = torch.nn.Parameter(out["w.weight_scale_inv"].reshape(()), requires_grad=False)
    parent, name = path.rsplit(".", 1)
    setattr(fp8.get_submodule(parent), name, new)


def dequantized_fp32(bf16: torch.nn.Module, fp8: torch.nn.Module) -> torch.nn.Module:
    """The test's own reference: the bf16 model's structure in fp32 with eager experts,
    every FP8 weight replaced by `reference_weight` of its codes and scales."""
    ref = copy.deepcopy(bf16).float()
    ref.set_experts_implementation("eager")
    fp8_modules = dict(fp8.named_modules())
    with torch.no_grad():
        for name, mod in ref.named_modules():
            src = fp8_modules.get(name)
            if isinstance(src, ff.FP8Linear):
                mod.weight.copy_(reference_weight(src.weight, src.weight_scale_inv, src.block_size))
            elif isinstance(src, ff.FP8Experts):
                for p in ("gate_up_proj", "down_proj"):
                    w, s = getattr(src, p), getattr(src, f"{p}_scale_inv")
                    experts = [reference_weight(w[e], s[e], src.block_size) for e in range(w.shape[0])]
                    getattr(mod, p).copy_(torch.stack(experts))
    return ref
