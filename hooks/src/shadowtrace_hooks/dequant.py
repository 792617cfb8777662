"""Production's quantized weights, dequantized for the shadow, and what production runs.

transformers' fine-grained FP8 (`quant_method` "fp8": `FP8Linear`, `FP8Experts`) keeps e4m3
codes with fp32 or ue8m0 (`float8_e8m0fnu`) scales, one per block of the weight (128x128 in
GLM-5 and DeepSeek-V3.2; edge blocks may be partial, as GLM-5's 576-row kv_a_proj) or one per
tensor. The shadow multiplies the codes by their scales in fp32 and computes in its own
precision: it never calls an FP8 kernel, and it never quantizes activations.

A format this module does not know (another quantization method, FP4 or integer codes, a
scale grid that does not tile its weight, a grouped FP8 linear) is `Unsupported`: the
adapter refuses the shadow, visibly, rather than run one lower than its label.

transformers is imported inside the functions: the hooks import without it.
"""

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

E4M3 = torch.float8_e4m3fn
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
SCALE_DTYPES = tuple(d for d in (torch.float32, _E8M0) if d is not None)
PLAIN = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# What the shadow does with a quantized weight (settings.shadow_dequant).
HOW = (
    "fp32 = e4m3 codes x their block or tensor scales (fp32 or ue8m0); "
    "no FP8 kernel, no activation quantization"
)


class Unsupported(Exception):
    """A weight format the shadow cannot dequantize; str() is the one-line reason, `param`
    the parameter it is about when it is one parameter of the module."""

    def __init__(self, reason: str, param: str | None = None) -> None:
        super().__init__(reason)
        self.param = param


def _ff() -> Any:
    """transformers' fine-grained FP8 module, or None (no transformers, or a release without it)."""
    try:
        from transformers.integrations import finegrained_fp8
    except Exception:
        return None
    return finegrained_fp8


def _name(dtype: torch.dtype) -> str:
    from shadowtrace_hooks.shadow import dtype_name

    return dtype_name(dtype)


def _grid(codes: torch.Tensor, scale: torch.Tensor, block: Any) -> None:
    """Raises Unsupported unless `scale` is one per tensor or the cdiv grid of `block`."""
    if codes.dtype != E4M3:
        raise Unsupported(f"codes are {_name(codes.dtype)}, not fp8_e4m3")
    if scale.dtype not in SCALE_DTYPES:
        raise Unsupported(f"scales are {_name(scale.dtype)}, neither fp32 nor ue8m0")
    if codes.dim() != 2:
        raise Unsupported(f"codes of shape {tuple(codes.shape)} are not a matrix")
    if scale.numel() == 1 and (block is None or scale.dim() == 0):
        return  # one scale per tensor
    if block is None:
        raise Unsupported(f"scale grid {tuple(scale.shape)} without a block size")
    bn, bk = block
    n, k = codes.shape
    if tuple(scale.shape) != (-(-n // bn), -(-k // bk)):
        raise Unsupported(f"scale grid {tuple(scale.shape)} does not tile weight {n}x{k} by {bn}x{bk} blocks")


def blocks(codes: torch.Tensor, scale: torch.Tensor, block: Any) -> torch.Tensor:
    """[N, K] e4m3 codes times their scales, in fp32. `scale`: one value (per tensor), or
    the cdiv(N, bn) x cdiv(K, bk) grid of `block` = (bn, bk), fp32 or ue8m0 (whose fp32
    value is exact: a power of two). Raises Unsupported for anything else."""
    _grid(codes, scale, block)
    w = codes.to(torch.float32)
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return w * s.reshape(())
    bn, bk = block
    n, k = w.shape
    if n % bn == 0 and k % bk == 0:  # no full-size scale temporary
        return (w.view(n // bn, bn, k // bk, bk) * s[:, None, :, None]).view(n, k)
    return w * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def _scales(scale: torch.Tensor, block: Any) -> str:
    kind = "ue8m0" if scale.dtype == _E8M0 else _name(scale.dtype)
    if block is None or (scale.numel() == 1 and scale.dim() == 0):
        return f"per tensor, {kind} scale"
    return f"block {block[0]}x{block[1]}, {kind} scales"


@dataclass(frozen=True)
class Format:
    """A quantized module the shadow dequantizes: its kind and production's precision."""

    kind: str  # "fp8_linear" | "fp8_experts" | "fp8_embedding"
    prod: str  # e.g. "fp8_e4m3 block 128x128, fp32 scales, dynamic activations (per token, 1x128)"


def _activations(module: Any) -> str:
    if getattr(module, "activation_scheme", "dynamic") == "static":
        return "static activation scale (e4m3)"
    block = getattr(module, "block_size", None)
    group = f"1x{block[1]}" if block is not None else "per token"
    return f"dynamic e4m3 activations ({group} groups)"


def _sharded(module: torch.nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(t, DTensor) for t in module._parameters.values())


def classify(module: torch.nn.Module) -> Format | None:
    """The quantized format of `module` itself (not its submodules): a Format, None for a
    module with plain floating-point parameters only, or Unsupported with the reason."""
    ff = _ff()
    if ff is not None:
        grouped = getattr(ff, "FP8GroupedLinear", None)
        if grouped is not None and isinstance(module, grouped):
            raise Unsupported("FP8GroupedLinear (grouped block-scaled linear): no grouped dequantization yet")
        if isinstance(module, ff.FP8Linear):
            w = module.weight
            if w.dtype in PLAIN:  # loaded with dequantize=True: a plain linear
                return None
            try:
                _grid(w, module.weight_scale_inv, module.block_size)
            except Unsupported as e:
                raise Unsupported(f"FP8Linear: {e}") from None
            scales = _scales(module.weight_scale_inv, module.block_size)
            return Format("fp8_linear", f"fp8_e4m3 {scales}, {_activations(module)}")
        if isinstance(module, ff.FP8Experts):
            return _experts(module)
        embedding = getattr(ff, "FP8Embedding", None)
        if embedding is not None and isinstance(module, embedding):
            # Its forward already returns rows.float() * scale: nothing for the shadow to do.
            return Format("fp8_embedding", f"{_name(module.weight.dtype)} per tensor, fp32 scale")
    for name, p in module._parameters.items():
        if p is not None and p.dtype not in PLAIN:
            raise Unsupported(
                f"{_name(p.dtype)} in a {type(module).__name__}: the shadow cannot upcast quantized "
                "codes without their scales (no dequantization known for this module)",
                param=name,
            )
    return None


def _experts(bank: torch.nn.Module) -> Format:
    if not getattr(bank, "has_gate", True):
        raise Unsupported("FP8Experts without a gate (up_proj): not dequantized yet")
    if _sharded(bank):
        raise Unsupported("FP8Experts sharded (DTensor): its shards' scales are not dequantized")
    described = set()
    for name in ("gate_up_proj", "down_proj"):
        w, s = getattr(bank, name), getattr(bank, f"{name}_scale_inv", None)
        if w.dtype == torch.int8:
            raise Unsupported(f"FP8Experts {name} is int8 (FP4 e2m1 packed): not dequantized yet")
        if s is None or w.dim() != 3 or s.shape[0] != w.shape[0]:
            raise Unsupported(f"FP8Experts {name}: no per-expert scales")
        try:
            _grid(w[0], s[0], bank.block_size)
        except Unsupported as e:
            raise Unsupported(f"FP8Experts {name}: {e}") from None
        described.add(_scales(s[0], bank.block_size))
    return Format("fp8_experts", f"fp8_e4m3 {', '.join(sorted(described))}, {_activations(bank)}")


def quantized(module: Any) -> bool:
    """Whether `module` is an FP8Linear holding e4m3 codes (which `weight` dequantizes)."""
    ff = _ff()
    return ff is not None and isinstance(module, ff.FP8Linear) and module.weight.dtype == E4M3


def weight(module: Any) -> torch.Tensor:
    """A linear's weight: fp32 codes times scales for an FP8Linear, else the weight as it is."""
    if quantized(module):
        return blocks(module.weight, module.weight_scale_inv, module.block_size)
    return module.weight


def expert(bank: torch.nn.Module, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert `e`'s weight `name` ([out, in]) of a bank in `dtype`, dequantized when FP8."""
    w = getattr(bank, name)[e]
    if w.dtype == E4M3:
        return blocks(w, getattr(bank, f"{name}_scale_inv")[e], bank.block_size).to(dtype)
    if w.dtype not in PLAIN:
        raise Unsupported(f"{type(bank).__name__} {name} is {_name(w.dtype)}")
    return w.to(dtype)


class _Linear:
    """An FP8Linear's forward for the shadow: F.linear in `dtype` on its dequantized weight,
    computed at the first call and kept for the block (one layer's copy at a time)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        self.module, self.dtype = module, dtype
        self.weight: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            self.weight = weight(self.module).to(self.dtype)
        bias = self.module.bias
        bias = None if bias is None else bias.to(self.dtype)
        return torch.nn.functional.linear(x.to(self.dtype), self.weight, bias)


@contextlib.contextmanager
def linears(module: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Within the block, every FP8Linear under `module` (itself included) computes in
    `dtype` from its dequantized weight. Parameters are not touched; an instance-level
    forward that was there (accelerate's hooks) is put back after, else none is left."""
    saved: list[tuple[torch.nn.Module, Any]] = []
    try:
        for sub in module.modules():
            if quantized(sub):
                saved.append((sub, sub.__dict__.get("forward")))
                sub.forward = _Linear(sub, dtype)  # type: ignore[method-assign]
        yield
    finally:
        for sub, old in reversed(saved):
            if old is None:
                sub.__dict__.pop("forward", None)
            else:
                sub.forward = old  # type: ignore[method-assign]


@dataclass
class Plan:
    """A model's quantized modules (path -> Format) and the first one the shadow cannot
    dequantize (`refused`: "<path>: <reason>"), read once when the tracer attaches."""

    formats: dict[str, Format] = field(default_factory=dict)
    refused: str | None = None
    method: str | None = None  # the config's quant_method
    codes: set[str] = field(default_factory=set)  # dtypes of quantized codes, whoever holds them

    @property
    def fp8(self) -> bool:
        return any(f.kind in ("fp8_linear", "fp8_experts") for f in self.formats.values())

    def prod(self, first: torch.dtype) -> str:
        """`dtypes.prod`: fp8_e4m3 for an FP8 model (its first parameter, the embedding, is
        bf16), else the codes' dtypes or the quantization method, else `first`'s dtype."""
        if self.fp8:
            return "fp8_e4m3"
        if self.codes:
            return "+".join(sorted(self.codes))
        if self.method not in (None, "fp8"):
            return f"quantized ({self.method})"
        return _name(first)


def plan(model: torch.nn.Module) -> Plan:
    """Walks the model once, every module (the first refusal kept, the formats all read).
    Never raises: a failure to read a module refuses the shadow."""
    out = Plan()
    out.method = method = quant_method(getattr(model, "config", None))
    if method not in (None, "fp8"):
        out.refused = (
            f"quantization method {method!r}: the shadow dequantizes only transformers' fine-grained fp8"
        )
    for path, module in model.named_modules():
        refused = None
        try:
            out.codes.update(
                _name(p.dtype)
                for p in module._parameters.values()
                if p is not None and p.dtype not in PLAIN and p.dtype not in SCALE_DTYPES
            )
            found = classify(module)
        except Unsupported as e:
            found, refused = None, f"{path}.{e.param}: {e}" if e.param else f"{path}: {e}"
        except Exception as e:  # a module this code misreads: no shadow rather than a wrong one
            found, refused = None, f"{path}: its format could not be read ({type(e).__name__}: {e})"
        if found is not None:
            out.formats[path] = found
        if out.refused is None:
            out.refused = refused
    return out


def quant_method(config: Any) -> str | None:
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return None if method is None else str(getattr(method, "value", method))


def quantization(model: torch.nn.Module) -> dict | None:
    """The model's quantization config as a JSON dict, with the modules left unconverted as
    its quantizer resolved them; None for a model without one."""
    qc = getattr(model.config, "quantization_config", None)
    if qc is None:
        return None
    data = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)
    resolved = getattr(getattr(model, "hf_quantizer", None), "modules_to_not_convert", None)
    if resolved is not None:
        data["modules_to_not_convert_resolved"] = sorted(str(m) for m in resolved)
    return json.loads(json.dumps(data, default=str))


def _label(path: str, module: torch.nn.Module, output: Any) -> str | None:
    """The module kind a path belongs to in settings.prod_precision."""
    leaf = path.rsplit(".", 1)[-1]
    if module is output:
        return "lm_head"
    if ".indexer." in f".{path}":
        return f"indexer.{leaf}"
    if isinstance(module, torch.nn.Embedding):
        return "embed"
    if leaf == "gate" and ".mlp" in f".{path}" and not isinstance(module, torch.nn.Linear):
        return "router"
    down = module._parameters.get("down_proj")
    if leaf == "experts" or (down is not None and down.dim() == 3):
        return "experts"
    if isinstance(module, torch.nn.Linear):
        return "linear"
    return None


def precision(model: torch.nn.Module, found: Plan) -> dict[str, str]:
    """Production's precision per module kind, read off the model's modules (FP8 formats
    from the plan, else the parameters' dtypes): {"linear": ..., "experts": ..., ...}."""
    try:
        output = model.get_output_embeddings()
    except Exception:
        output = None
    kinds: dict[str, set[str]] = {}
    for path, module in model.named_modules():
        label = _label(path, module, output)
        if label is None:
            continue
        fmt = found.formats.get(path)
        if fmt is not None:
            text = fmt.prod
        else:
            params = {n: p for n, p in module._parameters.items() if p is not None}
            if not params:
                continue
            text = ", ".join(sorted({f"{_name(p.dtype)}" for p in params.values()}))
            if label == "router":  # its weight, and its routing bias (a buffer in GLM-5)
                params.update({n: b for n, b in module._buffers.items() if b is not None})
                text = ", ".join(f"{n} {_name(p.dtype)}" for n, p in sorted(params.items()))
        kinds.setdefault(label, set()).add(text)
    return {k: " | ".join(sorted(v)) for k, v in sorted(kinds.items())}


def _deepgemm(ff: Any) -> tuple[bool, str]:
    try:
        return bool(ff.is_deepgemm_loadable(raise_error=True)), ""
    except Exception as e:  # ImportError with what is missing
        return False, " ".join(str(e).split())[:160]


def kernel(model: torch.nn.Module, found: Plan) -> str | None:
    """Which FP8 kernels production calls and why, from fp8_linear's dispatch rule evaluated
    on the live modules and environment (no kernel is called) and the experts'
    implementation; None without FP8 modules. What was loaded is `loaded`'s."""
    ff = _ff()
    if ff is None or not found.fp8:
        return None
    modules = dict(model.named_modules())
    parts = []
    loadable, why_not = _deepgemm(ff)
    linear_paths: dict[str, int] = {}
    for path, fmt in found.formats.items():
        if fmt.kind != "fp8_linear":
            continue
        m = modules[path]
        why = []
        if getattr(m, "_deepgemm_disabled", False):
            why.append("deepgemm disabled on this module (model on several devices)")
        if not loadable:
            why.append(f"deepgemm not loadable: {why_not}")
        if getattr(m, "activation_scale", None) is not None:
            why.append("static activation scale")
        if loadable and m.weight_scale_inv.dtype == torch.float32:
            with contextlib.suppress(Exception):
                if ff.is_sm100():
                    why.append("SM100 with fp32 scales")
        block = m.block_size
        if block is None or list(block) != [128, 128]:
            why.append(f"block {block} is not 128x128")
        if os.environ.get("TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR", "0") == "1":
            why.append("TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR=1")
        text = "deepgemm" if not why else f"triton {_hub_kernel()} ({'; '.join(why)})"
        linear_paths[text] = linear_paths.get(text, 0) + 1
    if linear_paths:
        parts.append("linear: " + " | ".join(f"{t} x{n}" for t, n in sorted(linear_paths.items())))
    if any(f.kind == "fp8_experts" for f in found.formats.values()):
        impl = getattr(model.config, "_experts_implementation", None) or "eager"
        how = {
            "grouped_mm": f"triton {_hub_kernel()} grouped_matmul",
            "batched_mm": f"triton {_hub_kernel()} batched_matmul",
            "eager": "fp8_linear per expert (as the linears)",
        }.get(impl, "deepgemm experts" if str(impl).startswith("deepgemm") else "unknown")
        parts.append(f"experts: {impl} -> {how}")
    return "; ".join(parts)


def _hub_kernel() -> str:
    try:
        from transformers.integrations import hub_kernels

        return hub_kernels._HUB_KERNEL_MAPPING["finegrained-fp8"]["repo_id"]
    except Exception:
        return "finegrained-fp8"


def loaded() -> str:
    """The FP8 kernels transformers has loaded in this process (its module globals): a
    DeepGEMM fallback or a kernel put in place by hand shows here, not in the rule."""
    ff = _ff()
    if ff is None:
        return "none"
    out = []
    triton = getattr(ff, "_FINEGRAINED_FP8", None)
    if triton is not None:

        def name(fn: object) -> str:
            return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"

        # The expert banks' entry points may be another kernel's than the linears'.
        experts = f"grouped {name(triton.grouped_matmul)}, batched {name(triton.batched_matmul)}"
        out.append(f"{name(triton.matmul)} ({experts})")
    with contextlib.suppress(Exception):
        from transformers.integrations import deepgemm

        if getattr(deepgemm, "_DEEPGEMM", None) is not None:
            out.append("deepgemm")
    return ", ".join(out) or "none yet"
