#!/bin/bash
# The suspects sweep on a synthetic full-width GLM-5.1-FP8 checkpoint, on a GPU machine without
# a Rust toolchain. Prepare here, then run this from the repository root there:
#   cargo build --release -p shadowtrace-tracer --no-default-features --bin shadowtrace-suspects
#   mkdir -p gpu-bin && cp $CARGO_TARGET_DIR/release/shadowtrace-suspects gpu-bin/ && strip gpu-bin/shadowtrace-suspects
# LAYERS, LENGTHS, DEVS (comma list) and SWEEP_S (a time limit) may be set; OUT is where the
# report goes (the device runner sets it).
OUT=${OUT:-$PWD/suspects-h200}
TL=$(python3 -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
export LD_LIBRARY_PATH=$TL:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; df -h /tmp | tail -1
S=./gpu-bin/shadowtrace-suspects
T0=$(date +%s)
$S checkpoint --shape glm51 --full-width --layers "${LAYERS:-3}" --dense-layers 1 --out /tmp/glm51-fp8 2>&1 | tail -5
echo "checkpoint written in $(( $(date +%s) - T0 )) s"; du -sh /tmp/glm51-fp8
timeout "${SWEEP_S:-420}" $S --model /tmp/glm51-fp8 --demo-prompts --lengths "${LENGTHS:-1024,4096}" \
  ${DEVS:+--deviations "$DEVS"} --report "$OUT/suspects" 2>&1 | tee "$OUT/suspects.log" | tail -60
echo "sweep rc=${PIPESTATUS[0]}"
