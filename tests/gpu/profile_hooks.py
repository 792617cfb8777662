"""Where a traced forward's extra time goes: one forward of the GLM-5-shaped transformers model
of bench_hooks_overhead.py under torch.profiler, per mode, each in a process of its own.

Every hook body of the HF adapter runs inside `Session.guarded`; this script wraps that call
in a `record_function` named after the capture (`st:<key>`, the layer number dropped), so the
table shows how much host and device time each capture costs beside the model's own ops. It
also counts the host syncs the forward made (`cudaStreamSynchronize`, `cudaMemcpyAsync` to
pageable memory show as long CPU rows), and on CUDA how long the device ran no kernel during
the forward, with its longest gaps and the kernels on either side (`--gaps`).

usage: python tests/gpu/profile_hooks.py [--layers 4] [--tokens 8192] [--modes unhooked,capture,on]
       [--rows 30] [--gaps 12] [--inside fn:selection._gap_coded,...] [--tiny] [--fp8] [--attn IMPL]

The model is bench_hooks_overhead.py's, with its attention (default the model's own, SDPA) and
with --fp8 its FP8 production (transformers' FP8 modules on torch._scaled_mm).

The figures are a profile's (the profiler adds its own cost): read them as shares, and take
ratios from bench_hooks_overhead.py.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import bench_hooks_overhead as bench

MODES = {
    "unhooked": {},
    "capture": {"SHADOWTRACE": "1", "SHADOWTRACE_SHADOW": "none"},
    "on": {"SHADOWTRACE": "1", "SHADOWTRACE_SHADOW_SCOPE": "indexer"},
    "local": {"SHADOWTRACE": "1"},
}


def child(args: argparse.Namespace) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    if os.environ.get("SHADOWTRACE"):
        from shadowtrace_hooks import session

        inner = session.Session.guarded

        def guarded(self, key, run, fn, *a, **kw):
            # one row per capture, whatever the layer: "indexer_shadow:3" -> "st:indexer_shadow"
            name = key.rsplit(":", 1)[0] if key.rsplit(":", 1)[-1].isdigit() else key
            with record_function("st:" + name):
                return inner(self, key, run, fn, *a, **kw)

        session.Session.guarded = guarded
        # The device work inside the captures, a row each (callers look these names up at
        # call time, so wrapping the module attribute reaches every call).
        from shadowtrace_hooks import kernels, numerics, selection, shadow, stats

        def wrap(module, name):
            fn = getattr(module, name)

            def wrapped(*a, **kw):
                with record_function(f"fn:{module.__name__.rsplit('.', 1)[-1]}.{name}"):
                    return fn(*a, **kw)

            setattr(module, name, wrapped)

        for module, names in (
            (
                selection,
                (
                    "compare",
                    "_selected",
                    "_kth",
                    "_shadow_top",
                    "_margin",
                    "_kth_from_top",
                    "_near",
                    "_gap_coded",
                    "columns",
                ),
            ),
            (
                stats,
                ("counts_device", "hidden_device", "events_device", "site_device", "slot_nonfinite_device"),
            ),
            (numerics, ("index_scores", "causal_mask")),
            (shadow, ("indexer_scores",)),
            (
                kernels,
                ("index_scores", "row_stats", "membership", "compare_masks", "gap_code", "slot_counts"),
            ),
        ):
            for name in names:
                if hasattr(module, name):
                    wrap(module, name)
    model, ids, device = bench.model_and_prompt(args.layers, args.tokens, args.tiny, args.attn, args.fp8)
    if args.fp8:  # production's FP8 modules on the benchmark's kernel for the whole process
        kernel = bench.fp8_kernel(device)
        kernel.__enter__()

    def forward() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model(ids, logits_to_keep=1)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    forward()
    plain = sorted(forward() for _ in range(2))[0]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        profiled = forward()
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    print(f"forward {plain:.3f} s unprofiled, {profiled:.3f} s profiled")
    print(events.table(sort_by=sort, row_limit=args.rows, max_name_column_width=60))
    ranges = [e for e in events if e.key.startswith(("st:", "fn:"))]
    print("captures (host total, device total of the kernels they launched):")
    for e in sorted(ranges, key=lambda e: -e.cpu_time_total):
        dev = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))
        host = e.cpu_time_total / 1e3
        print(f"  {e.key:40} calls {e.count:5}  host {host:8.1f} ms  device {dev / 1e3:8.1f} ms")
    if device == "cuda":
        idle(prof, args.gaps)
        for name in filter(None, args.inside.split(",")):
            inside(prof, name, args.rows)
    waits = [e for e in events if "Synchron" in e.key or "Memcpy" in e.key]
    syncs = {e.key: (e.count, e.cpu_time_total / 1e3) for e in waits}
    print("syncs and copies:", json.dumps(syncs))


def idle(prof, shown: int) -> None:
    """How long the GPU ran no kernel during the profiled forward (the union of every
    stream's kernels against the span from the first to the last), and the longest gaps
    with the kernels on either side: where the device waited for the host."""
    from torch.autograd import DeviceType

    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
        and not e.name.startswith(("st:", "fn:"))
    )  # fmt: skip
    if not kernels:
        return
    busy, gaps, end, last = 0.0, [], kernels[0][0], kernels[0][2]
    for start, stop, name in kernels:
        if start > end:
            gaps.append((start - end, last, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, last = stop, name
    span = end - kernels[0][0]
    print(f"device busy {busy / 1e3:.1f} ms of {span / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms "
          f"in {len(gaps)} gaps")  # fmt: skip
    for gap, before, after in sorted(gaps, reverse=True)[:shown]:
        print(f"  gap {gap / 1e3:7.2f} ms after {before[:60]} before {after[:60]}")


def inside(prof, name: str, shown: int) -> None:
    """The kernels launched within every range `name` (a capture's `st:` row or a function's
    `fn:` row), by device time: what a row's device total is made of."""
    totals: dict[str, list] = {}
    for event in prof.events():
        if event.name != name:
            continue
        stack = [event]
        while stack:
            op = stack.pop()
            for kernel in op.kernels:
                total = totals.setdefault(kernel.name, [0, 0.0])
                total[0] += 1
                total[1] += kernel.duration
            stack.extend(op.cpu_children)
    print(f"kernels inside {name}:")
    for kernel, (n, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:shown]:
        print(f"  {us / 1e3:8.2f} ms  calls {n:5}  {kernel[:100]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--modes", default="unhooked,capture,on")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--gaps", type=int, default=12, help="longest device idle gaps listed")
    parser.add_argument("--inside", default="", help="comma list of ranges whose kernels are listed")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--fp8", action="store_true", help="transformers' FP8 production, as the benchmark's --fp8"
    )
    parser.add_argument("--attn", help="attention implementation (default: the model's own, sdpa)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE")}
    status = 0
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--child", "--layers", str(args.layers)]
        cmd += ["--tokens", str(args.tokens), "--rows", str(args.rows), "--gaps", str(args.gaps)]
        cmd += ["--inside", args.inside]
        cmd += ["--tiny"] if args.tiny else []
        cmd += ["--fp8"] if args.fp8 else []
        cmd += ["--attn", args.attn] if args.attn else []
        env = {**clean, **MODES[mode], "SHADOWTRACE_DIR": f"/tmp/profile-runs/{mode}"}
        print(f"===== {mode}: {MODES[mode]}", flush=True)
        out = subprocess.run(cmd, env=env, check=False)
        status = status or out.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
