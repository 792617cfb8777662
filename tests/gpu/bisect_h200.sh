#!/bin/bash
# tests/gpu/bisect_h200.py on a GPU machine with torch and transformers but no network: GLM-5
# widths, 4 layers, FP8 production on torch._scaled_mm, a fault planted at layer 2's MoE output,
# bisected; times per step beside an unhooked and a plain traced forward. Prepare here, then
# run this from the repository root there (extra arguments go to the script):
#   mkdir -p gpu-bin/hooks && pip wheel --no-deps ./hooks -w gpu-bin/hooks
# Exits with the script's status (1 when the bisection does not name mlp_out at layer 2).
set -o pipefail
OUT=${OUT:-$PWD}
python3 -m pip install -q --no-deps --force-reinstall gpu-bin/hooks/shadowtrace_hooks-*.whl 2>&1 | grep -v WARNING
python3 -c "import transformers, torch; print('torch', torch.__version__, 'transformers', transformers.__version__)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 tests/gpu/bisect_h200.py "$@" 2> "$OUT/bisect.log" | tee "$OUT/bisect.json"
