"""Precision bisection on the GPU (issue 30): transformers' GLM-5-shaped model at GLM-5 widths,
4 layers (the first dense, 256 routed experts), production in transformers' fine-grained FP8 on
torch._scaled_mm (tests/python/bench_hooks_overhead.py builds the same model), a fault planted
with a forward hook (layer 2's MoE output scaled by 4), bisected by shadowtrace_hooks.bisect.

Times, side by side in one process on one card: an unhooked forward, a plain traced forward
(SHADOWTRACE=1: the fp32 local shadow of every layer), the fp32 reference chain, and each
bisection step (one grafted forward). Every forward computes the logits of the last --last
positions only. Prints one JSON object; the bisection's answer must name mlp_out at layer 2,
or the script exits 1.

usage: python tests/gpu/bisect_h200.py [--tokens N] [--last N] [--tiny]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import bench_hooks_overhead as bench
import torch
from shadowtrace_hooks import bisect, session, startup

LAYER = 2


def synced(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--last", type=int, default=1024)
    parser.add_argument("--tiny", action="store_true", help="small widths: checks the script, not a figure")
    args = parser.parse_args()
    model, ids, device = bench.model_and_prompt(4, args.tokens, args.tiny, None, fp8=True)
    keep = {"logits_to_keep": args.last}
    out: dict = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "tokens": args.tokens,
        "compared_positions": args.last,
        "layers": 4,
        "experts": model.config.n_routed_experts,
        "hidden": model.config.hidden_size,
        "attn": model.config._attn_implementation,
        "production": "transformers FP8 on torch._scaled_mm" if device == "cuda" else "tiny_fp8 emulation",
    }
    with bench.fp8_kernel(device), torch.no_grad():
        model(ids[:, :16])  # warm-up: kernels, allocator
        clean, out["unhooked_s"] = synced(lambda: model(ids, **keep).logits)
        _, again = synced(lambda: model(ids, **keep).logits)
        out["unhooked_s"] = min(out["unhooked_s"], again)
        with tempfile.TemporaryDirectory() as runs:
            assert startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": runs}) is not None
            try:
                model(ids[:, :16])  # attaches the tracer
                _, out["traced_fp32_local_s"] = synced(lambda: model(ids, **keep).logits)
            finally:
                session.stop()
        handle = model.model.layers[LAYER].mlp.register_forward_hook(lambda m, a, o: o * 4.0)
        try:
            reference, out["reference_fp32_chain_s"] = synced(
                lambda: bisect.reference_logits(model, ids, logits_to_keep=args.last)
            )
            stamps: list[tuple[str, float]] = []

            def progress(line: str) -> None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                stamps.append((line, time.perf_counter()))

            started = time.perf_counter()
            result, out["bisect_s"] = synced(
                lambda: bisect.bisect(
                    model,
                    ids,
                    clean=clean,
                    metric="js",
                    last=args.last,
                    reference=reference,
                    progress=progress,
                )
            )
        finally:
            handle.remove()
    steps = [(line.strip(), t) for line, t in stamps if line.strip().startswith("bisect [")]
    times, previous = [], None
    for _, t in steps:
        times.append(t - (previous if previous is not None else stamps[0][1]))
        previous = t
    out |= {
        "target": str(result.target),
        "summary": result.summary(),
        "steps": [line for line, _ in steps],
        "step_s": times,
        "step_mean_s": sum(times) / len(times) if times else None,
        "setup_s": (stamps[0][1] - started) if stamps else None,
        "ratio_step_to_traced": (sum(times) / len(times)) / out["traced_fp32_local_s"] if times else None,
        "ratio_step_to_unhooked": (sum(times) / len(times)) / out["unhooked_s"] if times else None,
    }
    print(json.dumps(out, indent=1))
    named = result.named()
    return 0 if named is not None and (named.site, named.layers) == ("mlp_out", (LAYER, LAYER)) else 1


if __name__ == "__main__":
    sys.exit(main())
