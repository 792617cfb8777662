"""The site and sentinel kernels compiled for the GPU, against torch's ops and answers planted
by hand (hooks/tests/kernel_cases.py runs the same kernels in Triton's CPU interpreter; this is
the compiler's code). Exits 1 when a check fails.

- `kernels.row_stats`' first non-finite element per row and kind, at GLM-5's hidden width in
  bf16, against the plants;
- `stats.site_device` through the kernel (one launch a mode) against torch's ops on the same
  CUDA tensors (the kernel refused): the events equal, the statistics within 1e-5 relative,
  with and without shadows, every row and a few;
- `stats.sentinel_device` (`kernels.sentinel_reads`) against the slots read one by one in
  Python (`sentinel_by_hand` of hooks/tests/test_stats.py), for a cache of GLM-5's heads.

Usage (the hooks installed, from the repository root): `python tests/gpu/site_kernels.py`.
"""

import math
import sys
from pathlib import Path

import numpy as np
import torch
from shadowtrace_hooks import kernels, stats

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hooks" / "tests"))
from test_stats import sentinel_by_hand

failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok' if ok else 'FAILED'}  {name}{': ' + detail if detail else ''}")
    if not ok:
        failures.append(name)


def planted(t: int, n: int, seed: int) -> tuple[torch.Tensor, list[tuple[int, int, float]]]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, generator=gen)
    plants = {}  # (row, col): the value planted last there
    for row in torch.randperm(t, generator=gen)[: t // 4].tolist():
        for _ in range(3):
            col = int(torch.randint(n, (1,), generator=gen))
            plants[row, col] = (math.nan, math.inf, -math.inf)[int(torch.randint(3, (1,), generator=gen))]
            x[row, col] = plants[row, col]
    return x.bfloat16().cuda(), [(row, col, value) for (row, col), value in plants.items()]


def by_hand_first(t: int, plants: list[tuple[int, int, float]]) -> torch.Tensor:
    want = torch.full((3, t), -1.0)
    for kind, match in enumerate((math.isnan, lambda v: v == math.inf, lambda v: v == -math.inf)):
        for row, col, value in plants:
            if match(value) and (want[kind, row] < 0 or col < want[kind, row]):
                want[kind, row] = col
    return want


def torch_site(prod, shadows, tokens, index):
    kernels.failed["row_stats"] = "the torch reference"
    try:
        work = stats.site_device(prod, shadows, tokens, index)
        assert work.how.startswith("torch"), work.how
        return work.rows([t.cpu().numpy() for t in work.tensors])
    finally:
        kernels.failed.pop("row_stats")


def main() -> None:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {kernels.describe()}")
    t, n = 257, 6144
    prod, plants = planted(t, n, 1)
    shade = (prod.float() + 1e-2 * torch.randn_like(prod.float())).bfloat16()
    shade[5, 9] = math.nan
    for shadow in (None, shade):
        got = kernels.row_stats(prod, shadow)[-3:].cpu()
        check(
            f"row_stats first elements, shadow {shadow is not None}",
            torch.equal(got, by_hand_first(t, plants)),
        )
    tokens = torch.tensor([0, 3, 100, 256], device="cuda")
    for shadows in ({}, {"local": shade}, {"free": shade.roll(1, 0), "local": shade}):
        for picked in (None, tokens):
            index = None if picked is None else picked.cpu().numpy()
            work = stats.site_device(prod, shadows, picked, index)
            events, hidden = work.rows([x.cpu().numpy() for x in work.tensors])
            want_events, want_hidden = torch_site(prod, shadows, picked, index)
            label = f"site_device {sorted(shadows)} rows {'all' if picked is None else len(index)}"
            check(f"{label}: {work.how}, {len(work.tensors)} tensors", work.how == "triton"
                  and len(work.tensors) == max(1, len(shadows)))  # fmt: skip
            check(
                f"{label}: events",
                np.array_equal(events, want_events),
                f"{events.tolist()} vs {want_events.tolist()}",
            )
            for mode, got in hidden.items():
                want = want_hidden[mode]
                same_nan = np.array_equal(np.isnan(got), np.isnan(want))
                close = np.allclose(got, want, rtol=1e-5, atol=1e-7, equal_nan=True)
                worst = np.nanmax(np.abs(got - want) / np.maximum(np.abs(want), 1e-30))
                check(
                    f"{label} mode {mode}: statistics",
                    same_nan and close,
                    f"largest relative difference {worst:.2e}",
                )
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(3, 8, 300, 128, generator=gen).bfloat16()
    keys[1, 3, 0, 7], keys[2, 0, 201, 127], keys[2, 7, 201, 0], keys[0, 5, 250, 64] = (
        math.nan, math.inf, -math.inf, math.nan)  # fmt: skip
    values = torch.randn(8, 3, 300, 128, generator=gen).bfloat16().transpose(0, 1)
    values[2, 1, 202, 3] = math.nan
    positions = torch.tensor([[250], [17], [202]])
    spans = torch.arange(190, 210).repeat(3, 1)
    for label, pos in (("decode", positions), ("20 slots a row", spans)):
        want = sentinel_by_hand([keys, values], pos)
        got = stats.sentinel_device([keys.cuda(), values.cuda()], pos.cuda()).cpu()
        check(f"sentinel_device {label}", torch.equal(got, want), f"{got.tolist()} vs {want.tolist()}"
              if not torch.equal(got, want) else "")  # fmt: skip
    check("no kernel fell back", not kernels.failed, str(kernels.failed))
    print("all checks passed" if not failures else f"{len(failures)} checks failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
