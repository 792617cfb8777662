#!/bin/bash
# One device call: the GLM and DeepSeek tool-call runs with the copy stage first
# (toolcall.copy_row: corpus rows with random segments written twice), beside a GLM copy
# probe (copy stage, then a short dense stage): does a copying circuit form, at which step
# (the curve's answer_acc on the second copies), and with 256-byte rows at 1e-3?
# Run from the repository root with gpu-bin carried (python models/train/corpus.py --out
# gpu-bin/corpus first). Writes $OUT/glm5-toolcall and $OUT/dsv32-toolcall (config, weights,
# record), $OUT/logs.txt (every train.log) and $OUT/sweep.json (each run's curve and exact
# calls): 8 files. LIMIT (default 560 s) bounds each process; COPY_S (200) and BUDGET_S
# (180) the two full runs' copy stage and the rest of their training, PROBE_S (330) the
# probe's copy stage.
set -o pipefail
W=$(mktemp -d)
nvidia-smi --query-gpu=name --format=csv,noheader
T="timeout ${LIMIT:-560}"
run() { name=$1; shift; mkdir -p $W/$name; PYTHONUNBUFFERED=1 $T python3 models/train/train_toolcall.py --corpus "${CORPUS:-gpu-bin/corpus}" --out $W/$name "$@" > $W/$name/train.log 2>&1; echo "$name rc $?" >> $W/rc.txt; }
run glm5-toolcall --model glm --copy-s ${COPY_S:-200} --budget-s ${BUDGET_S:-180} --eval-count 16 &
run dsv32-toolcall --model deepseek --copy-s ${COPY_S:-200} --budget-s ${BUDGET_S:-180} --eval-count 16 &
run probe-256x64-1e-3 --model glm --copy 256,64,1e-3 --copy-s ${PROBE_S:-330} --dense-only --budget-s 40 --eval-count 16 --buckets 1024,2048 --dtypes fp32 --eval-windows 1 &
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
                 "answer_curve": [(c["stage"], c["step"], round(c.get("answer", -1), 3), round(c.get("answer_acc", -1), 3), round(c.get("lm", -1), 3)) for c in r["curve"]],
                 "eval": {d: {b: {k: v[k] for k in ("exact", "prompts", "control_exact", "first_wrong", "schema_mass", "schema_in_topk")} for b, v in e.items()} for d, e in r["toolcall_eval"].items() if isinstance(e, dict) and d in ("fp32", "bf16")}}
print(json.dumps(out, indent=1))
PY
grep -h "exact calls" -A7 $W/*/train.log
grep -h " a step\|dense [0-9]*/\|cut at\|Error" $W/*/train.log | grep -v "dense [0-9]*01/" | tail -40
