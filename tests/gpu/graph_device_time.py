"""Where a traced replayed decode step's time goes on the device (issue 41), on the GPU machine.

The decode graph of `cuda_graphs.py` (transformers' Llama, bf16, hidden 2048, 8 layers, sdpa,
StaticCache), captured untraced and traced (SHADOWTRACE=1 in this process), each replayed by
torch's own C++ replay (`torch._C._CUDAGraph.replay`, under the hooks' patch of the Python
class): no host hook runs, so the figures are the graph's device work alone. Prints, per
capture, the median device time of 20 replays between CUDA events, and the kernels one replay
runs (torch.profiler, CUDA activity) with the largest by time. The runs the traced captures
write miss these replays; nothing reads them.
Usage (the hooks installed, from the repository root): `python tests/gpu/graph_device_time.py`.
"""

import runpy
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPLAYS = 20
TOP = 12


def device_time(d: object) -> list[float]:
    times = []
    for i in range(4, 4 + REPLAYS):
        d.ids.fill_(d.tokens[i])
        d.position.fill_(d.prompt.shape[1] + i)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch._C._CUDAGraph.replay(d.graph)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def kernels(d: object) -> list:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            torch._C._CUDAGraph.replay(d.graph)
        torch.cuda.synchronize()
    return [e for e in prof.key_averages() if e.device_time_total > 0]


def main() -> None:
    shared = runpy.run_path(str(Path(__file__).with_name("cuda_graphs.py")))
    decoder, traced, llama = shared["Decoder"], shared["traced"], shared["llama"]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    model = llama(2048, 8)
    with torch.no_grad():
        decoder(model, 4).replayed()  # warm-up: kernels loaded, a throwaway capture
        for label in ("untraced", "traced", "untraced again", "traced again"):
            # Room in the cache for every replay: a StaticCache counts its length on the device,
            # and replays past its end index out of it (`index_copy_` asserts).
            d = decoder(model, 4 + REPLAYS + 10 + 8)
            on = traced(Path(f"/tmp/graph-device-time/{label}")) if label.startswith("traced") else None
            if on is not None:
                on.__enter__()
            try:
                d.capture()
                for i in range(4):
                    d.sampled_replay(i)  # the hooks' own replays first: the runs open
                times, events = device_time(d), kernels(d)
            finally:
                if on is not None:
                    on.__exit__()
            total = sum(e.device_time_total for e in events) / 10 / 1e3
            count = sum(e.count for e in events) / 10
            median = statistics.median(times)
            print(f"\n== {label}: device time a replay, median of {REPLAYS}: {median:.3f} ms "
                  f"(min {min(times):.3f}); {count:.0f} kernels, {total:.3f} ms of kernel time")  # fmt: skip
            for e in sorted(events, key=lambda e: -e.device_time_total)[:TOP]:
                print(f"  {e.count / 10:6.0f} a replay {e.device_time_total / 10:8.1f} us  {e.key[:100]}")


if __name__ == "__main__":
    main()
