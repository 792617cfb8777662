"""Forward time of a GLM-5-shaped transformers model in three processes, side by side:

- unhooked: the interpreter starts without site processing (-S), so shadowtrace_hooks.pth
  never runs (the site-packages are put on PYTHONPATH instead);
- installed: the .pth runs with SHADOWTRACE unset, the way every process of an engine
  environment with the hooks installed starts;
- capture only: SHADOWTRACE=1 with SHADOWTRACE_SHADOW=none (production statistics and
  top-k, no shadow);
- tracing: SHADOWTRACE=1 with the default settings (fp32 local shadow, every layer, site
  and token), the run written to a temporary directory.

Weights are random, seeded identically in each process, at GLM-5's widths (read from
transformers' GlmMoeDsaConfig defaults) with few layers. Prints per-process seconds per
forward (median of --repeat after one warm-up) and the ratios to the unhooked process.

usage: python tests/python/bench_hooks_overhead.py [--layers 3] [--tokens 8192] [--repeat 3] [--tiny]
"""

import argparse
import json
import os
import site
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    overrides = {"num_hidden_layers": args.layers, "first_k_dense_replace": 1}
    if args.tiny:  # a CPU check of the script itself, not a figure
        overrides |= {
            "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
            "kv_lora_rank": 32, "index_n_heads": 4, "vocab_size": 1024,
        }  # fmt: skip
    config = GlmMoeDsaConfig(**overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    with torch.device(device):
        model = GlmMoeDsaForCausalLM(config).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=gen).to(device)
    times = []
    for _ in range(args.repeat + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            logits = model(ids, logits_to_keep=1).logits
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(json.dumps({"seconds": times[1:], "logit": float(logits.float().sum()), "device": device}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="small widths: checks the script on a CPU")
    parser.add_argument(
        "--keep-runs", type=Path, help="write the traced runs here instead of a temporary directory"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    base = [__file__, "--child", "--layers", str(args.layers), "--tokens", str(args.tokens)]
    base += ["--repeat", str(args.repeat)] + (["--tiny"] if args.tiny else [])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE")}
    paths = os.pathsep.join(site.getsitepackages() + [p for p in sys.path if p])
    with tempfile.TemporaryDirectory() as tmp:
        runs = str(args.keep_runs or tmp)
        modes = {
            "unhooked": ([sys.executable, "-S", *base], {**clean, "PYTHONPATH": paths}),
            "installed, SHADOWTRACE unset": ([sys.executable, *base], clean),
            "capture only (SHADOW=none)": (
                [sys.executable, *base],
                {**clean, "SHADOWTRACE": "1", "SHADOWTRACE_SHADOW": "none", "SHADOWTRACE_DIR": tmp + "/none"},
            ),
            "tracing (SHADOWTRACE=1)": (
                [sys.executable, *base],
                {**clean, "SHADOWTRACE": "1", "SHADOWTRACE_DIR": runs},
            ),
        }
        results = {}
        for name, (cmd, env) in modes.items():
            print(f"running: {name}", file=sys.stderr, flush=True)
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        traced_runs = len(list(Path(runs).iterdir()))
    first = next(iter(results.values()))
    print(
        f"GLM-5 widths, {args.layers} layers, {args.tokens} tokens, {first['device']}, "
        f"median of {args.repeat}"
    )
    base_time = statistics.median(first["seconds"])
    for name, r in results.items():
        median = statistics.median(r["seconds"])
        print(
            f"  {name:30} {median:8.3f} s/forward  x{median / base_time:.3f}  (logits sum {r['logit']:.6g})"
        )
    print(f"  runs written while tracing: {traced_runs}")


if __name__ == "__main__":
    main()
