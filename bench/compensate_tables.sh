#!/usr/bin/env bash
# Every compensation table of issue 3 in one GPU call (BENCHMARKS.md §2): the four settings run
# as parallel processes on one H200 (a 135M model leaves the GPU mostly idle per process).
#   bash bench/compensate_tables.sh MODEL OUTDIR
# Warm-up first, so the GGUF conversion and the self-sampled calibration ids are cached once.
set -u
model=${1:-smollm2}; out=${2:-bench/results}; mkdir -p "$out"
limit=${LIMIT_S:-540}
python - "$model" <<'PY'
import sys
from spear.api import model_key
from spear.data.calibration import CalibConfig, calibration_ids
from spear.models import load_float_model
lm = load_float_model(sys.argv[1])
calibration_ids(lm.model, lm.tokenizer, CalibConfig(128, 512), model_key(sys.argv[1]))
PY
table() { name=$1; shift; timeout "$limit" python bench/compensate_table.py --model "$model" --json "$out/$name.json" "$@" > "/tmp/$name.log" 2>&1; }
table compensate_rtn_w4pc --method rtn --bits 4 --group-size -1 --only LORC LQER QERA SPEAR &
table compensate_rtn_w4pc_ablations --method rtn --bits 4 --group-size -1 --only ablation &
table compensate_gptq_w4pc --method gptq --bits 4 --group-size -1 --only LORC LQER QERA SPEAR &
table compensate_rtn_w4g64 --method rtn --bits 4 --group-size 64 --only LORC LQER QERA SPEAR &
table compensate_gptq_w3g64 --method gptq --bits 3 --group-size 64 --only LORC LQER QERA SPEAR &
table compensate_rtn_w4pc_steps600 --method rtn --bits 4 --group-size -1 --only SPEAR --steps 600 &
timeout "$limit" python bench/quant_table.py --model "$model" --bits 4 --only "GPTQ act-order" --json "$out/smollm2_quant_table_actorder.json" > /tmp/compensate_quant_actorder.log 2>&1 &
wait
for f in /tmp/compensate_*.log; do echo "== $f"; grep -v "^\s*$" "$f" | tail -n 14; done | tee "$out/compensate_tables.log"
