"""Triton kernels for the shared layer and the runtime model, and their PyTorch references.

    pack.py         the quantized-weight record → the kernels' int4 layout (and EC tensors)
    reference.py    the specification every W4 kernel is tested against
    w4/             W4A16: the decode kernel (≤ 128 rows, split-K, the EC fused in one launch), the prefill tile
                    GEMM, dequantization + cuBLAS, the tuner
    ec_epilogue.py  tensor parallelism: gate and B applied to the reduced u, added to the reduced y
    ops.py          the runtime model's fused non-linear ops (add + RMSNorm, SiLU·up, RoPE + KV write, attention)
    f16_gemv.py     the float model's one-row GEMV
    cpu_w4.py       4-bit linears served on a CPU: PyTorch's int4 kernel (decode), nibble codes dequantized into
                    one shared scratch (prefill); no float copy of the weight
    options.py      the switches that remain (one frozen record, read from the environment once)
    offline.py      compile every launched variant for sm_90 without a GPU, and read its SASS
    compile_ahead.py  the kernels a piece of code will launch (the CUDA graphs' warm-ups), recorded by a dry
                    pass and compiled in parallel processes first
"""
