#!/usr/bin/env bash
# The compensation tables (BENCHMARKS.md §2) in one GPU call, rows as parallel processes on one H200
# (a 135M model leaves the GPU mostly idle per process). JSON lands in OUTDIR, logs beside it.
#   bash bench/compensate_tables.sh MODEL OUTDIR tables      the four settings: static baselines, SPEAR, gate off
#   bash bench/compensate_tables.sh MODEL OUTDIR ablations   the hard case (W4 RTN per-channel): every ablation
#   bash bench/compensate_tables.sh MODEL OUTDIR data        the hard case: sample count, sampler and steps, gate form,
#                                                            and W3 gate off (one trained row a process)
#   bash bench/compensate_tables.sh MODEL OUTDIR warm        only the warm-up (GGUF conversion, 128 and 512 self-samples)
# Warm-up first, so the GGUF conversion and the self-sampled calibration ids are cached once.
set -u
model=${1:-smollm2}; out=${2:-bench/results}; suite=${3:-tables}; mkdir -p "$out"
limit=${LIMIT_S:-540}
case "$suite" in data|warm) counts="128 512" ;; *) counts=128 ;; esac
python - "$model" $counts <<'PY'
import sys
from spear.api import model_key
from spear.data.calibration import CalibConfig, calibration_ids
from spear.models import load_float_model
lm = load_float_model(sys.argv[1])
for n in map(int, sys.argv[2:]):
    calibration_ids(lm.model, lm.tokenizer, CalibConfig(n, 512), model_key(sys.argv[1]))
PY
table() { name=$1; shift; timeout "$limit" python bench/compensate_table.py --model "$model" --json "$out/$name.json" "$@" > "$out/$name.log" 2>&1; }
pc="--method rtn --bits 4 --group-size -1"
case "$suite" in
  tables)  # one trained row a process, so that eight share the GPU evenly
    g4="--method gptq --bits 4 --group-size -1"; r64="--method rtn --bits 4 --group-size 64"; g3="--method gptq --bits 3 --group-size 64"
    table tab_rtn_w4pc_gateoff $pc --only "gate off (static" &
    table tab_rtn_w4pc_static $pc --budgets 0.01 --only QERA "rank 1" &
    table tab_rtn_w4pc_random $pc --calib-first-token random --only "+SPEAR" &
    table tab_gptq_w4pc $g4 --budgets 0.01 --only LQER QERA "+SPEAR" &
    table tab_gptq_w4pc_gateoff $g4 --only "gate off (static" &
    table tab_rtn_w4g64 $r64 --budgets 0.01 --only LQER QERA "+SPEAR" &
    table tab_rtn_w4g64_gateoff $r64 --only "gate off (static" &
    table tab_gptq_w3g64 $g3 --budgets 0.01 --only LQER QERA "+SPEAR" &
    ;;
  ablations)
    table abl_default $pc --budgets 0.01 --only "+SPEAR" "gate off (static" &
    table abl_static $pc --budgets 0.01 --only LORC LQER QERA "rank 1" &
    table abl_gate $pc --only "gate hidden" &
    table abl_hidden01 $pc --only "hidden-state term 0.1" &
    table abl_hidden1 $pc --only "hidden-state term 1" &
    table abl_placement $pc --only "placement spread" "placement concentrate" &
    table abl_lr $pc --only "learning rate" &
    table abl_data_random $pc --calib-first-token random --only "+SPEAR" "gate off (static" &
    table abl_data_top_p $pc --calib-first-token random --calib-temperature 0.9 --calib-top-p 0.95 --only "+SPEAR" &
    table abl_data_512 $pc --calib-samples 512 --only "+SPEAR" &
    table abl_data_wikivalid $pc --calib-file "$SPEAR_DATA/wikitext-2-raw/wiki.valid.tokens.txt" --only "+SPEAR" &
    ;;
  data)
    g3="--method gptq --bits 3 --group-size 64"
    table abl_data_512 $pc --calib-samples 512 --only "+SPEAR" &
    table abl_data_512_gateoff $pc --calib-samples 512 --only "gate off (static" &
    table abl_steps400 $pc --steps 400 --only "+SPEAR" &
    table abl_token_gate $pc --only "per-token scalar gate" &
    table abl_gate32 $pc --only "gate hidden 32" &
    table abl_data_top_p095 $pc --calib-top-p 0.95 --only "+SPEAR" &
    table abl_data_temp12 $pc --calib-temperature 1.2 --only "+SPEAR" &
    table tab_gptq_w3g64_gateoff $g3 --only "gate off (static" &
    ;;
  warm) ;;
  *) echo "unknown suite $suite: tables, ablations, data or warm" >&2; exit 2 ;;
esac
wait
for f in "$out"/*.log; do echo "== $f"; grep -E "wiki .* ptb" "$f"; grep -E "Error" "$f" | tail -n 1 | cut -c1-300; done | tee "$out/summary.log"
