"""transformers' FP8 path on a real FP8 kernel, traced (issue 26, item 6): run on the H200.

transformers fetches its FP8 kernel (`kernels-community/finegrained-fp8`) from a hub at run
time, which the GPU machine cannot reach. What serves here is PyTorch's own block-scaled
FP8 GEMM, `torch._scaled_mm` on the tensor cores, behind the kernel's three entry points
(tests/python/fp8_kernel.py). The manifest's `settings.prod_fp8_kernel` names what ran.

It checks, and prints:
1. the kernel against a dequantized fp32 product of the same operands (relative L2), at
   4096x2048x6144 and at the tiny model's shapes; its grouped entry point against the
   per-expert loop of its matmul, bit for bit;
2. a tiny GLM-5 converted by transformers' own FP8 code (tests/python/tiny_fp8.py) on CUDA,
   traced with SHADOWTRACE=1 in local mode: every recorded local error at attn_out and
   mlp_out against this script's own dequantized fp32 recompute of that layer from
   production's input, token by token (the CPU test's tolerance, 1e-3 relative);
3. production's logits bit-identical traced and untraced, and the manifest's record of
   what production ran.
Exits 1 when a check fails. Usage (the hooks installed, tests/python on sys.path):
`python tests/gpu/fp8_hf_h200.py OUT_DIR`.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import fp8_kernel
import pyarrow.parquet as pq
import tiny_fp8
from fp8_kernel import FP8_MAX, scaled_mm_matmul, tensor_core_kernel

E4M3 = torch.float8_e4m3fn
ERR_REL = 1e-3  # as tests/python/test_hooks_fp8.py: fp32 summation order only
SITES = [(layer, site) for layer in range(3) for site in ("attn_out", "mlp_out")]
failed: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("ok      " if ok else "FAILED  ") + what, flush=True)
    if not ok:
        failed.append(what)


def kernel_against_fp32(m: int, k: int, n: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda") * 0.02
    blocks = w.view(n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    codes = (blocks / scale[:, None, :, None]).to(E4M3).view(n, k)
    got = scaled_mm_matmul(x, codes, scale, [128, 128], torch.float32)
    exact = x.float() @ tiny_fp8.reference_weight(codes, scale, (128, 128)).t()
    emulated = tiny_fp8.emu_matmul(x, codes, scale, [128, 128], torch.float32)
    rel = float((got - exact).norm() / exact.norm())
    rel_emu = float((got - emulated).norm() / emulated.norm())
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        scaled_mm_matmul(x, codes, scale, [128, 128], torch.bfloat16)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 10
    print(
        f"kernel {m}x{k}x{n}: rel L2 {rel:.2e} against the dequantized fp32 product, "
        f"{rel_emu:.2e} against the CPU test's emulation (same activation quantization); "
        f"{2 * m * k * n / seconds / 1e12:.0f} TFLOP/s with its quantization",
        flush=True,
    )
    check(rel < 5e-2, f"kernel {m}x{k}x{n} within FP8's error of the fp32 product")
    check(rel_emu < 1e-3, f"kernel {m}x{k}x{n} equals the emulation but for accumulation order")


def traced(out: Path, mode: str, body) -> tuple[dict, list[dict], object]:
    from shadowtrace_hooks import session, startup

    assert startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(out), "SHADOWTRACE_MODE": mode})
    try:
        with torch.no_grad():
            result = body()
    finally:
        session.stop()
    (path,) = sorted(out.glob("*/manifest.json"))
    return json.loads(path.read_text()), pq.read_table(path.parent / "hidden").to_pylist(), result


def hooks(model, store: dict, prod_in: dict | None = None, swap: dict | None = None) -> list:
    handles = []
    for i, layer in enumerate(model.model.layers):
        if prod_in is not None:
            handles.append(
                layer.register_forward_pre_hook(
                    lambda m, a, kw, i=i: prod_in.__setitem__(
                        i, (a[0] if a else kw["hidden_states"]).detach().clone()
                    ),
                    with_kwargs=True,
                )
            )
        if swap is not None:

            def replace(m, a, kw, i=i):
                x = swap[i].float()
                return ((x, *a[1:]), kw) if a else (a, {**kw, "hidden_states": x})

            handles.append(layer.register_forward_pre_hook(replace, with_kwargs=True))
        for site, block in (("attn_out", layer.self_attn), ("mlp_out", layer.mlp)):
            handles.append(
                block.register_forward_hook(
                    lambda m, a, o, key=(i, site): store.__setitem__(
                        key, (o[0] if isinstance(o, tuple) else o).detach().clone()
                    )
                )
            )
    return handles


def tiny_model_traced(out: Path) -> None:
    # kv_lora_rank 128: every K a whole 128-block, as _scaled_mm takes them.
    bf16, model, _ = tiny_fp8.fp8_glm(kv_lora_rank=128)
    ref = tiny_fp8.dequantized_fp32(bf16, model).cuda()
    model = model.cuda()
    ids = tiny_fp8.tiny_models.prompt(64).cuda()
    with torch.no_grad():
        untraced = model(ids).logits
    prod_in, prod_site = {}, {}
    handles = hooks(model, prod_site, prod_in=prod_in)
    manifest, rows, result = traced(out / "local", "local", lambda: model(ids).logits)
    for h in handles:
        h.remove()
    check(torch.equal(result, untraced), "production's logits bit-identical traced and untraced")
    want = {}
    handles = hooks(ref, want, swap=prod_in)
    with torch.no_grad():
        ref(ids)
    for h in handles:
        h.remove()
    worst = 0.0
    for layer, site in SITES:
        p, s = prod_site[layer, site][0].float(), want[layer, site][0].float()
        expected = ((p - s).norm(dim=-1) / s.norm(dim=-1)).tolist()
        got = sorted(
            (r for r in rows if (r["layer"], r["site"], r["shadow_mode"]) == (layer, site, "local")),
            key=lambda r: r["token"],
        )
        if len(got) != len(expected):
            check(False, f"layer {layer} {site}: {len(got)} rows recorded, {len(expected)} tokens")
            continue
        dev = max(abs(r["rel_l2_err"] - e) / e for r, e in zip(got, expected, strict=True))
        worst = max(worst, dev)
        print(
            f"layer {layer} {site}: local rel L2 err {min(expected):.3f}-{max(expected):.3f} "
            f"(this script's fp32 recompute), recorded within {dev:.1e} of it",
            flush=True,
        )
    check(worst <= ERR_REL, f"every local error within {ERR_REL} of the recompute (worst {worst:.1e})")
    settings = manifest["settings"]
    print("manifest dtypes:", manifest["dtypes"])
    for key in ("prod_precision", "quantization", "prod_fp8_kernel", "shadow_dequant"):
        print(f"manifest settings.{key}: {settings.get(key)}")
    check(manifest["dtypes"]["prod"] == "fp8_e4m3", "dtypes.prod says fp8_e4m3")
    check("scaled_mm_matmul" in settings.get("prod_fp8_kernel", ""), "the manifest names the kernel that ran")
    check(not any(manifest["counters"].get(c) for c in ("hook_errors", "shadow_refused")), "nothing refused")
    check(settings.get("disabled_sites") is None, "no capture disabled")


def grouped_against_per_expert(experts: int, tokens: int, k: int, n: int) -> None:
    """The grouped entry point (one quantization of the sorted tokens, each expert's scale
    layout kept) against the per-expert loop of matmul_2d: bit for bit, uneven groups, an
    expert with no tokens, and a second call reading the kept layouts."""
    torch.manual_seed(1)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda") * 0.02
    blocks = w.view(experts, n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(2, 4)) / FP8_MAX
    codes = (blocks / scale[:, :, None, :, None]).to(E4M3).view(experts, n, k)
    ids = torch.randint(0, experts, (tokens,))
    ids[ids == 1] = 0  # expert 1 gets no token
    offsets = torch.cumsum(torch.bincount(ids, minlength=experts), 0).to(torch.int32).cuda()
    _, loop = tiny_fp8.per_expert(scaled_mm_matmul)
    want = loop(x, codes, scale, offsets=offsets, block_size=[128, 128])
    grouped = fp8_kernel._Grouped()
    first = grouped(x, codes, scale, offsets=offsets, block_size=[128, 128])
    again = grouped(x, codes, scale, offsets=offsets, block_size=[128, 128])
    same = torch.equal(first, want) and torch.equal(again, want)
    check(same, f"grouped entry point {experts}x{tokens}x{k}x{n} equals the per-expert loop bit for bit")


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this script measures the tensor cores")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    kernel_against_fp32(4096, 2048, 6144)
    kernel_against_fp32(64, 256, 512)
    grouped_against_per_expert(16, 1000, 512, 256)
    grouped_against_per_expert(8, 333, 384, 640)
    with tensor_core_kernel():
        tiny_model_traced(out)
    print(f"{len(failed)} checks failed" if failed else "every check passed", flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
