#!/usr/bin/env bash
# The GPU measurements of issues 4–7 in one device call on nvidia-h200-x2 (about 9 minutes):
#   GPU 0: the GPU test suites (kernels, runtime ops, fused launches, engine), then the decode-kernel
#          grid (per-channel and g = 128);
#   GPU 1: the SLO experiment with mixed steps as CUDA-graph pieces, then decode with and without them;
#   both:  the tensor-parallel benchmark.
# Run as: run(command="SPEAR_COMMIT=<sha> bash bench/gpu_all.sh", kind="nvidia-h200-x2"). At most 8 files come
# back from $OUT, so the logs are gathered into one file.
set -u
out=${OUT:-bench/results/gpu_all}; mkdir -p "$out"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log=/tmp/gpu_all; mkdir -p $log
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $log/0_nvidia_smi.log
gpu0() {
  timeout 200 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_runtime_ops.py \
    tests/test_runtime_fuse.py tests/test_runtime_engine.py > $log/1_tests.log 2>&1
  timeout 150 python bench/kernels.py --json "$out/kernels_h200.json" --models 8b 70b 7b 13b --ms 1 4 16 \
    --time-limit 120 > $log/2_kernels.log 2>&1
  timeout 90 python bench/kernels.py --json "$out/kernels_h200_g128.json" --models 8b --ms 1 4 16 --group-size 128 \
    --time-limit 60 > $log/3_kernels_g128.log 2>&1
}
gpu1() {
  timeout 330 python bench/slo_experiment.py --json "$out/slo_experiment_h200.json" --time-limit 280 \
    --mixed-graph-tokens 64 128 256 512 1024 > $log/4_slo.log 2>&1
  timeout 60 python bench/profile_step.py --setting w4+ec15 --batch 8 --chunk 64 --steps 5 \
    --mixed-graph-tokens 128 --json /tmp/gpu_all/profile_pieces.json > $log/5_profile_pieces.log 2>&1
}
(export CUDA_VISIBLE_DEVICES=0; gpu0) &
(export CUDA_VISIBLE_DEVICES=1; gpu1) &
wait
timeout 150 python bench/tp_decode.py --json "$out/tp_decode_h200x2.json" --time-limit 100 > $log/6_tp.log 2>&1
for f in $log/*.log; do echo "=== $f"; tail -n ${TAIL:-40} "$f"; done > "$out/gpu_all.log"
tail -c 11000 "$out/gpu_all.log"
