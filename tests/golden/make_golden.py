"""Golden numerics vectors, from PyTorch's own FP8 casts and torch reference math.

Nothing here may depend on the CPU: sums are correctly rounded (math.fsum), never a
BLAS's order, and no vectorised transcendental function makes an input.

The Rust tracer (tch and ndarray paths) and the Python hooks check themselves
against the file this script writes. Regenerate it with

    .venv/bin/python tests/golden/make_golden.py > tests/golden/numerics_v1.json

The test suite runs this script again and requires byte-identical output, so the
committed file always matches the script under the pinned torch version.

Floats are stored as the decimal of their IEEE bits (f32 as u32, f64 as u64) so that
NaN payloads, signed zeros and infinities survive JSON exactly.
"""

import json
import math
import sys

import torch

SEED = 20261129
FORMATS = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FMAX = {"e4m3fn": 448.0, "e5m2": 57344.0}
D = 128


def f32_bits(t: torch.Tensor) -> list[int]:
    return t.to(torch.float32).contiguous().view(torch.int32).flatten().tolist()


def u32(bits: list[int]) -> list[int]:
    return [b & 0xFFFFFFFF for b in bits]


def f64_bits(t: torch.Tensor) -> list[int]:
    bits = t.to(torch.float64).contiguous().view(torch.int64).flatten().tolist()
    return [b & 0xFFFFFFFFFFFFFFFF for b in bits]


def codes(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


def all_codes() -> dict:
    raw = torch.arange(256, dtype=torch.uint8)
    return {name: u32(f32_bits(raw.view(dt).to(torch.float32))) for name, dt in FORMATS.items()}


def cast_inputs(gen: torch.Generator) -> torch.Tensor:
    """Values that exercise rounding, subnormals, saturation and specials."""
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1e-45, -1e-45, 3.4e38, -3.4e38]
    special += [448.0, 449.0, 463.99, 464.0, 464.01, 479.99, 480.0, 500.0, 1e4]
    special += [57344.0, 61439.0, 61440.0, 61441.0, 65535.0, 65536.0, 1e6]
    values = [torch.tensor(special, dtype=torch.float32)]
    for dt in FORMATS.values():
        grid = torch.arange(256, dtype=torch.uint8).view(dt).to(torch.float32)
        grid = grid[torch.isfinite(grid)].unique()
        mids = (grid[1:] + grid[:-1]) / 2  # exact ties: round-to-even decides
        values += [mids, torch.nextafter(mids, torch.full_like(mids, math.inf))]
        values += [torch.nextafter(mids, torch.full_like(mids, -math.inf))]
    # Powers of two 2^-20 .. 2^19 built from their bits, so that no CPU's exp2 rounds them
    # (torch's vectorised exp2 differs in the last bit between CPUs); randn gives the
    # mantissas, and the product is exact.
    exponents = torch.empty(2000).uniform_(-20, 20, generator=gen).floor().to(torch.int32)
    magnitudes = ((exponents + 127) << 23).view(torch.float32)
    values.append(torch.randn(2000, generator=gen) * magnitudes)
    return torch.cat(values)


def exact_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [m, n] @ b [n, p] in float64, each product rounded once and summed correctly
    rounded (math.fsum): the same bits on every CPU, where a BLAS sums in an order of its
    own. Products of float32 values are exact in float64."""
    a64, b64 = a.double().numpy(), b.double().numpy()
    products = a64[:, :, None] * b64[None, :, :]
    out = [[math.fsum(products[i, :, j]) for j in range(b64.shape[1])] for i in range(a64.shape[0])]
    return torch.tensor(out, dtype=torch.float64)


def head_sum(x: torch.Tensor) -> torch.Tensor:
    """x [t, h, s] summed over h, correctly rounded."""
    t, _, s = x.shape
    sums = [[math.fsum(x[i, :, j].tolist()) for j in range(s)] for i in range(t)]
    return torch.tensor(sums, dtype=torch.float64)


def round_up_pow2(s: torch.Tensor) -> torch.Tensor:
    """ue8m0: the smallest power of two >= s, exactly, from the fp32 bits."""
    bits = s.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    rounded = ((exponent + (mantissa != 0).to(torch.int32)) << 23).view(torch.float32)
    return torch.where(torch.isfinite(s), rounded, s)


def quantize_blocks(x: torch.Tensor, block: tuple[int, int], fmt: str, scale_fmt: str, clamp: float):
    """Production block quantization: scale = amax / max (optionally a power of two), saturating cast."""
    rows, cols = x.shape
    br, bc = block
    xb = x.view(rows // br, br, cols // bc, bc).permute(0, 2, 1, 3)
    amax = xb.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=clamp)
    scale = amax / FMAX[fmt]
    if scale_fmt == "ue8m0":
        scale = round_up_pow2(scale)
    y = (xb / scale).clamp(-FMAX[fmt], FMAX[fmt]).to(FORMATS[fmt])
    values = y.permute(0, 2, 1, 3).reshape(rows, cols)
    return values, scale.reshape(rows // br, cols // bc)


def block_cases(gen: torch.Generator) -> dict:
    act = torch.randn(6, 256, generator=gen)
    act[1, 5] *= 1000.0  # an outlier channel
    act[2] = 0.0  # an all-zero row: the amax clamp decides the scale
    act[3] *= 1e-9  # below every clamp
    act[4, 7] = math.nan
    act[4, 200] = math.inf
    act[5, 130] = -math.inf
    weight = torch.randn(256, 128, generator=gen) * 0.02
    weight[128:] *= 50.0
    cases = []
    for fmt in FORMATS:
        for scale_fmt in ("fp32", "ue8m0"):
            for clamp in (1e-4, 1e-10, 1e-12):
                values, scales = quantize_blocks(act, (1, 128), fmt, scale_fmt, clamp)
                cases.append(case("act", (1, 128), fmt, scale_fmt, clamp, values, scales))
            values, scales = quantize_blocks(weight, (128, 128), fmt, scale_fmt, 1e-12)
            cases.append(case("weight", (128, 128), fmt, scale_fmt, 1e-12, values, scales))
    inputs = {
        name: {"shape": list(x.shape), "bits": u32(f32_bits(x))}
        for name, x in [("act", act), ("weight", weight)]
    }
    return {"inputs": inputs, "cases": cases}


def case(input_name, block, fmt, scale_fmt, clamp, values, scales) -> dict:
    return {
        "name": f"{input_name}-{fmt}-{scale_fmt}-{clamp:g}",
        "input": input_name,
        "format": fmt,
        "scale_format": scale_fmt,
        "amax_clamp": clamp,
        "block": list(block),
        "values": codes(values),
        "scales": u32(f32_bits(scales)),
    }


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def indexer_cases(gen: torch.Generator) -> dict:
    """Small indexer inputs and their scores, computed in float64 from the
    values each precision actually sees."""
    t, s, h = 6, 40, 4
    q = torch.randn(t, h, D, generator=gen)
    k = torch.randn(s, D, generator=gen)
    q[:, :, 3] *= 30.0  # outlier channel, where the Hadamard rotation matters
    w = torch.randn(t, h, generator=gen) * h**-0.5
    q_pos = torch.tensor([0, 9, 19, 29, 38, 39])
    mask = torch.arange(s)[None, :] <= q_pos[:, None]

    def dots(qv: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return exact_matmul(qv.reshape(t * h, D), kv.t()).reshape(t, h, s)

    def scores(qv, kv, wv) -> torch.Tensor:
        out = head_sum(dots(qv, kv).relu() * wv.double()[:, :, None]) * D**-0.5
        return out.masked_fill(~mask, -math.inf)

    bf16 = lambda v: v.to(torch.bfloat16).to(torch.float32)  # noqa: E731
    expected = {"fp32": scores(q, k, w), "bf16": scores(bf16(q), bf16(k), bf16(w))}
    variants = {}
    for name, rotate, scale_fmt, clamp in [
        ("deepseek_reference", True, "ue8m0", 1e-4),
        ("sglang", True, "ue8m0", 1e-4),
        ("trtllm", False, "ue8m0", 1e-12),
        ("vllm", False, "ue8m0", 1e-4),
        ("fp32_scales", False, "fp32", 1e-4),
    ]:
        qr, kr = q, k
        if rotate:
            had = hadamard(D)
            qr = exact_matmul(q.reshape(t * h, D), had).float().reshape(t, h, D)
            kr = exact_matmul(k, had).float()
        q8, q_scale = quantize_blocks(qr.reshape(t * h, D), (1, D), "e4m3fn", scale_fmt, clamp)
        k8, k_scale = quantize_blocks(kr, (1, D), "e4m3fn", scale_fmt, clamp)
        fp8_dots = dots(q8.double().reshape(t, h, D), k8.double()).relu()
        folded = w.double() * q_scale.double().reshape(t, h) * D**-0.5
        out = head_sum(fp8_dots * folded[:, :, None]) * k_scale.double().reshape(1, s)
        expected[f"fp8_{name}"] = out.masked_fill(~mask, -math.inf)
        variants[name] = {"hadamard": rotate, "scale_format": scale_fmt, "amax_clamp": clamp}
    return {
        "t": t,
        "s": s,
        "h": h,
        "d": D,
        "q": u32(f32_bits(q)),
        "k": u32(f32_bits(k)),
        "w": u32(f32_bits(w)),
        "q_pos": q_pos.tolist(),
        "variants": variants,
        "scores_f64": {name: f64_bits(v) for name, v in expected.items()},
    }


def topk_cases(gen: torch.Generator) -> list[dict]:
    """Rows for top-k with the k-th score and margin: distinct scores, ties
    across the k-th boundary, an all-tied row, and a dense row."""
    k, s = 8, 24
    distinct = torch.randn(s, generator=gen)
    boundary_ties = torch.randn(s, generator=gen)
    order = boundary_ties.argsort(descending=True)
    boundary_ties[order[5:11]] = boundary_ties[order[5]].item()  # ranks 6..11 tie across k = 8
    all_tied = torch.full((s,), 0.5)
    rows = []
    for name, row, visible in [
        ("distinct", distinct, s),
        ("boundary_ties", boundary_ties, s),
        ("all_tied", all_tied, s),
        ("dense", distinct, 6),
    ]:
        values = row.clone()
        values[visible:] = -math.inf
        top = torch.topk(values, min(k + 1, s))
        rows.append(
            {
                "name": name,
                "k": k,
                "visible": visible,
                "scores": u32(f32_bits(values)),
                "torch_topk_indices": top.indices[:k].tolist(),
                "torch_topk_values": u32(f32_bits(top.values[:k])),
                "kth_score": u32(f32_bits(top.values[k - 1 : k]))[0],
                "next_score": u32(f32_bits(top.values[k : k + 1]))[0],
            }
        )
    return rows


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(SEED)
    inputs = cast_inputs(gen)
    doc = {
        "generator": "tests/golden/make_golden.py",
        "torch_version": torch.__version__.split("+")[0],
        "seed": SEED,
        "codes": all_codes(),
        "casts": {
            "input": u32(f32_bits(inputs)),
            **{name: codes(inputs.to(dt)) for name, dt in FORMATS.items()},
        },
        "block_quant": block_cases(gen),
        "indexer": indexer_cases(gen),
        "topk": topk_cases(gen),
    }
    json.dump(doc, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
