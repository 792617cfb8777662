"""The hooks' device work at GLM-5 shapes, op by op, beside the candidates that could replace
it: what each costs on the GPU (CUDA events, median of repeats) and, for the indexer scores,
how far each is from an fp64 recomputation. One process, one run, side by side.

usage: python tests/gpu/kernels_h200.py [--tokens 8192] [--repeat 5]

Rows:
- scores: `numerics.index_scores` as the shadow runs it (fp32, TF32 off) against the same
  product as three TF32 products (`numerics.index_scores(..., matmul="3xtf32")`), with the
  largest error over 64 rows relative to sum_h |w| sum_i |q k| D^-0.5 (fp64) and the top-2048
  Jaccard of each against the fp64 top-k;
- counts: `stats.counts_device` on a bf16 hidden [T, 6144] and on fp32 scores [T, T];
- hidden: `stats.hidden_device` for prod and one shadow, beside Triton's one-pass
  `kernels.row_stats` and `stats.site_device`, which uses it on CUDA;
- compare: `selection.compare` with production's scores and values, a shadow and a band,
  through Triton's `kernels.compare_masks` and through torch's ops, with whether the two
  packets are identical; the same on the CPU, against the lists the GPU made on its side
  stream (`Packet.later`), also with the inputs freed and overwritten once that work is queued,
  and with two requests' comparisons in flight (the inputs held within `PENDING_BYTES`);
- projection: `shadow.linear` (bf16 operands, fp32 results on the tensor cores) against the
  fp32 GEMM, both against fp64.

It exits 1 when a packet differs or the projection's error is over its bound.
"""

import argparse
import json
import math
import statistics
import sys

import torch
from shadowtrace_hooks import kernels, numerics, selection, shadow, stats, transfer
from shadowtrace_hooks.transfer import Packet


def timed(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def equal(a, b) -> bool:
    """Two host arrays of a packet alike: shape and every element, NaN equal to NaN."""
    return a.shape == b.shape and bool(((a == b) | ((a != a) & (b != b))).all())


def same(a_arrays, b_arrays) -> bool:
    """Two packets' arrays alike, array by array."""
    return len(a_arrays) == len(b_arrays) and all(map(equal, a_arrays, b_arrays))


def differences(a_arrays, b_arrays) -> str:
    """Which arrays of two packets differ, and how, for the printout."""
    out = [f"{len(a_arrays)} arrays vs {len(b_arrays)}"] if len(a_arrays) != len(b_arrays) else []
    for i, (a, b) in enumerate(zip(a_arrays, b_arrays, strict=False)):
        if a.shape != b.shape:
            out.append(f"array {i}: shape {a.shape} vs {b.shape}")
        elif not equal(a, b):
            out.append(f"array {i}: {int((a != b).sum())} of {a.size} differ")
    return "; ".join(out) or "none"


def jaccard(a: torch.Tensor, b: torch.Tensor, keys: int) -> float:
    ma = torch.zeros(a.shape[0], keys, dtype=torch.bool, device=a.device).scatter_(1, a, True)
    mb = torch.zeros_like(ma).scatter_(1, b, True)
    return float((ma & mb).sum() / (ma | mb).sum())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    dev = torch.device("cuda")
    t, h, d, hidden, k = args.tokens, 32, 128, 6144, 2048
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(t, h, d, device=dev, generator=gen).bfloat16().float()
    keys = torch.randn(t, d, device=dev, generator=gen).bfloat16().float()
    w = torch.randn(t, h, device=dev, generator=gen) * h**-0.5
    pos = torch.arange(t, device=dev)
    pos_host = pos.cpu().numpy()
    rows: dict[str, float] = {}
    with shadow.full_fp32():
        fp32 = numerics.index_scores(q, keys, w, pos, q_pos_host=pos_host)
        rows["scores fp32 (ieee) ms"] = timed(
            lambda: numerics.index_scores(q, keys, w, pos, q_pos_host=pos_host), args.repeat
        )
        split = numerics.index_scores(q, keys, w, pos, q_pos_host=pos_host, matmul="3xtf32")
        rows["scores 3xtf32 ms"] = timed(
            lambda: numerics.index_scores(q, keys, w, pos, q_pos_host=pos_host, matmul="3xtf32"), args.repeat
        )
    qc, kc, wc = q.contiguous(), keys.contiguous(), w.contiguous()
    out = torch.empty(t, t, device=dev)
    triton_rows = {}
    for launch in ((64, 64, 4, 2), (64, 128, 4, 2), (128, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2),
                   (64, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 2)):  # fmt: skip
        try:
            triton_rows[launch] = timed(
                lambda launch=launch: kernels.launch_scores(qc, kc, wc, pos, out, d**-0.5, "tf32x3", *launch),
                args.repeat,
            )
        except Exception as exc:  # a tile shape this GPU cannot hold
            print(f"launch {launch}: {type(exc).__name__}: {str(exc)[:200]}")
    for launch, ms in sorted(triton_rows.items(), key=lambda kv: kv[1]):
        rows[f"scores triton tf32x3 {launch} ms"] = ms
    rows["scores triton default launch"] = str(kernels.SCORES_LAUNCH)
    tri = kernels.index_scores(q, keys, w, pos)
    tri_ieee = kernels.index_scores(q, keys, w, pos, precision="ieee")
    rows["scores triton ieee (default launch) ms"] = timed(
        lambda: kernels.index_scores(q, keys, w, pos, precision="ieee"), args.repeat
    )
    # fp64 oracle on 64 rows spread over the prompt
    pick = torch.linspace(k, t - 1, 64, device=dev).long()
    q64, k64, w64 = q[pick].double(), keys.double(), w[pick].double()
    dots = torch.einsum("rhd,sd->rhs", q64, k64)
    ref = torch.einsum("rh,rhs->rs", w64, dots.relu()) * d**-0.5
    mag = torch.einsum("rh,rhs->rs", w64.abs(), torch.einsum("rhd,sd->rhs", q64.abs(), k64.abs())) * d**-0.5
    visible = torch.arange(t, device=dev)[None, :] <= pick[:, None]
    ref = ref.masked_fill(~visible, -math.inf)
    for name, got in (
        ("fp32 (ieee)", fp32),
        ("3xtf32", split),
        ("triton tf32x3", tri),
        ("triton ieee", tri_ieee),
    ):
        err = ((got[pick].double() - ref).abs() / mag).masked_fill(~visible, 0).max()
        rows[f"scores {name} max err / sum|wqk|"] = float(err)
        rows[f"scores {name} top-{k} Jaccard vs fp64"] = jaccard(
            got[pick].topk(k).indices, ref.topk(k).indices, t
        )
    top32 = fp32.topk(k).indices
    rows["scores 3xtf32 vs fp32 top-k Jaccard, all rows"] = jaccard(top32, split.topk(k).indices, t)
    rows["scores triton tf32x3 vs fp32 top-k Jaccard, all rows"] = jaccard(top32, tri.topk(k).indices, t)
    rows["scores triton vs torch: same -inf"] = bool((torch.isinf(tri) == torch.isinf(fp32)).all())

    x = torch.randn(t, hidden, device=dev, generator=gen).bfloat16()
    xs = (x.float() + 1e-3 * torch.randn_like(x.float())).bfloat16()
    rows["counts bf16 hidden ms"] = timed(lambda: stats.counts_device(x), args.repeat)
    rows["counts fp32 scores ms"] = timed(lambda: stats.counts_device(fp32, pos + 1), args.repeat)
    cx, cs = stats.counts_device(x), stats.counts_device(xs)
    rows["hidden_device prod+shadow ms"] = timed(
        lambda: stats.hidden_device(x, cx, xs, cs, None), args.repeat
    )
    rows["hidden_device prod ms"] = timed(lambda: stats.hidden_device(x, cx, None, None, None), args.repeat)
    rows["events_device ms"] = timed(lambda: stats.events_device(x, cx, None), args.repeat)
    rows["row_stats kernel prod+shadow ms"] = timed(lambda: kernels.row_stats(x, xs), args.repeat)
    rows["row_stats kernel prod ms"] = timed(lambda: kernels.row_stats(x), args.repeat)
    rows["site_device prod+shadow (kernel, all rows; device work) ms"] = timed(
        lambda: stats.site_device(x, {"local": xs}, None, None), args.repeat
    )
    rows["site_device prod (kernel; device work) ms"] = timed(
        lambda: stats.site_device(x, {}, None, None), args.repeat
    )
    work = stats.site_device(x, {"local": xs}, None, None)
    _, by_kernel = work.rows([t.cpu().numpy() for t in work.tensors])
    want = stats.hidden_device(x, cx, xs, cs, None).cpu()
    rows["site_device computed by"] = work.how
    got = torch.from_numpy(by_kernel["local"])
    rows["site_device vs torch, largest relative difference"] = float(
        ((got - want).abs() / want.abs().clamp(min=1e-30)).nan_to_num(0).max()
    )

    prod_top = fp32.topk(k)
    rows["topk k=2048 over fp32 scores ms"] = timed(lambda: fp32.topk(k), args.repeat)

    def compare():
        packet = Packet()
        selection.compare(
            packet,
            prod_top.indices,
            pos,
            t,
            k,
            prod_scores=fp32,
            shadow_scores=split,
            band=1e-3,
            prod_top_values=prod_top.values,
        )
        return packet.ship()

    rows["compare (with ship) ms"] = timed(compare, args.repeat)
    by_kernel = compare().arrays()
    kernels.failed["compare_masks"] = "torch, for the side-by-side row"
    rows["compare, torch's ops (with ship) ms"] = timed(compare, args.repeat)
    by_torch = compare().arrays()
    kernels.failed.pop("compare_masks")
    rows["compare kernel vs torch: identical packet"] = same(by_kernel, by_torch)

    def compare_prod():
        packet = Packet()
        selection.compare(
            packet, prod_top.indices, pos, t, k, prod_scores=fp32, band=1e-3, prod_top_values=prod_top.values
        )
        return packet.ship()

    rows["compare, production only (with ship) ms"] = timed(compare_prod, args.repeat)

    # The lists made on the side stream (Packet.later) against the same comparison on the CPU,
    # where they are made at once. The shadow's scores have no ties (each row a permutation of
    # 0..T-1, masked as causal): torch's top-k orders tied keys differently on the CPU and the
    # GPU, which would change the selection, not show a fault.
    distinct = torch.argsort(torch.rand(t, t, device=dev, generator=gen), dim=1).float()
    distinct = distinct.masked_fill(torch.arange(t, device=dev)[None, :] > pos[:, None], -math.inf)

    def compare_on(device: str):
        packet = Packet()
        on = lambda x: x.to(device)  # noqa: E731
        selection.compare(
            packet, on(prod_top.indices), on(pos), t, k, prod_scores=on(fp32), shadow_scores=on(distinct),
            band=1e-3, prod_top_values=on(prod_top.values),
        )  # fmt: skip
        return packet.ship().arrays()

    by_gpu, by_host = compare_on("cuda"), compare_on("cpu")
    rows["compare lists, side stream vs CPU: identical packet"] = same(by_gpu, by_host)
    rows["compare lists, side stream vs CPU: differences"] = differences(by_gpu, by_host)
    rows["compare kernel vs torch: differences"] = differences(by_kernel, by_torch)
    # The same comparison with its inputs freed as soon as the side stream's work is queued,
    # and their memory filled with NaN on the main stream. The side stream first sleeps
    # (about 50 ms) so that, without the main stream's wait for it, the NaN would land before
    # it reads the scores; the inputs it reads are its own copies, freed when the work is
    # dropped, and the junk, as large, reuses their blocks.
    real = selection._gap_coded

    def slow(*a):
        torch.cuda._sleep(100_000_000)
        return real(*a)

    selection._gap_coded = slow
    packet = Packet()
    selection.compare(
        packet, prod_top.indices, pos, t, k, prod_scores=fp32, shadow_scores=split, band=1e-3,
        prod_top_values=prod_top.values,
    )  # fmt: skip
    packet.settle()
    selection._gap_coded = real
    junk = [torch.full((t, t), math.nan, device=dev) for _ in range(4)]
    rows["compare lists, inputs overwritten: identical packet"] = same(by_kernel, packet.ship().arrays())
    del junk

    # Two requests' comparisons in flight (a packet each): the inputs held by the work put
    # off stay within transfer.PENDING_BYTES (one piece may exceed it alone), and both
    # packets still match.
    packets, held = [Packet(), Packet()], []
    for packet in packets:
        selection.compare(
            packet, prod_top.indices, pos, t, k, prod_scores=fp32, shadow_scores=split, band=1e-3,
            prod_top_values=prod_top.values,
        )  # fmt: skip
        held.append((transfer.held_bytes(), len(transfer._waiting)))
    rows["compare, two requests: held MiB, pieces waiting"] = [(b / 2**20, n) for b, n in held]
    # one piece alone may exceed the budget (it waits until the next); two may not
    rows["compare, two requests: held within PENDING_BYTES"] = all(
        b <= transfer.PENDING_BYTES or n == 1 for b, n in held
    )
    rows["compare, two requests: identical packets"] = all(
        same(by_kernel, packet.ship().arrays()) for packet in packets
    )

    # The shadow's projections (`shadow.linear`): bf16 operands to fp32 results on the tensor
    # cores against the fp32 GEMM of the upcast operands, both against fp64, at GLM-5's q
    # projection (q_lora 2048 -> 32 heads x 128).
    xq = torch.randn(t, 2048, device=dev, generator=gen).bfloat16()
    wq = (torch.randn(h * d, 2048, device=dev, generator=gen) * 2048**-0.5).bfloat16()
    with shadow.full_fp32():
        rows["projection tensor cores ms"] = timed(lambda: shadow.linear(xq, wq, torch.float32), args.repeat)
        rows["projection fp32 GEMM ms"] = timed(
            lambda: torch.nn.functional.linear(xq.float(), wq.float()), args.repeat
        )
        tc = shadow.linear(xq, wq, torch.float32)
        full = torch.nn.functional.linear(xq.float(), wq.float())
        # after the calls: a tensor-core op that raised has switched `linear` to fp32
        rows["projection path"] = shadow.linear_path(xq, wq, torch.float32)
    exact = xq[:256].double() @ wq.double().t()
    scale = xq[:256].double().abs() @ wq.double().abs().t()
    rows["projection tensor cores max err / sum|xw|"] = float(((tc[:256] - exact).abs() / scale).max())
    rows["projection fp32 GEMM max err / sum|xw|"] = float(((full[:256] - exact).abs() / scale).max())
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        compare()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=50))
    try:
        import triton

        rows["triton"] = triton.__version__
    except ImportError as exc:
        rows["triton"] = f"absent ({exc})"
    print(json.dumps(rows, indent=1))
    # fp32 accumulation over 2048 terms: well inside 2048 * 2^-24 = 1.2e-4 of sum |x w|
    checks = {
        "compare kernel vs torch: identical packet": rows["compare kernel vs torch: identical packet"],
        "side stream vs CPU": rows["compare lists, side stream vs CPU: identical packet"],
        "inputs freed and overwritten": rows["compare lists, inputs overwritten: identical packet"],
        "two requests held": rows["compare, two requests: held within PENDING_BYTES"],
        "two requests packets": rows["compare, two requests: identical packets"],
        "projection on the tensor cores": rows["projection path"] == "tensor cores",
        "projection error <= 2048 * 2^-24": rows["projection tensor cores max err / sum|xw|"] <= 2.0**-13,
    }  # fmt: skip
    failed = [name for name, ok in checks.items() if not ok]
    print("checks failed: " + ", ".join(failed) if failed else "checks passed: " + ", ".join(checks))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
