"""Triton kernels for the shared layer and their PyTorch references.

    pack.py       the quantized-weight record → the kernels' int4 layout (and EC tensors)
    reference.py  the specification every kernel is tested against
    w4.py         W4A16 GEMM: decode (M ≤ 16, split-K, EC fused in one launch) and
                  prefill (tensor-core tiles, EC rank-space kernel + GEMM epilogue)
"""
