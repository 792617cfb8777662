"""The indexer's rotary embedding as the model defines it, independent of any engine.

The shadow takes RoPE from the model's config and the model family's reference definition
(HF transformers' modeling code), never from an engine's rotary module: an engine with the
wrong convention (NeoX pairs on GLM-5, whose indexer is interleaved) must show as a
difference between production and shadow, not be copied into the shadow.

- layout: GLM-5 (`glm_moe_dsa`) rotates interleaved pairs (2i, 2i+1), as
  `apply_rotary_pos_emb_interleave` in transformers' GlmMoeDsaIndexer, whatever the config's
  `indexer_rope_interleave` says; DeepSeek-V3.2 (`deepseek_v32`) rotates half-split pairs
  (i, i+R/2). The architecture decides, read from `architectures` first because engines
  rewrite `model_type` (TensorRT-LLM serves GLM-5 as deepseek_v32);
- frequencies: `rope_theta` and, for `yarn` (engines rename it in place), the YaRN
  inverse frequencies and attention factor of transformers' `_compute_yarn_parameters`,
  over the first `qk_rope_head_dim` dimensions of the 128-dimensional head.

Angles are computed in float64 and cos/sin rounded once to float32, so the shadow's RoPE is
no less accurate than any engine's table.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch

# architecture -> the model family's HF model_type; its indexer RoPE pairs are interleaved
_FAMILIES = {"GlmMoeDsaForCausalLM": "glm_moe_dsa", "DeepseekV32ForCausalLM": "deepseek_v32"}
_INTERLEAVED = {"glm_moe_dsa": True, "deepseek_v32": False}
# Engines rewrite `rope_type` in the HF config object they share with the model (vLLM:
# deepseek_yarn, or deepseek_llama_scaling when the attention factor is 1; SGLang:
# deepseek_yarn); every one of them computes YaRN's frequencies.
_YARN = ("yarn", "deepseek_yarn", "deepseek_llama_scaling")


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True)
class IndexerRope:
    """RoPE of the indexer's first `dim` dimensions, as the model defines it."""

    interleaved: bool
    inv_freq: tuple[float, ...]  # per rotated pair
    attention_factor: float
    source: str  # where the layout was decided: the architecture, or the config key

    @property
    def dim(self) -> int:
        return 2 * len(self.inv_freq)

    @property
    def layout(self) -> str:
        return "interleaved" if self.interleaved else "neox"

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, dim/2] in float32 for absolute positions [T]."""
        inv = torch.tensor(self.inv_freq, dtype=torch.float64, device=positions.device)
        angles = positions.reshape(-1).to(torch.float64)[:, None] * inv[None, :]
        return (
            (angles.cos() * self.attention_factor).float(),
            (angles.sin() * self.attention_factor).float(),
        )

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, ..., D] in float32 with its first `dim` dimensions rotated."""
        cos, sin = self.cos_sin(positions)
        shape = [cos.shape[0]] + [1] * (x.dim() - 2) + [cos.shape[1]]
        cos, sin = cos.reshape(shape), sin.reshape(shape)
        x = x.float()
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        else:
            x1, x2 = rot.chunk(2, dim=-1)
            rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return torch.cat([rot, rest], dim=-1)


class UnknownModel(ValueError):
    """A config whose indexer RoPE layout the reference definitions do not settle."""


def indexer_rope(config: Any) -> IndexerRope:
    """The indexer RoPE of a model from its HF config (a PretrainedConfig or the parsed
    config.json)."""
    interleaved, source = _layout(config)
    dim = int(_get(config, "qk_rope_head_dim"))
    params = _parameters(config)
    theta = float(params.get("rope_theta") or _get(config, "rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    exponents = [2 * i / dim for i in range(dim // 2)]
    inv = [1.0 / theta**e for e in exponents]
    factor = 1.0
    if rope_type in _YARN:
        inv, factor = _yarn(config, params, theta, dim)
    elif rope_type != "default":
        raise UnknownModel(f"indexer RoPE: rope_type {rope_type!r}: expected default or yarn")
    return IndexerRope(interleaved, tuple(inv), factor, source)


def family(config: Any) -> str | None:
    """The model family's HF model_type (glm_moe_dsa, deepseek_v32), from `architectures`
    first: engines rewrite `model_type` (TensorRT-LLM serves GLM-5 as deepseek_v32)."""
    for arch in _get(config, "architectures") or []:
        if arch in _FAMILIES:
            return _FAMILIES[arch]
    model_type = _get(config, "model_type")
    return model_type if model_type in _INTERLEAVED else None


def _layout(config: Any) -> tuple[bool, str]:
    name = family(config)
    if name is not None:
        return _INTERLEAVED[name], f"{name} indexer (transformers reference)"
    model_type = _get(config, "model_type")
    key = _get(config, "indexer_rope_interleave")
    if key is not None:
        return bool(key), "config indexer_rope_interleave"
    raise UnknownModel(
        f"indexer RoPE: architectures {_get(config, 'architectures')}, model_type {model_type!r}: "
        "expected GlmMoeDsaForCausalLM or DeepseekV32ForCausalLM, or an indexer_rope_interleave key"
    )


def _parameters(config: Any) -> dict:
    """RoPE parameters under either spelling: transformers 5's `rope_parameters` (with
    rope_theta inside) or config.json's `rope_scaling` beside `rope_theta`."""
    for name in ("rope_parameters", "rope_scaling"):
        value = _get(config, name)
        if isinstance(value, dict) and value:
            return dict(value)
    return {}


def _yarn(config: Any, params: dict, theta: float, dim: int) -> tuple[list[float], float]:
    """transformers' `_compute_yarn_parameters`, in float64."""
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = _get(config, "max_position_embeddings") / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(beta_fast), correction(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        extrapolation = 1.0 / theta ** (2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        keep = 1.0 - ramp  # share of the unscaled (extrapolated) frequency
        out.append(extrapolation / factor * (1.0 - keep) + extrapolation * keep)
    return out, float(attention)
