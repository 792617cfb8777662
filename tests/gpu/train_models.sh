#!/bin/bash
# Trains the GLM-5- and DeepSeek-V3.2-shaped models (models/README.md) on a GPU machine with
# torch and transformers but no network, both at once on its one GPU. Prepare here, then run
# this from the repository root there with gpu-bin carried:
#   python models/train/corpus.py --out gpu-bin/corpus
# Writes $OUT/glm5-tiny and $OUT/dsv32-tiny (config.json, model.safetensors,
# training_record.json, train.log). BUDGET_S (default 360) is each model's training time;
# evaluation and saving take about a minute more. MODELS (default "glm deepseek") picks the
# models, STEPS fixes the steps per stage instead (e.g. dense=1395,warmup=241,sparse=420).
# At most 8 files come back from the machine: keep $OUT to these. Exits 1 when a model failed.
set -o pipefail
OUT=${OUT:-$PWD/out/trained}
BUDGET_S=${BUDGET_S:-360}
MODELS=${MODELS:-glm deepseek}
CORPUS=${CORPUS:-gpu-bin/corpus}
mkdir -p "$OUT"
python3 -c "import transformers, torch; print('torch', torch.__version__, 'transformers', transformers.__version__)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
status=0
pids=()
for model in $MODELS; do
    case $model in glm) name=glm5-tiny ;; deepseek) name=dsv32-tiny ;; *) echo "no model $model"; exit 2 ;; esac
    mkdir -p "$OUT/$name"
    python3 models/train/train_dsa.py --model "$model" --corpus "$CORPUS" --out "$OUT/$name" \
        --budget-s "$BUDGET_S" ${STEPS:+--steps "$STEPS"} > "$OUT/$name/train.log" 2>&1 &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
tail -n 12 "$OUT"/*/train.log
rm -f "$OUT"/*/generation_config.json
nvidia-smi --query-gpu=memory.used --format=csv,noheader
exit $status
