#!/usr/bin/env bash
# Benchmark suites in one device call, one after another; the result JSONs and one log come back in $OUT:
#   run(command="SPEAR_COMMIT=$(git rev-parse --short HEAD) bash bench/gpu_all.sh tests decode", kind="nvidia-h200")
# Parts, run in the order given (default: tests decode kernels); each gets at most its own limit and what is left of
# the call's 9.5 minutes ($LIMIT seconds, default 570):
#   tests     the GPU test suites (kernels, runtime ops, KV cache, engine, fused launches; about 380 s without a
#             Triton cache)
#   decode    $MODEL (default llama2-7b; llama3-8b the other) through the engine: fp16, W4 and W4+EC on 15, 38 and
#             60% of the linears at batch 1, 8 and 32 (BENCHMARKS.md §5)
#   profile   where an eager batch-1 W4 step of Llama-2-7B spends its device time (§5)
#   kernels   issue 4's grid (§4): $KMODELS (default 7b 8b 13b 70b) at $MS rows (default 1); $KSHAPES picks shapes
#   slo       the SLO-aware chunked-prefill experiment (§6)
#   tp        on nvidia-h200-x2: the layer-level TP grid (collective, p2p), then the engine at TP 2 (§7)
#   quality   the quality suites $SUITES (default: bases; $ROWS: only these rows) of bench/quality.py on the staged default model: run
#             `eval $(bash .stage/b/device-join.sh)` first, with ../shared/data copied to /tmp/spear-data (quality.py
#             says how); the suites' JSON (quality_SUITE.json, every row's table) and quality_rows.tgz (each row's
#             JSON and log, there even when the limit cut the merge) come back
#   run       the main job timed end to end on the staged default model (bench/spear_run.py; $RUN_ARGS: options for
#             `spear run`, default none: the defaults); stage as for quality; spear_run_h200_$tag.json comes back
#   startup   `spear serve`'s start-up split by stage (bench/serve_startup.py: $MODEL, default llama3-8b, a random W4
#             artifact with ECs on 15% of the linears; a cold start in fresh Triton and tuner caches, then a warm
#             one); needs the serving wheels: `eval $(bash .stage/b/device-join.sh)` first (stage with --serve)
#   ab        decode A/B against another source tree $BEFORE (default .before; carry it: `git archive REV src
#             bench/decode.py bench/common.py | tar -x -C .before`): $MODEL's $SETTINGS (default w4) at batch 1 and 32,
#             in the order before, after, after, before, each tree with its own tuning cache (the second run of a
#             tree reuses its picks); the picks come back as w4_tuning_{before,after}.json
# The W4 tuner's picks come back as w4_tuning.json and the compiled Triton kernels as triton_cache.tgz (under 15
# MB): copied into .gpu_cache/ and carried (carry=[".gpu_cache"]), the next call skips that tuning and most compiles.
set -u
parts=${*:-tests decode kernels}
for part in $parts; do
  case $part in tests|decode|profile|kernels|slo|tp|quality|run|startup|ab) ;;
    *) echo "unknown part $part: tests, decode, profile, kernels, slo, tp, quality, run, startup or ab" >&2; exit 2 ;; esac
done
out=${OUT:-bench/results/gpu_all}; mkdir -p "$out"
tag=$(echo "${SPEAR_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" | cut -c1-7)
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export SPEAR_CACHE=$PWD/.gpu_cache TRITON_CACHE_DIR=$PWD/.gpu_cache/triton
[ -f .gpu_cache/triton_cache.tgz ] && tar xzf .gpu_cache/triton_cache.tgz -C .gpu_cache
log=/tmp/gpu_all; mkdir -p $log
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $log/0_nvidia_smi.log
left() { local t=$((${LIMIT:-570} - SECONDS)); echo $((t < $1 ? t : $1)); }  # the next part's seconds: its limit or less
n=1
for part in $parts; do
  n=$((n + 1)); l=$log/${n}_$part.log
  case $part in
    tests)  # -v: one line a test, so that the failures are named even when the timeout cuts the run; a test that
            # hangs is cut after 120 s (pytest-timeout, on the GPU image) and the others still run
      timeout "$(left 450)" python -m pytest -p no:cacheprovider -o addopts= -v --timeout 120 tests/test_kernels.py \
        tests/test_runtime_ops.py tests/test_runtime_kv_cache.py tests/test_runtime_engine.py tests/test_runtime_fuse.py \
        > $l 2>&1
      { grep -cE " PASSED" $l; grep -E " (FAILED|ERROR)|passed|failed" $l; } > $log/${n}_tests_summary.log ;;
    decode)
      model=${MODEL:-llama2-7b}
      timeout "$(left 420)" python bench/decode.py --models $model --settings fp16 w4 w4+ec15 w4+ec38 w4+ec60 \
        --batches 1 8 32 --json "$out/decode_h200_${model}_$tag.json" > $l 2>&1 ;;
    profile)
      timeout "$(left 60)" python bench/profile_step.py --model llama2-7b --setting w4 --batch 1 \
        --json "$out/profile_b1_$tag.json" > $l 2>&1 ;;
    kernels)
      t=$(left 570)
      timeout $t python bench/w4_kernels.py --json "$out/kernels_h200_$tag.json" --models ${KMODELS:-7b 8b 13b 70b} \
        ${KSHAPES:+--shapes $KSHAPES} --ms ${MS:-1} --time-limit $((t - 45)) > $l 2>&1 ;;
    slo)
      timeout "$(left 450)" python bench/slo_experiment.py --json "$out/slo_experiment_h200_$tag.json" \
        --time-limit 400 > $l 2>&1 ;;
    tp)
      timeout "$(left 340)" python bench/tp_decode.py --reductions collective p2p --time-limit 300 \
        --json "$out/tp_decode_h200x2_$tag.json" > $l 2>&1
      timeout "$(left 230)" python bench/decode.py --tp 2 --models llama2-7b --settings w4 w4+ec38 --batches 1 16 \
        --json "$out/decode_tp2_h200x2_$tag.json" >> $l 2>&1 ;;
    quality)
      [ -n "${GGUF:-}" ] || { echo "quality: GGUF is not set: stage the model (bench/quality.py)" > $l; continue; }
      t=$(left 570)
      SPEAR_DATA=${SPEAR_DATA:-/tmp/spear-data} OMP_NUM_THREADS=2 timeout $t python bench/quality.py --model "$GGUF" \
        --out /tmp/quality --suite ${SUITES:-bases} ${ROWS:+--rows $ROWS} --time-limit $((t - 30)) > $l 2>&1
      cp /tmp/quality/quality_*.json "$out/" 2>/dev/null
      tar czf "$out/quality_rows.tgz" -C /tmp/quality . 2>/dev/null  # every row's JSON and log, merged or not
      for f in /tmp/quality/*.log; do echo "--- $f"; tail -n 3 "$f"; done >> $l 2>/dev/null ;;
    run)
      [ -n "${GGUF:-}" ] || { echo "run: GGUF is not set: stage the model (bench/quality.py)" > $l; continue; }
      SPEAR_DATA=${SPEAR_DATA:-/tmp/spear-data} timeout "$(left 570)" python bench/spear_run.py --model "$GGUF" \
        --json "$out/spear_run_h200_$tag.json" -- ${RUN_ARGS:-} > $l 2>&1 ;;
    startup)
      SPEAR_CACHE=/tmp/startup_cache TRITON_CACHE_DIR=/tmp/startup_cache/triton timeout "$(left 300)" \
        python bench/serve_startup.py --model ${MODEL:-llama3-8b} --ec-fraction 0.15 \
        --json "$out/serve_startup_${MODEL:-llama3-8b}_$tag.json" > $l 2>&1 ;;
    ab)
      before=${BEFORE:-.before}
      [ -f "$before/bench/decode.py" ] || { echo "no source tree at $before (BEFORE)" > $l; continue; }
      for tree in before after after before; do
        src=$PWD; [ $tree = before ] && src=$(cd "$before" && pwd)
        SPEAR_CACHE=/tmp/ab_$tree PYTHONPATH=$src/src:${PYTHONPATH:-} timeout "$(left 260)" python $src/bench/decode.py \
          --models ${MODEL:-llama2-7b} --settings ${SETTINGS:-w4} --batches 1 32 --new-tokens 128 \
          --json "$out/decode_ab_${tree}_$SECONDS.json" >> $l 2>&1
        cp /tmp/ab_$tree/w4_tuning.json "$out/w4_tuning_$tree.json" 2>/dev/null
      done ;;
  esac
done
cp .gpu_cache/w4_tuning.json "$out/" 2>/dev/null
if tar czf /tmp/triton_cache.tgz -C .gpu_cache triton 2>/dev/null && [ "$(stat -c %s /tmp/triton_cache.tgz)" -lt 15000000 ] \
   && [ "$(ls "$out" | wc -l)" -lt 7 ]; then  # at most 8 files come back, gpu_all.log last
  cp /tmp/triton_cache.tgz "$out/"
fi
for f in $log/*.log; do echo "=== $f"; tail -n ${TAIL:-40} "$f"; done > "$out/gpu_all.log"
tail -c 11000 "$out/gpu_all.log"
