"""Tiny random GLM-5 and DeepSeek-V3.2 models from HF transformers, for the hooks' tests.

Small widths, the real structure: MLA with q/kv LoRA, the DSA indexer (index_head_dim 128
and index_topk 2048 as in the real models, so prompts above 2048 tokens reach the sparse
regime), dense first layer then MoE with shared experts, each model's RoPE flavour.

Why random weights here, where the trained checkpoints of models/ exist (tests/python/trained.py):
these tests need structure the trained models do not have, and build it per test: shared
("GLM-5.2") indexer layers, YaRN at a small original context, an FP8 lm_head, per-tensor
scales, planted outliers, 3 transformers versions at a few seconds each. What they check
(production bit-identical under the hooks, a planted NaN located, a shadow equal to the
test's own recompute) holds by construction for any weights. The layer-by-layer agreement of
the reference engine with transformers, FP8 included, runs on both: test_reference_engine.py
and test_reference_fp8.py.
"""

import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    q_lora_rank=64,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    index_topk=2048,
    index_head_dim=128,
    index_n_heads=4,
    first_k_dense_replace=1,
    max_position_embeddings=8192,
)


def glm(layers: int = 3, dtype: torch.dtype = torch.bfloat16, **overrides) -> GlmMoeDsaForCausalLM:
    config = GlmMoeDsaConfig(**{**COMMON, "num_hidden_layers": layers, **overrides})
    return _build(GlmMoeDsaForCausalLM, config, dtype)


def deepseek(layers: int = 3, dtype: torch.dtype = torch.bfloat16, **overrides) -> DeepseekV32ForCausalLM:
    config = DeepseekV32Config(
        **{**COMMON, "num_hidden_layers": layers, "n_group": 2, "topk_group": 1, **overrides}
    )
    return _build(DeepseekV32ForCausalLM, config, dtype)


def _build(cls, config, dtype):
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval()
    # Spread the indexer's scores as a trained model's are: random init leaves them nearly
    # tied, where any two precisions disagree about the top-k and nothing can be learned.
    with torch.no_grad():
        for layer in model.model.layers:
            indexer = getattr(layer.self_attn, "indexer", None)
            if indexer is not None:
                indexer.wk.weight.mul_(8.0)
                indexer.wq_b.weight.mul_(8.0)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:  # a routing bias that matters, as trained models have
                gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape) * 0.05)
    return model.to(dtype)


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, COMMON["vocab_size"], (1, length), generator=gen)
