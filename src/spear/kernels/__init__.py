"""Triton kernels for the shared layer and their PyTorch references.

    pack.py         the quantized-weight record → the kernels' int4 layout (and EC tensors)
    reference.py    the specification every kernel is tested against
    w4.py           W4A16: the decode kernel (≤ 128 rows, split-K, the EC fused in one launch),
                    dequantization for the prefill path (then cuBLAS, the EC's rank-space kernel
                    on a side stream), and a fused tile GEMM kept for comparison
    ec_epilogue.py  tensor parallelism: gate and B applied to the reduced u, added to the reduced y
"""
