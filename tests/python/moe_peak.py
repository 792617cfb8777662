"""A GLM-5-structured model whose expert bank is most of its weights, run once to warm up
and once measured: prints the measured forward's peak resident memory above what the
process held before it, as the kernel counts it (VmHWM, reset through
/proc/self/clear_refs), and the model's weight bytes. Tracing is whatever the environment
says (SHADOWTRACE=1 through the installed shadowtrace_hooks.pth).

usage: moe_peak.py LENGTH
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import tiny_models

# 256 experts of 3 x 128 x 1024: a 201 MB bf16 bank (403 MB in fp32), the rest about 2 MB.
WIDTHS = {"n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 1024, "n_group": 8,
          "topk_group": 4}  # fmt: skip


def status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    torch.set_num_threads(1)
    model = tiny_models.glm(layers=2, **WIDTHS)
    ids = tiny_models.prompt(int(sys.argv[1]))
    with torch.no_grad():
        model(ids)  # warm-up: allocator, writer thread, pyarrow, all in place before measuring
        before = status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        model(ids)
        peak = status("VmHWM")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    bank = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    print(json.dumps({"extra_peak": peak - before, "weights": weights, "bank": bank}))


if __name__ == "__main__":
    main()
