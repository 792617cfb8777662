"""Runs a tiny random model of the rest of the family (tiny_family.py) on a random prompt and
saves what it computed: the traced process of the family's end-to-end tests. Tracing is
whatever the environment says (SHADOWTRACE=1 activates it through the installed
shadowtrace_hooks.pth; this script never imports shadowtrace), and so is the transformers
release (5.24, installed apart, first on PYTHONPATH).

usage: trace_family.py MODEL LENGTH OUT.pt [--generate N] [--nan-layer L --nan-token T]
                       [--prefix M [--stale-layer J] [--stale-by D]] [--fp32]

Without --prefix: one forward over the prompt (use_cache=True), then, with --generate N,
greedy generation of N tokens from the same prompt.

With --prefix M (context 004's prefix-cache hit): the prompt computed from scratch
(generate, a cache miss), then a forward over its first M tokens that fills a cache, a
copy of which serves the same prompt again (generate with that cache: a hit that computes
only the last LENGTH - M tokens). --stale-layer J then serves it once more from a copy
with stale state planted: layer J's recurrent state (and convolution window) as they were
D tokens earlier (--stale-by, default 8), the checkpoint an engine restores when its
bookkeeping is off.

OUT.pt holds a dict: `version`, `logits` (the forward's, or per generated token), `ids`
(generated), `cache` (every tensor of the forward's cache), and with --prefix `miss`,
`hit` (and `stale_hit`): each generation's logits per token and its ids.
"""

import argparse
import copy
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
import tiny_family


def cache_tensors(cache: object) -> list[torch.Tensor]:
    """Every tensor the cache holds, layer by layer (dicts of states included)."""
    out = []
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            values = value.values() if isinstance(value, dict) else [value]
            out += [v.clone() for v in values if isinstance(v, torch.Tensor)]
    return out


def generate(model: torch.nn.Module, ids: torch.Tensor, n: int, **kwargs: object) -> object:
    return model.generate(ids, max_new_tokens=n, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, **kwargs)  # fmt: skip


def stale(cache: object, earlier: object, layer: int) -> None:
    """Layer `layer`'s linear-attention state in `cache` replaced by `earlier`'s."""
    now, then = cache.layers[layer], earlier.layers[layer]
    for name in ("recurrent_states", "conv_states"):
        for i, value in getattr(then, name).items():
            if value is not None:
                getattr(now, name)[i].copy_(value)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", choices=["glm5_next", "deepseek_v4", "qwen3_5_moe", "t5"])
    parser.add_argument("length", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--generate", type=int, default=0)
    parser.add_argument("--nan-layer", type=int)
    parser.add_argument("--nan-token", type=int, default=0)
    parser.add_argument("--prefix", type=int)
    parser.add_argument("--stale-layer", type=int)
    parser.add_argument("--stale-by", type=int, default=8)
    parser.add_argument("--fp32", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # bit-identical logits across processes need one reduction order
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    model = tiny_family.t5() if args.model == "t5" else getattr(tiny_family, args.model)(dtype=dtype)
    if args.nan_layer is not None:
        # A test-only fault, registered before tracing attaches: the traced layer_out holds it.
        def plant(module: object, inputs: object, output: object) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            hidden[0, args.nan_token].view(-1)[7] = float("nan")

        layers = model.model.language_model.layers if args.model == "glm5_next" else model.model.layers
        layers[args.nan_layer].register_forward_hook(plant)
    ids = tiny_family.prompt(args.length)
    saved: dict = {"version": transformers.__version__}
    with torch.no_grad():
        if args.model == "t5":
            out = model(input_ids=ids, decoder_input_ids=ids[:, :8])
            saved["logits"] = out.logits
        elif args.prefix is None:
            out = model(ids, use_cache=True)
            saved["logits"] = out.logits
            # `cache` from transformers 5.24, `past_key_values` before
            saved["cache"] = cache_tensors(out.cache if hasattr(out, "cache") else out.past_key_values)
            if args.generate:
                gen = generate(model, ids, args.generate)
                saved["gen_logits"], saved["ids"] = torch.stack(gen.logits), gen.sequences
        else:
            runs = {"miss": generate(model, ids, args.generate)}
            warm = model(ids[:, : args.prefix], use_cache=True).cache
            runs["hit"] = generate(model, ids, args.generate, cache=copy.deepcopy(warm))
            if args.stale_layer is not None:
                earlier = model(ids[:, : args.prefix - args.stale_by], use_cache=True).cache
                cache = copy.deepcopy(warm)
                stale(cache, earlier, args.stale_layer)
                runs["stale_hit"] = generate(model, ids, args.generate, cache=cache)
            for name, run in runs.items():
                saved[name] = {"logits": torch.stack(run.logits), "ids": run.sequences}
    torch.save(saved, args.out)


if __name__ == "__main__":
    main()
