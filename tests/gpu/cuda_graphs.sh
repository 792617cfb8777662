#!/bin/bash
# tests/gpu/cuda_graphs.py on a GPU machine with torch and transformers but no network: a
# decode step captured into a torch.cuda.CUDAGraph and replayed, traced (issue 41). Prepare
# here, then run this from the repository root there:
#   mkdir -p gpu-bin/hooks && pip wheel --no-deps ./hooks -w gpu-bin/hooks
# Exits with the script's status (1 when a check failed).
set -o pipefail
OUT=${OUT:-$PWD}
python3 -m pip install -q --no-deps --force-reinstall gpu-bin/hooks/shadowtrace_hooks-*.whl 2>&1 | grep -v WARNING
python3 -c "import transformers, torch; print('torch', torch.__version__, 'transformers', transformers.__version__)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 tests/gpu/cuda_graphs.py /tmp/cuda_graph_runs "$@" 2>&1 | tee "$OUT/cuda_graphs.log"
