"""The indexer RoPE the shadow takes from the model's config, against transformers' own
GLM-5 and DeepSeek-V3.2 rotary embeddings and indexer RoPE functions (the model family's
reference definition), and its refusal of a model it cannot settle."""

import pytest
import torch
from shadowtrace_hooks import rope
from transformers import DeepseekV32Config, GlmMoeDsaConfig
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as ds
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

POSITIONS = torch.tensor([0, 1, 7, 2047, 2048, 6000, 131071])


def angle_tolerance(positions: torch.Tensor) -> torch.Tensor:
    """transformers computes angles in fp32 (position x inv_freq), the shadow in fp64: cos and
    sin may differ by the fp32 rounding of the angle, a few ulps of the position."""
    return 4 * torch.finfo(torch.float32).eps * positions.double().clamp_min(1.0)[:, None] + 1e-6


def configs() -> list:
    glm_config = GlmMoeDsaConfig(qk_rope_head_dim=64, max_position_embeddings=202752)
    ds_config = DeepseekV32Config(
        qk_rope_head_dim=64, max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    )  # fmt: skip
    return [
        pytest.param(glm_config, glm.GlmMoeDsaRotaryEmbedding, glm.apply_rotary_pos_emb_interleave, id="glm"),
        pytest.param(ds_config, ds.DeepseekV32RotaryEmbedding, ds.apply_rotary_pos_emb, id="deepseek-yarn"),
    ]


@pytest.mark.parametrize(("config", "embedding", "apply"), configs())
def test_cos_and_sin_are_transformers_own(config: object, embedding: type, apply: object) -> None:
    mine = rope.indexer_rope(config)
    ref_cos, ref_sin = embedding(config)(torch.empty(0), POSITIONS[None, :])
    half = mine.dim // 2
    cos, sin = mine.cos_sin(POSITIONS)
    tol = angle_tolerance(POSITIONS)
    assert ((cos.double() - ref_cos[0, :, :half].double()).abs() <= tol).all()
    assert ((sin.double() - ref_sin[0, :, :half].double()).abs() <= tol).all()


@pytest.mark.parametrize(("config", "embedding", "apply"), configs())
def test_rotated_query_key_products_are_transformers_own(
    config: object, embedding: type, apply: object
) -> None:
    """The layouts: q.k after RoPE equals the reference's (GLM's reference returns the
    rotated pairs de-interleaved, a permutation that leaves q.k unchanged)."""
    mine = rope.indexer_rope(config)
    gen = torch.Generator().manual_seed(0)
    t, d = len(POSITIONS), 128
    q, k = torch.randn(t, 4, d, generator=gen), torch.randn(t, d, generator=gen)
    cos, sin = embedding(config)(torch.empty(0), POSITIONS[None, :])
    q_rot, k_rot = apply(
        q[None, ..., : mine.dim], k[None, :, None, : mine.dim], cos.float(), sin.float(), unsqueeze_dim=2
    )
    ref_q = torch.cat([q_rot[0], q[..., mine.dim :]], -1)
    ref_k = torch.cat([k_rot[0, :, 0], k[..., mine.dim :]], -1)
    got_q, got_k = mine.apply(q, POSITIONS), mine.apply(k, POSITIONS)
    ref = torch.einsum("thd,sd->ths", ref_q.double(), ref_k.double())
    got = torch.einsum("thd,sd->ths", got_q.double(), got_k.double())
    # |q||k| ~ 128 here; fp32 angles at position 131071 move products by ~1e-2 of that
    assert (got - ref).abs().max() < 1e-2 * 128


def test_glm5_is_interleaved_whatever_its_model_type_says_and_deepseek_is_neox() -> None:
    served_as_deepseek = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "deepseek_v32",
                          "qk_rope_head_dim": 64, "rope_theta": 1e6}  # fmt: skip
    assert rope.indexer_rope(served_as_deepseek).layout == "interleaved"
    deepseek = {"architectures": ["DeepseekV32ForCausalLM"], "qk_rope_head_dim": 64, "rope_theta": 1e4}
    assert rope.indexer_rope(deepseek).layout == "neox"


def test_a_model_whose_layout_nothing_settles_is_refused_with_what_was_expected() -> None:
    with pytest.raises(rope.UnknownModel, match="expected GlmMoeDsaForCausalLM or DeepseekV32ForCausalLM"):
        rope.indexer_rope({"architectures": ["LlamaForCausalLM"], "qk_rope_head_dim": 64})
    with pytest.raises(rope.UnknownModel, match="rope_type 'longrope'"):
        rope.indexer_rope({"model_type": "deepseek_v32", "qk_rope_head_dim": 64,
                           "rope_scaling": {"rope_type": "longrope"}})  # fmt: skip
