"""Forward time, memory and bytes written of a GLM-5-shaped transformers model, traced six
ways, each in a process of its own:

- unhooked: the interpreter starts without site processing (-S), so shadowtrace_hooks.pth
  never runs (the site-packages are put on PYTHONPATH instead);
- installed, SHADOWTRACE unset: the .pth runs and imports nothing;
- capture only: SHADOWTRACE=1 with SHADOWTRACE_SHADOW=none (production statistics at every
  site and token, production top-k summaries and boundaries, no shadow);
- On: SHADOWTRACE=1 with SHADOWTRACE_SHADOW_SCOPE=indexer (issue 15's "On": per-token
  statistics at every site, the fp32 local indexer shadow and the top-k overlap, no layer
  re-run);
- fp32 local shadow: SHADOWTRACE=1 with the defaults (every layer, site and token; each
  layer and the indexer re-run in fp32 on production's input);
- fp32 local,free: the same with the free chain from the embeddings as well;
- bf16 local shadow: SHADOWTRACE_SHADOW=bf16.

Weights are random, seeded identically in each process, in bf16, at GLM-5's widths (read
from transformers' GlmMoeDsaConfig defaults: 256 routed experts, 8 per token) with
--layers layers, the first dense. Prints per process the seconds per forward (median of
--repeat after one warm-up) and its ratio to the unhooked process; the extra peak memory
over the unhooked process (CUDA: torch's peak allocated; CPU: the kernel's peak resident
set, VmHWM); the bytes each traced forward wrote; and what tracing did not do: disabled
captures with their reason, dropped rows, shadows that did not run. Exits 1 when any
capture was disabled, a row was dropped, a run was not complete or wrote fewer rows than
the model's layers, sites and tokens call for, or a slower path ran than the row claims
(work that was claimed and skipped). Prints
the bytes written per layer and 1k tokens, what computed the statistics and the shadow's
indexer scores (a Triton kernel or torch's ops, from the manifests), what fell back to a
slower path (production's indexer scores recomputed because their capture failed, a kernel
that raised), and issue 15's goals, each met or
missed: installed and off <= 1.01x, capture only <= 1.05x, On <= 1.15x, and issue 14's
volume goal (default settings, 8192 tokens: <= 1 MB per layer). Goals do not set the exit
status; skipped work does.

usage: python tests/python/bench_hooks_overhead.py [--layers 4] [--tokens 8192] [--repeat 3]
       [--fp8] [--attn IMPL] [--tiny] [--only NAME,...] [--keep-runs DIR]

--fp8 converts the model to transformers' fine-grained FP8 (e4m3, 128x128 block scales) by
transformers' own code (tests/python/tiny_fp8.convert), and production runs transformers'
FP8 modules on PyTorch's block-scaled `torch._scaled_mm` behind the hub kernel's entry points
(tests/python/fp8_kernel.py; on the CPU, tiny_fp8's emulation of the same definition); the
hub kernel itself cannot be fetched here. --attn sets the attention implementation (default:
the model's own, SDPA for GLM-5 in transformers 5.17; `eager` is 1.64x slower at 8192 tokens,
and ratios against it flatter the hooks). The header names both. A fallback (production's
indexer scores recomputed, a kernel that raised) fails the run as skipped work does.

--tiny runs small widths on whatever device there is: a check of the script, not a figure.
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

TINY = {
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64, "n_routed_experts": 16,
    "num_experts_per_tok": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
    "kv_lora_rank": 32, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32, "index_n_heads": 4,
    "vocab_size": 1024,
}  # fmt: skip
# name -> SHADOWTRACE* variables (None: the unhooked interpreter, without site processing)
MODES = {
    "unhooked": None,
    "installed, SHADOWTRACE unset": {},
    "capture only (SHADOW=none)": {"SHADOWTRACE": "1", "SHADOWTRACE_SHADOW": "none"},
    "On (fp32 indexer shadow)": {"SHADOWTRACE": "1", "SHADOWTRACE_SHADOW_SCOPE": "indexer"},
    "fp32 local shadow": {"SHADOWTRACE": "1"},
    "fp32 local,free": {"SHADOWTRACE": "1", "SHADOWTRACE_MODE": "local,free"},
    "bf16 local shadow": {"SHADOWTRACE": "1", "SHADOWTRACE_SHADOW": "bf16"},
}
SITES = ("layer_in", "attn_out", "mlp_out", "layer_out")
# (row, ratio at most) of issue 15; the volume goal of issue 14 in bytes per layer
GOALS = (("installed, SHADOWTRACE unset", 1.01), ("capture only (SHADOW=none)", 1.05),
         ("On (fp32 indexer shadow)", 1.15))  # fmt: skip
VOLUME_ROW, VOLUME_GOAL, VOLUME_TOKENS = "fp32 local shadow", 1_000_000, 8192
# counters that say a slower path ran instead of the one the row claims
FALLBACKS = (
    "indexer_scores_recomputed",
    "process.kernel_failed.index_scores",
    "process.kernel_failed.row_stats",
    "process.kernel_failed.membership",
    "process.kernel_failed.compare_masks",
    "process.kernel_failed.gap_code",
    "process.kernel_failed.slot_counts",
)
# manifest settings that name what computed a row's numbers (a Triton kernel or torch's ops)
KERNEL_SETTINGS = ("hidden_stats", "shadow_indexer_scores", "shadow_indexer_projections", "prod_fp8_kernel")


def _rss(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def model_and_prompt(
    layers: int, tokens: int, tiny: bool, attn: str | None = None, fp8: bool = False
) -> tuple:
    """(model, prompt ids, device): the GLM-5-shaped model every row times, seeded alike in
    each process (tests/gpu/profile_hooks.py profiles the same); with `fp8`, converted to
    transformers' fine-grained FP8 by transformers' own code."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    overrides = {"num_hidden_layers": layers, "first_k_dense_replace": 1}
    if tiny:
        overrides |= TINY
        if fp8:
            # FP8Experts holds gate and up scales apart: an intermediate size that is not whole
            # 128-blocks gets a grid the quantizer's fused one does not match (GLM-5's 2048 is).
            overrides["moe_intermediate_size"] = 128
    config = GlmMoeDsaConfig(**overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = GlmMoeDsaForCausalLM._from_config(
            config, dtype=torch.bfloat16, attn_implementation=attn
        ).eval()
    if fp8:
        import tiny_fp8

        model, _ = tiny_fp8.convert(model)
        if device == "cuda":
            torch.cuda.empty_cache()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=gen).to(device)
    return model, ids, device


def fp8_kernel(device: str):
    """What production's FP8 modules run on: `torch._scaled_mm` on CUDA, tiny_fp8's
    emulation of the same definition elsewhere (module docs)."""
    if device == "cuda":
        import fp8_kernel

        return fp8_kernel.tensor_core_kernel()
    import tiny_fp8

    return tiny_fp8.kernel_emulated()


def child(args: argparse.Namespace) -> None:
    import contextlib

    model, ids, device = model_and_prompt(args.layers, args.tokens, args.tiny, args.attn, args.fp8)
    with fp8_kernel(device) if args.fp8 else contextlib.nullcontext():
        timed(args, model, ids, device)


def timed(args: argparse.Namespace, model, ids, device: str) -> None:
    import torch

    config = model.config
    times = []
    peak = 0
    for i in range(args.repeat + 1):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            before = _rss("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        start = time.perf_counter()
        with torch.no_grad():
            logits = model(ids, logits_to_keep=1).logits
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if i:  # the warm-up's peak holds one-time allocations
            used = torch.cuda.max_memory_allocated() if device == "cuda" else _rss("VmHWM")
            peak = max(peak, used - before)
        del logits
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(json.dumps({"seconds": times[1:], "peak": peak, "weights": weights, "device": name,
                      "forwards": args.repeat + 1, "experts": config.n_routed_experts,
                      "attn": config._attn_implementation}))  # fmt: skip


def expected_rows(env: dict, layers: int, tokens: int) -> dict[str, int]:
    """Rows one forward must write in a mode: every site and token of every layer (each
    shadowed site once per shadow mode; layer_in is recorded for prod only), one top-k row
    per query token and layer, the kept logits row."""
    shadowed = env.get("SHADOWTRACE_SHADOW", "fp32") != "none"
    shadowed = shadowed and env.get("SHADOWTRACE_SHADOW_SCOPE", "layer") == "layer"
    modes = len(env.get("SHADOWTRACE_MODE", "local").split(",")) if shadowed else 1
    per_layer = 1 + (len(SITES) - 1) * modes
    return {"hidden": layers * per_layer * tokens, "topk": layers * tokens, "logits": 1}


def audit(
    runs: Path, env: dict, args: argparse.Namespace, forwards: int
) -> tuple[int, list[str], dict[str, int], set[str]]:
    """Bytes the mode's runs hold, every way they fall short of what was timed, the
    fallbacks they took (counter totals) and what computed their numbers (`KERNEL_SETTINGS`)."""
    problems = []
    fallbacks: dict[str, int] = {}
    computed: set[str] = set()
    manifests = sorted(runs.glob("*/manifest.json"))
    if len(manifests) != forwards:
        problems.append(f"{len(manifests)} runs for {forwards} forwards")
    size = sum(p.stat().st_size for p in runs.rglob("*") if p.is_file())
    want = expected_rows(env, args.layers, args.tokens)
    for path in manifests:
        m = json.loads(path.read_text())
        rid = m["run_id"]
        for key, reason in (m["settings"].get("disabled_sites") or {}).items():
            problems.append(f"{rid}: capture {key} disabled: {reason}")
        if m["status"] != "complete":
            problems.append(f"{rid}: status {m['status']}")
        counters = m["counters"]
        for name in ("hook_errors", "dropped_rows", "sites_disabled", "shadow_skipped_decode_steps",
                     "queue_wait_timeouts", "undecoded_shipments",
                     "topk_scores_skipped_capture_failed"):  # fmt: skip
            if counters.get(name):
                problems.append(f"{rid}: {name} = {counters[name]}")
        computed.update(f"{k}: {m['settings'][k]}" for k in KERNEL_SETTINGS if k in m["settings"])
        for name in FALLBACKS:
            if counters.get(name):
                fallbacks[name] = fallbacks.get(name, 0) + counters[name]
        for table, n in want.items():
            got = m["tables"][table]["rows"]
            if got < n:
                problems.append(f"{rid}: {table} has {got} rows, the forward calls for {n}")
    return size, problems, fallbacks, computed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="small widths: checks the script, not a figure")
    parser.add_argument("--fp8", action="store_true", help="transformers' fine-grained FP8 production")
    parser.add_argument("--attn", help="attention implementation (default: the model's own, sdpa)")
    parser.add_argument(
        "--only", help="comma list of the rows to run, each by the start of its name (unhooked always runs)"
    )
    parser.add_argument(
        "--keep-runs", type=Path, help="write the traced runs here instead of a temporary directory"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    base = [__file__, "--child", "--layers", str(args.layers), "--tokens", str(args.tokens)]
    base += (
        ["--repeat", str(args.repeat)] + (["--tiny"] if args.tiny else []) + (["--fp8"] if args.fp8 else [])
    )
    base += ["--attn", args.attn] if args.attn else []
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE")}
    paths = os.pathsep.join(site.getsitepackages() + [p for p in sys.path if p])
    # --only names rows by the start of their names ("installed" for "installed, SHADOWTRACE unset")
    wanted = [w.strip() for w in (args.only or "").split(",") if w.strip()]
    chosen = {
        k: v for k, v in MODES.items() if v is None or not wanted or any(k.startswith(w) for w in wanted)
    }
    results, audits = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep_runs or Path(tmp)
        for i, (name, env) in enumerate(chosen.items()):
            print(f"running: {name}", file=sys.stderr, flush=True)
            runs = root / f"mode-{i}"
            if env is None:
                cmd, environ = [sys.executable, "-S", *base], {**clean, "PYTHONPATH": paths}
            else:
                cmd, environ = [sys.executable, *base], {**clean, **env, "SHADOWTRACE_DIR": str(runs)}
            out = subprocess.run(cmd, env=environ, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(f"{name}: the process failed:\n{out.stderr[-4000:]}", file=sys.stderr)
                return 1
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
            if env and env.get("SHADOWTRACE"):
                audits[name] = audit(runs, env, args, results[name]["forwards"])
            elif env is not None and runs.exists():
                audits[name] = (0, [f"SHADOWTRACE unset wrote {runs}"], {}, set())
    first = results["unhooked"]
    precision = (
        "production FP8 (transformers' fine-grained FP8 on torch._scaled_mm; the emulation off CUDA)"
        if args.fp8
        else "production bf16"
    )
    print(
        f"GLM-5 widths{' (tiny)' if args.tiny else ''}, {args.layers} layers (first dense), "
        f"{first['experts']} experts, {args.tokens} tokens, {first['device']}, {precision}, "
        f"attention {first['attn']}, weights {first['weights'] / 2**30:.2f} GiB, "
        f"median of {args.repeat} forwards after one warm-up"
    )
    base_time = statistics.median(first["seconds"])
    print(f"  {'process':30} {'s/forward':>9} {'ratio':>7} {'extra peak':>13} {'written/forward':>15} "
          f"{'per layer, 1k tok':>17}")  # fmt: skip
    failed = False
    ratios, per_layer = {}, {}
    for name, r in results.items():
        median = statistics.median(r["seconds"])
        ratios[name] = median / base_time
        extra = (r["peak"] - first["peak"]) / 2**20
        size, problems, fallbacks, computed = audits.get(name, (0, [], {}, set()))
        written, rate = f"{'-':>15}", f"{'-':>17}"
        if name in audits:
            per_forward = size / r["forwards"]
            per_layer[name] = per_forward / args.layers
            written = f"{per_forward / 2**20:11.2f} MiB"
            rate = f"{per_layer[name] / (args.tokens / 1000) / 1e3:13.1f} kB"
        print(f"  {name:30} {median:9.3f} {ratios[name]:6.3f}x {extra:9.1f} MiB {written} {rate}")
        for counter, n in fallbacks.items():
            print(f"      FALLBACK: {counter} = {n} (a slower path than the row claims)")
        for how in sorted(computed):
            print(f"      computed by {how}")
        for p in problems:
            print(f"      NOT DONE: {p}")
        failed = failed or bool(problems) or bool(fallbacks)
    print(goals(ratios, per_layer, args))
    if failed:
        print(
            "traced work was skipped, or a slower path ran (above): these figures do not time what they claim"
        )
    return 1 if failed else 0


def goals(ratios: dict[str, float], per_layer: dict[str, float], args: argparse.Namespace) -> str:
    """Each goal this run measured, met or missed (not a figure with --tiny)."""
    lines = ["goals" + (" (tiny widths: not a figure)" if args.tiny else "") + ":"]
    for name, most in GOALS:
        if name in ratios:
            verdict = "met" if ratios[name] <= most else "missed"
            lines.append(f"  {name}: {ratios[name]:.3f}x, goal <= {most:.2f}x: {verdict}")
    if VOLUME_ROW in per_layer:
        mb = per_layer[VOLUME_ROW] / 1e6
        at = f"at {args.tokens} tokens" + (
            "" if args.tokens == VOLUME_TOKENS else f" (the goal is at {VOLUME_TOKENS})"
        )
        verdict = "met" if per_layer[VOLUME_ROW] <= VOLUME_GOAL else "missed"
        lines.append(f"  volume, {VOLUME_ROW} {at}: {mb:.3f} MB per layer, goal <= 1 MB: {verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
