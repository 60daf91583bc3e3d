#!/usr/bin/env bash
# The GPU measurements of issues 4–7 in one device call on nvidia-h200-x2 (about 6 minutes; with SLO=1 up to 10):
#   GPU 0: the GPU test suites (kernels, runtime ops, fused launches, engine, KV cache), the decode benchmark
#          on Llama-2-7B, then the decode-kernel grid (7B, 70B shapes as time allows; M = $MS, default 1 16);
#   GPU 1: with SLO=1 the SLO experiment (all EC densities), then the decode benchmark on Llama-3-8B (fp16, W4,
#          W4+EC38), then the decode-kernel grid's 8B and 13B shapes;
#   or, with LAB=1, a short call comparing the decode kernel's candidates (ec_ablation.py's per-config times) and
#          the SwiGLU epilogue with an EC (the block below);
#   or, with AB=1, every decode candidate of two source trees (src/ and a carried .lab/src) on both GPUs in turn;
#   or, with NCU=1 (nvidia-h200 is enough), the W4 kernel's hardware counters, then Llama-2-7B through the engine;
#   or, with STREAM=1 (one GPU), the GEMV tiling's streaming ceiling (stream_lab.py; STREAM_MODES picks modes);
#   or, with CHAIN=1 (one GPU), the fp16x2 loop's word chains A/B'd, then the engine;
#   or, with FOLD=1 (one GPU), the add + RMSNorm folded into the W4 launches (SPEAR_FOLD_NORM) A/B'd in the engine;
#   or, with FINAL=1 (nvidia-h200-x2), session 12's last call (the block below);
#   or, with FINAL13=1 (one GPU), session 13's last call: GPU tests of the changed ops, the engine on 7B and 8B;
#   or, with WIDE=1 (nvidia-h200-x2), session 14's dot-loop A/B (one dot a block, more K splits) and the engine;
#   or, with FINAL14=1 (nvidia-h200-x2), session 14's last call: the TP grid at TP 2, the engine on 7B and 8B;
#   or, with S15=1 (nvidia-h200-x2), session 15: the 13B TP grid, the grouped wide loop at g = 32, the GPU tests;
#   or, with NCCLAB=1 (nvidia-h200-x2), session 15: NCCL_PROTO for the TP all-reduces (13B fp16 and W4);
#   or, with LAB15=1 (nvidia-h200-x2), session 15: attention's keys a step (SPEAR_ATTN_BLOCK_N), the fused prefill;
#   or, with FINAL15=1 (nvidia-h200-x2), session 15's last call: attention 16 vs 32 keys a step, the prefill GEMM;
#   or, with DOTASM=1 (nvidia-h200-x2), for session 16: the dot loops' codes through inline PTX (SPEAR_W4_DOT_ASM);
#   or, with S16=1 (nvidia-h200-x2): the group scale on the codes (SPEAR_W4_SCALE_CODES at f77b692), the 7B kernel grid,
#          the engine; with S16B=1 the EC's rank kernel with K split, the prefill lab per case, the engine; with
#          S16C=1 (one H200) the kernel grid's prefill rows, per-channel and g = 128; with S16D=1 the same with
#          the tile GEMM's own rank programs; with S16E=1 where W4+EC's prefill time goes, and the engine at batch 1;
#   or, with S17A=1 (one H200), session 17: the EC rank kernel's tiles (7B, 70B), the decode candidates at 1 and 16 rows;
#          with S17B=1 (at c1d36f6 only) the prefill tile GEMM's own rank programs, by count, and the 70B grid at 1 and
#          16 rows; with S17C=1 the rank programs as a launch beside the GEMM (PDL), by count and tiling, and the 7B
#          prefill grid; with S17D=1 the GPU tests and the prefill grid on every model's shapes; with S17E=1 the narrow
#          weights' GEMM first, the prefill grid (7B, 8B, 70B), 8B and 13B at 1 and 16 rows; with S17F=1 the wave rule
#          on 13B at 1024 and 2048 rows, the prefill GPU tests, the runtime ops' and engine's;
#   or, with S18A=1 (one H200, at d17d481: the fold was removed in session 22), session 18's: the GPU tests of decode
#          attention with RoPE and the K/V write inside,
#          then Llama-2-7B W4 and fp16 at batch 1 and 8 with and without (bench/decode.py --attention), then the
#          eager batch-1 W4 profile with it on;
#   or, with S20A=1 (one H200), session 20's: the fp16 GEMV on / off under the float fusion, fp16's profile, the full
#          Llama-2-7B table; with S20B=1 (.gpu_cache carried) the full Llama-3-8B table; with S20C=1 the fp16 GEMV's
#          early PDL release A/B'd (the kernel on 7B, then the engine); with S20D=1 the W4 kernel's (SPEAR_PDL_LATE);
#          with S20E=1 the W4 GEMV loop's alone (SPEAR_PDL_LATE_GEMV), W4 and W4+EC38;
#   or, with S23D=1 (one H200), issue 4's grid on the 7B shapes at 2, 4, 8, 16, 64 and 256 rows;
#   or, with S23B=1 / S23C=1 (one H200 each), session 23's: the full Llama-2-7B / Llama-3-8B decode table (every
#          setting, batch 1, 8, 32), then issue 4's grid at one row on $KMODELS (default 70b 13b 8b; with $KSHAPES
#          only those shapes) while time lasts;
#   or, with S22D=1 (one H200), the Llama-3-8B decode table alone;
#   or, with S22C=1 (one H200), the 7B decode table, its W4 profile and issue 4's grid at one row;
#   or, with S22B=1 (one H200), the tuner's fixed splits of K at one row A/B'd through the engine;
#   or, with S22A=1 (one H200), what one persistent launch a layer could save over four (bench/stream_lab.py --layer);
#   or, with S21B=1 / S21C=1 / S21D=1 (one H200; run them at 607c966 / f846d72 / af0e5ad: the code was removed after),
#          the L2 read-ahead of o's weight and a share of gate|up's while attention runs (SPEAR_L2_PREFETCH) A/B'd;
#   or, with S21A=1 (one H200, at 3e55312: removed after), the float path's norm and SiLU·up folded into its GEMVs;
#   or, with S19A=1 (one H200), session 19's: the float model's fused q/k/v, gate/up and fp16 GEMV (the block below);
#          with S19B=1 the GEMV's runs of row blocks, then the engine;
#   or, with TP=1 in the environment, only the tensor-parallel benchmarks on both (a call of its own): the
#          layer-level TP grid (bench/tp_decode.py: collective, p2p, p2p with the norm folded), then the serving
#          engine at TP 2 (bench/decode.py --tp 2; the step hand-off alone: bench/step_channel.py, not run here).
# Run as: run(command="SPEAR_COMMIT=<sha> bash bench/gpu_all.sh", kind="nvidia-h200-x2"). At most 8 files come
# back from $OUT, so the logs are gathered into one file.
set -u
out=${OUT:-bench/results/gpu_all}; mkdir -p "$out"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the W4 tuner's choices come back in $OUT; carry=[".gpu_cache"] on the next call skips the tuning it did
export SPEAR_CACHE=$PWD/.gpu_cache
# compiled Triton kernels too: they come back as triton_cache.tgz (where under 15 MB); copied into .gpu_cache/ and
# carried, the next call unpacks it and skips most compiles (the GPU tests and the tuner's candidates: minutes on a
# fresh machine; a kernel whose source changed compiles again)
export TRITON_CACHE_DIR=$PWD/.gpu_cache/triton
[ -f .gpu_cache/triton_cache.tgz ] && tar xzf .gpu_cache/triton_cache.tgz -C .gpu_cache
log=/tmp/gpu_all; mkdir -p $log
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $log/0_nvidia_smi.log
gpu0() {
  # -v: one line a test, so that the failures are named even when the timeout cuts the run before its summary
  timeout 180 python -m pytest -p no:cacheprovider -o addopts= -v tests/test_kernels.py tests/test_runtime_ops.py tests/test_runtime_kv_cache.py \
    tests/test_runtime_engine.py tests/test_runtime_fuse.py > $log/1_tests.log 2>&1
  { grep -cE " PASSED" $log/1_tests.log; grep -E " (FAILED|ERROR)|passed|failed" $log/1_tests.log; } \
    > $log/1_tests_summary.log
  timeout 270 python bench/decode.py --models llama2-7b --json "$out/decode_h200.json" > $log/2_decode.log 2>&1
  # where a batch-1 W4 step's device time goes (eager, every kernel listed)
  timeout 60 python bench/profile_step.py --model llama2-7b --setting w4 --batch 1 --json "$out/profile_b1.json" \
    > $log/2_profile.log 2>&1
  left=$((570 - SECONDS))  # the kernel grid takes what is left of the call's 10 minutes
  timeout $left python bench/kernels.py --json "$out/kernels_h200_rows.json" --models ${MODELS:-7b 70b} --ms ${MS:-1 16} \
    --time-limit $((left - 50)) > $log/3_kernels.log 2>&1
}
gpu1() {
  [ "${SLO:-0}" = 1 ] && timeout 450 python bench/slo_experiment.py --json "$out/slo_experiment_h200.json" \
    --time-limit 400 > $log/4_slo.log 2>&1  # SLO=1 runs it (4 more minutes; issue 6 is resolved)
  # Llama-3-8B through the engine (GQA, a 128k vocabulary; its W4 launches tuned on a fresh machine first)
  timeout 270 python bench/decode.py --models llama3-8b --settings fp16 w4 w4+ec38 \
    --json "$out/decode_h200_llama3.json" > $log/5_decode_llama3.log 2>&1
  left=$((560 - SECONDS))
  timeout $left python bench/kernels.py --json "$out/kernels_h200_rows_8b13b.json" --models 8b 13b --ms 1 16 \
    --time-limit $((left - 40)) > $log/6_kernels_8b13b.log 2>&1
}
if [ "${LAB:-0}" = 1 ]; then  # a short call of its own (session 9, ~8 minutes): the kernel candidates side by side
  (export CUDA_VISIBLE_DEVICES=0  # the kernel tests that touch the GEMV loops, then every candidate's W4 and W4+EC µs
   timeout 130 python -m pytest -p no:cacheprovider tests/test_kernels.py -k "f16x2 or workspace or gemv or reproducible" \
     > $log/1_tests.log 2>&1
   timeout 260 python bench/ec_ablation.py --ms 1 --json "$out/ec_ablation_h200.json" > $log/5_ec_ablation.log 2>&1
   timeout 130 python bench/decode.py --models llama2-7b --settings w4 --batches 1 8 --json "$out/decode_h200_w4.json" \
     > $log/2_decode_w4.log 2>&1) &
  (export CUDA_VISIBLE_DEVICES=1  # W4+EC38 with SiLU·up in the gate/up epilogue and without, one GPU
   for f in 0 1; do SPEAR_FUSE_SWIGLU=$f timeout 200 python bench/decode.py --models llama2-7b --settings w4+ec38 \
     --batches 1 8 --json "$out/decode_h200_ec38_swiglu$f.json" > $log/2_decode_ec38_swiglu$f.log 2>&1; done) &
  wait
elif [ "${AB:-0}" = 1 ]; then  # two source trees side by side: src/ and .lab/src (another branch's, carried in
  # with carry=[".lab"]); every decode candidate's W4 and W4+EC µs, each tree on both GPUs in turn
  for phase in 1 2; do
    for gpu in 0 1; do
      tree=$([ $(( (gpu + phase) % 2 )) = 1 ] && echo src || echo .lab/src); name=$([ $tree = src ] && echo main || echo lab)
      (export CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$PWD/$tree
       timeout 250 python bench/ec_ablation.py --configs-only --ms 1 16 --json "$out/ab_${name}_gpu${gpu}.json" \
         > $log/ab_${phase}_${name}_gpu${gpu}.log 2>&1) &
    done
    wait
  done
elif [ "${PDLAB:-0}" = 2 ]; then  # session 10's last call: PDL on and off in the engine, both GPUs in both orders
  run() { SPEAR_PDL=$1 timeout $3 python bench/decode.py --models llama2-7b --settings $4 --batches 1 8 \
    --json "$out/decode_h200_pdl$1_gpu$2.json" > $log/2_decode_pdl$1_gpu$2.log 2>&1; }
  (export CUDA_VISIBLE_DEVICES=0
   timeout 110 python -m pytest -p no:cacheprovider -rf tests/test_kernels.py -k "pdl or reproducible or swiglu" \
     tests/test_runtime_engine.py > $log/1_tests.log 2>&1
   grep -E "^FAILED|passed|failed" $log/1_tests.log > $log/1_tests_summary.log
   run 1 0 100 "w4 w4+ec38"; run 0 0 100 "w4 w4+ec38") &
  (export CUDA_VISIBLE_DEVICES=1
   run 0 1 100 "w4 w4+ec38"; run 1 1 170 "fp16 w4 w4+ec38") &
  wait
elif [ "${PDLAB:-0}" = 1 ]; then  # session 10 (run at 3a42402: SPEAR_PDL_PREFETCH went in session 23): PDL knobs
  settings="0:0:0 1:1:1024 1:1:0 1:0:0 1:0:1024"  # SPEAR_PDL:SPEAR_PDL_LATE:SPEAR_PDL_PREFETCH
  mkdir -p "$out/pdl"
  (export CUDA_VISIBLE_DEVICES=0
   timeout 150 python -m pytest -p no:cacheprovider -rf tests/test_kernels.py tests/test_runtime_ops.py \
     > $log/1_tests.log 2>&1
   grep -E "^FAILED|passed|failed" $log/1_tests.log > $log/1_tests_summary.log
   for s in 1:1:1024 0:0:0 1:0:0; do IFS=: read p l b <<< "$s"
     SPEAR_PDL=$p SPEAR_PDL_LATE=$l SPEAR_PDL_PREFETCH=$b timeout 120 python bench/decode.py --models llama2-7b \
       --settings w4 w4+ec38 --batches 1 8 --json "$out/pdl/decode_pdl_$p$l$b.json" > $log/2_decode_pdl_$p$l$b.log 2>&1; done) &
  (export CUDA_VISIBLE_DEVICES=1
   for s in $settings; do IFS=: read p l b <<< "$s"
     SPEAR_PDL=$p SPEAR_PDL_LATE=$l SPEAR_PDL_PREFETCH=$b timeout 60 python bench/ec_ablation.py --configs-only --ms 1 \
       --shapes 7b/qkvo 7b/gate_up 7b/down --json "$out/pdl/ec_pdl_$p$l$b.json" > $log/3_ec_pdl_$p$l$b.log 2>&1; done
   for s in 1:1:0 1:0:1024; do IFS=: read p l b <<< "$s"
     SPEAR_PDL=$p SPEAR_PDL_LATE=$l SPEAR_PDL_PREFETCH=$b timeout 100 python bench/decode.py --models llama2-7b \
       --settings w4 w4+ec38 --batches 1 8 --json "$out/pdl/decode_pdl_$p$l$b.json" > $log/2_decode_pdl_$p$l$b.log 2>&1; done) &
  wait
  tar czf "$out/pdl_jsons.tgz" -C "$out" pdl && rm -r "$out/pdl"  # at most 8 files come back
elif [ "${NCU:-0}" = 1 ]; then  # session 12, one GPU: the W4 kernel's hardware counters (bench/ncu_w4.py), then
  # the engine on Llama-2-7B (every setting)
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | tail -n 1)
  timeout 240 $ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats --metrics "$(python bench/ncu_w4.py --metrics)" \
    --csv --page details --log-file $log/ncu.csv python bench/ncu_w4.py --labels $log/ncu_labels.json > $log/1_ncu.log 2>&1
  python bench/ncu_w4.py --summarize $log/ncu.csv --labels $log/ncu_labels.json --json "$out/ncu_w4_h200.json" \
    > $log/1_ncu_summary.log 2>&1
  gzip -c $log/ncu.csv > "$out/ncu_w4_h200.csv.gz"
  timeout 300 python bench/decode.py --models llama2-7b --json "$out/decode_h200.json" > $log/2_decode.log 2>&1
elif [ "${STREAM:-0}" = 1 ]; then  # session 12, one GPU: the GEMV tiling's streaming ceiling (bench/stream_lab.py;
  # its codes-two-steps-ahead runs are gone with that refuted knob)
  timeout $((575 - SECONDS)) python bench/stream_lab.py --shapes 7b/qkvo 7b/gate_up 7b/down ${STREAM_MODES:+--modes $STREAM_MODES} \
    --json "$out/stream_lab_h200.json" > $log/3_stream.log 2>&1  # STREAM_MODES="a1 s3 k2 k4": stream-K against the best
elif [ "${FOLD:-0}" = 1 ]; then  # session 13, one GPU: the add + RMSNorm folded into the W4 launches around it
  # (SPEAR_FOLD_NORM) in both orders through the engine, after its GPU tests; then the batch-1 profile with it
  timeout 100 python -m pytest -p no:cacheprovider -o addopts= -v tests/test_kernels.py tests/test_runtime_fuse.py \
    tests/test_runtime_ops.py -k "folded or pdl_chain or rms" > $log/1_tests.log 2>&1
  grep -cE " PASSED" $log/1_tests.log > $log/1_tests_summary.log; grep -E " (FAILED|ERROR)|passed|failed" $log/1_tests.log >> $log/1_tests_summary.log
  mkdir -p $out/fold; i=0; for f in ${FOLD_ORDER:-0 1 1 0}; do i=$((i + 1)); SPEAR_FOLD_NORM=$f timeout $((i == 1 ? 170 : 80)) \
    python bench/decode.py --models llama2-7b --settings w4 w4+ec38 --batches ${FOLD_BATCHES:-1 8} \
    --json "$out/fold/decode_h200_fold${f}_run$i.json" > $log/2_fold${f}_$i.log 2>&1; done
  tar czf "$out/fold_jsons.tgz" -C "$out" fold && rm -r "$out/fold"  # at most 8 files come back
  timeout $((570 - SECONDS)) python bench/profile_step.py --model llama2-7b --setting w4 --batch 1 \
    --json "$out/profile_b1.json" > $log/3_profile.log 2>&1
elif [ "${FINAL13:-0}" = 1 ]; then  # session 13's last call, one GPU (carry .gpu_cache: tuned at this w4.py): the GPU
  # tests of the ops whose loads moved before the PDL wait and of the folded norm, Llama-2-7B through the engine
  # (fp16, W4, W4+EC38), W4+EC38 with SPEAR_FOLD_NORM=0 beside it, then Llama-3-8B
  timeout 100 python -m pytest -p no:cacheprovider -o addopts= -v tests/test_runtime_ops.py tests/test_kernels.py \
    -k "attention or rope or rms or folded" > $log/1_tests.log 2>&1
  { grep -cE " PASSED" $log/1_tests.log; grep -E " (FAILED|ERROR)|passed|failed" $log/1_tests.log; } > $log/1_tests_summary.log
  timeout 230 python bench/decode.py --models llama2-7b --settings fp16 w4 w4+ec38 --json "$out/decode_h200.json" \
    > $log/2_decode.log 2>&1
  SPEAR_FOLD_NORM=0 timeout 100 python bench/decode.py --models llama2-7b --settings w4+ec38 --batches 1 8 \
    --json "$out/decode_h200_fold0.json" > $log/3_decode_fold0.log 2>&1
  timeout $((540 - SECONDS)) python bench/decode.py --models llama3-8b --settings w4 w4+ec38 --batches 1 8 \
    --json "$out/decode_h200_llama3.json" > $log/4_decode_llama3.log 2>&1
elif [ "${CHAIN:-0}" = 1 ]; then  # session 12, one GPU: the fp16x2 loop's chains over 1 or 2 words
  # (SPEAR_W4_WORD_CHAIN) in both orders, then the engine at the default (2)
  timeout 150 python -m pytest -p no:cacheprovider -o addopts= -v tests/test_kernels.py -k "f16x2 or preload or gemv" \
    > $log/1_tests.log 2>&1
  grep -cE " PASSED" $log/1_tests.log > $log/1_tests_summary.log; grep -E " (FAILED|ERROR)|passed|failed" $log/1_tests.log >> $log/1_tests_summary.log
  i=0; for c in 1 2 2 1; do i=$((i + 1)); SPEAR_W4_WORD_CHAIN=$c timeout 75 python bench/ec_ablation.py --configs-only --ms 1 \
    --shapes 7b/qkvo 7b/gate_up 7b/down --json "$out/ec_ablation_h200_chain${c}_run$i.json" > $log/2_chain${c}_$i.log 2>&1; done
  timeout $((575 - SECONDS)) python bench/decode.py --models llama2-7b --settings w4 w4+ec38 --batches 1 8 \
    --json "$out/decode_h200.json" > $log/3_decode.log 2>&1
elif [ "${FINAL:-0}" = 1 ]; then  # session 12's last call, nvidia-h200-x2: GPU 0 the GPU tests, Llama-2-7B through
  # the engine (every setting) and the batch-1 profile; GPU 1 unmasked code loads (SPEAR_W4_EVEN) and the u-programs'
  # columns of A (SPEAR_EC_AX_COLUMNS) against the defaults, then Llama-3-8B through the engine
  (export CUDA_VISIBLE_DEVICES=0
   timeout 180 python -m pytest -p no:cacheprovider -o addopts= -v tests/test_kernels.py tests/test_runtime_ops.py \
     tests/test_runtime_kv_cache.py tests/test_runtime_engine.py tests/test_runtime_fuse.py > $log/1_tests.log 2>&1
   { grep -cE " PASSED" $log/1_tests.log; grep -E " (FAILED|ERROR)|passed|failed" $log/1_tests.log; } > $log/1_tests_summary.log
   timeout 270 python bench/decode.py --models llama2-7b --json "$out/decode_h200.json" > $log/2_decode.log 2>&1
   timeout $((560 - SECONDS)) python bench/profile_step.py --model llama2-7b --setting w4 --batch 1 \
     --json "$out/profile_b1.json" > $log/2_profile.log 2>&1) &
  (export CUDA_VISIBLE_DEVICES=1; mkdir -p $out/ab
   # the defaults first and last (drift), between them unmasked loads off, then 512 columns of A a u-program
   i=0; for v in base:1:256 even0:0:256 ax512:1:512 base:1:256; do i=$((i + 1)); IFS=: read name e a <<< "$v"
     SPEAR_W4_EVEN=$e SPEAR_EC_AX_COLUMNS=$a timeout 75 python bench/ec_ablation.py --configs-only --ms 1 \
       --shapes 7b/qkvo 7b/gate_up 7b/down --json "$out/ab/ec_ablation_h200_${name}_run$i.json" > $log/3_ab_${name}_$i.log 2>&1
   done
   timeout $((565 - SECONDS)) python bench/decode.py --models llama3-8b --settings w4 w4+ec38 --batches 1 8 \
     --json "$out/decode_h200_llama3.json" > $log/5_decode_llama3.log 2>&1) &
  wait
  tar czf "$out/ab_jsons.tgz" -C "$out" ab && rm -r "$out/ab"  # at most 8 files come back
elif [ "${S15:-0}" = 1 ]; then  # session 15, nvidia-h200-x2: the TP grid's 13B rows at TP 2 with the wide loop; then
  # GPU 0 the grouped wide loop at g = 32 (SPEAR_W4_DOT_WIDE 1 vs 2, both orders) and fp16 / W4 through the engine
  # at batch 1 (the ratio in one call), GPU 1 the GPU tests of the kernels and the fused launches
  timeout 230 python bench/tp_decode.py --tp 2 --models llama2-13b --settings fp16 w4 w4+ec \
    --reductions collective p2p --time-limit 200 --json "$out/tp_decode_h200x2.json" > $log/6_tp.log 2>&1
  mkdir -p $out/ab
  (export CUDA_VISIBLE_DEVICES=0
   for w in 1 2 2 1; do
     SPEAR_W4_DOT_WIDE=$w timeout 70 python bench/ec_ablation.py --configs-only --group-size 32 --ms 16 32 \
       --shapes 7b/qkv_fused 7b/gate_up_fused 7b/down 7b/qkvo --json "$out/ab/ec_ablation_h200_g32_wide${w}_$SECONDS.json" \
       > $log/3_ab_g32_wide${w}_$SECONDS.log 2>&1
   done
   timeout $((580 - SECONDS)) python bench/decode.py --models llama2-7b --settings fp16 w4 --batches 1 16 \
     --json "$out/decode_h200.json" > $log/2_decode.log 2>&1) &
  (export CUDA_VISIBLE_DEVICES=1
   timeout $((580 - SECONDS)) python -m pytest -p no:cacheprovider -o addopts= -v tests/test_kernels.py \
     tests/test_runtime_fuse.py tests/test_runtime_ops.py > $log/1_tests.log 2>&1
   { grep -cE " PASSED" $log/1_tests.log; grep -E " (FAILED|ERROR)|passed|failed" $log/1_tests.log; } \
     > $log/1_tests_summary.log) &
  wait
  tar czf "$out/ab_jsons.tgz" -C "$out" ab && rm -r "$out/ab"
elif [ "${NCCLAB:-0}" = 1 ]; then  # session 15, nvidia-h200-x2: NCCL's protocol for TP's all-reduces (13B, TP 2,
  # fp16 and W4 over the collective path): the default, then NCCL_PROTO=LL and LL128, then the default again
  for proto in default LL LL128 default; do
    left=$((575 - SECONDS)); [ $left -lt 60 ] && break
    (if [ $proto != default ]; then export NCCL_PROTO=$proto; fi
     timeout $left python bench/tp_decode.py --tp 2 --models llama2-13b --settings fp16 w4 --reductions collective \
       --time-limit $((left - 30)) --json "$out/tp_nccl_${proto}_$SECONDS.json") > $log/6_tp_${proto}_$SECONDS.log 2>&1
  done
elif [ "${LAB15:-0}" = 1 ]; then  # session 15's last call, nvidia-h200-x2: decode attention's keys a step
  # (SPEAR_ATTN_BLOCK_N 64, the default, vs 32) through the engine, and the fused prefill GEMM with the wide loop
  attn() {  # BLOCK_N
    SPEAR_ATTN_BLOCK_N=$1 timeout $2 python bench/decode.py --models llama2-7b --settings w4 --batches 1 8 16 \
      --json "$out/decode_h200_attn$1_gpu$CUDA_VISIBLE_DEVICES.json" > $log/2_decode_attn$1_gpu$CUDA_VISIBLE_DEVICES.log 2>&1
  }
  (export CUDA_VISIBLE_DEVICES=0 SPEAR_TUNE_CACHE=/tmp/tune_gpu0.json
   attn 64 230; attn 32 $((490 - SECONDS))) &
  (export CUDA_VISIBLE_DEVICES=1 SPEAR_TUNE_CACHE=/tmp/tune_gpu1.json
   for w in 2 0; do SPEAR_W4_DOT_WIDE=$w timeout 110 python bench/prefill_lab.py \
     --json "$out/prefill_lab_h200_wide$w.json" > $log/3_prefill_lab_wide$w.log 2>&1; done
   attn 32 $((490 - SECONDS))) &
  wait
elif [ "${FINAL15:-0}" = 1 ]; then  # session 15's last call, nvidia-h200-x2 (about 5 minutes): GPU 0 attention's
  # keys a step 16 vs 32 (the new default) through the engine, then the GPU tests of the changed paths; GPU 1 the
  # prefill tile GEMM on 70B shapes and at 4096 rows, and at g = 128, then the engine's GPU tests
  (export CUDA_VISIBLE_DEVICES=0 SPEAR_TUNE_CACHE=/tmp/tune_gpu0.json
   for b in 16 32; do SPEAR_ATTN_BLOCK_N=$b timeout 120 python bench/decode.py --models llama2-7b --settings w4 \
     --batches 1 8 16 32 --json "$out/decode_h200_attn$b.json" > $log/2_decode_attn$b.log 2>&1; done
   timeout $((310 - SECONDS)) python -m pytest -p no:cacheprovider -o addopts= -q tests/test_kernels.py \
     tests/test_runtime_ops.py -k "prefill or dispatch or dequant or attention or rope" > $log/1_tests_kernels.log 2>&1) &
  (export CUDA_VISIBLE_DEVICES=1
   timeout 110 python bench/prefill_lab.py --shapes 70b/gate_up 70b/down 7b/qkv_fused --ms 1024 4096 \
     --json "$out/prefill_lab_h200_70b.json" > $log/3_prefill_lab_70b.log 2>&1
   timeout 60 python bench/prefill_lab.py --group-size 128 --shapes 7b/gate_up_fused 7b/down --ms 256 1024 \
     --json "$out/prefill_lab_h200_g128.json" > $log/3_prefill_lab_g128.log 2>&1
   timeout $((310 - SECONDS)) python -m pytest -p no:cacheprovider -o addopts= -q tests/test_runtime_engine.py \
     > $log/1_tests_engine.log 2>&1) &
  wait
elif [ "${DOTASM:-0}" = 1 ]; then  # built in session 15 for the next call, nvidia-h200-x2: the wide dot loops' codes
  # through inline PTX (SPEAR_W4_DOT_ASM=1, untimed, off): the GPU tests with it on, then per config on both GPUs in
  # both orders (per-channel), then the engine (GPU 0 on, GPU 1 off) and the prefill lab with it on
  mkdir -p $out/ab
  arm() {  # asm 0/1, tag
    SPEAR_W4_DOT_ASM=$1 timeout 100 python bench/ec_ablation.py --configs-only --ms 16 32 \
      --shapes 7b/qkv_fused 7b/gate_up_fused 7b/down 7b/qkvo --json "$out/ab/ec_ablation_h200_asm$1_$2.json" \
      > $log/3_ab_asm$1_$2.log 2>&1
  }
  (export CUDA_VISIBLE_DEVICES=0
   SPEAR_W4_DOT_ASM=1 timeout 150 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_kernels.py \
     -k "wide or group or prefill or dispatch or dot" > $log/1_tests_asm.log 2>&1
   arm 1 a; arm 0 b
   SPEAR_W4_DOT_ASM=1 SPEAR_TUNE_CACHE=/tmp/tune_asm1.json timeout $((570 - SECONDS)) python bench/decode.py \
     --models llama2-7b --settings w4 --batches 1 8 16 32 --json "$out/decode_h200_asm1.json" > $log/4_decode_asm1.log 2>&1) &
  (export CUDA_VISIBLE_DEVICES=1
   arm 0 c; arm 1 d
   SPEAR_W4_DOT_ASM=1 timeout 90 python bench/prefill_lab.py --shapes 7b/qkv_fused 7b/gate_up_fused 7b/down \
     --ms 512 1024 2048 --json "$out/prefill_lab_h200_asm1.json" > $log/3_prefill_asm1.log 2>&1
   SPEAR_TUNE_CACHE=/tmp/tune_asm0.json timeout $((570 - SECONDS)) python bench/decode.py --models llama2-7b \
     --settings w4 --batches 1 8 16 32 --json "$out/decode_h200_asm0.json" > $log/4_decode_asm0.log 2>&1) &
  wait
  tar czf "$out/ab_jsons.tgz" -C "$out" ab && rm -r "$out/ab"
elif [ "${S16:-0}" = 1 ]; then  # session 16, nvidia-h200-x2, with the codes through inline PTX now the default:
  # GPU 0 the GPU tests with the group scale on the codes (SPEAR_W4_SCALE_CODES=1, lab), then Llama-2-7B fp16 / W4 /
  # W4+EC38 through the engine; GPU 1 the kernel grid on the 7B shapes (M = 1 vs 16, W4+EC at 1024 and 4096 rows), then
  # the group scale on the codes off / on at g = 128 (decode configs at 16–32 rows, the prefill lab at 1024–2048)
  mkdir -p $out/ab
  (export CUDA_VISIBLE_DEVICES=0
   SPEAR_W4_SCALE_CODES=1 timeout 120 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_kernels.py \
     -k "wide or group or prefill or dispatch or dot" > $log/1_tests_scale_codes.log 2>&1
   timeout $((570 - SECONDS)) python bench/decode.py --models llama2-7b --settings fp16 w4 w4+ec38 --batches 1 8 16 32 \
     --json "$out/decode_h200.json" > $log/2_decode.log 2>&1) &
  (export CUDA_VISIBLE_DEVICES=1 SPEAR_TUNE_CACHE=/tmp/tune_gpu1.json
   timeout 240 python bench/kernels.py --json "$out/kernels_h200_7b.json" --models 7b --ms 1 16 1024 4096 \
     --time-limit 200 > $log/3_kernels.log 2>&1
   for sc in 0 1; do
     SPEAR_W4_SCALE_CODES=$sc timeout 70 python bench/ec_ablation.py --configs-only --ms 16 32 --group-size 128 \
       --shapes 7b/qkv_fused 7b/gate_up_fused 7b/down --json "$out/ab/ec_ablation_h200_g128_sc$sc.json" \
       > $log/4_ab_g128_sc$sc.log 2>&1
     SPEAR_W4_SCALE_CODES=$sc timeout 60 python bench/prefill_lab.py --group-size 128 --ms 1024 2048 \
       --shapes 7b/gate_up_fused 7b/down --json "$out/ab/prefill_lab_h200_g128_sc$sc.json" > $log/5_prefill_g128_sc$sc.log 2>&1
   done) &
  wait
  tar czf "$out/ab_jsons.tgz" -C "$out" ab && rm -r "$out/ab"
elif [ "${S16B:-0}" = 1 ]; then  # session 16's second call, one H200 (the pair was not lent), one after another: the
  # GPU tests; the prefill lab: W4+EC (the EC's rank kernel with K split), groups of 128 and 64, per-channel (the
  # dispatch timed before and after the configs) with the inline PTX on and off; the kernel grid's 7B rows at 1024 /
  # 4096 rows; W4 / W4+EC38 through the engine with what is left
  mkdir -p $out/ab
  export CUDA_VISIBLE_DEVICES=0
  timeout 100 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_kernels.py \
    -k "rank or wide or group or prefill or dispatch or dot" > $log/1_tests.log 2>&1
  lab() {  # tag, then prefill_lab's arguments
    tag=$1; shift
    timeout 80 python bench/prefill_lab.py "$@" --json "$out/ab/prefill_lab_h200_$tag.json" > $log/5_prefill_$tag.log 2>&1
  }
  lab ec32 --ec-rank 32 --ms 1024 2048
  lab g128 --group-size 128 --ms 256 512 1024
  lab pc --ms 1024 2048
  SPEAR_W4_DOT_ASM=0 lab pc_asm0 --ms 1024 2048
  lab g64 --group-size 64 --ms 256 1024
  timeout 150 python bench/kernels.py --json "$out/kernels_h200_prefill.json" --models 7b --ms 1024 4096 \
    --time-limit 120 > $log/3_kernels.log 2>&1
  timeout $((575 - SECONDS)) python bench/decode.py --models llama2-7b --settings w4 w4+ec38 --batches 1 16 \
    --json "$out/decode_h200.json" > $log/2_decode.log 2>&1
  tar czf "$out/ab_jsons.tgz" -C "$out" ab && rm -r "$out/ab"
elif [ "${S16C:-0}" = 1 ]; then  # session 16's last call, one H200: the GPU tests, then the kernel grid's prefill rows
  # on the 7B shapes: per-channel at 1024–4096 (W4+EC through the tile GEMM and, at 4096, dequantize + cuBLAS with the EC
  # term read in cuBLAS's epilogue), then groups of 128 at 512 / 1024 (the dispatch's switch for grouped weights)
  export CUDA_VISIBLE_DEVICES=0
  timeout 100 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_kernels.py \
    -k "rank or wide or group or prefill or dispatch or dot" > $log/1_tests.log 2>&1
  timeout 250 python bench/kernels.py --json "$out/kernels_h200_prefill.json" --models 7b --ms 1024 2048 4096 \
    --time-limit 200 > $log/3_kernels.log 2>&1
  timeout $((570 - SECONDS)) python bench/kernels.py --json "$out/kernels_h200_prefill_g128.json" --models 7b \
    --ms 512 1024 --group-size 128 --time-limit $((530 - SECONDS)) > $log/4_kernels_g128.log 2>&1
elif [ "${S16D:-0}" = 1 ]; then  # session 16, one H200, at 5532723 (reverted after: level with ec_rank before the
  # GEMM): the prefill tile GEMM computing g in its own rank programs (the GPU tests first: they run rank programs and tiles concurrently and compare repeats bit for bit), then the
  # kernel grid's prefill rows on the 7B and 70B shapes, W4 against W4+EC
  export CUDA_VISIBLE_DEVICES=0
  timeout 120 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_kernels.py \
    -k "rank or wide or group or prefill or dispatch or dot" > $log/1_tests.log 2>&1
  timeout $((560 - SECONDS)) python bench/kernels.py --json "$out/kernels_h200_prefill.json" --models 7b 70b \
    --ms 1024 2048 --time-limit $((520 - SECONDS)) > $log/3_kernels.log 2>&1
elif [ "${S16E:-0}" = 1 ]; then  # session 16's last call, one H200: where W4+EC's time goes in the prefill tile GEMM
  # (the rank kernel alone, the GEMM with g given), then W4 / W4+EC38 through the engine at batch 1
  export CUDA_VISIBLE_DEVICES=0
  timeout 120 python bench/prefill_lab.py --ec-rank 32 --ms 1024 2048 --json "$out/prefill_lab_h200_ec32.json" \
    > $log/5_prefill_ec32.log 2>&1
  timeout $((400 - SECONDS)) python bench/decode.py --models llama2-7b --settings w4 w4+ec38 --batches 1 \
    --json "$out/decode_h200.json" > $log/2_decode.log 2>&1
elif [ "${S17A:-0}" = 1 ]; then  # session 17, one H200: the EC's rank-kernel tiles at 1024–2048 rows (7B, then 70B at
  # 1024), then every decode candidate at 1 and 16 rows with three more dot configs (M = 16 against M = 1)
  export CUDA_VISIBLE_DEVICES=0 TAIL=200
  timeout 280 python bench/prefill_lab.py --ec-rank 32 --ms 1024 2048 --json "$out/prefill_lab_h200_ec32.json" \
    > $log/5_prefill_ec32.log 2>&1
  timeout 130 python bench/prefill_lab.py --ec-rank 32 --ms 1024 --shapes 70b/gate_up 70b/down \
    --json "$out/prefill_lab_h200_ec32_70b.json" > $log/6_prefill_ec32_70b.log 2>&1
  timeout $((570 - SECONDS)) python bench/ec_ablation.py --configs-only --ms 1 16 --shapes 7b/qkvo 7b/gate_up 7b/down \
    --extra-dot 128:4:4 64:4:5 32:4:4 --json "$out/ec_ablation_h200_m16.json" > $log/3_m16.log 2>&1
elif [ "${S17C:-0}" = 1 ]; then  # session 17, one H200: the rank programs as a launch of their own beside the tile
  # GEMM (its programmatic dependent), by count and tiling, 7B/8B/13B/70B at 1024–2048 rows; the 7B grid at 1024, 2048
  export CUDA_VISIBLE_DEVICES=0 TAIL=200
  timeout 150 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_kernels.py -k "prefill or rank or pdl" \
    > $log/1_tests.log 2>&1
  timeout 200 python bench/prefill_lab.py --rank-programs --ms 1024 2048 --shapes 7b/qkvo 7b/gate_up 7b/down \
    7b/qkv_fused 7b/gate_up_fused --json "$out/prefill_lab_h200_rankprog_7b.json" > $log/5_rankprog_7b.log 2>&1
  timeout 160 python bench/prefill_lab.py --rank-programs --ms 1024 --shapes 70b/q_o 70b/gate_up 70b/down 13b/qkvo \
    13b/gate_up 13b/down 8b/gate_up 8b/down --json "$out/prefill_lab_h200_rankprog_big.json" > $log/6_rankprog_big.log 2>&1
  timeout $((575 - SECONDS)) python bench/kernels.py --json "$out/kernels_h200_7b.json" --models 7b --ms 1024 2048 \
    --time-limit $((540 - SECONDS)) > $log/3_kernels_7b.log 2>&1
elif [ "${S17D:-0}" = 1 ]; then  # session 17's last call, one H200: GPU tests (kernels, runtime ops, engine), then the
  # prefill rows of the kernel grid (1024, 2048) on every model's shapes with the rank programs' final count
  export CUDA_VISIBLE_DEVICES=0
  timeout 200 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_kernels.py tests/test_runtime_ops.py \
    tests/test_runtime_engine.py > $log/1_tests.log 2>&1
  timeout $((575 - SECONDS)) python bench/kernels.py --json "$out/kernels_h200_prefill.json" --models 7b 8b 13b 70b \
    --ms 1024 2048 --time-limit $((530 - SECONDS)) > $log/3_kernels_prefill.log 2>&1
elif [ "${S17E:-0}" = 1 ]; then  # session 17, one H200: the narrow weights' GEMM first beside the rank kernel (GPU
  # tests first), the prefill grid on 7B, 8B and 70B again, then 8B and 13B at 1 and 16 rows
  export CUDA_VISIBLE_DEVICES=0
  timeout 120 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_kernels.py -k "prefill or rank" \
    > $log/1_tests.log 2>&1
  timeout 200 python bench/kernels.py --json "$out/kernels_h200_prefill.json" --models 7b 8b 70b --ms 1024 2048 \
    --time-limit 170 > $log/3_kernels_prefill.log 2>&1
  timeout $((560 - SECONDS)) python bench/kernels.py --json "$out/kernels_h200_8b13b.json" --models 8b 13b --ms 1 16 \
    --time-limit $((520 - SECONDS)) > $log/4_kernels_8b13b.log 2>&1
elif [ "${S17F:-0}" = 1 ]; then  # session 17's last call, one H200: the dispatch's wave rule on 13B (the prefill grid
  # at 1024, 2048), the GPU tests of the prefill paths, then the runtime ops and the engine
  export CUDA_VISIBLE_DEVICES=0
  timeout 90 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_kernels.py -k "prefill or rank or dispatch" \
    > $log/1_tests.log 2>&1
  timeout 100 python bench/kernels.py --json "$out/kernels_h200_prefill_13b.json" --models 13b --ms 1024 2048 \
    --time-limit 80 > $log/3_kernels_13b.log 2>&1
  timeout $((300 - SECONDS)) python -m pytest -p no:cacheprovider -o addopts= -q tests/test_runtime_ops.py \
    tests/test_runtime_engine.py > $log/2_tests_runtime.log 2>&1
elif [ "${S18A:-0}" = 1 ]; then  # built in session 18, timed in 19 (run it at d17d481; removed in session 22):
  # the GPU tests of decode attention with RoPE and the K/V write inside, then both attention variants on one built
  # model each (separate, rope-in, separate again: the order's drift shows), batch 1 and 8, W4 then fp16
  export CUDA_VISIBLE_DEVICES=0
  timeout 150 python -m pytest -p no:cacheprovider -o addopts= -v tests/test_runtime_ops.py \
    -k "paged or folded or tiled_token_rows or model_steps" > $log/1_tests.log 2>&1
  timeout $((560 - SECONDS)) python bench/decode.py --models llama2-7b --settings w4 fp16 --batches 1 8 \
    --attention separate rope-in separate --json "$out/decode_h200_attention.json" > $log/2_decode_attention.log 2>&1
  # where a batch-1 W4 step's time goes with the fold on (eager; the tuner's picks come from the cache written above)
  SPEAR_ROPE_IN_ATTENTION=1 timeout $((585 - SECONDS)) python bench/profile_step.py --model llama2-7b --setting w4 \
    --batch 1 --json "$out/profile_b1_ropein.json" > $log/3_profile_ropein.log 2>&1
elif [ "${S19A:-0}" = 1 ]; then  # session 19, one H200: the float model's dense path (q/k/v and gate/up stacked, the
  # fp16 GEMV kernel where it beats cuBLAS): its GPU tests, the kernel against cuBLAS on every model's shapes at one
  # row, then Llama-2-7B fp16 through the engine with it off / on / off, and W4 beside it (batch 1 and 8)
  export CUDA_VISIBLE_DEVICES=0 TAIL=60
  timeout 120 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_f16_gemv.py tests/test_runtime_fuse.py \
    > $log/1_tests.log 2>&1
  timeout 150 python bench/f16_gemv.py --models 7b 8b 13b 70b --json "$out/f16_gemv_h200.json" > $log/2_f16_gemv.log 2>&1
  i=0; for d in 1 0 1; do i=$((i + 1)); SPEAR_DENSE_KERNELS=$d timeout 90 python bench/decode.py --models llama2-7b \
    --settings fp16 --batches 1 8 --json "$out/decode_h200_fp16_dense${d}_run$i.json" > $log/3_fp16_dense${d}_$i.log 2>&1; done
  timeout $((575 - SECONDS)) python bench/decode.py --models llama2-7b --settings w4 w4+ec38 --batches 1 8 \
    --json "$out/decode_h200_w4.json" > $log/4_w4.log 2>&1
elif [ "${S19B:-0}" = 1 ]; then  # session 19, one H200: the fp16 GEMV with runs of row blocks a program, then the
  # engine: fp16 with the dense path on / off, W4 and W4+EC38 (batch 1 and 8)
  export CUDA_VISIBLE_DEVICES=0 TAIL=60
  timeout 100 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_f16_gemv.py tests/test_runtime_fuse.py \
    -k "f16 or float or dense" > $log/1_tests.log 2>&1
  timeout 170 python bench/f16_gemv.py --models 7b 8b 13b 70b --json "$out/f16_gemv_h200.json" > $log/2_f16_gemv.log 2>&1
  i=0; for d in 1 0; do i=$((i + 1)); SPEAR_DENSE_KERNELS=$d timeout 90 python bench/decode.py --models llama2-7b \
    --settings fp16 --batches 1 8 --json "$out/decode_h200_fp16_dense${d}.json" > $log/3_fp16_dense${d}_$i.log 2>&1; done
  timeout $((575 - SECONDS)) python bench/decode.py --models llama2-7b --settings w4 w4+ec38 --batches 1 8 \
    --json "$out/decode_h200_w4.json" > $log/4_w4.log 2>&1
elif [ "${S20A:-0}" = 1 ]; then  # session 20, one H200: the fp16 GEMV's own share of the dense path (SPEAR_F16_GEMV
  # 0 = the stacked projections through cuBLAS, then 1), fp16's eager batch-1 profile, then the full Llama-2-7B table
  export CUDA_VISIBLE_DEVICES=0 TAIL=60
  timeout 80 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_f16_gemv.py tests/test_runtime_fuse.py \
    -k "f16 or float or dense or gemv" > $log/1_tests.log 2>&1
  for g in 0 1; do SPEAR_F16_GEMV=$g timeout 100 python bench/decode.py --models llama2-7b --settings fp16 \
    --batches 1 8 32 --json "$out/decode_h200_fp16_gemv$g.json" > $log/2_fp16_gemv$g.log 2>&1; done
  timeout 70 python bench/profile_step.py --model llama2-7b --setting fp16 --batch 1 --json "$out/profile_b1_fp16.json" \
    > $log/3_profile_fp16.log 2>&1
  timeout $((575 - SECONDS)) python bench/decode.py --models llama2-7b --settings w4 w4+ec38 w4+ec15 w4+ec60 \
    --batches 1 8 32 --json "$out/decode_h200_llama2.json" > $log/4_llama2.log 2>&1
elif [ "${S20B:-0}" = 1 ]; then  # session 20's second call (one H200, .gpu_cache carried): the full Llama-3-8B table,
  # then Llama-2-7B fp16 at batch 1 with the GEMV on every one-row shape (SPEAR_F16_GEMV=always), then as tuned
  export CUDA_VISIBLE_DEVICES=0 TAIL=60
  timeout 420 python bench/decode.py --models llama3-8b --settings fp16 w4 w4+ec38 w4+ec15 w4+ec60 \
    --batches 1 8 32 --json "$out/decode_h200_llama3.json" > $log/4_llama3.log 2>&1
  for g in always 1; do SPEAR_F16_GEMV=$g timeout $((585 - SECONDS)) python bench/decode.py --models llama2-7b \
    --settings fp16 --batches 1 --json "$out/decode_h200_fp16_gemv_$g.json" > $log/5_fp16_gemv_$g.log 2>&1; done
elif [ "${S20C:-0}" = 1 ]; then  # session 20's third call (one H200): the fp16 GEMV releasing its dependents right
  # after its wait (SPEAR_F16_GEMV_RELEASE=early) against after its stores (late): the kernel alone on 7B, then the engine
  export CUDA_VISIBLE_DEVICES=0 TAIL=60
  timeout 60 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_f16_gemv.py > $log/1_tests.log 2>&1
  for r in late early; do SPEAR_F16_GEMV_RELEASE=$r timeout 70 python bench/f16_gemv.py --models 7b \
    --json "$out/f16_gemv_7b_$r.json" > $log/2_f16_gemv_$r.log 2>&1; done
  i=0; for r in late early late early; do i=$((i + 1)); SPEAR_F16_GEMV_RELEASE=$r timeout $((585 - SECONDS)) \
    python bench/decode.py --models llama2-7b --settings fp16 --batches 1 8 \
    --json "$out/decode_h200_fp16_${r}_run$i.json" > $log/3_fp16_${r}_$i.log 2>&1; done
elif [ "${S20D:-0}" = 1 ]; then  # session 20's fourth call (one H200, .gpu_cache carried): the W4 kernel's PDL release
  # point again (SPEAR_PDL_LATE 1: after the main loops, the default since session 10; 0: right after the wait)
  export CUDA_VISIBLE_DEVICES=0 TAIL=60
  i=0; for l in 1 0 1 0; do i=$((i + 1)); SPEAR_PDL_LATE=$l timeout $((585 - SECONDS)) python bench/decode.py \
    --models llama2-7b --settings w4 --batches 1 8 --json "$out/decode_h200_w4_late${l}_run$i.json" \
    > $log/3_w4_late${l}_$i.log 2>&1; done
elif [ "${S20E:-0}" = 1 ]; then  # session 20's last call (one H200, .gpu_cache carried): the W4 GEMV loop's early
  # release (SPEAR_PDL_LATE_GEMV=0, the default now) against late (1) for W4 and W4+EC38, after the runtime's GPU tests
  export CUDA_VISIBLE_DEVICES=0 TAIL=60
  timeout 100 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_runtime_fuse.py tests/test_runtime_engine.py \
    > $log/1_tests.log 2>&1
  i=0; for l in 0 1 0 1; do i=$((i + 1)); SPEAR_PDL_LATE_GEMV=$l timeout $((585 - SECONDS)) python bench/decode.py \
    --models llama2-7b --settings w4 w4+ec38 --batches 1 8 --json "$out/decode_h200_gemvlate${l}_run$i.json" \
    > $log/3_gemvlate${l}_$i.log 2>&1; done
elif [ "${S23D:-0}" = 1 ]; then  # for session 23 (one H200, the session's last minutes): issue 4's grid on the 7B shapes
  # at the row counts no call has timed since session 2's first kernels (2, 8, 64, 256), with 4 and 16 beside them
  export CUDA_VISIBLE_DEVICES=0 TAIL=60
  timeout ${S23D_LIMIT:-400} python bench/kernels.py --json "$out/kernels_h200_rows.json" --models 7b \
    --ms 2 4 8 16 64 256 --time-limit $((${S23D_LIMIT:-400} - 90)) > $log/2_kernels.log 2>&1
elif [ "${S23B:-0}" = 1 ] || [ "${S23C:-0}" = 1 ]; then  # for session 23 (one H200 each): the decode tables that close
  # issue 5 (every setting in one call, so that the ratios are side by side), then issue 4's one-row grid on the shapes
  # S22C's time left out, with the tuner's fixed splits (the 7B row is kernels_h200_m1_2bc3f9a.json)
  export CUDA_VISIBLE_DEVICES=0 TAIL=60
  model=$([ "${S23B:-0}" = 1 ] && echo llama2-7b || echo llama3-8b)
  timeout 420 python bench/decode.py --models $model --settings fp16 w4 w4+ec15 w4+ec38 w4+ec60 --batches 1 8 32 \
    --json "$out/decode_h200_$model.json" > $log/2_decode.log 2>&1
  left=$((575 - SECONDS))
  timeout $left python bench/kernels.py --json "$out/kernels_h200_m1.json" --models ${KMODELS:-70b 13b 8b} \
    ${KSHAPES:+--shapes $KSHAPES} --ms 1 --time-limit $((left - 60)) > $log/3_kernels.log 2>&1
elif [ "${S22D:-0}" = 1 ]; then  # for session 22 (one H200, the session's last minutes): the Llama-3-8B decode table
  export CUDA_VISIBLE_DEVICES=0 TAIL=20
  timeout 300 python bench/decode.py --models llama3-8b --settings fp16 w4 w4+ec38 \
    --json "$out/decode_h200_llama3.json" > $log/2_decode_llama3.log 2>&1
elif [ "${S22C:-0}" = 1 ]; then  # for session 22 (one H200): the state after the tuner's fixed splits at one row: the
  # Llama-2-7B decode table, the batch-1 W4 profile, then issue 4's grid at one row on every model while time lasts
  export CUDA_VISIBLE_DEVICES=0 TAIL=40
  timeout 280 python bench/decode.py --models llama2-7b --json "$out/decode_h200.json" > $log/2_decode.log 2>&1
  timeout 60 python bench/profile_step.py --model llama2-7b --setting w4 --batch 1 --json "$out/profile_b1.json" \
    > $log/3_profile.log 2>&1
  left=$((575 - SECONDS))
  timeout $left python bench/kernels.py --json "$out/kernels_h200_m1.json" --models 7b 8b 13b 70b --ms 1 \
    --time-limit $((left - 45)) > $log/4_kernels.log 2>&1
elif [ "${S22B:-0}" = 1 ]; then  # for session 22 (one H200): the tuner at one row with the GEMV loop's K also split
  # 1, 2 and 4 ways (SPEAR_W4_GEMV_SPLITS, default) against the automatic split alone (""), each arm with a tuning
  # cache of its own; Llama-2-7B W4 / W4+EC38 at batch 1, off / on / off / on, then Llama-3-8B off / on while time
  # lasts (the JSON and both caches in one s22b_runs.tgz)
  export CUDA_VISIBLE_DEVICES=0 TAIL=12
  runs=/tmp/s22b_runs; mkdir -p $runs
  timeout 120 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_kernels.py -k "tune or one_row" \
    > $log/1_tests.log 2>&1
  for arm in auto fixed; do cp .gpu_cache/w4_tuning.json $runs/w4_tuning_$arm.json; done
  i=0; for arm in auto fixed auto fixed; do i=$((i + 1)); splits=$([ $arm = fixed ] && echo "1 2 4")
    SPEAR_W4_GEMV_SPLITS=$splits SPEAR_TUNE_CACHE=$runs/w4_tuning_$arm.json timeout $([ $i -le 2 ] && echo 170 || echo 80) \
      python bench/decode.py --models llama2-7b --settings w4 w4+ec38 --batches 1 \
      --json "$runs/decode_h200_${arm}_run$i.json" > $log/2_7b_${arm}_$i.log 2>&1; done
  for arm in auto fixed; do i=$((i + 1)); splits=$([ $arm = fixed ] && echo "1 2 4")
    [ $SECONDS -lt 440 ] && SPEAR_W4_GEMV_SPLITS=$splits SPEAR_TUNE_CACHE=$runs/w4_tuning_$arm.json \
      timeout $((575 - SECONDS)) python bench/decode.py --models llama3-8b --settings w4 w4+ec38 --batches 1 \
      --json "$runs/decode_h200_8b_${arm}_run$i.json" > $log/3_8b_${arm}_$i.log 2>&1; done
  tar czf "$out/s22b_runs.tgz" -C $runs .
elif [ "${S22A:-0}" = 1 ]; then  # for session 22 (one H200): a layer's four W4 weights streamed by persistent
  # programs as four launches, four under PDL, one launch with grid barriers between them, one without
  # (bench/stream_lab.py --layer; the stand-in's tests first); then the GEMV loop's split of K at one row
  export CUDA_VISIBLE_DEVICES=0 TAIL=80
  timeout 150 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_stream_lab.py > $log/1_tests.log 2>&1
  timeout 300 python bench/stream_lab.py --layer --json "$out/stream_lab_layer_h200.json" > $log/2_layer.log 2>&1
  # the GEMV loop's split of K at one row, fixed against the automatic one (never timed apart): each candidate as W4
  # and W4+EC32 on the 7B shapes the engine launches
  timeout $((570 - SECONDS)) python bench/ec_ablation.py --configs-only --ms 1 --gemv-split-ks 0 1 2 4 8 \
    --shapes 7b/qkv_fused 7b/qkvo 7b/gate_up_fused 7b/down --json "$out/ec_ablation_h200_gemv_splits.json" \
    > $log/3_gemv_splits.log 2>&1
elif [ "${S21D:-0}" = 1 ]; then  # for session 21 (one H200): S21C's one Llama-3-8B pair (2.48 off, 2.35 on) again,
  # off / on three times, W4 and W4+EC38 at batch 1 (the JSON in one s21d_runs.tgz)
  export CUDA_VISIBLE_DEVICES=0 TAIL=8
  runs=/tmp/s21d_runs; mkdir -p $runs
  i=0; for f in 0 1 0 1 0 1; do i=$((i + 1)); SPEAR_L2_PREFETCH=$f timeout $([ $i = 1 ] && echo 150 || echo 75) \
    python bench/decode.py --models llama3-8b --settings w4 w4+ec38 --batches 1 \
    --json "$runs/decode_h200_8b_warm${f}_run$i.json" > $log/2_8b_warm${f}_$i.log 2>&1; done
  tar czf "$out/s21d_runs.tgz" -C $runs .
elif [ "${S21C:-0}" = 1 ]; then  # for session 21 (one H200): decode steps of one row read o's weight and the first
  # NEXT of each gate|up row into L2 on a side stream beside attention (kernels.l2_prefetch): its GPU tests, then
  # Llama-2-7B W4 / W4+EC38 at batch 1 over off / o only / o + 0.25, twice; fp16 and Llama-3-8B W4 off / on. The runs'
  # JSON come back in one s21c_runs.tgz (at most 8 files come back)
  export CUDA_VISIBLE_DEVICES=0 TAIL=12
  runs=/tmp/s21c_runs; mkdir -p $runs
  timeout 90 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_l2_prefetch.py > $log/1_tests.log 2>&1
  i=0; for arm in "0 0.25" "1 0" "1 0.25" "0 0.25" "1 0" "1 0.25"; do set -- $arm; i=$((i + 1))
    SPEAR_L2_PREFETCH=$1 SPEAR_L2_PREFETCH_NEXT=$2 timeout $([ $i = 1 ] && echo 150 || echo 70) python bench/decode.py --models llama2-7b \
      --settings w4 w4+ec38 --batches 1 --json "$runs/decode_h200_warm$1_next$2_run$i.json" > $log/2_w4_warm${1}_$i.log 2>&1
  done
  for f in 0 1 0 1; do i=$((i + 1)); SPEAR_L2_PREFETCH=$f timeout 50 python bench/decode.py --models llama2-7b \
    --settings fp16 --batches 1 --json "$runs/decode_h200_fp16_warm${f}_run$i.json" > $log/3_fp16_warm${f}_$i.log 2>&1; done
  for f in 0 1; do i=$((i + 1)); SPEAR_L2_PREFETCH=$f timeout $((560 - SECONDS)) python bench/decode.py \
    --models llama3-8b --settings w4 --batches 1 --json "$runs/decode_h200_8b_warm${f}_run$i.json" \
    > $log/4_8b_warm${f}_$i.log 2>&1; done
  tar czf "$out/s21c_runs.tgz" -C $runs .
elif [ "${S21B:-0}" = 1 ]; then  # for session 21 (one H200): decode steps of one row, the RoPE launch asking L2 for
  # o's weight and the first NEXT of each gate|up row (kernels.l2_prefetch): its GPU tests, then Llama-2-7B W4 / W4+EC38
  # at batch 1 over off / o only / o + 0.25 / o + 0.5, twice; then fp16 (o cut to half the L2) and Llama-3-8B W4, off / on
  export CUDA_VISIBLE_DEVICES=0 TAIL=60
  timeout 90 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_l2_prefetch.py tests/test_runtime_ops.py \
    > $log/1_tests.log 2>&1
  i=0; for arm in "0 0.25" "1 0" "1 0.25" "1 0.5" "0 0.25" "1 0" "1 0.25" "1 0.5"; do set -- $arm; i=$((i + 1))
    SPEAR_L2_PREFETCH=$1 SPEAR_L2_PREFETCH_NEXT=$2 timeout 60 python bench/decode.py --models llama2-7b \
      --settings w4 w4+ec38 --batches 1 --json "$out/decode_h200_l2pf$1_next$2_run$i.json" > $log/2_w4_l2pf${1}_$i.log 2>&1
  done
  for f in 0 1 0 1; do i=$((i + 1)); SPEAR_L2_PREFETCH=$f timeout 50 python bench/decode.py --models llama2-7b \
    --settings fp16 --batches 1 --json "$out/decode_h200_fp16_l2pf${f}_run$i.json" > $log/3_fp16_l2pf${f}_$i.log 2>&1; done
  for f in 0 1; do i=$((i + 1)); SPEAR_L2_PREFETCH=$f timeout $((585 - SECONDS)) python bench/decode.py \
    --models llama3-8b --settings w4 --batches 1 --json "$out/decode_h200_8b_l2pf${f}_run$i.json" \
    > $log/4_8b_l2pf${f}_$i.log 2>&1; done
elif [ "${S21A:-0}" = 1 ]; then  # for session 21 (one H200): the float path's add + RMSNorm and SiLU·up folded into
  # the stacked GEMVs (SPEAR_DENSE_FOLD): its GPU tests, the folded GEMV against the launches it replaces (7B), then
  # Llama-2-7B fp16 off / on / off / on through the engine, then its eager profile
  export CUDA_VISIBLE_DEVICES=0 TAIL=60
  timeout 90 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_f16_gemv.py tests/test_runtime_fuse.py \
    -k "f16 or float or dense or gemv" > $log/1_tests.log 2>&1
  timeout 90 python bench/f16_gemv.py --models 7b --fold --json "$out/f16_gemv_7b_fold.json" > $log/2_f16_gemv_fold.log 2>&1
  i=0; for f in 0 1 0 1; do i=$((i + 1)); SPEAR_DENSE_FOLD=$f timeout 100 python bench/decode.py --models llama2-7b \
    --settings fp16 --batches 1 8 --json "$out/decode_h200_fp16_fold${f}_run$i.json" > $log/2_fp16_fold${f}_$i.log 2>&1; done
  SPEAR_DENSE_FOLD=1 timeout $((585 - SECONDS)) python bench/profile_step.py --model llama2-7b --setting fp16 --batch 1 \
    --json "$out/profile_b1_fp16_fold.json" > $log/3_profile_fold.log 2>&1
elif [ "${FINAL14:-0}" = 1 ]; then  # session 14's last call, nvidia-h200-x2: the TP grid at TP 2 (both GPUs), then
  # GPU 0 Llama-2-7B through the engine, GPU 1 the GPU tests and Llama-3-8B
  timeout 200 python bench/tp_decode.py --tp 2 --models llama2-13b llama2-7b --settings w4 w4+ec \
    --reductions collective p2p --time-limit 170 --json "$out/tp_decode_h200x2.json" > $log/6_tp.log 2>&1
  (export CUDA_VISIBLE_DEVICES=0
   timeout $((565 - SECONDS)) python bench/decode.py --models llama2-7b --settings fp16 w4 w4+ec38 --batches 1 8 16 32 \
     --json "$out/decode_h200.json" > $log/2_decode.log 2>&1) &
  (export CUDA_VISIBLE_DEVICES=1
   timeout 150 python -m pytest -p no:cacheprovider -o addopts= -q -x tests/test_kernels.py tests/test_runtime_ops.py \
     tests/test_runtime_fuse.py > $log/1_tests.log 2>&1
   # dot-loop configs that are not candidates: more stages, 8 warps (for the next session's candidate list)
   timeout 120 python bench/ec_ablation.py --configs-only --ms 16 32 64 --shapes 7b/qkv_fused 7b/gate_up_fused 7b/down \
     7b/qkvo --extra-dot 64:4:4 64:4:5 128:4:4 64:8:3 128:8:3 --json "$out/ec_ablation_h200_extra.json" > $log/3_extra.log 2>&1
   timeout $((565 - SECONDS)) python bench/decode.py --models llama3-8b --settings w4 w4+ec38 --batches 1 8 32 \
     --json "$out/decode_h200_llama3.json" > $log/5_decode_llama3.log 2>&1) &
  wait
elif [ "${WIDE:-0}" = 1 ]; then  # session 14, nvidia-h200-x2: the dot loop at 16-32 rows, one dot a 128-column block
  # (SPEAR_W4_DOT_WIDE) and K split for 4 / 8 programs an SM (SPEAR_W4_DOT_FILLS), per config on both GPUs in both
  # orders, then the engine: GPU 0 both on, GPU 1 both off (each arm tuned into its own cache)
  mkdir -p $out/ab
  arm() {  # wide, run number
    SPEAR_W4_DOT_WIDE=$1 timeout 110 python bench/ec_ablation.py --configs-only --ms 16 32 \
      --shapes 7b/qkv_fused 7b/gate_up_fused 7b/down 7b/qkvo --json "$out/ab/ec_ablation_h200_wide$1_run$2.json" \
      > $log/3_ab_wide$1_$2.log 2>&1
  }
  (export CUDA_VISIBLE_DEVICES=0
   timeout 150 python -m pytest -p no:cacheprovider -o addopts= -q tests/test_kernels.py > $log/1_tests.log 2>&1
   arm 1 1; arm 0 3
   SPEAR_TUNE_CACHE=/tmp/tune_new.json timeout $((570 - SECONDS)) python bench/decode.py --models llama2-7b \
     --settings w4 w4+ec38 --batches 1 8 16 32 --json "$out/decode_h200_dotnew.json" > $log/4_decode_new.log 2>&1) &
  (export CUDA_VISIBLE_DEVICES=1
   arm 0 2; arm 1 4
   SPEAR_W4_DOT_WIDE=0 SPEAR_W4_DOT_FILLS=2 SPEAR_TUNE_CACHE=/tmp/tune_old.json timeout $((570 - SECONDS)) \
     python bench/decode.py --models llama2-7b --settings w4 w4+ec38 --batches 1 8 16 32 \
     --json "$out/decode_h200_dotold.json" > $log/4_decode_old.log 2>&1) &
  wait
  cp /tmp/tune_new.json "$out/w4_tuning_dotnew.json" 2>/dev/null
  tar czf "$out/ab_jsons.tgz" -C "$out" ab && rm -r "$out/ab"
elif [ "${TP:-0}" = 1 ]; then  # a call of its own: with the rest it would pass the device's 10-minute limit
  # the layer-level grid, 13B then 7B, TP 1 then 2: the baseline (collective), p2p, and p2p with the next add +
  # RMSNorm folded into its epilogue (p2p+fold, session 13's SPEAR_FOLD_NORM_TP) timed right after p2p
  timeout 340 python bench/tp_decode.py ${TP_GRID:---reductions collective p2p p2p+fold --time-limit 300} \
    --json "$out/tp_decode_h200x2.json" > $log/6_tp.log 2>&1
  # the serving engine over both GPUs (as `spear serve --tp 2`): with TP_FOLDS="0 1" the fold off, then on; by
  # default once, with the fold on where the grid found it exact
  fold=$(python -c "import json; r = [x for x in json.load(open('$out/tp_decode_h200x2.json'))['rows'] if x['reduce'] == 'p2p+fold']
print(int(bool(r) and all(x['repeat_identical'] and x['ranks_identical'] and x.get('max_abs_diff_vs_collective', 1) < 0.1 for x in r)))" 2>/dev/null || echo 0)
  echo "the fold checked exact in the grid: $fold" > $log/7_fold.log
  for f in ${TP_FOLDS:-$fold}; do
    SPEAR_FOLD_NORM_TP=$f timeout $((575 - SECONDS)) python bench/decode.py --tp 2 --models llama2-7b \
      --settings w4 w4+ec38 --batches 1 16 --json "$out/decode_tp2_fold${f}_h200x2.json" > $log/8_decode_tp2_fold$f.log 2>&1
  done
else
  (export CUDA_VISIBLE_DEVICES=0; gpu0) &
  (export CUDA_VISIBLE_DEVICES=1; gpu1) &
  wait
fi
cp .gpu_cache/w4_tuning.json "$out/" 2>/dev/null  # at most 8 files come back: the default call makes 7
# the compiled kernels, where small enough and a file is left of the 8 (gpu_all.log comes after)
if tar czf /tmp/triton_cache.tgz -C .gpu_cache triton 2>/dev/null && [ "$(stat -c %s /tmp/triton_cache.tgz)" -lt 15000000 ] \
   && [ "$(ls "$out" | wc -l)" -lt 7 ]; then
  cp /tmp/triton_cache.tgz "$out/"
fi
for f in $log/*.log; do echo "=== $f"; tail -n ${TAIL:-40} "$f"; done > "$out/gpu_all.log"
tail -c 11000 "$out/gpu_all.log"
