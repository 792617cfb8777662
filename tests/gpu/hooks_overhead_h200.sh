#!/bin/bash
# tests/python/bench_hooks_overhead.py at GLM-5 widths (256 experts, 4 layers, 8192 tokens) on a
# GPU machine with torch and transformers but no network. Prepare here, then run this from the
# repository root there (extra arguments go to the benchmark):
#   mkdir -p gpu-bin/hooks && pip wheel --no-deps ./hooks -w gpu-bin/hooks
# It installs the hooks wheel into that machine's python and exits with the benchmark's status
# (1 when any traced work was skipped; goals met or missed are printed, not the status).
# --only "installed,capture only,On,fp32 local shadow" (rows by the start of their names) took
# under 2 minutes on an H200; the local,free and bf16 rows add their own minutes.
set -o pipefail
OUT=${OUT:-$PWD}
python3 -m pip install -q --no-deps --force-reinstall gpu-bin/hooks/shadowtrace_hooks-*.whl 2>&1 | grep -v WARNING
python3 -c "import shadowtrace_hooks; print(shadowtrace_hooks.__file__)" || exit 1
python3 -c "import transformers, torch; print('torch', torch.__version__, 'transformers', transformers.__version__)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 tests/python/bench_hooks_overhead.py --layers 4 --tokens 8192 --repeat 3 "$@" 2>&1 | tee "$OUT/bench_hooks.log"
