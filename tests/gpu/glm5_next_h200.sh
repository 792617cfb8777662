#!/bin/bash
# GLM-5.3-Flash in the reference engine on CUDA: production's FP8 linears on the tensor cores
# (_scaled_mm) against the fp32 shadow, on a GPU machine without a Rust toolchain or
# transformers 5.24. Prepare here, from the repository root:
#   cargo build --release -p shadowtrace-tracer --no-default-features --bin shadowtrace-run
#   mkdir -p gpu-bin && cp $CARGO_TARGET_DIR/release/shadowtrace-run gpu-bin/ && strip gpu-bin/shadowtrace-run
#   PYTHONPATH=$(python -c 'import sys; sys.path.insert(0, "tests/python"); import upstream; \
#     print(upstream.site("transformers", "5.24.0"))') \
#     python tests/python/glm5_next_reference.py gpu-bin/glm5_next 2048 /tmp/hf.pt
#   python -c 'import torch, json; json.dump(torch.load("/tmp/hf.pt")["ids"].tolist(), open("gpu-bin/ids.json", "w"))'
# Then run this from the repository root there. It fails when the run did not use the
# tensor cores (a CPU-only libtorch, or every _scaled_mm falling back): the figures it
# prints would then not be the ones it claims.
set -o pipefail
OUT=${OUT:-$PWD}
TL=$(python3 -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
export LD_LIBRARY_PATH=$TL:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name --format=csv,noheader
./gpu-bin/shadowtrace-run --model gpu-bin/glm5_next gpu-bin/ids.json --path fp8 || exit 1
./gpu-bin/shadowtrace-run --model gpu-bin/glm5_next gpu-bin/ids.json --out "$OUT/runs" || exit 1
python3 - "$OUT/runs" <<'PY'
import glob, json, sys
import pyarrow.parquet as pq
(run,) = glob.glob(sys.argv[1] + "/*")
manifest = json.load(open(run + "/manifest.json"))
counters = manifest["counters"]
print("device", manifest["device"], "counters", counters)
topk = pq.read_table(run + "/topk").to_pydict()
print("selections", len(topk["token"]), "unit", set(topk["unit"]), "unit_tokens", set(topk["unit_tokens"]))
if not counters.get("fp8_linears_tensor_cores"):
    sys.exit("no FP8 linear ran on the tensor cores: not the CUDA production path")
PY
