#!/bin/bash
# tests/gpu/fp8_hf_h200.py on a GPU machine with torch and transformers but no network: the
# FP8 path of transformers on torch._scaled_mm, traced. Prepare here, then run this from the
# repository root there:
#   mkdir -p gpu-bin/hooks && pip wheel --no-deps ./hooks -w gpu-bin/hooks
# Exits with the script's status (1 when a check failed).
set -o pipefail
OUT=${OUT:-$PWD}
python3 -m pip install -q --no-deps --force-reinstall gpu-bin/hooks/shadowtrace_hooks-*.whl 2>&1 | grep -v WARNING
python3 -c "import transformers, torch; print('torch', torch.__version__, 'transformers', transformers.__version__)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 tests/gpu/fp8_hf_h200.py /tmp/fp8_hf_runs 2>&1 | tee "$OUT/fp8_hf_h200.log"
