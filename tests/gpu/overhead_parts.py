"""Where capture only's extra forward time goes: the bench_hooks_overhead.py model timed in one
process per variant, with the host time of each hook body summed by capture, and ablations that
remove one piece of work each.

The ablations skip work the traced rows need, so they are diagnoses, never figures for a
goal: each variant's line says what it left out.

- unhooked: no hooks (the interpreter starts without site processing, as the benchmark's);
- capture: SHADOWTRACE=1, SHADOWTRACE_SHADOW=none, as the benchmark's row;
- settled: capture, waiting outside the timed forward for the previous run's writer to finish
  (what the writer thread costs the next forward);
- no-sentinel: capture without the KV sentinel checks;
- switch: capture with sys.setswitchinterval(0.0005) (how much the writer thread's hold on
  the GIL delays the forward's launches);
- no-parquet: capture with the writer's Parquet encoding skipped (empty part files);
- no-decode: capture with the writer dropping each shipment once it arrived, undecoded.

Each traced variant also prints its writer threads' CPU time and busy time per run (from the
thread's start to its end, less the time it waited for work).

usage: python tests/gpu/overhead_parts.py [--layers 4] [--tokens 8192] [--repeat 4]
       [--variants unhooked,capture,settled,no-sentinel,switch] [--tiny]
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
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import bench_hooks_overhead as bench

CAPTURE = {"SHADOWTRACE": "1", "SHADOWTRACE_SHADOW": "none"}
VARIANTS = {
    "unhooked": (None, "no hooks"),
    "capture": (CAPTURE, "nothing left out"),
    "settled": (CAPTURE, "the writer's work is waited for between forwards, untimed"),
    "no-sentinel": (CAPTURE, "no KV sentinel checks"),
    "switch": (CAPTURE, "GIL switch interval 0.5 ms instead of 5 ms"),
    "no-parquet": (CAPTURE, "no Parquet encoding or writing"),
    "no-decode": (CAPTURE, "shipments dropped on arrival: no decoding, no Parquet"),
}


def child(args: argparse.Namespace) -> None:
    import torch

    variant = args.child
    host: dict[str, float] = defaultdict(float)
    writers: list[tuple[float, float]] = []
    calls: dict[str, int] = defaultdict(int)
    if variant != "unhooked":
        from shadowtrace_hooks import session, writer
        from shadowtrace_hooks.adapters import hf

        inner = session.Session.guarded

        def guarded(self, key, run, fn, *a, **kw):
            name = key.rsplit(":", 1)[0] if key.rsplit(":", 1)[-1].isdigit() else key
            start = time.perf_counter()
            try:
                return inner(self, key, run, fn, *a, **kw)
            finally:
                host[name] += time.perf_counter() - start
                calls[name] += 1

        session.Session.guarded = guarded
        if variant == "no-sentinel":
            hf._Tracer._record_sentinels = lambda self, layer, step: None
        if variant == "switch":
            sys.setswitchinterval(0.0005)
        if variant == "no-parquet":
            writer.pq.ParquetWriter.write_table = lambda self, table, row_group_size=None: None
        if variant == "no-decode":
            writer.RunWriter._write_deferred = lambda self, payload: payload.shipment.arrays() and None
        run_worker = writer.RunWriter._run

        def timed_worker(self):
            cpu, wall = time.thread_time(), time.perf_counter()
            waited = [0.0]
            ready = self._ready
            wait = ready.wait

            def counted_wait(timeout=None):
                start = time.perf_counter()
                try:
                    return wait(timeout)
                finally:
                    waited[0] += time.perf_counter() - start

            ready.wait = counted_wait
            try:
                run_worker(self)
            finally:
                busy = time.perf_counter() - wall - waited[0]
                writers.append((time.thread_time() - cpu, busy))

        writer.RunWriter._run = timed_worker
    model, ids, device = bench.model_and_prompt(args.layers, args.tokens, args.tiny, attn="eager")
    cuda = device == "cuda"
    walls, parts = [], []
    for i in range(args.repeat + 1):
        if variant == "settled":
            session.current().wait_closed(time.monotonic() + 120)
        if cuda:
            torch.cuda.synchronize()
        host.clear()
        calls.clear()
        start = time.perf_counter()
        with torch.no_grad():
            model(ids, logits_to_keep=1)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        if i:
            walls.append(wall)
            parts.append({k: (calls[k], v) for k, v in host.items()})
    if variant != "unhooked":  # every run written, so its writer's times are in
        session.current().wait_closed(time.monotonic() + 120)
    print(json.dumps({"walls": walls, "parts": parts, "writers": writers}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tiny", action="store_true", help="small widths: checks the script, not a figure")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; expected some of {list(VARIANTS)}")
    if "unhooked" not in chosen:
        chosen.insert(0, "unhooked")
    base = [__file__, "--layers", str(args.layers), "--tokens", str(args.tokens)]
    base += ["--repeat", str(args.repeat)]
    base += ["--tiny"] if args.tiny else []
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE")}
    paths = os.pathsep.join(site.getsitepackages() + [p for p in sys.path if p])
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            env, _ = VARIANTS[name]
            print(f"running: {name}", file=sys.stderr, flush=True)
            if env is None:
                cmd, environ = [sys.executable, "-S", *base, "--child", name], {**clean, "PYTHONPATH": paths}
            else:
                environ = {**clean, **env, "SHADOWTRACE_DIR": str(Path(tmp) / name)}
                cmd = [sys.executable, *base, "--child", name]
            out = subprocess.run(cmd, env=environ, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(f"{name}: the process failed:\n{out.stderr[-4000:]}", file=sys.stderr)
                return 1
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    wall0 = statistics.median(results["unhooked"]["walls"])
    print(f"{args.layers} layers, {args.tokens} tokens, median of {args.repeat} forwards after one warm-up")
    print(f"  {'variant':12} {'wall s':>8} {'ratio':>7}  left out")
    for name, r in results.items():
        wall = statistics.median(r["walls"])
        print(f"  {name:12} {wall:8.4f} {wall / wall0:6.3f}x  {VARIANTS[name][1]}")
        if r["writers"]:
            cpu = statistics.median(c for c, _ in r["writers"])
            busy = statistics.median(b for _, b in r["writers"])
            print(f"      writer thread per run: cpu {cpu * 1e3:.1f} ms, busy {busy * 1e3:.1f} ms")
        if r["parts"]:
            last = r["parts"][-1]
            for key, (n, seconds) in sorted(last.items(), key=lambda kv: -kv[1][1]):
                print(f"      host {key:28} calls {n:4}  {seconds * 1e3:8.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
