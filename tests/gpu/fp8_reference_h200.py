"""The reference engine's production as an FP8 checkpoint stores it (`shadowtrace-run --path
fp8-checkpoint`) against transformers' own FP8 path, both on the GPU's tensor cores: the
checkpoint converted and saved by transformers (tests/python/tiny_fp8.py), transformers'
kernel entry points on torch._scaled_mm (tests/python/fp8_kernel.py), the engine's FP8
linears on _scaled_mm (counted in its manifest-free dump run by `fp8_linears_tensor_cores`
when traced). tests/python/test_reference_fp8.py is the same comparison on the CPU with the
kernel emulated.

Per model and scale format, per layer: the share of token rows bit-identical between the
engine and transformers, the median and 90th percentile of the per-token relative L2 error,
and the same for the control (transformers on the fp64-accumulated emulation against
transformers on _scaled_mm: two FP8 implementations that differ in accumulation alone).
Exits 1 when the engine departs by more than twice the control (+1e-6) at some layer, as the
CPU test requires.

usage: fp8_reference_h200.py SHADOWTRACE_RUN WORK_DIR [LENGTH]
"""

import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import fp8_kernel
import tiny_fp8
import tiny_models
from safetensors.torch import load_file

FACTOR, FLOOR = 2.0, 1e-6
# Off a GPU (a dry run of this script), the kernel emulated as the CPU test does.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel():
    return fp8_kernel.tensor_core_kernel() if DEVICE == "cuda" else tiny_fp8.kernel_emulated()


def stats(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    same = float((got == want).all(-1).float().mean())
    return same, float(err.median()), float(err.quantile(0.9))


def main() -> int:
    binary, work = Path(sys.argv[1]), Path(sys.argv[2])
    length = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
    failed = 0
    print(f"{'case':<22} layer  engine: same  median   p90     | control: same  median   p90")
    for family in ("glm", "deepseek"):
        for scale_fmt in ("float", "ue8m0"):
            case = work / f"{family}-{scale_fmt}"
            _, model, _ = tiny_fp8.fp8_model(family, scale_fmt=scale_fmt)
            model.save_pretrained(case / "fp8")
            tiny_fp8.fp32_rope(model, family)
            model.to(DEVICE)
            ids = tiny_models.prompt(length)
            (case / "ids.json").write_text(json.dumps(ids[0].tolist()))
            hf, hf_logits = tiny_fp8.layer_outputs(model, ids.to(DEVICE), kernel())
            control, _ = tiny_fp8.layer_outputs(
                model, ids.to(DEVICE), tiny_fp8.kernel(tiny_fp8.emu_matmul_fp64)
            )
            run = subprocess.run(
                [binary, "--model", case / "fp8", case / "ids.json", "--path", "fp8-checkpoint",
                 "--dump", case / "engine.safetensors"],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            print(run.stdout.strip())
            if run.returncode != 0:
                print(run.stderr[-2000:])
                return 1
            engine = load_file(case / "engine.safetensors")
            for i, want in hf.items():
                e, c = stats(engine[f"layer_out.{i}"], want), stats(control[i], want)
                ok = all(g <= FACTOR * k + FLOOR for g, k in zip(e[1:], c[1:], strict=True))
                failed += not ok
                print(f"{family + ' ' + scale_fmt:<22} {i:>5}  {e[0]:>12.3f}  {e[1]:.2e} {e[2]:.2e} | "
                      f"{c[0]:>13.3f}  {c[1]:.2e} {c[2]:.2e}{'' if ok else '  FAILED'}")  # fmt: skip
            agree = float((engine["logits"].argmax(-1) == hf_logits.argmax(-1)).float().mean())
            print(f"{family + ' ' + scale_fmt:<22} argmax agreement with transformers {agree:.4f}")
    print("failed layers:", failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
