#!/bin/bash
# tests/gpu/fp8_reference_h200.py on a GPU machine with torch and transformers but no Rust
# toolchain. Prepare here:
#   cargo build --release -p shadowtrace-tracer --no-default-features --bin shadowtrace-run
#   mkdir -p gpu-bin; cp $CARGO_TARGET_DIR/release/shadowtrace-run gpu-bin/; strip it
# Then run this from the repository root there. Exits with the script's status.
set -o pipefail
OUT=${OUT:-$PWD}
TL=$(python3 -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
export LD_LIBRARY_PATH=$TL:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 tests/gpu/fp8_reference_h200.py "$PWD/gpu-bin/shadowtrace-run" /tmp/fp8_reference "${1:-4096}" 2>&1 \
  | grep -v "Writing model shards" | tee "$OUT/fp8_reference_h200.log"
