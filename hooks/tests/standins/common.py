"""What the engine stand-ins share: fake modules in sys.modules, and DeepGEMM's FP8 MQA
logits and the engines' request-local top-k, written from their definitions.

DeepGEMM `fp8_mqa_logits` (deepseek-ai/DeepGEMM README and csrc/apis/attention.hpp):
out[i, j] = sum_h relu(q[i, h] . k[j]) * weights[i, h], times k_scale[j], for keys j in
[ks[i], ke[i]); each FP8 dot product accumulates in fp32. Every engine turns the logits
into request-local key positions, padded with -1.
"""

import sys
from types import ModuleType
from typing import Any

import torch

E4M3_MAX = 448.0


def register(monkeypatch: Any, name: str, **attrs: Any) -> ModuleType:
    """Puts a module and its parent packages into sys.modules for the test's duration."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            monkeypatch.setitem(sys.modules, parent, ModuleType(parent))
    module = ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def mqa_logits(
    q8: torch.Tensor, weights: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor,
    ks: torch.Tensor, ke: torch.Tensor, logits_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # fmt: skip
    """DeepGEMM's logits [M, N] fp32 for q8 [M,H,D] e4m3 (scale folded into weights [M,H]),
    k8 [N,D] e4m3 with k_scale [N]; -inf outside each row's [ks, ke). With bf16
    `logits_dtype` (vLLM 0.34 on SM100 for DeepSeek-V3.2: "the MQA logits kernels also
    reduce in BF16"), the sum over heads accumulates in bf16, head by head, and the logits
    come out bf16 (returned as fp32 holding bf16 values)."""
    dots = torch.einsum("mhd,nd->mhn", q8.float(), k8.float()).clamp_min(0.0)
    terms = dots * weights.float()[:, :, None]
    if logits_dtype == torch.bfloat16:
        acc = torch.zeros(terms.shape[0], terms.shape[2], dtype=torch.bfloat16)
        for h in range(terms.shape[1]):
            acc = (acc.float() + terms[:, h]).to(torch.bfloat16)
        logits = (acc.float() * k_scale.float().reshape(1, -1)).to(torch.bfloat16).float()
    else:
        logits = terms.sum(1) * k_scale.float().reshape(1, -1)
    j = torch.arange(k8.shape[0])[None, :]
    return logits.masked_fill((j < ks[:, None]) | (j >= ke[:, None]), float("-inf"))


def topk_positions(logits: torch.Tensor, ks: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the k best keys as positions relative to the row's ks, -1 padded."""
    take = min(k, logits.shape[1])
    values, idx = logits.topk(take, dim=-1)
    out = torch.full((logits.shape[0], k), -1, dtype=torch.int32)
    out[:, :take] = torch.where(torch.isfinite(values), idx - ks[:, None], -1).to(torch.int32)
    return out
