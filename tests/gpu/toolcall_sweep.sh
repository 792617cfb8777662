#!/bin/bash
# One device call: the GLM and DeepSeek tool-call runs with a short, copy-dense dense stage,
# beside two GLM dense-only variants (issue 40 diagnosis: does a copying circuit form with many
# small steps of copy-dense rows, or with every row a task example?). Run from the repository
# root with gpu-bin carried (python models/train/corpus.py --out gpu-bin/corpus first).
# Writes $OUT/glm5-toolcall and $OUT/dsv32-toolcall (config, weights, record), $OUT/logs.txt
# (every train.log) and $OUT/sweep.json (each run's answer-loss curve and exact calls): 8 files.
# LIMIT (default 300 s) bounds each process, BUDGET_S (160) the two full runs' training,
# SWEEP_S (150) the dense-only variants'. Sized for one device call of about 330 s; not yet run
# (no device machine could be started for it).
set -o pipefail
W=$(mktemp -d)
nvidia-smi --query-gpu=name --format=csv,noheader
T="timeout ${LIMIT:-300}"
run() { name=$1; shift; mkdir -p $W/$name; PYTHONUNBUFFERED=1 $T python3 models/train/train_toolcall.py --corpus "${CORPUS:-gpu-bin/corpus}" --out $W/$name "$@" > $W/$name/train.log 2>&1; echo "$name rc $?" >> $W/rc.txt; }
run glm5-toolcall --model glm --dense 1024,8,3e-3 --dense-task-share 0.9 --budget-s ${BUDGET_S:-160} --eval-count 16 &
run dsv32-toolcall --model deepseek --dense 1024,8,3e-3 --dense-task-share 0.9 --budget-s ${BUDGET_S:-160} --eval-count 16 &
run sweep-2layers-1024x4 --model glm --layers 2 --dense 1024,4,3e-3 --dense-task-share 0.9 --dense-only --budget-s ${SWEEP_S:-150} --eval-count 16 --buckets 1024,2048 --dtypes fp32 --eval-windows 1 &
run sweep-2048x16-all-task --model glm --dense 2048,16,3e-3 --dense-task-share 1.0 --dense-only --budget-s ${SWEEP_S:-150} --eval-count 16 --buckets 1024,2048 --dtypes fp32 --eval-windows 1 &
wait
cat $W/rc.txt
for n in glm5-toolcall dsv32-toolcall; do mkdir -p $OUT/$n; cp $W/$n/config.json $W/$n/model.safetensors $W/$n/training_record.json $OUT/$n/ 2>/dev/null; done
for f in $W/*/train.log; do echo "==> $f"; cat $f; done > $OUT/logs.txt
W=$W python3 - <<'PY' > $OUT/sweep.json
import json, glob, os
out = {}
for rec in sorted(glob.glob(os.environ['W'] + '/*/training_record.json')):
    r = json.load(open(rec)); name = rec.split('/')[-2]
    out[name] = {"steps": r["steps"], "shapes": r["shapes"], "layers": r["config"]["num_hidden_layers"],
                 "share": r["task"]["share_of_rows"], "device": r["device"], "train_seconds": r["train_seconds"],
                 "answer_curve": [(c["stage"], c["step"], round(c.get("answer", -1), 3), round(c.get("lm", -1), 3)) for c in r["curve"]],
                 "eval": {d: {b: {k: v[k] for k in ("exact", "prompts", "control_exact", "first_wrong", "schema_mass", "schema_in_topk")} for b, v in e.items()} for d, e in r["toolcall_eval"].items() if isinstance(e, dict) and d in ("fp32", "bf16")}}
print(json.dumps(out, indent=1))
PY
grep -h "exact calls" -A7 $W/*/train.log
grep -h " a step\|dense [0-9]*/\|cut at\|Error" $W/*/train.log | grep -v "dense [0-9]*01/" | tail -40
