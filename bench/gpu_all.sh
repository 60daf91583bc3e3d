#!/usr/bin/env bash
# Every GPU benchmark of issues 4–7 in one device call (the session's device time allows one or two).
# Last run as: SPEAR_COMMIT=<sha> OUT=$OUT KERNELS_S=270 DECODE_S=160 bash bench/gpu_all.sh (about 380 s on
# nvidia-h200-x2); the kernel grid needs more than 270 s for all four models: split it over two calls.
# On a 2-GPU host the single-GPU benchmarks run side by side (GPU 0: kernels; GPU 1: decode,
# then the SLO experiment), then the tensor-parallel benchmark takes both GPUs.
#   OUT=dir bash bench/gpu_all.sh
set -u
out=${OUT:-bench/results}; mkdir -p "$out"; export OUT=$out
SLO_CMD=${SLO_CMD:-'timeout 200 python bench/slo_experiment.py --json "$OUT/slo_experiment.json"'}
TP_CMD=${TP_CMD:-'timeout 150 python bench/tp_decode.py --json "$OUT/tp_decode.json" --time-limit 100'}
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi -L | wc -l)
log=/tmp/gpu_all; mkdir -p $log
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $log/0_nvidia_smi.log
kernels() {
  timeout 150 python -m pytest -q tests/test_kernels.py -p no:cacheprovider > $log/1_kernel_tests.log 2>&1
  timeout 100 python -m pytest -q tests/test_kernels.py -p no:cacheprovider -k "decode" >> $log/1_kernel_tests.log 2>&1
  timeout ${KERNELS_S:-300} python bench/kernels.py --json "$out/kernels_h200.json" --models 8b 70b 7b 13b \
    --time-limit $(( ${KERNELS_S:-300} - 70 )) > $log/2_kernels.log 2>&1
}
serving() {
  timeout ${DECODE_S:-200} python bench/decode.py --models llama2-7b --json "$out/decode_h200.json" > $log/3_decode.log 2>&1
  [ -n "${SLO_CMD:-}" ] && bash -c "$SLO_CMD" > $log/4_slo.log 2>&1
}
if [ "$gpus" -gt 1 ]; then
  (export CUDA_VISIBLE_DEVICES=0; kernels) &
  (export CUDA_VISIBLE_DEVICES=1; serving) &
  wait
else
  kernels; serving
fi
if [ "$gpus" -gt 1 ] && [ -n "${TP_CMD:-}" ]; then
  bash -c "$TP_CMD" > $log/5_tp.log 2>&1
fi
for f in $log/*.log; do echo "=== $f"; tail -n ${TAIL:-40} "$f"; done > "$out/gpu_all.log"
cat "$out/gpu_all.log" | tail -c 11000
