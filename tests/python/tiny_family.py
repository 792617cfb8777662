"""Tiny random models of the rest of the family, from HF transformers 5.24 (run where it is
first on PYTHONPATH: tests/python/upstream.py): GLM-5.3-Flash (`glm5_next`), DeepSeek-V4
(`deepseek_v4`) and Qwen3.5-MoE (`qwen3_5_moe`), with their real structure at small width.

- glm5_next: KDA linear-attention layers with an MLA layer every fourth (the default
  schedule), the k-pool indexer (index_kpool 16), `mlp_layer_types` dense then sparse,
  4 hyper-connection streams, no RoPE; index_topk 64 (4 pools), so prompts above 64 + 16
  tokens reach the sparse regime quickly;
- deepseek_v4: a sliding, a CSA (compress rate 4, Lightning Indexer, index_topk 16) and an
  HCA layer (rate 16), hash-routed then learned-routed MoE, 4 hyper-connection streams;
- qwen3_5_moe: three Gated DeltaNet layers and a gated full-attention layer, MoE with a
  shared expert.

The parameters HF initialises to constants (the k-pool gate and offsets, the compressors'
position biases, hash routing tables, routing biases) are drawn at random, so every path
through them matters; the indexers' projections are drawn 8x wider, as in tiny_models.
"""

import torch

VOCAB = 512


def _text_glm5_next(layers: int, **overrides: object) -> dict:
    return {
        **dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=32, v_head_dim=16,
            qk_nope_head_dim=16, index_topk=64, index_head_dim=32, index_n_heads=4, index_kpool=16,
            linear_head_dim=16, linear_num_heads=4, hc_mult=4, pad_token_id=0, max_position_embeddings=4096,
            mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
        ),
        **overrides,
    }  # fmt: skip


def glm5_next(layers: int = 4, dtype: torch.dtype = torch.bfloat16, **overrides: object) -> torch.nn.Module:
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                  projection_intermediate_size=64)  # fmt: skip
    config = Glm5NextConfig(text_config=_text_glm5_next(layers, **overrides), vision_config=vision)
    return _build(Glm5NextForConditionalGeneration, config, dtype)


def deepseek_v4(dtype: torch.dtype = torch.bfloat16, **overrides: object) -> torch.nn.Module:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(**{
        "vocab_size": VOCAB, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "head_dim": 64, "q_lora_rank": 32, "num_experts_per_tok": 2,
        "n_routed_experts": 8, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16, "o_groups": 2,
        "o_lora_rank": 32, "sliding_window": 16, "num_nextn_predict_layers": 0,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "max_position_embeddings": 4096,
        **overrides,
    })  # fmt: skip
    return _build(DeepseekV4ForCausalLM, config, dtype)


def qwen3_5_moe(dtype: torch.dtype = torch.bfloat16, **overrides: object) -> torch.nn.Module:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "max_position_embeddings": 4096, **overrides,
    })  # fmt: skip
    return _build(Qwen3_5MoeForCausalLM, config, dtype)


def t5() -> torch.nn.Module:
    """An encoder-decoder, which the generic adapter refuses."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      decoder_start_token_id=0)  # fmt: skip
    return _build(T5ForConditionalGeneration, config, torch.float32)


def _build(cls: type, config: object, dtype: torch.dtype) -> torch.nn.Module:
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    # As from_pretrained loads them: the modules the model keeps in fp32 stay fp32.
    model = cls._from_config(config, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(1)

    def draw(t: torch.Tensor, scale: float) -> None:
        t.copy_(torch.randn(t.shape, generator=gen) * scale)

    with torch.no_grad():
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "indexer":
                for proj in ("wk", "wq_b", "kv_proj", "q_b_proj"):
                    if hasattr(module, proj):
                        getattr(module, proj).weight.mul_(8.0)
                if hasattr(module, "index_kpool_compress_ape"):
                    draw(module.index_kpool_compress_ape, 0.5)
                    draw(module.index_kpool_compress_gate, 0.05)
            if hasattr(module, "position_bias"):
                draw(module.position_bias, 0.5)
            if hasattr(module, "e_score_correction_bias"):
                draw(module.e_score_correction_bias, 0.05)
            if hasattr(module, "tid2eid"):
                experts = module.num_experts
                module.tid2eid.copy_(torch.stack([torch.randperm(experts, generator=gen)[: module.top_k]
                                                  for _ in range(module.tid2eid.shape[0])]))  # fmt: skip
            if hasattr(module, "sinks"):
                draw(module.sinks, 0.5)
            if hasattr(module, "A_log") and module.A_log.dim() == 1 and hasattr(module, "in_proj_a"):
                # Gated DeltaNet decays: slow heads, as trained models have, so the
                # recurrent state carries over tens of tokens (HF draws A up to 16).
                module.A_log.copy_(torch.empty(module.A_log.shape).uniform_(0.05, 1.0, generator=gen).log())
    return model


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (1, length), generator=gen)
