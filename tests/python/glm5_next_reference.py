"""Builds a tiny random GLM-5.3-Flash (tiny_family.glm5_next, fp32) with the layer schedule
of the reference-engine test, saves it with `save_pretrained`, runs transformers' own
forward on a prompt and saves what each layer computed: run under transformers 5.24
(installed apart, first on PYTHONPATH), by tests/python/test_reference_glm5_next.py.

usage: glm5_next_reference.py MODEL_DIR LENGTH OUT.pt [--softplus-gate] [--bf16]

--softplus-gate: the KDA forget gate without its lower bound (`linear_lower_bound` None,
`-exp(A_log) * softplus`), the branch the shipped config (-5.0) does not take.
--bf16: the model in bf16 (the modules transformers keeps in fp32 stay fp32), saved so.

The parameters HF initialises to constants are drawn at random first (vary_constants).
OUT.pt holds `version`, `ids` [S], `layer_out` {layer: [S, hc_mult, hidden]} (the
decoder layers' own outputs, from forward hooks), `topk` {layer: [S, W]} (each full
indexer's returned token indices, -1 unused) and `logits` [S, vocab].
"""

import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
import tiny_family

# KDA and MLA layers, a `shared` MLA layer reusing the previous one's selection, a dense
# then MoE feed-forward: every block the reference engine implements.
LAYER_TYPES = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
               "linear_attention", "indexed_attention"]  # fmt: skip
INDEXER_TYPES = ["full", "full", "shared", "full", "full", "full"]
# Low enough that the SwiGLU clamp cuts a share of the gate and up projections of this
# tiny model (the shipped 10 never would at its scale).
SWIGLU_LIMIT = 0.1


def vary_constants(model: torch.nn.Module) -> None:
    """Draws at random what HF initialises to constants and tiny_family leaves alone (norm
    weights and biases, the hyper-connections' biases and scales, the KDA decay rates), so
    that a weight applied in the wrong place or not at all shows in the comparison."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and leaf == "weight":
                p.copy_(1.0 + 0.3 * noise)
            elif "norm" in name and leaf == "bias":
                p.copy_(0.3 * noise)
            elif leaf == "base":
                p.copy_(0.5 * noise)
            elif leaf == "scale":
                p.copy_(1.0 + 0.5 * noise)
            elif leaf == "fn":
                p.mul_(5.0)
            elif leaf == "A_log":
                p.copy_(0.5 * noise)


def main() -> None:
    model_dir, length, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    gate = {"linear_lower_bound": None} if "--softplus-gate" in sys.argv[4:] else {}
    dtype = torch.bfloat16 if "--bf16" in sys.argv[4:] else torch.float32
    model = tiny_family.glm5_next(
        layers=len(LAYER_TYPES),
        dtype=dtype,
        layer_types=LAYER_TYPES,
        indexer_types=INDEXER_TYPES,
        swiglu_limit=SWIGLU_LIMIT,
        **gate,
    )
    vary_constants(model)
    model.save_pretrained(model_dir)
    ids = tiny_family.prompt(length)
    layers = model.model.language_model.layers
    streams: dict[int, torch.Tensor] = {}
    topk: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda m, a, out, i=i: streams.__setitem__(i, out[0][0].clone()))
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            indexer.register_forward_hook(lambda m, a, out, i=i: topk.__setitem__(i, out[0].long().clone()))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0]
    saved = {"version": transformers.__version__, "ids": ids[0], "layer_out": streams, "topk": topk}
    torch.save({**saved, "logits": logits}, out)


if __name__ == "__main__":
    main()
