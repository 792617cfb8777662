"""transformers' FP8 kernel entry points on PyTorch's own block-scaled FP8 GEMM (issue 26).

transformers fetches its FP8 kernel (`kernels-community/finegrained-fp8`) from a hub at run
time, which the GPU machine cannot reach. `tensor_core_kernel()` puts `torch._scaled_mm` on
the tensor cores behind the kernel's three entry points (the module global that
`load_finegrained_fp8_kernel` returns once set; the batched and grouped ones go expert by
expert, `tiny_fp8.per_expert`): activations quantized per token in 1x128
groups (e4m3, fp32 scale amax/448, as the Triton kernel quantizes them), the weight's
128x128 block scales repeated over their 128 rows (the 1x128-by-1x128 scaling `_scaled_mm`
takes, the same numbers), fp32 accumulation. CUDA only (compute capability 8.9 or newer);
the CPU tests use tiny_fp8's emulation of the same definition.
"""

import tiny_fp8
import torch

E4M3 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(E4M3).max


def scaled_mm_matmul(input, weight, weight_scale_inv, block_size, output_dtype, activation_scale=None):
    """The finegrained-fp8 kernel's matmul_2d on torch._scaled_mm (module docs)."""
    if activation_scale is not None or block_size is None or list(block_size) != [128, 128]:
        raise NotImplementedError("only dynamic activations and 128x128 weight blocks")
    shape = input.shape
    x = input.reshape(-1, shape[-1])
    (m, k), n = x.shape, weight.shape[0]
    mp, kp, np_ = -(-m // 16) * 16, -(-k // 128) * 128, -(-n // 128) * 128
    xp = torch.nn.functional.pad(x.float(), (0, kp - k, 0, mp - m)).view(mp, kp // 128, 128)
    scale_a = (xp.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)  # (M, K/128)
    a = (xp / scale_a[..., None]).clamp(-FP8_MAX, FP8_MAX).to(E4M3).view(mp, kp)
    w = torch.nn.functional.pad(weight.view(torch.uint8), (0, kp - k, 0, np_ - n)).view(E4M3)
    scale_b = weight_scale_inv.float().repeat_interleave(128, 0)
    scale_b = torch.nn.functional.pad(scale_b, (0, 0, 0, np_ - scale_b.shape[0]))[:np_]
    out = torch._scaled_mm(
        a,
        w.t(),
        scale_a=scale_a.t().contiguous().t(),  # M-major
        scale_b=scale_b.t().contiguous(),  # (K/128, N) row-major
        out_dtype=torch.float32,
    )
    return out[:m, :n].to(output_dtype).view(*shape[:-1], n)


def tensor_core_kernel():
    """transformers' FP8 kernel entry points are `torch._scaled_mm` within the block."""
    return tiny_fp8.kernel(scaled_mm_matmul)
