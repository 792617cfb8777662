#!/bin/bash
# Issue 40, item 4: every deviation beside the clean production path on both trained models
# (models/glm5-tiny, models/dsv32-tiny) at 3072 and 6144 tokens of held-out text: per-layer
# top-k Jaccard against the clean path and argmax agreement with it (suspects.json, cells[].
# layers[].topk_jaccard_vs_clean and cells[].logits_vs_clean). Runs where the binary is:
#   SUSPECTS=$CARGO_TARGET_DIR/debug/shadowtrace-suspects tests/gpu/deviations_table.sh
# or on a GPU machine with the release binary in gpu-bin/ (as tests/gpu/suspects_h200.sh).
# The length-dependent deviations run at their defaults and with a parameter that acts on
# these prompts: the defaults (a paged kernel wrong past 4096 keys, a 4096-entry candidate
# buffer, a reduction failing past 131072 keys) lie at or past these lengths.
OUT=${OUT:-$PWD/deviations-table}
S=${SUSPECTS:-./gpu-bin/shadowtrace-suspects}
LENGTHS=${LENGTHS:-3072,6144}
DEVS=${DEVS:-indexer_rope_neox,indexer_rope_interleaved,indexer_fp8,hadamard_dropped,indexer_k_cache_fp8,weights_proj_bf16,indexer_logits_bf16,tie_order,kv_slot_nan,zero_rope_writer,kcache_wrong_blocks,stale_prefix_state,indexer_logits_lowprec,indexer_logits_lowprec_fp16,paged_logits_past_len,paged_logits_past_len:2048,topk_drops_winners,topk_drops_winners:256,fp8_gemm_mtile_rows,reduction_zeros_large,reduction_zeros_large:4096}
mkdir -p "$OUT"
for length in ${LENGTHS//,/ }; do
  for model in glm5-tiny dsv32-tiny; do
    $S --model "models/$model" --prompts heldout=models/corpus/heldout_head.bin --lengths "$length" \
      --deviations "$DEVS" --report "$OUT/$model-$length" 2>&1 | tee "$OUT/$model-$length.log" | tail -80
  done
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("*/suspects.json")):
    sweep = json.loads(f.read_text())["sweep"]
    print(f"\n{f.parent.name}: per-layer Jaccard vs clean | argmax agreement vs clean")
    for c in sweep["cells"]:
        js = " ".join("-" if l["topk_jaccard_vs_clean"] is None else f"{l['topk_jaccard_vs_clean']:.4f}" for l in c["layers"])
        arg = (c.get("logits_vs_clean") or {}).get("argmax_agreement")
        print(f"{c['path']:<32} {c['length']:>5}  J {js}  argmax {arg if arg is None else round(arg, 4)}")
PY
