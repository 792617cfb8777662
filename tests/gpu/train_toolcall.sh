#!/bin/bash
# Trains the GLM-5- and DeepSeek-V3.2-shaped tool-call models (issue 40,
# models/train/train_toolcall.py) on a GPU machine with torch and transformers but no
# network, both at once on its one GPU, then evaluates each (exact calls by length, fp32 and
# bf16). Prepare here, then run this from the repository root there with gpu-bin carried:
#   python models/train/corpus.py --out gpu-bin/corpus
# Writes $OUT/glm5-toolcall and $OUT/dsv32-toolcall (config.json, model.safetensors,
# training_record.json, train.log: 8 files, the most that come back). BUDGET_S (default 240)
# is each model's training time; the indexer check, saving and the evaluation (EVAL_COUNT
# prompts per length bucket, default 32) take about two minutes more. MODELS (default
# "glm deepseek") picks the models, STEPS fixes the steps per stage instead. Exits 1 when a
# model failed.
set -o pipefail
OUT=${OUT:-$PWD/out/toolcall}
BUDGET_S=${BUDGET_S:-240}
MODELS=${MODELS:-glm deepseek}
CORPUS=${CORPUS:-gpu-bin/corpus}
EVAL_COUNT=${EVAL_COUNT:-32}
mkdir -p "$OUT"
python3 -c "import transformers, torch; print('torch', torch.__version__, 'transformers', transformers.__version__)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
status=0
pids=()
for model in $MODELS; do
    case $model in glm) name=glm5-toolcall ;; deepseek) name=dsv32-toolcall ;; *) echo "no model $model"; exit 2 ;; esac
    mkdir -p "$OUT/$name"
    python3 models/train/train_toolcall.py --model "$model" --corpus "$CORPUS" --out "$OUT/$name" \
        --budget-s "$BUDGET_S" --eval-count "$EVAL_COUNT" ${STEPS:+--steps "$STEPS"} \
        > "$OUT/$name/train.log" 2>&1 &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
tail -n 16 "$OUT"/*/train.log
rm -f "$OUT"/*/generation_config.json
nvidia-smi --query-gpu=memory.used --format=csv,noheader
exit $status
