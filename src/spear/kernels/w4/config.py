"""The W4 kernels' launch configs, the tuner's candidates and its choices (tuning.tune_w4 fills them).

Choices are kept per (N, K, group size, row bucket, EC padded rank, int8 EC factors): `decode_config` reads them
for a decode launch, `prefill_choice` for the tile GEMM; untuned, each config class's defaults apply.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from spear.kernels import options
from spear.kernels.pack import PackedEC, PackedW4

DECODE_KERNEL_MAX_M = 128  # the decode kernel's widest row tile


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 32  # untuned defaults: the H200's most frequent pick at M = 1 (BENCHMARKS.md §4)
    split_k: int = 0  # 0: pick so that the grid fills the GPU (decode.FILL programs an SM)
    num_warps: int = 8
    num_stages: int = 3
    gemv_rows: int = 4  # up to this many rows (≤ 4), the GEMV main loop instead of tensor-core dots
    block_kw: int = 128  # GEMV loop: code words per row per step (a multiple of 16: 128 columns each)
    gemv_f16x2: bool = False  # GEMV loop in fp16x2 arithmetic (_w4_gemv_f16x2), else float32 FMAs (_w4_gemv)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


# Candidate configs for `tune_w4`; the untuned default is each dataclass's defaults.
# The H200's picks over the 7B/8B/13B/70B shapes (kernels suite, BENCHMARKS §4): every
# winner, and the configs that came second or third most often; the 13 former candidates dropped never won
# (each cost a compile and a timing at engine start-up: 227 s for a 7B engine on a fresh machine). Four more
# were dropped that no shape's W4 or W4+EC picked first (ec_ablation per_config, the tuner
# caches): the 8-warp dot loop, and the 4-warp 128-word and 8-warp 4-stage GEMV configs.
DECODE_CANDIDATES = [  # the tensor-core dot loop (any M ≤ DECODE_KERNEL_MAX_M), then the GEMV loop (M ≤ 4)
    DecodeConfig(bn, 0, warps, stages, gemv_rows=0)
    for bn, warps, stages in ((32, 4, 3), (64, 4, 3), (64, 4, 4), (128, 4, 3))
] + [DecodeConfig(bn, 0, warps, stages, gemv_rows=4, block_kw=bkw) for bn, warps, stages, bkw in
     ((16, 4, 3, 256), (32, 8, 1, 128))  # the float32 GEMV loop: 3 stages through shared memory, or none
] + [DecodeConfig(bn, 0, warps, stages, gemv_rows=4, block_kw=bkw, gemv_f16x2=True) for bn, warps, stages, bkw in
     ((16, 4, 2, 256), (32, 8, 1, 128), (32, 4, 1, 64), (32, 4, 2, 64), (32, 4, 4, 64))]  # the fp16x2 GEMV loop


# The list keeps every config that came within 3% of the best W4 or W4+EC time on some 7B / 70B shape at M = 1 or
# 16 (`ab_pairlayout_1a95746_gpu{0,1}.json`), the one the 13B qkvo tuning picked, and the BN 32 dot loop for
# narrow layers; dropped (never within 3%): the float32 twins of the fp16x2 configs, (32 rows, 8 warps, 3 stages),
# (16, 4, 2, 256) in float32 and the 4-stage BN 128 dot loop. Tuning a shape times 10 candidates instead of 16.
# The 4-stage BN 64 dot loop was added (3–6% faster than 3 stages on 7B gate/up and down at 16–32 rows, slower
# at 64: `ec_ablation_h200_extra_77e62e7.json`; the tuner decides per bucket); 8 warps and 5 stages never won.
# At one row the GEMV loop's candidates are timed with K split a fixed number of ways too, beside the automatic split
# (decode.FILL programs an SM). One timing each (`ec_ablation_h200_gemv_splits_82ce0f1.json`): fixed
# splits beat it on 7B o (6.1 µs split once against 6.7) and down (10.7 split twice against 12.0), not on q|k|v or
# gate|up. The fixed splits are options.OPTIONS.gemv_splits ("" in SPEAR_W4_GEMV_SPLITS: the automatic split alone).
PREFILL_CANDIDATES = [
    PrefillConfig(128, 128, 8, 8, 3), PrefillConfig(128, 128, 8, 4, 4), PrefillConfig(64, 128, 8, 4, 4),
    PrefillConfig(128, 64, 8, 4, 4), PrefillConfig(64, 64, 8, 4, 4), PrefillConfig(128, 256, 8, 8, 3),
]


_TUNED: dict[tuple, DecodeConfig | PrefillConfig] = {}


def _m_bucket(m: int) -> int:
    """Tuning buckets: one row, the GEMV loop's rows (≤ 4; at 4 rows its FMAs may cost more than the dot
    loop, so it is tuned apart from one row), then the decode kernel's row tiles (16, 32, 64, 128) and
    powers of two up to 4096."""
    return 1 if m == 1 else 4 if m <= 4 else min(4096, _row_tile(m))


def decode_tune_rows(max_rows: int) -> tuple[int, ...]:
    """The tuning buckets of decode steps of up to `max_rows` rows, as the engine pads them to its CUDA graphs' row
    buckets (powers of two): the row counts a decode benchmark needs tuned (batch 1: one)."""
    return tuple(sorted({_m_bucket(1 << i) for i in range((max_rows - 1).bit_length() + 1)}))


def _row_tile(m: int) -> int:
    """The decode kernel's BM for m rows: the power of two ≥ max(16, m) (16: the tensor-core dot's minimum)."""
    return max(16, 1 << (m - 1).bit_length())


def _tune_key(w: PackedW4, m: int, ec: PackedEC | None = None) -> tuple:
    """W4 alone, or with an EC of this padded rank, fp16 or int8 factors (tuned apart at M = 1: for W4+EC, W4's pick
    was 1.05-1.23x slower than W4+EC's own on 4 of 5 Llama shapes, BENCHMARKS §4; int8 factors halve the EC's
    reads)."""
    return (w.out_features, w.in_features, w.group_size, _m_bucket(m), 0 if ec is None else ec.padded_rank,
            ec is not None and ec.int8)


def decode_config(w: PackedW4, m: int, ec: PackedEC | None = None) -> DecodeConfig:
    """The decode launch's config: W4+EC's own pick where tune_w4 timed it with an EC of this rank and factor
    precision, else W4's, else the untuned default."""
    return _TUNED.get(_tune_key(w, m, ec)) or _TUNED.get(_tune_key(w, m), DecodeConfig())


def prefill_choice(w: PackedW4, m: int) -> PrefillConfig | None:
    """The tile GEMM's config where tune_w4 timed this shape at m's row bucket (None: untuned)."""
    return _TUNED.get(_tune_key(w, m))


def _slices_per_group(group_size: int) -> int:
    """16-column slices per group span inside a 128-column block (pack_w4 admits g = 32, 64, 128·n, K)."""
    return min(8, group_size // 16)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere, so that CPU tests see split grids)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _tune_candidates(m: int) -> list[DecodeConfig] | list[PrefillConfig]:
    """The configs tune_w4 times at m rows: the decode kernel's (the GEMV loop only where m ≤ 4; at one row each GEMV
    config also with K split options.OPTIONS.gemv_splits ways), else prefill's."""
    if m > DECODE_KERNEL_MAX_M:
        return PREFILL_CANDIDATES
    candidates = [c for c in DECODE_CANDIDATES if m <= 4 or c.gemv_rows == 0]
    if m == 1:
        splits = options.OPTIONS.gemv_splits
        candidates += [dataclasses.replace(c, split_k=s) for c in candidates if c.gemv_rows for s in splits]
    return candidates
