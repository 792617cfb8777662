"""The operands `fp8_kernel` hands `torch._scaled_mm`, checked on the CPU.

`_scaled_mm` has no block-scaled CPU kernel, so `fp8_kernel._mm` is replaced by the
definition of 1x128-by-128x128 block scaling written here: per 128-column group of K, the
codes' fp32 product times the activation row's and the weight column's scale, summed. It
refuses scales shaped as row-wise scaling's, (M, 1) and (1, N), which `_scaled_mm` checks
before block scaling and cuBLASLt refuses with an fp32 output (an H100, an expert whose K is
one 128-group). The expected products are the test's own: activations quantized per token in
1x128 groups and weights dequantized by `tiny_fp8`, multiplied in fp32.
"""

import fp8_kernel
import pytest
import tiny_fp8
import torch

E4M3 = torch.float8_e4m3fn
BLOCK = (128, 128)
# fp32 sums of the same products in another order (by K group here, whole rows in the
# expected product): a few ulps of the largest output.
REL = 1e-5


def block_scaled(a, scale_a, w_t, scale_b):
    groups = a.shape[1] // 128
    assert a.shape[1] == groups * 128
    assert w_t.shape[0] == a.shape[1]
    assert scale_a.shape == (a.shape[0], groups)
    assert scale_b.shape == (groups, w_t.shape[1])
    assert groups >= 2, "scales shaped (M, 1) and (1, N): _scaled_mm reads them as row-wise scaling"
    out = torch.zeros(a.shape[0], w_t.shape[1])
    for g in range(groups):
        cols = slice(g * 128, (g + 1) * 128)
        out += (a[:, cols].float() @ w_t[cols].float()) * scale_a[:, g : g + 1] * scale_b[g : g + 1]
    return out


def weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(n, k, generator=g) / 4).to(E4M3)
    scales = torch.rand(-(-n // 128), -(-k // 128), generator=g) + 0.5
    return codes, scales


def expected(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return tiny_fp8._quant_act(x, 128) @ tiny_fp8.reference_weight(codes, scales, BLOCK).t()


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=REL * want.abs().max().item())


@pytest.mark.parametrize("k", [128, 200, 256, 640])
def test_a_linear_s_operands_give_the_block_scaled_product_whatever_k(k, monkeypatch):
    monkeypatch.setattr(fp8_kernel, "_mm", block_scaled)
    codes, scales = weights(192, k, seed=k)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(1))
    got = fp8_kernel.scaled_mm_matmul(x, codes, scales, list(BLOCK), torch.float32)
    close(got, expected(x, codes, scales))


@pytest.mark.parametrize("k", [128, 384])
def test_the_grouped_entry_point_gives_each_expert_s_block_scaled_product(k, monkeypatch):
    monkeypatch.setattr(fp8_kernel, "_mm", block_scaled)
    experts, n = 4, 64
    banks = [weights(n, k, seed=10 * k + e) for e in range(experts)]
    w = torch.stack([c for c, _ in banks])
    s = torch.stack([sc for _, sc in banks])
    counts = [5, 0, 19, 8]  # an expert without a token among them
    x = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(2))
    offsets = torch.tensor(counts).cumsum(0)
    got = fp8_kernel._Grouped()(x, w, s, offsets=offsets, block_size=list(BLOCK))
    start = 0
    for (codes, scales), end in zip(banks, offsets.tolist(), strict=True):
        if end > start:
            close(got[start:end], expected(x[start:end], codes, scales))
        start = end
