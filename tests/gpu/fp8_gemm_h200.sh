#!/bin/bash
# The CUDA-only tests (FP8 GEMM on the tensor cores against its emulation) and the prefill
# attribution benchmark, on a GPU machine without a Rust toolchain. Prepare here:
#   cargo build --release -p shadowtrace-tracer --no-default-features --benches --tests
#   mkdir -p gpu-bin; copy the cuda_matches_cpu test and engine_prefill bench executables
#   from $CARGO_TARGET_DIR/release/deps into gpu-bin/ under those names, and strip them.
# Then run this from the repository root there.
set -o pipefail
OUT=${OUT:-$PWD}
TL=$(python3 -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
export LD_LIBRARY_PATH=$TL:$LD_LIBRARY_PATH
export SHADOWTRACE_GOLDEN=$PWD/tests/golden/numerics_v1.json
echo "== cuda_matches_cpu"
./gpu-bin/cuda_matches_cpu --ignored --nocapture --test-threads 1 2>&1 | tee "$OUT/cuda_matches_cpu.log"
echo "== engine_prefill, 8192 tokens, 8 layers"
SHADOWTRACE_BENCH_TOKENS=8192 ./gpu-bin/engine_prefill 2>&1 | tee "$OUT/prefill_8192.log"
