"""Runs a tiny random HF model on a random prompt and saves what it computed: the traced
process of the hooks' end-to-end tests. Tracing is whatever the environment says
(SHADOWTRACE=1 activates it through the installed shadowtrace_hooks.pth; this script
never imports shadowtrace). Which transformers runs is whatever the environment says too
(a release installed apart goes first on PYTHONPATH).

usage: trace_tiny.py glm|deepseek LENGTH OUT.pt [--nan-layer L --nan-token T] [--generate N]
                     [--prompt-lookup N --repeat-prompt P] [--count-hooks] [--forwards N]
                     [--engine-sigterm]

With --forwards N the prefill runs N times (N requests), printing `done I` after each
(for the fault tests, which kill the process between or during them); --engine-sigterm
installs a SIGTERM handler that raises SystemExit, as serving engines do.

OUT.pt holds a dict: `logits` (the forward's, or generate's per step), `ids` (generated
ids), `version` (transformers'), `cache` (every tensor of the KV cache after the forward,
in order), `hook_calls` (with --count-hooks: calls of forward hooks a user registered on
every layer's self_attn and mlp).
"""

import argparse
import hashlib
import signal
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
import tiny_models


def cache_tensors(cache: object) -> list[torch.Tensor]:
    """Every tensor the cache holds, layer by layer, in attribute order."""
    out = []
    for layer in getattr(cache, "layers", []):
        out += [v.clone() for v in vars(layer).values() if isinstance(v, torch.Tensor)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", choices=["glm", "deepseek"])
    parser.add_argument("length", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--nan-layer", type=int)
    parser.add_argument("--nan-token", type=int, default=0)
    parser.add_argument("--generate", type=int, default=0)
    parser.add_argument(
        "--prompt-lookup",
        type=int,
        default=0,
        metavar="N",
        help="generate with prompt-lookup drafts of N tokens (rejected drafts crop the cache)",
    )
    parser.add_argument(
        "--repeat-prompt", type=int, metavar="P", help="the prompt: its first P tokens, repeated"
    )
    parser.add_argument("--count-hooks", action="store_true")
    parser.add_argument("--forwards", type=int, default=1)
    parser.add_argument("--engine-sigterm", action="store_true")
    parser.add_argument(
        "--poison-slot0",
        type=int,
        metavar="LAYER",
        help="at the first decode step, write NaN into slot 0 of LAYER's cached keys",
    )
    parser.add_argument("--digest-only", action="store_true", help="print the logits' sha256, save nothing")
    args = parser.parse_args()
    if args.engine_sigterm:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    torch.set_num_threads(1)  # bit-identical logits across processes need one reduction order
    model = getattr(tiny_models, args.model)()
    if args.nan_layer is not None:
        # A test-only fault: registered before tracing attaches, so the traced layer_out
        # already holds it.
        def plant(module, inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            hidden[0, args.nan_token, 7] = float("nan")

        model.model.layers[args.nan_layer].register_forward_hook(plant)
    if args.poison_slot0 is not None:
        # A test-only fault, as a padding row's write into a reserved slot does (contexts 000,
        # 001): after the layer ran at the first decode step, its cached keys of slot 0 hold NaN.
        def poison(module, inputs, kwargs, output):
            cache = kwargs.get("cache") or kwargs.get("past_key_values")
            keys = cache.layers[args.poison_slot0].keys
            if keys.shape[-2] == args.length + 1:
                keys[..., 0, :] = float("nan")

        model.model.layers[args.poison_slot0].register_forward_hook(poison, with_kwargs=True)
    calls = {"self_attn": 0, "mlp": 0}
    if args.count_hooks:
        for layer in model.model.layers:
            for name in calls:

                def count(module, inputs, output, name=name):
                    calls[name] += 1

                getattr(layer, name).register_forward_hook(count)
    ids = tiny_models.prompt(args.length)
    if args.repeat_prompt:
        ids = ids[:, : args.repeat_prompt].repeat(1, -(-args.length // args.repeat_prompt))[:, : args.length]
    saved = {"version": transformers.__version__, "hook_calls": calls}
    with torch.no_grad():
        if args.generate:
            drafts = {"prompt_lookup_num_tokens": args.prompt_lookup} if args.prompt_lookup else {}
            out = model.generate(ids, max_new_tokens=args.generate, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, **drafts)  # fmt: skip
            saved["logits"] = torch.stack(out.logits)
            saved["ids"] = out.sequences
        else:
            for i in range(args.forwards):
                out = model(ids, use_cache=True)
                print(f"done {i}", flush=True)
            saved["logits"] = out.logits
            saved["cache"] = cache_tensors(getattr(out, "cache", None) or out.past_key_values)
    if args.digest_only:
        print("logits", hashlib.sha256(saved["logits"].float().numpy().tobytes()).hexdigest(), flush=True)
    else:
        torch.save(saved, args.out)


if __name__ == "__main__":
    main()
