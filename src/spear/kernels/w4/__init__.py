"""W4A16 GEMM with the error compensator, in Triton: y = x · W_hatᵀ + bias + (alpha·B) g,
g = gamma(A x) ⊙ A x (kernels/reference.py is the specification, kernels/pack.py the layout).

Two regimes behind `w4_linear`, picked by the number of rows M:

* decode (M ≤ DECODE_PATH_MAX_M): one launch of the decode kernel, split-K, the EC fused (decode.py); its main
  loop is a GEMV loop for up to 4 rows (gemv.py) or tensor-core dots (dot.py).
* prefill (more rows): the tile GEMM that dequantizes in its main loop, or dequantize + cuBLAS (prefill.py).

The modules, bottom up:

    codes.py     code words → fp16 (the bit tricks every loop shares)
    dot.py       the tensor-core dot loop
    gemv.py      the GEMV loops (1–4 rows)
    epilogue.py  the decode kernel's epilogue: gate, (alpha·B) g, stores, folded norm, g's hand-over
    config.py    launch configs, tuning candidates and choices
    decode.py    the decode kernel and its launch
    prefill.py   the prefill kernels and their launches
    tuning.py    tune_w4
    precompile.py  the tuner's candidates compiled in parallel processes first (a fresh machine)

The switches that remain (PDL, preloading, unmasked loads, the tuner's fixed splits) are kernels.options's.
"""

from __future__ import annotations

import torch

from spear.kernels.pack import PackedEC, PackedW4
from spear.kernels.w4.config import (
    DECODE_KERNEL_MAX_M,
    DecodeConfig,
    PrefillConfig,
    decode_config,
    decode_tune_rows,
    num_sms,
)
from spear.kernels.w4.decode import PeerRows, w4_decode, w4_decode_add_norm, w4_decode_to_peers
from spear.kernels.w4.epilogue import store_add_norm
from spear.kernels.w4.prefill import dequantize_w4_into, ec_rank, takes_tile_gemm, w4_prefill, w4_prefill_fused
from spear.kernels.w4.tuning import TUNE_ROWS, tune_w4, untuned_buckets

# w4_linear's switch from the decode kernel (split-K, the EC fused) to the prefill paths.
DECODE_PATH_MAX_M = 128

__all__ = [
    "DECODE_KERNEL_MAX_M", "DECODE_PATH_MAX_M", "DecodeConfig", "PeerRows", "PrefillConfig", "decode_config",
    "decode_tune_rows",
    "dequantize_w4_into", "ec_rank", "num_sms", "store_add_norm", "tune_w4", "w4_decode", "w4_decode_add_norm",
    "w4_decode_to_peers", "w4_linear", "w4_prefill", "w4_prefill_fused",
]


def w4_linear(x: torch.Tensor, w: PackedW4, ec: PackedEC | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Phase-adaptive dispatch by rows: the decode kernel up to DECODE_PATH_MAX_M rows, then the prefill tile GEMM
    (takes_tile_gemm), else dequantize + cuBLAS."""
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if x2.dtype != torch.float16:
        raise ValueError(f"the W4A16 kernels take fp16 activations, got {x2.dtype}")
    if x2.shape[0] <= DECODE_PATH_MAX_M:
        y = w4_decode(x2, w, ec, bias)
    elif takes_tile_gemm(x2.shape[0], w.out_features, w.scales.shape[1] == 1, num_sms(x2.device)):
        y = w4_prefill_fused(x2, w, ec, bias)
    else:
        y = w4_prefill(x2, w, ec, bias)
    return y.view(*x.shape[:-1], w.out_features)
