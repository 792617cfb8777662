"""A tiny GLM-5 checkpoint run with tensor parallelism under torchrun (CPU: gloo), the
traced process of the multi-rank tests. Tracing is whatever the environment says.

usage: torchrun --nproc-per-node N tp_tiny.py MODEL_DIR LENGTH LOGITS.pt [--nan-layer L --nan-token T]
       python tp_tiny.py --save MODEL_DIR     (writes the checkpoint first)
"""

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import tiny_models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("length", type=int, nargs="?")
    parser.add_argument("logits", type=Path, nargs="?")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--nan-layer", type=int)
    parser.add_argument("--nan-token", type=int, default=0)
    args = parser.parse_args()
    if args.save:
        tiny_models.glm().save_pretrained(args.model_dir)
        return
    from transformers import GlmMoeDsaForCausalLM

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    kwargs = {"tp_plan": "auto"} if world > 1 else {}
    model = GlmMoeDsaForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16, **kwargs).eval()
    model.config._attn_implementation = "eager"
    if args.nan_layer is not None:

        def plant(module, inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            hidden[0, args.nan_token, 7] = float("nan")

        model.model.layers[args.nan_layer].register_forward_hook(plant)
    with torch.no_grad():
        logits = model(tiny_models.prompt(args.length)).logits
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(logits, args.logits)


if __name__ == "__main__":
    main()
