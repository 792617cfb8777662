"""Runs a tiny random HF model on a random prompt and saves its logits: the traced
process of the hooks' end-to-end tests. Tracing is whatever the environment says
(SHADOWTRACE=1 activates it through the installed shadowtrace_hooks.pth; this script
never imports shadowtrace).

usage: trace_tiny.py glm|deepseek LENGTH LOGITS.pt [--nan-layer L --nan-token T] [--generate N]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import tiny_models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", choices=["glm", "deepseek"])
    parser.add_argument("length", type=int)
    parser.add_argument("logits", type=Path)
    parser.add_argument("--nan-layer", type=int)
    parser.add_argument("--nan-token", type=int, default=0)
    parser.add_argument("--generate", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # bit-identical logits across processes need one reduction order
    model = getattr(tiny_models, args.model)()
    if args.nan_layer is not None:
        # A test-only fault: registered before tracing attaches, so the traced layer_out
        # already holds it.
        def plant(module, inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            hidden[0, args.nan_token, 7] = float("nan")

        model.model.layers[args.nan_layer].register_forward_hook(plant)
    ids = tiny_models.prompt(args.length)
    with torch.no_grad():
        if args.generate:
            out = model.generate(ids, max_new_tokens=args.generate, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
            logits = torch.stack(out.logits)
        else:
            logits = model(ids).logits
    torch.save(logits, args.logits)


if __name__ == "__main__":
    main()
