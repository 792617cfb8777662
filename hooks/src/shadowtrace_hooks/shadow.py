"""Running engine modules in the shadow precision, and the indexer's shadow recompute.

`in_precision` runs a module with its floating-point parameters upcast for the duration of
one call. The production tensors are never touched, not even their dtype: the module's
parameter and buffer entries point at upcast copies for the call and at the very same
production tensors afterwards, also when the upcast fails half way (an out-of-memory
error). At most one layer's upcast copy exists at a time.

A mixture-of-experts layer's expert bank is not upcast: `routed_experts` runs only the
experts its tokens are routed to, one expert's weights upcast at a time, with the model's
own router and dispatch (the layer's code runs; only the experts' matmuls are swapped for
shadow-precision ones that follow the experts module's eager definition). Upcasting the
bank would need the whole bank again in fp32 (38 GB per layer at GLM-5's widths).

Quantized weights (transformers' fine-grained FP8) are dequantized, never run on production's
FP8 kernel: `in_precision` swaps each FP8 linear's forward for an F.linear on its codes times
its scales, and `routed_forward` dequantizes each routed expert (shadowtrace_hooks.dequant).

`indexer_scores` scores the indexer's shadow: Triton's kernel on CUDA (shadowtrace_hooks.kernels),
torch's product elsewhere, recording in the run's settings which one ran and why.

`hooks_suspended` keeps every forward hook of a module tree (the user's, transformers'
output recorders, ours) from firing during the shadow re-run, which must be invisible to
everything but the tracer. `full_fp32` keeps TF32 out of fp32 shadow matmuls whatever the
engine set.
"""

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shadowtrace_hooks import dequant, kernels, numerics

_UPCASTABLE = (torch.bfloat16, torch.float16)
# The manifest's names of dtypes (`dtype_name`); others go by torch's own name.
_DTYPE_NAMES = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8_e4m3",
}
if hasattr(torch, "float8_e8m0fnu"):  # ue8m0 block scales (DeepSeek-V3.2's and GLM-5's option)
    _DTYPE_NAMES[torch.float8_e8m0fnu] = "ue8m0"
# nn.Module's per-instance hook registries: emptied for the shadow call, restored after.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


@contextlib.contextmanager
def in_precision(
    module: torch.nn.Module, dtype: torch.dtype, keep: Callable[[torch.Tensor], bool] | None = None
) -> Iterator[None]:
    """Within the block, `module`'s bf16/fp16 parameters and buffers are `dtype` copies.
    Only upcasts: fp32 tensors (routing biases kept in fp32 on purpose) stay as they are, and
    so does any tensor `keep` says to keep (an expert bank run by `routed_experts`). A tensor
    tied between modules is upcast once. FP8 linears under `module`, whatever `dtype`, compute
    in `dtype` from their codes times their scales (`dequant.linears`): production's FP8
    kernel, which quantizes the activations, never runs in the shadow."""
    replaced: list[tuple[dict, str, torch.Tensor]] = []
    upcast: dict[int, torch.Tensor] = {}
    try:
        if dtype == torch.float32:
            for sub in module.modules():
                for registry in (sub._parameters, sub._buffers):
                    for name, tensor in list(registry.items()):
                        if tensor is None or tensor.dtype not in _UPCASTABLE or (keep and keep(tensor)):
                            continue
                        if id(tensor) not in upcast:
                            copy = tensor.detach().to(dtype)
                            if isinstance(tensor, torch.nn.Parameter):
                                copy = torch.nn.Parameter(copy, requires_grad=False)
                            upcast[id(tensor)] = copy
                        replaced.append((registry, name, tensor))
                        registry[name] = upcast[id(tensor)]
        with dequant.linears(module, dtype):
            yield
    finally:
        for registry, name, tensor in reversed(replaced):
            registry[name] = tensor


@contextlib.contextmanager
def full_fp32() -> Iterator[None]:
    """fp32 matmuls and convolutions in full fp32 within the block (no TF32), and no
    reduced-precision or fp16 accumulation in bf16/fp16 GEMMs (`linear`'s fp32 results from
    bf16 operands accumulate in fp32 throughout); every setting the engine made is put back
    as it was, split-K flags included."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = {"tf32": (matmul.allow_tf32, cudnn.allow_tf32)}
    for kind in ("bf16", "fp16"):
        name = f"allow_{kind}_reduced_precision_reduction"
        # (reduced precision, split-K): a plain bool set on the first would reset the second
        saved[name] = (getattr(matmul, name), getattr(matmul, f"{name}_split_k"))
    saved["fp16_accumulation"] = matmul.allow_fp16_accumulation
    try:
        matmul.allow_tf32 = cudnn.allow_tf32 = False
        for kind in ("bf16", "fp16"):
            # split-K stays allowed: with reduced precision off its partial sums are fp32, and
            # refusing it needs cuBLASLt (cuBLAS raises at the GEMM otherwise)
            setattr(matmul, f"allow_{kind}_reduced_precision_reduction", (False, True))
        matmul.allow_fp16_accumulation = False
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved["tf32"]
        for kind in ("bf16", "fp16"):
            name = f"allow_{kind}_reduced_precision_reduction"
            setattr(matmul, name, saved[name])
        matmul.allow_fp16_accumulation = saved["fp16_accumulation"]


# === expert banks ===


def expert_banks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules under `module` that hold every expert in 3-D parameters
    ([experts, out, in], as transformers' GLM-5 and DeepSeek-V3.2 do from 5.17 on)."""
    banks = []
    for sub in module.modules():
        down = sub._parameters.get("down_proj")
        up = sub._parameters.get("gate_up_proj", sub._parameters.get("up_proj"))
        if isinstance(down, torch.Tensor) and isinstance(up, torch.Tensor) and down.dim() == up.dim() == 3:
            banks.append(sub)
    return banks


def sharded(banks: list[torch.nn.Module]) -> bool:
    """Whether any bank holds tensor-parallel shards (DTensor parameters)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(t, DTensor) for bank in banks for t in bank._parameters.values())


def bank_tensors(banks: list[torch.nn.Module]) -> set[int]:
    """ids of the banks' per-expert weights and biases (3-D and 2-D tensors of the bank
    itself, not of its submodules): the tensors `in_precision` must keep."""
    return {
        id(t)
        for bank in banks
        for name, t in bank._parameters.items()
        if t is not None and name.endswith(("_proj", "_proj_bias"))
    }


@contextlib.contextmanager
def routed_experts(banks: list[torch.nn.Module], dtype: torch.dtype) -> Iterator[list[int]]:
    """Within the block, each bank's forward is `routed_forward` in `dtype`. Yields a list
    that collects the peak bytes of expert weights held upcast at once (for accounting)."""
    peaks: list[int] = []
    for bank in banks:
        bank.forward = functools.partial(routed_forward, bank, dtype, peaks)  # type: ignore[method-assign]
    try:
        yield peaks
    finally:
        for bank in banks:
            bank.__dict__.pop("forward", None)


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool
) -> torch.Tensor:
    out = x @ weight if transposed else torch.nn.functional.linear(x, weight)
    return out if bias is None else out + bias


def routed_forward(
    bank: torch.nn.Module,
    dtype: torch.dtype,
    peaks: list[int],
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts module's eager definition (transformers' `*Experts.forward`: for each
    expert a token is routed to, act(gate) * up, down, times the routing weight, summed into
    the token's row) with each routed expert's weights upcast to `dtype` only while it runs
    (dequantized first, for an FP8 bank).
    Experts no token is routed to are never read; routing entries beyond the bank (expert
    parallelism's sentinels) are skipped, as the eager loop skips them."""
    x = hidden_states.to(dtype)
    out = torch.zeros_like(x)
    experts = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    total = int(getattr(bank, "num_experts", bank.down_proj.shape[0]))
    counts = torch.bincount(flat, minlength=total + 1).tolist()  # one sync per layer
    tokens, slots = order // experts, order % experts
    weights = top_k_weights.reshape(-1, experts)
    gated = getattr(bank, "has_gate", True) and "gate_up_proj" in bank._parameters
    transposed = bool(getattr(bank, "is_transposed", False))
    biased = bool(getattr(bank, "has_bias", False))
    up_name = "gate_up_proj" if gated else "up_proj"
    start = 0
    for expert, n in enumerate(counts):
        rows = slice(start, start + n)
        start += n
        if n == 0 or expert >= total:
            continue
        # FP8 banks: this expert's codes times its block scales (dequant.expert), no more
        up_w = dequant.expert(bank, up_name, expert, dtype)
        down_w = dequant.expert(bank, "down_proj", expert, dtype)
        up_b = getattr(bank, f"{up_name}_bias")[expert].to(dtype) if biased else None
        down_b = bank.down_proj_bias[expert].to(dtype) if biased else None
        peaks.append((up_w.numel() + down_w.numel()) * up_w.element_size())
        who = tokens[rows]
        h = _linear(x[who], up_w, up_b, transposed)
        if gated:
            apply_gate = getattr(bank, "_apply_gate", None)
            if apply_gate is not None:
                h = apply_gate(h)
            else:
                gate, up = h.chunk(2, dim=-1)
                h = bank.act_fn(gate) * up
        else:
            h = bank.act_fn(h)
        h = _linear(h, down_w, down_b, transposed)
        if getattr(bank, "has_post_expert_norm", False):
            h = bank.post_expert_norm(h)
        h = h * weights[who, slots[rows], None].to(dtype)
        out.index_add_(0, who, h)
    return out


Hook = Callable[..., Any]


@contextlib.contextmanager
def hooks_suspended(
    module: torch.nn.Module, capture: dict[torch.nn.Module, Hook] | None = None
) -> Iterator[None]:
    """Within the block, no forward hook or pre-hook registered on `module` or any module
    below it fires; `capture` maps submodules to the only forward hooks that do (the
    tracer's shadow site captures). Everything is put back as it was."""
    saved = []
    for sub in module.modules():
        saved.append((sub, {name: getattr(sub, name) for name in _HOOK_DICTS if hasattr(sub, name)}))
        for name in saved[-1][1]:
            setattr(sub, name, OrderedDict())
    try:
        for sub, hook in (capture or {}).items():
            sub.register_forward_hook(hook)
        yield
    finally:
        for sub, dicts in saved:
            for name, value in dicts.items():
                setattr(sub, name, value)


# Why `linear` stopped using the tensor cores in this process (the op raised), or None.
tensor_cores_failed: str | None = None


def linear(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x @ weight.T in `dtype` (weights of FP8 layers must be dequantized by the caller:
    `dequant.weight`).

    fp32 of bf16 or fp16 operands on CUDA (`linear_path` says which): the operands go to the
    tensor cores as they are, with fp32 accumulation and an fp32 result. Their products are
    exact in fp32 (8 or 11 significant bits each, 24 kept), so this is the fp32 product of the
    upcast operands up to the order of the fp32 sums, without the fp32 GEMM's SIMT cost. If
    that op raises, the fp32 GEMM runs from then on and `linear_path` says why."""
    global tensor_cores_failed
    if linear_path(x, weight, dtype) == "tensor cores":
        try:
            out = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), torch.float32)
            return out.view(*x.shape[:-1], weight.shape[0])
        except torch.cuda.OutOfMemoryError:
            raise  # the fp32 GEMM would need more; the capture's guard counts it
        except (RuntimeError, TypeError) as e:  # TypeError: a torch without mm's out_dtype
            tensor_cores_failed = f"{type(e).__name__}: {str(e)[:160]}"
    return torch.nn.functional.linear(x.to(dtype), weight.to(dtype))


def linear_path(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> str:
    """How `linear` computes x @ weight.T: "tensor cores" (fp32 accumulation of operands that
    fp32 products hold exactly) or `dtype`'s own GEMM ("fp32", with why where the tensor
    cores raised)."""
    exact = x.dtype in _UPCASTABLE and weight.dtype == x.dtype and x.shape[-1] == weight.shape[-1]
    own = dtype_name(dtype)
    if dtype == torch.float32 and x.is_cuda and weight.device == x.device and exact:
        return "tensor cores" if tensor_cores_failed is None else f"{own} ({tensor_cores_failed})"
    return own


def projection_path(x: torch.Tensor, module: torch.nn.Module, dtype: torch.dtype) -> str:
    """`linear_path` of `linear(x, dequant.weight(module), dtype)`: an FP8 linear's
    dequantized weight is fp32, so its product is `dtype`'s own GEMM, said so."""
    if dequant.quantized(module):
        return f"{dtype_name(dtype)} (fp8_e4m3 dequantized)"
    return linear_path(x, module.weight, dtype)


def indexer_scores(
    run: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    q_pos: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    q_pos_host: Any = None,
) -> torch.Tensor:
    """The shadow's indexer scores [T, S], `numerics.index_scores`'s definition. On CUDA,
    Triton's kernel with three TF32 products per dot product (`kernels.index_scores`); where
    it cannot run, torch's product, split the same way on CUDA ("3xtf32") and plain fp32 on
    the CPU. Which one ran goes into the run's manifest (`settings.shadow_indexer_scores`,
    with the reason the kernel was passed over). A kernel that raises is not asked again in
    this process, and every run it closes counts it (`process.kernel_failed.index_scores`)."""
    if q.is_cuda:
        out, reason = kernels.attempt(
            "index_scores", q, lambda: kernels.index_scores(q, k, w, q_pos, softmax_scale, precision="tf32x3")
        )
        if out is not None:
            record_kernel(run, "shadow_indexer_scores", "triton tf32x3")
            return out
        record_kernel(run, "shadow_indexer_scores", f"torch 3xtf32 ({reason})")
        return numerics.index_scores(q, k, w, q_pos, softmax_scale, q_pos_host=q_pos_host, matmul="3xtf32")
    record_kernel(run, "shadow_indexer_scores", "torch ieee")
    return numerics.index_scores(q, k, w, q_pos, softmax_scale, q_pos_host=q_pos_host)


def record_kernel(run: Any, setting: str, how: str) -> None:
    """Names in the run's manifest settings what computed `setting`'s numbers."""
    run.writer.set_setting(setting, how)
