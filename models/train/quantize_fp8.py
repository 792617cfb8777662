"""FP8 checkpoints of the trained models, made as the published ones are: transformers' own
fine-grained FP8 conversion (`tests/python/tiny_fp8.convert`: the quantizer's pre-load step,
`Fp8Quantize` on each bf16 weight, the post-load step), e4m3 codes with 128x128 block scales,
dynamic activation scaling, written by `save_pretrained` with its `quantization_config`.

What stays bf16 is what the published checkpoints keep so (`stored` in
`tracer/src/model/fp8_checkpoint.rs`): lm_head, the indexer's weights_proj and, for GLM-5, the
indexer's wk (DeepSeek-V3.2's is FP8); routers, norms and embeddings are not linears. Scales:
fp32 for GLM-5, ue8m0 for DeepSeek-V3.2, whose config says `scale_fmt: ue8m0`.

    python models/train/quantize_fp8.py                 # both: models/<name> -> models/<name>-fp8
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

MODELS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(MODELS.parent / "tests" / "python"))
import tiny_fp8  # noqa: E402  (transformers' conversion as the FP8 tests drive it)

BLOCK = 128
# name -> (scale format, modules kept bf16)
RECIPES = {
    "glm5-tiny": ("float", ["lm_head", "indexer.weights_proj", "indexer.wk"]),
    "dsv32-tiny": ("ue8m0", ["lm_head", "indexer.weights_proj"]),
}


def regrid_scales(path: Path) -> int:
    """Writes every block scale as its [ceil(R/128), ceil(C/128)] grid, as the published
    checkpoints store it. transformers 5.17's `save_pretrained` splits an expert bank's scales
    with `SplitModulelist`, which squeezes each expert's: a [256, 128] down_proj's [2, 1]
    grid is written [2], and transformers' own loader then fails to dequantize it
    ("shape '[256, 128]' is invalid"). Returns how many scales were reshaped."""
    tensors = load_file(path)
    fixed = 0
    for name, scale in list(tensors.items()):
        if not name.endswith("weight_scale_inv"):
            continue
        rows, cols = tensors[name.removesuffix("_scale_inv")].shape
        grid = (-(-rows // BLOCK), -(-cols // BLOCK))
        if tuple(scale.shape) != grid and scale.numel() == grid[0] * grid[1]:
            tensors[name] = scale.reshape(grid).contiguous()
            fixed += 1
    save_file(tensors, path, metadata={"format": "pt"})
    return fixed


def quantize(src: Path, dst: Path, scale_fmt: str, skip: list[str]) -> dict:
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    model, _ = tiny_fp8.convert(model, scale_fmt=scale_fmt, skip=skip)
    model.save_pretrained(dst)
    (dst / "generation_config.json").unlink(missing_ok=True)
    regridded = regrid_scales(dst / "model.safetensors")
    fp8 = sum(p.dtype == torch.float8_e4m3fn for p in model.state_dict().values())
    record = {
        "quantized_from": src.name,
        "source_sha256": hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest(),
        "transformers": __import__("transformers").__version__,
        "scale_fmt": scale_fmt,
        "kept_bf16": skip,
        "fp8_tensors": fp8,
        "scales_regridded": regridded,
    }
    (dst / "quantization_record.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="*", default=sorted(RECIPES), help=f"among {sorted(RECIPES)}")
    args = parser.parse_args()
    for name in args.names:
        if name not in RECIPES:
            sys.exit(f"quantize_fp8: no recipe for {name!r}; known: {sorted(RECIPES)}")
        record = quantize(MODELS / name, MODELS / f"{name}-fp8", *RECIPES[name])
        print(
            f"quantize_fp8: {name}-fp8: {record['fp8_tensors']} FP8 tensors, scales {record['scale_fmt']}, "
            f"{record['scales_regridded']} squeezed scales written as their block grid"
        )


if __name__ == "__main__":
    main()
