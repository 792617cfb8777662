"""transformers' FP8 kernel entry points on PyTorch's own block-scaled FP8 GEMM (issue 26).

transformers fetches its FP8 kernel (`kernels-community/finegrained-fp8`) from a hub at run
time, which the GPU machine cannot reach. `tensor_core_kernel()` puts `torch._scaled_mm` on
the tensor cores behind the kernel's three entry points (the module global that
`load_finegrained_fp8_kernel` returns once set): activations quantized per token in 1x128
groups (e4m3, fp32 scale amax/448, as the Triton kernel quantizes them), the weight's
128x128 block scales repeated over their 128 rows (the 1x128-by-1x128 scaling `_scaled_mm`
takes, the same numbers), fp32 accumulation. CUDA only (compute capability 8.9 or newer);
the CPU tests use tiny_fp8's emulation of the same definition.

The grouped entry point (transformers' default for FP8 expert banks) quantizes the sorted
tokens once (per-token groups: the same codes and scales as per expert) and keeps each
expert's weight scales laid out for `_scaled_mm` after their first use, so an expert costs
a few launches: a production kernel's host cost rather than a Python loop's, which would
leave the device idle and make a hook's host work look like its device work. The batched
entry point goes expert by expert (`tiny_fp8.per_expert`).
"""

import tiny_fp8
import torch

E4M3 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(E4M3).max


def _k_padded(k: int) -> int:
    """K padded to whole 128-groups, and to two at least: with one group, the scales'
    shapes, (M, 1) and (1, N), are those of row-wise scaling, which `_scaled_mm` takes them
    for and cuBLASLt refuses with an fp32 output (CUBLAS_STATUS_NOT_SUPPORTED on an H100).
    The padding is zero codes: the product is the same, exactly."""
    return max(-(-k // 128), 2) * 128


def _rows(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] per token in 1x128 groups: e4m3 codes [rows, Kp] and fp32 scales
    [rows, Kp/128], zero rows past M (rows >= M), K padded (`_k_padded`)."""
    (m, k) = x.shape
    kp = _k_padded(k)
    xp = torch.nn.functional.pad(x.float(), (0, kp - k, 0, rows - m)).view(rows, kp // 128, 128)
    scale = (xp.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    codes = (xp / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(E4M3).view(rows, kp)
    return codes, scale


def _weight(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] e4m3 and its 128x128 scales as `_scaled_mm` takes them: the codes
    padded to whole blocks, transposed (a view), and the scales repeated over their rows,
    (K/128, Np) row-major."""
    n, k = weight.shape
    kp, np_ = _k_padded(k), -(-n // 128) * 128
    w = (
        weight
        if (kp, np_) == (k, n)
        else torch.nn.functional.pad(weight.view(torch.uint8), (0, kp - k, 0, np_ - n))
    )
    # A padded K block's codes are zero: any scale gives zero; 1.
    scale = weight_scale_inv.float()
    scale = torch.nn.functional.pad(scale, (0, kp // 128 - scale.shape[1]), value=1.0)
    scale_b = scale.repeat_interleave(128, 0)
    scale_b = torch.nn.functional.pad(scale_b, (0, 0, 0, np_ - scale_b.shape[0]))[:np_]
    return w.view(E4M3).t(), scale_b.t().contiguous()


def _mm(a: torch.Tensor, scale_a: torch.Tensor, w_t: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """One block-scaled GEMM on the tensor cores, fp32 out: a [M', Kp] e4m3 with its
    [M', Kp/128] scales (made M-major here), w_t [Kp, Np] with scale_b (Kp/128, Np)."""
    return torch._scaled_mm(
        a, w_t, scale_a=scale_a.t().contiguous().t(), scale_b=scale_b, out_dtype=torch.float32
    )


def scaled_mm_matmul(input, weight, weight_scale_inv, block_size, output_dtype, activation_scale=None):
    """The finegrained-fp8 kernel's matmul_2d on torch._scaled_mm (module docs)."""
    if activation_scale is not None or block_size is None or list(block_size) != [128, 128]:
        raise NotImplementedError("only dynamic activations and 128x128 weight blocks")
    shape = input.shape
    x = input.reshape(-1, shape[-1])
    m, n = x.shape[0], weight.shape[0]
    a, scale_a = _rows(x, -(-m // 16) * 16)
    out = _mm(a, scale_a, *_weight(weight, weight_scale_inv))
    return out[:m, :n].to(output_dtype).view(*shape[:-1], n)


class _Grouped:
    """matmul_grouped(x [S, K] sorted by expert, w [E, N, K], s [E, ...], offsets: cumsum)
    -> [S, N], on `_mm`; each expert's weight layout made once and kept."""

    def __init__(self) -> None:
        self.weights: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x, w, s, offsets=None, tokens_per_expert=None, block_size=None):
        if block_size is None or list(block_size) != [128, 128]:
            raise NotImplementedError("only 128x128 weight blocks")
        rows, n = x.shape[0], w.shape[1]
        # Each expert's rows padded to 16 read on into the next expert's (rows apart, the
        # results cropped): the codes are padded once at the end to keep the last in range.
        a, scale_a = _rows(x, -(-rows // 16) * 16 + 16)
        out = torch.zeros(rows, n, dtype=x.dtype, device=x.device)
        start = 0
        for e, end in enumerate(offsets.tolist()):
            if end > start:
                key = (w.data_ptr(), s.data_ptr(), e)
                if key not in self.weights:
                    self.weights[key] = _weight(w[e], s[e])
                span = -(-(end - start) // 16) * 16
                y = _mm(a[start : start + span], scale_a[start : start + span], *self.weights[key])
                out[start:end] = y[: end - start, :n].to(x.dtype)
            start = end
        return out


def tensor_core_kernel():
    """transformers' FP8 kernel entry points are `torch._scaled_mm` within the block."""
    batched, _ = tiny_fp8.per_expert(scaled_mm_matmul)
    return tiny_fp8.kernel(scaled_mm_matmul, batched=batched, grouped=_Grouped())
