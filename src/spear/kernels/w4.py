"""W4A16 GEMM with the error compensator, in Triton: y = x · W_hatᵀ + bias + (alpha·B) g,
g = gamma(A x) ⊙ A x (see reference.py for the specification, pack.py for the layout).

Two regimes behind `w4_linear`, picked by the number of rows M:

* decode (M ≤ DECODE_KERNEL_MAX_M = 128 rows, all in one [BN, BM] tile column: BM is the power of two
  ≥ max(16, M)), one launch. The grid is 1-D: its first num_ax programs compute partial
  u = A x over slices of K and store them in a float32 workspace; the remaining programs
  stream the int4 weight (split-K when N alone gives too few programs), with one of two main
  loops: for up to 4 rows a GEMV loop (plain FMAs on codes turned into denormal floats by one
  AND each, `_w4_gemv`; or two weights an HFMA2, `_w4_gemv_f16x2`, where the tuner picks it), else
  tensor-core dots: one a 128-column block where one quantization group spans it (`_w4_block_wide`,
  the codes' four planes joined back into column order), else one a 16-column slice (`_w4_block`). The last program
  to finish an output tile (a per-tile arrival counter) sums the splits' partials in split
  order, and adds (alpha·B)_tile g in registers to it, g = gamma(u) ⊙ u, then writes the output
  once. The last u-program to arrive sums the partial u in program order, applies the gate once
  and stores g in cells tagged with the launch's epoch: the flag is in the data (NCCL's LL
  protocol), so a tile reads g with one load and no flag to acquire first. Each tile issues that
  read and its B tile's before its main loop, so that only the first wave of tiles can find g not
  yet written (and re-reads it). The epoch comes from a count of g's reads that each tile advances
  when done, without waiting for the atomic's result; nothing is emptied or reset between launches.
  No float atomics: the result is bit-reproducible. The u-programs have the lowest ids, so they
  are dispatched first and the wait cannot deadlock. Each launch leaves its counters zeroed for the
  next one. (The u-programs in a launch of their own, the tiles loading g without waiting, measured
  slower at every shape and row count on the H200: BENCHMARKS.md §4, session 5.) The epilogue may
  also do the layer's next op (w4_decode's `swiglu`: silu(gate) ⊙ up of stacked [gate; up]): a tile
  then gathers rows of the two halves (BN / 2 rows of gate and the same rows of up).
* prefill (M > DECODE_PATH_MAX_M): up to FUSED_PREFILL_MAX_M rows (per-channel; FUSED_PREFILL_MAX_M_GROUPED with
  groups) where its tiles fill half the SMs and, 128 × 256 wide, their waves (`takes_tile_gemm`), one Triton tile
  GEMM that dequantizes in its main loop (the decode kernel's dot loop: one tensor-core dot a 128-column block or a
  group, a group's codes scaled in fp16 before it) with (alpha·B) g added in its epilogue (`w4_prefill_fused`). g
  comes from a few rank programs on the SMs the GEMM's last wave leaves idle, a launch of their own that the GEMM
  follows as its programmatic dependent, its main loop beside them and its epilogue after them
  (`_ec_rank_programs_kernel`); else from the EC's rank-space kernel before the GEMM (`ec_rank`, K split across the
  SMs). Beyond that the weight is dequantized once into scratch and multiplied by cuBLAS, the rank-space kernel on a
  side stream, the EC term written first and read by cuBLAS's epilogue (a narrow weight: added after the GEMM,
  which then runs beside the rank kernel; `w4_prefill`). Per-channel, the tile GEMM runs at 0.77–0.87× of cuBLAS
  fp16's throughput at 1024–2048 rows on the 7B shapes, W4+EC at 1.00–1.06× of W4 (session 17); with groups,
  dequantize + cuBLAS is ahead from 1024 rows.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spear.kernels import tune_cache
from spear.kernels.norm_fold import FoldedNorm
from spear.kernels.pack import PackedEC, PackedW4
from spear.kernels.pdl import (
    launch_options,
    pdl_enter,
    pdl_release,
    runs_compiled,
    uses_pdl,
    w4_launch,
)

DECODE_KERNEL_MAX_M = 128  # the decode kernel's widest row tile
# w4_linear's switch from the decode kernel (split-K, the EC fused) to the prefill tile GEMM.
DECODE_PATH_MAX_M = 128
# Prefill rows up to which w4_linear takes the tile GEMM (w4_prefill_fused), else dequantize + cuBLAS
# (bench/prefill_lab.py, BENCHMARKS §4 sessions 15–16). Per-channel: the most it was timed at, and faster on every 7B
# shape. With groups (128 or 64) dequantize + cuBLAS is level at 512 rows and 13–35% faster at 1024 (session 16).
FUSED_PREFILL_MAX_M = 2048
FUSED_PREFILL_MAX_M_GROUPED = 512
TILE_WAVE_FILL = 0.84  # how full the 128 × 256 tile GEMM's waves must be on average (takes_tile_gemm)
TWO_38: tl.constexpr = tl.constexpr(2.0**38)  # the GEMV loop's products are q x 2^-38 (_codes_denormal)
# Each decode launch with an EC advances the workspace's reads count by 2^READS_SHIFT (its tiles' shares), so that
# the count's high bits are the launch's epoch, the tag of g's cells (the kernel's comment); a launch has fewer tiles.
READS_SHIFT: tl.constexpr = tl.constexpr(20)
READS_PER_LAUNCH: tl.constexpr = tl.constexpr(1 << 20)
# The decode kernel's dot loop as one dot a 128-column block where one group spans it (_w4_block_wide; session 14:
# 19–36% faster at 16–128 rows on the 7B shapes than a dot a 16-column slice), and groups of 64 and 32 one dot each
# (_span_wide; session 15: at 16–32 rows on the 7B shapes 15–26% faster than a dot a slice at g = 64, 8–19% at 32).
# SPEAR_W4_DOT_WIDE=1 keeps the slices for groups under 128, =0 everywhere.
_DOT_WIDE_ENV = os.environ.get("SPEAR_W4_DOT_WIDE", "2")
if _DOT_WIDE_ENV not in ("0", "1", "2"):
    raise ValueError(f"SPEAR_W4_DOT_WIDE is 0, 1 or 2; got {_DOT_WIDE_ENV!r}")
DOT_WIDE = int(_DOT_WIDE_ENV)  # the decode kernel's WIDE
# The wide dot loops turn codes into q − z through inline PTX (_plane's ASM), which drops the 78 IMAD.MOV that
# rematerialise the LOP3 masks (offline SASS at BN 128, 16 rows: 372 → 300 a block). Session 16 on the H200: the 7B
# shapes at 16–32 rows 9–17% faster, W4 decode through the engine 8–13% faster at batch 8–32 (BENCHMARKS §4/§5).
# Compiled code only (the interpreter runs no PTX); SPEAR_W4_DOT_ASM=0 turns it off.
_DOT_ASM_ENV = os.environ.get("SPEAR_W4_DOT_ASM", "1")
if _DOT_ASM_ENV not in ("0", "1"):
    raise ValueError(f"SPEAR_W4_DOT_ASM is 0 or 1; got {_DOT_ASM_ENV!r}")
DOT_ASM = _DOT_ASM_ENV == "1"


# --- building blocks ------------------------------------------------------------------


@triton.jit
def _h2_unpack(v):
    """The fp16 halves (bits 0–15, bits 16–31) of int32 v."""
    return v.to(tl.int16).to(tl.float16, bitcast=True), (v >> 16).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _pair_bits(src, HI: tl.constexpr):
    """The code pair at bits 0–3 and 16–19 of src (HI: bits 4–7 and 20–23) OR-ed into 0x6400 in both halves: as
    fp16x2, 1024 + q (HI: 1024 + 16 q) for each code, exactly, in one LOP3 (Marlin's masks)."""
    if HI:
        bits = (src & 0x00F000F0) | 0x64006400
    else:
        bits = (src & 0x000F000F) | 0x64006400
    return bits


@triton.jit
def _plane(src, off_lo, off_hi, jj: tl.constexpr, ASM: tl.constexpr = False, scale=None):
    """q − z [BN, W, 2] of plane jj of code words src [BN, W] (pack.py's pair layout: columns 2 p, 2 p + 1 at bits
    4 jj, 16 + 4 jj of word p; src is words >> 8 for jj ≥ 2), with off_lo = 1024 + z, off_hi = 64 + z. The pair's
    halves (_pair_bits) are 1024 + q for even jj, so q − z = that − off_lo (HADD2), and 1024 + 16 q for odd jj, so
    q − z = that / 16 − off_hi (HFMA2): exact, two weights an instruction. ASM (DOT_ASM): the same as one
    inline LOP3 + HFMA2 on the packed pair (_h2_codes at SCALE 1), so that ptxas keeps the mask in the instruction
    instead of rematerialising it before every LOP3 (offline SASS at BN 128: 372 → 300 a block). With `scale`
    ([BN, 1] fp16, SCALE_CODES): (q − z) · s, W_hat rounded to fp16 as the reference rounds it."""
    if ASM:
        if jj % 2 == 1:
            v = _h2_codes(src, _h2_pack(-off_hi, -off_hi), True, True, 1)
        else:
            v = _h2_codes(src, _h2_pack(-off_lo, -off_lo), False, True, 1)
        if scale is not None:
            v = _h2_fma(v, _h2_pack(scale, scale), v, True, True)  # one HMUL2 on the packed pair
        lo, hi = _h2_unpack(v)
    else:
        lo, hi = _h2_unpack(_pair_bits(src, jj % 2 == 1))
        if jj % 2 == 1:
            lo = lo * 0.0625 - off_hi
            hi = hi * 0.0625 - off_hi
        else:
            lo = lo - off_lo
            hi = hi - off_lo
        if scale is not None:
            lo = lo * scale
            hi = hi * scale
    return tl.join(lo, hi)


@triton.jit
def _group_column(ptr, offs_n, mask_n, g, G):
    """Column g of a [N, G] scales or zeros table for the rows offs_n [BN]; 0 where g ≥ G (a span or slice of the
    K padding) or a row is masked."""
    return tl.load(ptr + offs_n * G + g, mask=mask_n & (offs_n * 0 + g < G), other=0.0)  # g < G as a tensor


@triton.jit
def _planes(words, words8, off_lo, off_hi, ASM: tl.constexpr, scale=None):
    """q − z [BN, W, 2, 2, 2] of all four planes of code words [BN, W] (words8 = words >> 8): (word, bit, jj % 2,
    jj // 2), _plane's pairs joined (times `scale` where given)."""
    low = tl.join(_plane(words, off_lo, off_hi, 0, ASM, scale), _plane(words, off_lo, off_hi, 1, ASM, scale))
    high = tl.join(_plane(words8, off_lo, off_hi, 2, ASM, scale), _plane(words8, off_lo, off_hi, 3, ASM, scale))
    return tl.join(low, high)


@triton.jit
def _slice_f16(words, words8, jj: tl.constexpr, off_lo, off_hi, BN: tl.constexpr):
    """q − z [BN, 16] fp16 of slice 4 h + jj of a block, from the 8 words [BN, 8] of its half h and words8 =
    words >> 8: _plane's pairs side by side (columns 2 p, 2 p + 1)."""
    if jj < 2:
        src = words
    else:
        src = words8
    return tl.reshape(_plane(src, off_lo, off_hi, jj), (BN, 16))


@triton.jit
def _w4_block_wide(acc, x_ptr, stride_xm, offs_m, mask_m, qw_ptr, offs_n, mask_n, kb, K, KW, z, BN: tl.constexpr,
                   ASM: tl.constexpr = False, s=None):
    """acc + Σ (q − z) x over one block as one tensor-core dot over its 128 columns (one z a row: per-channel, or the
    block's group where one spans it; the caller applies the scale, unless s [BN] fp16 is given: then the codes
    are scaled first, acc + Σ W_hat x): the four planes of the 16 words (_plane) joined and put back in column order
    (64 h + 16 jj + 2 p + bit), so that the dot's k-steps follow each other without a fence and a wait between
    slices."""
    words = tl.load(qw_ptr + offs_n[:, None] * KW + (kb // 8 + tl.arange(0, 16))[None, :],
                    mask=mask_n[:, None], other=0)  # [BN, 16] int32: word 8 h + p
    words8 = words >> 8  # planes 2 and 3
    t = _planes(words, words8, (z + 1024.0)[:, None], (z + 64.0)[:, None], ASM,
                None if s is None else s[:, None])  # [BN, 16, 2, 2, 2]
    t = tl.reshape(t, (BN, 2, 8, 2, 2, 2))  # (h, p, bit, jj0, jj1)
    q = tl.reshape(tl.permute(t, (0, 1, 5, 4, 2, 3)), (BN, 128))  # column 64 h + 16 (2 jj1 + jj0) + 2 p + bit
    offs_k = kb + tl.arange(0, 128)
    xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                 mask=(offs_k[:, None] < K) & mask_m[None, :], other=0.0)  # [128, BM]
    return tl.dot(q, xt, acc)


@triton.jit
def _span_wide(words, words8, off_lo, off_hi, FIRST: tl.constexpr, PLANES: tl.constexpr, BN: tl.constexpr,
               ASM: tl.constexpr = False, scale=None):
    """q − z [BN, 16 PLANES] of the slices FIRST .. FIRST + PLANES − 1 of one half of a block (one quantization group
    of 64 or 32 columns), from its 8 words and words8 = words >> 8, in column order 16 jj + 2 p + bit (_w4_block_wide's
    join, for a half)."""
    if PLANES == 4:  # one return statement: the compiler checks every return's shape, taken or not
        t4 = _planes(words, words8, off_lo, off_hi, ASM, scale)  # (p, bit, jj0, jj1)
        q = tl.reshape(tl.permute(t4, (0, 4, 3, 1, 2)), (BN, 64))
    else:
        if FIRST == 0:
            t2 = tl.join(_plane(words, off_lo, off_hi, 0, ASM, scale), _plane(words, off_lo, off_hi, 1, ASM, scale))
        else:
            t2 = tl.join(_plane(words8, off_lo, off_hi, 2, ASM, scale), _plane(words8, off_lo, off_hi, 3, ASM, scale))
        q = tl.reshape(tl.permute(t2, (0, 3, 1, 2)), (BN, 32))
    return q


@triton.jit
def _w4_block(acc, x_ptr, stride_xm, offs_m, mask_m, qw_ptr, s_ptr, z_ptr, offs_n, mask_n, kb, K, KW, G, group_size,
              z, SPG: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, PER_CHANNEL: tl.constexpr, WIDE: tl.constexpr,
              ASM: tl.constexpr = False, SCALE_CODES: tl.constexpr = False):
    """acc [BN, BM] += W_hat[offs_n, kb : kb + 128] · x[offs_m, kb : kb + 128]ᵀ, one packed block
    (per-channel: without the scale, which _w4_dot_loop applies once at the end).

    The zero points are integers (≤ 15), so q − z is exact in fp16 and costs one HADD2 / HFMA2 a code pair, what
    turning the codes into fp16 costs anyway (_slice_f16). Per group span (SPG slices of 16 columns: whole
    slices, whole halves of the block at SPG = 4) the tensor-core dots sum Σ (q − z) x and the scale acts once:
    acc += s · Σ (q − z) x. No Σ x correction term. Per-channel, `z` [BN] comes from the caller and the dots
    accumulate straight into acc. SCALE_CODES (the prefill tile GEMM, with WIDE): the wide loops' groups scale the
    codes instead, one HMUL2 a pair, W_hat = (q − z) · s, and their dots accumulate straight into acc too: no wgmma
    wait and float32 FMA pass a group. On the H200 (session 16, g = 128) that made the tile GEMM 6–11% faster at
    1024–2048 rows, and the decode kernel 8–18% slower at 16–32 rows (its dot loop is bound by instructions a code,
    and a 16-row tile's FMA pass is small), so the decode kernel keeps the float32 scale.
    """
    if WIDE and (PER_CHANNEL or SPG == 8):  # one group spans the block: one dot (_w4_block_wide)
        if PER_CHANNEL:
            return _w4_block_wide(acc, x_ptr, stride_xm, offs_m, mask_m, qw_ptr, offs_n, mask_n, kb, K, KW, z, BN, ASM)
        g = kb // group_size
        z = _group_column(z_ptr, offs_n, mask_n, g, G)
        if SCALE_CODES:
            return _w4_block_wide(acc, x_ptr, stride_xm, offs_m, mask_m, qw_ptr, offs_n, mask_n, kb, K, KW, z, BN, ASM,
                                  _group_column(s_ptr, offs_n, mask_n, g, G))
        part = _w4_block_wide(tl.zeros((BN, BM), dtype=tl.float32), x_ptr, stride_xm, offs_m, mask_m, qw_ptr, offs_n,
                              mask_n, kb, K, KW, z, BN, ASM)
        return acc + _group_column(s_ptr, offs_n, mask_n, g, G).to(tl.float32)[:, None] * part
    if WIDE == 2 and not PER_CHANNEL:  # groups of 64 / 32: one dot a group (_span_wide)
        for h in tl.static_range(2):
            words = tl.load(qw_ptr + offs_n[:, None] * KW + (kb // 8 + 8 * h + tl.arange(0, 8))[None, :],
                            mask=mask_n[:, None], other=0)  # [BN, 8] int32: slices 4 h .. 4 h + 3
            words8 = words >> 8
            for span in tl.static_range(4 // SPG):
                j = 4 * h + span * SPG  # the span's first slice
                g = (kb + 16 * j) // group_size
                z = _group_column(z_ptr, offs_n, mask_n, g, G)
                s16 = _group_column(s_ptr, offs_n, mask_n, g, G)  # not `s`: the slice loop below binds s to float32
                q = _span_wide(words, words8, (z + 1024.0)[:, None], (z + 64.0)[:, None], span * SPG, SPG, BN, ASM,
                               s16[:, None] if SCALE_CODES else None)
                offs_k = kb + 16 * j + tl.arange(0, 16 * SPG)
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                             mask=(offs_k[:, None] < K) & mask_m[None, :], other=0.0)  # [16 SPG, BM]
                if SCALE_CODES:
                    acc = tl.dot(q, xt, acc)
                else:
                    acc += s16.to(tl.float32)[:, None] * tl.dot(q, xt)
        return acc
    part = tl.zeros((BN, BM), dtype=tl.float32)
    if PER_CHANNEL:
        part = acc
    for h in tl.static_range(2):
        words = tl.load(qw_ptr + offs_n[:, None] * KW + (kb // 8 + 8 * h + tl.arange(0, 8))[None, :],
                        mask=mask_n[:, None], other=0)  # [BN, 8] int32: slices 4 h .. 4 h + 3
        words8 = words >> 8
        for jj in tl.static_range(4):
            j = 4 * h + jj
            g = (kb + 16 * (j - j % SPG)) // group_size  # the span's group (from its first column: K pads to 128)
            if not PER_CHANNEL and j % SPG == 0:
                z = _group_column(z_ptr, offs_n, mask_n, g, G)  # [BN] fp16
            offs_k = kb + 16 * j + tl.arange(0, 16)
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                         mask=(offs_k[:, None] < K) & mask_m[None, :], other=0.0)  # [16, BM]: the slice of xᵀ
            q = _slice_f16(words, words8, jj, (z + 1024.0)[:, None], (z + 64.0)[:, None], BN)  # [BN, 16]: q − z
            part += tl.dot(q, xt)
            if not PER_CHANNEL and (j + 1) % SPG == 0:
                s = _group_column(s_ptr, offs_n, mask_n, g, G).to(tl.float32)
                acc += s[:, None] * part
                part = tl.zeros((BN, BM), dtype=tl.float32)
    if PER_CHANNEL:
        acc = part
    return acc


@triton.jit
def _w4_dot_loop(x_ptr, stride_xm, offs_m, mask_m, qw_ptr, s_ptr, z_ptr, offs_n, mask_n, k_lo, k_hi, K, KW, G,
                 group_size, SPG: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, PER_CHANNEL: tl.constexpr,
                 WIDE: tl.constexpr = 0, ASM: tl.constexpr = False, SCALE_CODES: tl.constexpr = False):
    """The [BN, BM] yᵀ tile over columns k_lo:k_hi by tensor-core dots (_w4_block per 128 columns; WIDE (DOT_WIDE): one
    dot a block where one group spans it, and at 2 one a group of 64 or 32; ASM (DOT_ASM): the wide loops' codes
    through inline PTX, _plane; SCALE_CODES: their groups' codes scaled before the dot). Per-channel, z is loaded once
    and s applied once, after the loop."""
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    z = tl.zeros((BN,), dtype=tl.float16)
    if PER_CHANNEL:
        z = tl.load(z_ptr + offs_n * G, mask=mask_n, other=0.0)
    for kb in range(k_lo, k_hi, 128):
        acc = _w4_block(acc, x_ptr, stride_xm, offs_m, mask_m, qw_ptr, s_ptr, z_ptr, offs_n, mask_n, kb, K, KW, G,
                        group_size, z, SPG, BN, BM, PER_CHANNEL, WIDE, ASM, SCALE_CODES)
    if PER_CHANNEL:
        acc *= tl.load(s_ptr + offs_n * G, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _codes_denormal(half, jj: tl.constexpr):
    """q · 2^(4 jj − 149) for nibble jj (0–3) of `half` (the word, or the word shifted right by 16): the
    masked bits read as a float32 are a denormal whose value is the code times a power of two — one
    AND per weight, no shift and no int → float conversion. FMA keeps denormal inputs (no flush to
    zero), and x is pre-scaled by 2^(111 − 4 jj) (_x_scale) so every product is q x 2^-38, a normal float."""
    return (half & (0xF << (4 * jj))).to(tl.float32, bitcast=True)


@triton.jit
def _x_scale(jj: tl.constexpr):
    """2^(111 − 4 jj) as float32 (fp16 x ≤ 65504 < 2^16 stays finite after the scaling)."""
    return tl.full((), (111 - 4 * jj + 127) << 23, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _x_pairs(x_ptr, row, M, stride_xm, kb, jj: tl.constexpr, K, BKW: tl.constexpr, EVEN: tl.constexpr = False):
    """x[row] at the step's words' code pairs in plane jj, as int32 [BKW] holding the pair's two fp16 (the even
    column in bits 0–15). Word 8 h + p of the step (h counts 64-column halves of blocks) pairs columns
    kb + 64 h + 16 jj + 2 p and + 1 (pack.py), adjacent in x, so one int32 takes both (w4_decode keeps x's rows
    4-byte aligned), and a plane's pairs are a run of 8 int32 per half. (Loading the 16 fp16 of a run and
    splitting them into even and odd columns moved x through shared memory: a [BKW, 2] load as wide as the
    program's threads is not re-materialized in the layout the codes want.) The mask tests whole runs (K is a
    multiple of 64), so the compiler may vectorize the load along a run. EVEN (row 0, whole steps up to K): no mask,
    no zeroing of the masked-off registers first."""
    offs = tl.arange(0, BKW)
    run = kb + 64 * (offs // 8) + 16 * jj  # first column of each word's run of 16
    pairs = tl.max_contiguous(tl.multiple_of(kb // 2 + 32 * (offs // 8) + 8 * jj + offs % 8, 8), 8)
    x2 = x_ptr.to(tl.pointer_type(tl.int32)) + row * (stride_xm // 2)
    if EVEN:
        v = tl.load(x2 + pairs)
    else:
        v = tl.load(x2 + pairs, mask=(run < K) & (offs * 0 + row < M), other=0)
    return v


@triton.jit
def _gemv_row(part, xs, even, odd, x_ptr, row, M, stride_xm, kb, jj: tl.constexpr, K, scale, BKW: tl.constexpr):
    """part [BN, BKW] += even · (scale x_even) + odd · (scale x_odd) (broadcast down the rows of W), for the codes of
    the words' column pairs in plane jj and x[row] there (_x_pairs); xs [BKW] += x_even + x_odd."""
    x_even, x_odd = _h2_unpack(_x_pairs(x_ptr, row, M, stride_xm, kb, jj, K, BKW))
    x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
    return part + even * (x_even * scale)[None, :] + odd * (x_odd * scale)[None, :], xs + x_even + x_odd


@triton.jit
def _gemv_span_end(acc, xsum, part, xs, s, z, unit, PER_CHANNEL: tl.constexpr, BN: tl.constexpr, NC: tl.constexpr,
                   CW: tl.constexpr):
    """Close a group span: Σ (q − z) s x = s (unit P − z X) with P = Σ q x / unit, X = Σ x (unit: 2^38 for the
    denormal codes, 16 for the fp16x2 loop's codes (q − z) / 16).

    Per-channel: s and z wait for the end of the loop. Grouped: the span of each of the step's NC cells (CW words:
    a block, or a half of one, _w4_gemv) is one group, so P and X are first summed over the cell's words and s, z
    ([BN, NC], one per row and cell) act once per cell, not once per word."""
    if PER_CHANNEL:  # (an if/else, not an early return: the compiler type-checks the code after a return too)
        acc, xsum = part, xsum + xs  # part started from acc
    else:
        p = tl.sum(tl.reshape(part, (BN, NC, CW)), axis=2)  # [BN, NC]
        x = tl.sum(tl.reshape(xs, (NC, CW)), axis=1)  # [NC]
        acc += s * (unit * p - z * x[None, :])
    return acc, xsum


@triton.jit
def _gemv_row_out(acc, xsum, s, z, unit, offs_m, row, PER_CHANNEL: tl.constexpr):
    """Row `row` of the result, placed in column `row` of a [BN, BM] yᵀ tile."""
    y = tl.sum(acc, axis=1)  # [BN]
    if PER_CHANNEL:
        y = s * (unit * y - z * tl.sum(xsum, axis=0))
    return tl.where(offs_m[None, :] == row, y[:, None], 0.0)


@triton.jit
def _gemv_tile(acc0, acc1, acc2, acc3, xsum0, xsum1, xsum2, xsum3, s_ptr, z_ptr, offs_n, mask_n, G, unit, offs_m,
               ROWS: tl.constexpr, PER_CHANNEL: tl.constexpr, BN: tl.constexpr):
    """The GEMV loops' [BN, BM] yᵀ tile from the rows' accumulators (per-channel: s and z act here)."""
    s_row = tl.zeros((BN,), dtype=tl.float32)  # per-channel s and z
    z_row = tl.zeros((BN,), dtype=tl.float32)
    if PER_CHANNEL:
        s_row = tl.load(s_ptr + offs_n * G, mask=mask_n, other=0.0).to(tl.float32)
        z_row = tl.load(z_ptr + offs_n * G, mask=mask_n, other=0.0).to(tl.float32)
    tile = _gemv_row_out(acc0, xsum0, s_row, z_row, unit, offs_m, 0, PER_CHANNEL)
    if ROWS > 1:
        tile += _gemv_row_out(acc1, xsum1, s_row, z_row, unit, offs_m, 1, PER_CHANNEL)
    if ROWS > 2:
        tile += _gemv_row_out(acc2, xsum2, s_row, z_row, unit, offs_m, 2, PER_CHANNEL)
        tile += _gemv_row_out(acc3, xsum3, s_row, z_row, unit, offs_m, 3, PER_CHANNEL)
    return tile


@triton.jit
def _span_scales(s_ptr, z_ptr, offs_n, mask_n, kb, jj: tl.constexpr, G, group_size, CW: tl.constexpr,
                 NC: tl.constexpr):
    """s and z [BN, NC] float32 of the group span that starts at plane jj in each of a step's NC cells (CW words:
    8 CW columns, a block or a half of one, _w4_gemv)."""
    g = (kb + 8 * CW * tl.arange(0, NC) + 16 * jj) // group_size  # [NC]: the span's group per cell
    mask_g = mask_n[:, None] & (g[None, :] < G)
    s = tl.load(s_ptr + offs_n[:, None] * G + g[None, :], mask=mask_g, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs_n[:, None] * G + g[None, :], mask=mask_g, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _code_tile(qw_ptr, offs_n, mask_n, kb, k_hi, KW, BKW: tl.constexpr, EVEN: tl.constexpr = False):
    """The GEMV loop's [BN, BKW] int32 code words of the step at column kb (a multiple of 128); nothing past k_hi
    is read (the mask tests whole 16-word runs, k_hi being a multiple of 128, so the load may vectorize). EVEN
    (every tile row real, every step whole: w4_decode's `even`): no mask (a masked load zeroes its registers
    first, one CS2R per two; session 12)."""
    offs_w = tl.arange(0, BKW)
    block0 = 128 * (offs_w // 16)  # first column of each word's 128-column block, within the step
    words = tl.multiple_of(kb // 8, 16) + offs_w
    if EVEN:
        tile = tl.load(qw_ptr + offs_n[:, None] * KW + words[None, :])
    else:
        tile = tl.load(qw_ptr + offs_n[:, None] * KW + words[None, :],
                       mask=mask_n[:, None] & (kb + block0[None, :] < k_hi), other=0)
    return tile


@triton.jit
def _step_codes(qw_ptr, offs_n, mask_n, kb, k_hi, KW, BKW: tl.constexpr, ahead, PRELOAD: tl.constexpr,
                EVEN: tl.constexpr = False):
    """The step's code tile and the one loaded ahead: with PRELOAD, `ahead` (loaded a step earlier) and the next
    step's load starts now, so two steps are in flight (EVEN, unmasked: the last step loads itself again, from
    cache, rather than past the split); else the step's tile, loaded now (ahead unused)."""
    if PRELOAD:
        packed = ahead
        next_kb = kb + BKW * 8
        if EVEN:
            next_kb = tl.minimum(next_kb, k_hi - BKW * 8)
        ahead = _code_tile(qw_ptr, offs_n, mask_n, next_kb, k_hi, KW, BKW, EVEN)
    else:
        packed = _code_tile(qw_ptr, offs_n, mask_n, kb, k_hi, KW, BKW, EVEN)
    return packed, ahead


@triton.jit
def _w4_gemv(x_ptr, stride_xm, M, offs_m, qw_ptr, s_ptr, z_ptr, offs_n, mask_n, k_lo, k_hi, K, KW, G, group_size,
             SPG: tl.constexpr, PER_CHANNEL: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BKW: tl.constexpr,
             ROWS: tl.constexpr, STAGES: tl.constexpr, first, PRELOAD: tl.constexpr, EVEN: tl.constexpr):
    """The [BN, BM] yᵀ tile over columns k_lo:k_hi for M ≤ ROWS ≤ 4 rows of x: the GEMV main loop.

    Each step loads a wide [BN, BKW] tile of code words (BKW / 16 packed blocks) and multiplies every
    nibble plane (bits 4 jj of each word: the even columns of the word's pair in slice 4 h + jj; bits
    16 + 4 jj: the odd ones) by the matching slice of x (_x_pairs) with plain FMAs, one 2-D float32
    accumulator per row (a 3-D [ROWS, BN, BKW] one made the compiler shuffle the codes through shared
    memory). No tensor-core operand layout and no int → float conversion: a code is an AND away from a
    denormal float (_codes_denormal), so a weight costs an AND and an FMA.

    Grouped, planes c .. c + L − 1 (L = min(SPG, 4)) of the 8 words of a block's half h hold slices
    4 h + c .. 4 h + c + L − 1: one group span, so the span's sums close per cell of CW words, a half (SPG ≤ 4)
    or, where one group spans both halves, a block (SPG = 8).

    STAGES > 1 pipelines the code tiles through shared memory (cp.async, STAGES − 1 steps ahead): at one
    or two programs an SM, one step's tile in flight (16 KB) is too little to cover HBM latency.
    """
    L: tl.constexpr = min(SPG, 4)  # planes per span
    CW: tl.constexpr = 8 + 8 * (SPG // 8)  # words per group cell: a block's 16 (SPG = 8), else a half's 8
    NC: tl.constexpr = BKW // CW  # group cells per step
    ACC: tl.constexpr = NC + (BKW - NC) * PER_CHANNEL  # per-channel: per word; grouped: per row and cell
    # (not `BKW if PER_CHANNEL else NC`: the compiler's constexpr wrapper is always truthy there)
    acc0 = tl.zeros((BN, ACC), dtype=tl.float32)
    acc1 = tl.zeros((BN, ACC), dtype=tl.float32)
    acc2 = tl.zeros((BN, ACC), dtype=tl.float32)
    acc3 = tl.zeros((BN, ACC), dtype=tl.float32)
    xsum0 = tl.zeros((BKW,), dtype=tl.float32)  # per-channel: Σ x over the range, per row
    xsum1 = tl.zeros((BKW,), dtype=tl.float32)
    xsum2 = tl.zeros((BKW,), dtype=tl.float32)
    xsum3 = tl.zeros((BKW,), dtype=tl.float32)
    s = tl.zeros((BN, ACC), dtype=tl.float32)
    z = tl.zeros((BN, ACC), dtype=tl.float32)
    ahead = first  # PRELOAD: each step's codes were loaded a step earlier (the first before the PDL wait)
    for kb in tl.range(k_lo, k_hi, BKW * 8, num_stages=STAGES):
        packed, ahead = _step_codes(qw_ptr, offs_n, mask_n, kb, k_hi, KW, BKW, ahead, PRELOAD, EVEN)
        packed_hi = (packed.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)  # odd columns' codes
        for c in tl.static_range(0, 4, L):
            if not PER_CHANNEL:
                s, z = _span_scales(s_ptr, z_ptr, offs_n, mask_n, kb, c, G, group_size, CW, NC)
            if PER_CHANNEL:  # the span's sums go straight into the accumulators
                part0, part1, part2, part3 = acc0, acc1, acc2, acc3
            else:
                part0 = tl.zeros((BN, BKW), dtype=tl.float32)
                part1 = tl.zeros((BN, BKW), dtype=tl.float32)
                part2 = tl.zeros((BN, BKW), dtype=tl.float32)
                part3 = tl.zeros((BN, BKW), dtype=tl.float32)
            xs0 = tl.zeros((BKW,), dtype=tl.float32)
            xs1 = tl.zeros((BKW,), dtype=tl.float32)
            xs2 = tl.zeros((BKW,), dtype=tl.float32)
            xs3 = tl.zeros((BKW,), dtype=tl.float32)
            for jj in tl.static_range(c, c + L):
                even = _codes_denormal(packed, jj)  # [BN, BKW]: q 2^(4 jj − 149)
                odd = _codes_denormal(packed_hi, jj)
                scale = _x_scale(jj)
                part0, xs0 = _gemv_row(part0, xs0, even, odd, x_ptr, 0, M, stride_xm, kb, jj, K, scale, BKW)
                if ROWS > 1:
                    part1, xs1 = _gemv_row(part1, xs1, even, odd, x_ptr, 1, M, stride_xm, kb, jj, K, scale, BKW)
                if ROWS > 2:
                    part2, xs2 = _gemv_row(part2, xs2, even, odd, x_ptr, 2, M, stride_xm, kb, jj, K, scale, BKW)
                    part3, xs3 = _gemv_row(part3, xs3, even, odd, x_ptr, 3, M, stride_xm, kb, jj, K, scale, BKW)
            acc0, xsum0 = _gemv_span_end(acc0, xsum0, part0, xs0, s, z, TWO_38, PER_CHANNEL, BN, NC, CW)
            if ROWS > 1:
                acc1, xsum1 = _gemv_span_end(acc1, xsum1, part1, xs1, s, z, TWO_38, PER_CHANNEL, BN, NC, CW)
            if ROWS > 2:
                acc2, xsum2 = _gemv_span_end(acc2, xsum2, part2, xs2, s, z, TWO_38, PER_CHANNEL, BN, NC, CW)
                acc3, xsum3 = _gemv_span_end(acc3, xsum3, part3, xs3, s, z, TWO_38, PER_CHANNEL, BN, NC, CW)
    return _gemv_tile(acc0, acc1, acc2, acc3, xsum0, xsum1, xsum2, xsum3, s_ptr, z_ptr, offs_n, mask_n, G, TWO_38,
                      offs_m, ROWS, PER_CHANNEL, BN)


# --- the GEMV loop in fp16x2 (DecodeConfig.gemv_f16x2) ----------------------------------
# An int32 holds two fp16 (bits 0–15, 16–31): one HADD2 / HFMA2 computes both. Each helper is one short inline PTX
# block (ASM) or, for the interpreter (which runs no PTX), the same arithmetic on the two halves in Triton.


@triton.jit
def _h2_pack(lo, hi):
    """fp16 lo and hi as the halves of one int32."""
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _h2_codes(src, offset, HI: tl.constexpr, ASM: tl.constexpr, SCALE: tl.constexpr = 16):
    """(q − z) / SCALE (16 or 256) of the codes at bits 0–3 and 16–19 of src (HI: bits 4–7 and 20–23) as fp16x2,
    exactly: OR-ing a code into 0x6400 gives 1024 + q (HI: 1024 + 16 q); one fma by 1 / SCALE (HI: 1 / (16 SCALE))
    gives 1024 / SCALE + q / SCALE (both terms on the fp16 grid there), and `offset` holds −(1024 + z) / SCALE (HI:
    −(64 + z) / SCALE) in both halves. One LOP3 and one HFMA2 for two weights; the 1 / SCALE that keeps the fp16
    partial sums finite rides on the codes, so x needs no scaling (SCALE 16: 1/16 = 0x2C00, 1/256 = 0x1C00;
    SCALE 256: 0x1C00, 1/4096 = 0x0C00). SCALE 1 gives q − z itself (the dot loop's _plane with ASM)."""
    if ASM:
        # 1 is 0x3C00 in both halves; each factor 1/16 takes 4 from the exponent (0x1000 a half)
        mul = tl.full(src.shape, 0x3C003C00 - 0x10001000 * (HI + (SCALE >= 16) + (SCALE == 256)), tl.int32)
        if HI:
            q = tl.inline_asm_elementwise("{ .reg .b32 t; lop3.b32 t, $1, 0x00F000F0, 0x64006400, 0xea; "
                                          "fma.rn.f16x2 $0, t, $3, $2; }", "=r,r,r,r", [src, offset, mul],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            q = tl.inline_asm_elementwise("{ .reg .b32 t; lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xea; "
                                          "fma.rn.f16x2 $0, t, $3, $2; }", "=r,r,r,r", [src, offset, mul],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        off_lo, off_hi = _h2_unpack(offset)
        lo, hi = _h2_unpack(_pair_bits(src, HI))
        step: tl.constexpr = 1.0 / (SCALE * (1 + 15 * HI))  # 1 / SCALE, HI 1 / (16 SCALE): powers of two
        q = _h2_pack(lo * step + off_lo, hi * step + off_hi)
    return q


@triton.jit
def _h2_fma(a, b, c, FIRST: tl.constexpr, ASM: tl.constexpr):
    """a b + c on fp16x2, one rounding (HFMA2); a b (HMUL2) where FIRST (c is then +0: the same sum)."""
    if ASM:
        if FIRST:
            d = tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                          is_pure=True, pack=1)
        else:
            d = tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                          is_pure=True, pack=1)
    else:
        a_lo, a_hi = _h2_unpack(a)
        b_lo, b_hi = _h2_unpack(b)
        c_lo, c_hi = _h2_unpack(c)
        d = _h2_pack((a_lo.to(tl.float32) * b_lo.to(tl.float32) + c_lo.to(tl.float32)).to(tl.float16),
                     (a_hi.to(tl.float32) * b_hi.to(tl.float32) + c_hi.to(tl.float32)).to(tl.float16))
    return d


@triton.jit
def _h2_f32(h, ASM: tl.constexpr):
    """The halves of fp16x2 h as two float32."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise("{ .reg .f16 l, u; mov.b32 {l, u}, $2; cvt.f32.f16 $0, l; "
                                           "cvt.f32.f16 $1, u; }", "=r,=r,r", [h], dtype=(tl.float32, tl.float32),
                                           is_pure=True, pack=1)
    else:
        lo, hi = _h2_unpack(h)
        lo, hi = lo.to(tl.float32), hi.to(tl.float32)
    return lo, hi


@triton.jit
def _h2_row(h, xs, codes, x_ptr, row, M, stride_xm, kb, jj: tl.constexpr, K, FIRST: tl.constexpr, ASM: tl.constexpr,
            BKW: tl.constexpr):
    """h [BN, BKW] fp16x2 += codes / 16 · (x_even, x_odd) for the words' column pairs in plane jj (_x_pairs), two
    weights an HFMA2 (FIRST: h =); xs [BKW] += x_even + x_odd (float32, for grouped weights' z Σ x). A partial sum of
    four products (q − z) x / 16 stays below 60 |x|max / 16: finite for |x| < 17,000."""
    pairs = _x_pairs(x_ptr, row, M, stride_xm, kb, jj, K, BKW)
    x_even, x_odd = _h2_f32(pairs, ASM)
    return _h2_fma(codes, pairs[None, :], h, FIRST, ASM), xs + x_even + x_odd


@triton.jit
def _h2_chain_end(acc, xsum, h, xs, s, z, ASM: tl.constexpr, PER_CHANNEL: tl.constexpr, BN: tl.constexpr,
                  NC: tl.constexpr, CW: tl.constexpr):
    """Add a chain's fp16x2 sums h = Σ (q − z) x / 16 (grouped: Σ (q − 8) x / 16) to the float32 accumulator: per-channel
    per word, grouped closing the chain's group span (both halves of a pair are in one slice, hence one group)."""
    lo, hi = _h2_f32(h, ASM)
    if PER_CHANNEL:
        acc += lo + hi
    else:
        acc, xsum = _gemv_span_end(acc, xsum, lo + hi, xs, s, z, 16.0, PER_CHANNEL, BN, NC, CW)
    return acc


@triton.jit
def _w4_gemv_f16x2(x_ptr, stride_xm, M, offs_m, qw_ptr, s_ptr, z_ptr, offs_n, mask_n, k_lo, k_hi, K, KW, G,
                   group_size, SPG: tl.constexpr, PER_CHANNEL: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                   BKW: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr, first,
                   PRELOAD: tl.constexpr, EVEN: tl.constexpr):
    """_w4_gemv's tile with fp16x2 arithmetic (Marlin / ExLlama style): two weights an instruction.

    The code pair of plane jj of a word (columns 2 p, 2 p + 1 of its slice, pack.py) sits at bits 4 jj' and
    16 + 4 jj' of the word (jj' = jj) or of the word shifted right by 8 (jj' = jj − 2), so one LOP3 and one
    HFMA2 make the pair (q − z) / 16 in one register (_h2_codes), and one HFMA2 multiplies it by the pair of
    adjacent x, as loaded (session 11: x / 16 cost an HMUL2 a pair and plane). Per word and row, the four planes
    chain into fp16 sums of four products (each an fp16 rounding), then into the float32 accumulator
    (_h2_chain_end). Per-channel z is in the codes' offsets: no Σ x term. Grouped, the codes are (q − 8) / 16, and
    z − 8 acts per group span via Σ x, as z in _w4_gemv, whose spans the chains follow (SPG = 2: two planes a chain).
    """
    L: tl.constexpr = min(SPG, 4)  # planes per chain
    CW: tl.constexpr = 8 + 8 * (SPG // 8)  # words per group cell (_w4_gemv)
    NC: tl.constexpr = BKW // CW
    ACC: tl.constexpr = NC + (BKW - NC) * PER_CHANNEL  # per-channel: per word; grouped: per row and cell
    acc0 = tl.zeros((BN, ACC), dtype=tl.float32)
    acc1 = tl.zeros((BN, ACC), dtype=tl.float32)
    acc2 = tl.zeros((BN, ACC), dtype=tl.float32)
    acc3 = tl.zeros((BN, ACC), dtype=tl.float32)
    xsum = tl.zeros((BKW,), dtype=tl.float32)  # per-channel Σ x: none needed (z is in the codes)
    s = tl.zeros((BN, ACC), dtype=tl.float32)
    z_span = tl.zeros((BN, ACC), dtype=tl.float32)
    z = tl.full((BN,), 8.0, dtype=tl.float16)  # grouped: codes q − 8, half the products' size of q's
    if PER_CHANNEL:
        z = tl.load(z_ptr + offs_n * G, mask=mask_n, other=0.0)
    z16 = z * 0.0625  # z / 16, exact
    off_lo = _h2_pack(-64.0 - z16, -64.0 - z16)[:, None]  # −(64 + z / 16), exact in fp16
    off_hi = _h2_pack(-4.0 - z16, -4.0 - z16)[:, None]
    ahead = first  # PRELOAD: each step's codes were loaded a step earlier (the first before the PDL wait)
    for kb in tl.range(k_lo, k_hi, BKW * 8, num_stages=STAGES):
        packed, ahead = _step_codes(qw_ptr, offs_n, mask_n, kb, k_hi, KW, BKW, ahead, PRELOAD, EVEN)
        packed8 = packed >> 8  # the pairs of planes 2, 3 at bits 0–7 and 16–23
        for c in tl.static_range(0, 4, L):  # the chain of planes c .. c + L − 1
            if not PER_CHANNEL:
                s, z_span = _span_scales(s_ptr, z_ptr, offs_n, mask_n, kb, c, G, group_size, CW, NC)
                z_span -= 8.0  # Σ (q − z) x = Σ (q − 8) x − (z − 8) Σ x
            h0 = tl.zeros((BN, BKW), dtype=tl.int32)  # fp16x2 (+0, +0)
            h1, h2, h3 = h0, h0, h0
            xs0, xs1, xs2, xs3 = xsum, xsum, xsum, xsum  # zeros
            for jj in tl.static_range(c, c + L):
                if jj < 2:
                    src = packed
                else:
                    src = packed8
                if jj % 2 == 1:
                    codes = _h2_codes(src, off_hi, True, ASM)
                else:
                    codes = _h2_codes(src, off_lo, False, ASM)
                h0, xs0 = _h2_row(h0, xs0, codes, x_ptr, 0, M, stride_xm, kb, jj, K, jj == c, ASM, BKW)
                if ROWS > 1:
                    h1, xs1 = _h2_row(h1, xs1, codes, x_ptr, 1, M, stride_xm, kb, jj, K, jj == c, ASM, BKW)
                if ROWS > 2:
                    h2, xs2 = _h2_row(h2, xs2, codes, x_ptr, 2, M, stride_xm, kb, jj, K, jj == c, ASM, BKW)
                    h3, xs3 = _h2_row(h3, xs3, codes, x_ptr, 3, M, stride_xm, kb, jj, K, jj == c, ASM, BKW)
            acc0 = _h2_chain_end(acc0, xsum, h0, xs0, s, z_span, ASM, PER_CHANNEL, BN, NC, CW)
            if ROWS > 1:
                acc1 = _h2_chain_end(acc1, xsum, h1, xs1, s, z_span, ASM, PER_CHANNEL, BN, NC, CW)
            if ROWS > 2:
                acc2 = _h2_chain_end(acc2, xsum, h2, xs2, s, z_span, ASM, PER_CHANNEL, BN, NC, CW)
                acc3 = _h2_chain_end(acc3, xsum, h3, xs3, s, z_span, ASM, PER_CHANNEL, BN, NC, CW)
    return _gemv_tile(acc0, acc1, acc2, acc3, xsum, xsum, xsum, xsum, s_ptr, z_ptr, offs_n, mask_n, G, 16.0, offs_m,
                      ROWS, PER_CHANNEL, BN)


@triton.jit
def _split_words(t, R: tl.constexpr, C: tl.constexpr, WC: tl.constexpr):
    """t [R, C] as four [R, C / WC] tensors: the columns c ≡ 0, 1, 2, 3 (mod WC) of t (WC = 2: the last two repeat
    the first two). Each thread holds runs of adjacent words (the loads are 16 bytes wide), so the splits stay in
    registers."""
    if WC == 4:
        even, odd = tl.split(tl.reshape(t, (R, C // 4, 2, 2)))  # columns 4 i + 2 a and 4 i + 2 a + 1
        w0, w2 = tl.split(even)
        w1, w3 = tl.split(odd)
    else:
        w0, w1 = tl.split(tl.reshape(t, (R, C // 2, 2)))
        w2, w3 = w0, w1
    return w0, w1, w2, w3


@triton.jit
def _h2_word_plane(h, src0, src1, src2, src3, offset, p0, p1, p2, p3, HI: tl.constexpr, FIRST: tl.constexpr,
                   ASM: tl.constexpr, WC: tl.constexpr):
    """h += Σ over the WC words of a chain of (q − z) / 256 · (x_even, x_odd) for one plane (_h2_codes, _h2_fma)."""
    h = _h2_fma(_h2_codes(src0, offset, HI, ASM, 256), p0, h, FIRST, ASM)
    h = _h2_fma(_h2_codes(src1, offset, HI, ASM, 256), p1, h, False, ASM)
    if WC == 4:
        h = _h2_fma(_h2_codes(src2, offset, HI, ASM, 256), p2, h, False, ASM)
        h = _h2_fma(_h2_codes(src3, offset, HI, ASM, 256), p3, h, False, ASM)
    return h


@triton.jit
def _w4_gemv_f16x2_words(x_ptr, stride_xm, M, qw_ptr, z_ptr, offs_n, mask_n, k_lo, k_hi, K, KW, G, BN: tl.constexpr,
                         BKW: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr, first, PRELOAD: tl.constexpr,
                         WC: tl.constexpr, EVEN: tl.constexpr):
    """_w4_gemv_f16x2 for one row of x and per-channel weights, its fp16 chains running over WC (2 or 4) adjacent
    words: 4 WC products a chain instead of 4, so the chain's end (two conversions to float32 and two FADDs) comes
    once per WC words (session 12: 64 of the loop's 334 instructions a step were chain ends). The codes are
    (q − z) / 256 (_h2_codes, SCALE 256), so a chain's sum stays below 16 · 15 / 256 |x|max: finite for any fp16 x.
    Returns the float32 [BN, BKW / WC] accumulator of Σ (q − z) x / 256."""
    acc = tl.zeros((BN, BKW // WC), dtype=tl.float32)
    z = tl.load(z_ptr + offs_n * G, mask=mask_n, other=0.0)
    z256 = z * 0.00390625  # z / 256, exact
    off_lo = _h2_pack(-4.0 - z256, -4.0 - z256)[:, None]  # −(1024 + z) / 256, exact in fp16
    off_hi = _h2_pack(-0.25 - z256, -0.25 - z256)[:, None]  # −(64 + z) / 256
    ahead = first  # PRELOAD: each step's codes were loaded a step earlier (the first before the PDL wait)
    for kb in tl.range(k_lo, k_hi, BKW * 8, num_stages=STAGES):
        packed, ahead = _step_codes(qw_ptr, offs_n, mask_n, kb, k_hi, KW, BKW, ahead, PRELOAD, EVEN)
        w0, w1, w2, w3 = _split_words(packed, BN, BKW, WC)
        h = tl.zeros((BN, BKW // WC), dtype=tl.int32)  # fp16x2 (+0, +0)
        for jj in tl.static_range(4):
            pairs = _x_pairs(x_ptr, 0, M, stride_xm, kb, jj, K, BKW, EVEN)[None, :]  # row 0: M ≥ 1
            p0, p1, p2, p3 = _split_words(pairs, 1, BKW, WC)
            if jj == 2:  # planes 2, 3: the pairs at bits 8–15 and 24–31
                w0, w1, w2, w3 = w0 >> 8, w1 >> 8, w2 >> 8, w3 >> 8
            if jj % 2 == 1:
                h = _h2_word_plane(h, w0, w1, w2, w3, off_hi, p0, p1, p2, p3, True, False, ASM, WC)
            else:
                h = _h2_word_plane(h, w0, w1, w2, w3, off_lo, p0, p1, p2, p3, False, jj == 0, ASM, WC)
        lo, hi = _h2_f32(h, ASM)
        acc += lo + hi
    return acc


@triton.jit
def _gate(u, w1_ptr, b1_ptr, w2_ptr, b2_ptr, GATED: tl.constexpr, R: tl.constexpr, H: tl.constexpr):
    """g = u ⊙ (1 + tanh(W2 silu(W1 u + b1) + b2)) for u [BM, R] float32; u itself when not gated."""
    if GATED:
        offs_r = tl.arange(0, R)
        offs_h = tl.arange(0, H)
        w1t = tl.load(w1_ptr + offs_h[None, :] * R + offs_r[:, None])  # [R, H] = W1ᵀ
        b1 = tl.load(b1_ptr + offs_h).to(tl.float32)
        hidden = tl.dot(u.to(tl.float16), w1t) + b1[None, :]
        hidden = hidden * tl.sigmoid(hidden)  # silu
        w2t = tl.load(w2_ptr + offs_r[None, :] * H + offs_h[:, None])  # [H, R] = W2ᵀ
        b2 = tl.load(b2_ptr + offs_r).to(tl.float32)
        z = tl.dot(hidden.to(tl.float16), w2t) + b2[None, :]
        u = u * (2.0 * tl.sigmoid(2.0 * z))  # 1 + tanh(z) = 2 sigmoid(2z)
    return u


@triton.jit
def _add_ec_and_bias(acc, g, b, offs_n, mask_n, bias_ptr, HAS_EC: tl.constexpr, HAS_BIAS: tl.constexpr):
    """accᵀ + bias + ((alpha·B) g)ᵀ for acc [BN, BM], g [BM, R], b = (alpha·B)_tile [BN, R] (as [BN, BM])."""
    if HAS_EC:
        acc += tl.dot(b, tl.trans(g.to(tl.float16)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _store_tile(acc, offs_m, mask_m, offs_n, mask_n, y_ptr, stride_ym):
    """y[offs_m, offs_n] = accᵀ for acc [BN, BM]."""
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=mask_n[:, None] & mask_m[None, :])


@triton.jit
def _add_ec_and_store(acc, g, b, offs_m, mask_m, offs_n, mask_n, y_ptr, stride_ym, bias_ptr,
                      HAS_EC: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[offs_m, offs_n] = accᵀ + bias + ((alpha·B) g)ᵀ (_add_ec_and_bias)."""
    _store_tile(_add_ec_and_bias(acc, g, b, offs_n, mask_n, bias_ptr, HAS_EC, HAS_BIAS), offs_m, mask_m, offs_n,
                mask_n, y_ptr, stride_ym)


@triton.jit
def _swiglu_rows(pid_n, N, BN: tl.constexpr):
    """A SwiGLU tile's rows of the stacked [gate; up] (N rows): BN / 2 rows of gate, then the same rows of up, and
    the mask of the real ones."""
    j = tl.arange(0, BN)
    pair = pid_n * (BN // 2) + j % (BN // 2)
    return pair + (j >= BN // 2).to(tl.int32) * (N // 2), pair < N // 2


@triton.jit
def _tile_rows(pid_n, N, BN: tl.constexpr, SWIGLU: tl.constexpr):
    """Tile pid_n's rows of the weight and the mask of the real ones: BN consecutive rows, or a SwiGLU tile's
    (_swiglu_rows)."""
    if SWIGLU:
        offs_n, mask_n = _swiglu_rows(pid_n, N, BN)
    else:
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_n = offs_n < N
    return offs_n, mask_n


@triton.jit
def _store_swiglu(acc, offs_m, mask_m, pid_n, N, y_ptr, stride_ym, BN: tl.constexpr, BM: tl.constexpr):
    """y[offs_m, rows] = silu(gate) ⊙ up for a SwiGLU tile's acc [BN, BM] (gate rows, then up's: _swiglu_rows),
    rows its BN / 2 columns of the [M, N / 2] activation."""
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BN // 2, BM)), (1, 2, 0)))  # [BN / 2, BM] each
    act = gate * tl.sigmoid(gate) * up
    rows = pid_n * (BN // 2) + tl.arange(0, BN // 2)
    tl.store(y_ptr + offs_m[None, :] * stride_ym + rows[:, None], act.to(y_ptr.dtype.element_ty),
             mask=(rows < N // 2)[:, None] & mask_m[None, :])


@triton.jit
def store_add_norm(acc, res, norm_w, offs_m, mask_m, offs_n, mask_n, pid_n, h_ptr, stride_m, hw_ptr, ssq_ptr,
                    num_ssq):
    """The next RMSNorm's share of a tile (FoldedNorm), for acc [BN, BM] = yᵀ, the residual's tile res [BN, BM] and
    the norm's weights norm_w [BN]: h = y + residual rounded as ops.add_rms_norm rounds it, hw = h ⊙ w_norm, and
    Σ h² over the tile's columns per row into ssq[m, pid_n]. (Also the p2p epilogue's, ec_epilogue.)"""
    mask = mask_n[:, None] & mask_m[None, :]
    rows = offs_m[None, :] * stride_m + offs_n[:, None]
    h = (acc.to(tl.float16).to(tl.float32) + res.to(tl.float32)).to(tl.float16)
    tl.store(h_ptr + rows, h, mask=mask)
    hf = tl.where(mask, h.to(tl.float32), 0.0)
    tl.store(ssq_ptr + offs_m * num_ssq + pid_n, tl.sum(hf * hf, axis=0), mask=mask_m)
    tl.store(hw_ptr + rows, (hf * norm_w.to(tl.float32)[:, None]).to(tl.float16), mask=mask)


@triton.jit
def _row_rstd(ssq_ptr, offs_m, mask_m, num_ssq, K, eps, SSQ_BLOCK: tl.constexpr):
    """rstd [BM] = 1 / sqrt(mean(h²) + eps) from the per-tile sums of h² a FoldedNorm's producer stored, summed
    in a fixed order (every program of the launch gets the same bits)."""
    offs_p = tl.arange(0, SSQ_BLOCK)
    parts = tl.load(ssq_ptr + offs_m[:, None] * num_ssq + offs_p[None, :],
                    mask=mask_m[:, None] & (offs_p < num_ssq)[None, :], other=0.0)
    return tl.rsqrt(tl.sum(parts, axis=1) / K + eps)


@triton.jit
def _load_b_tile(b_ptr, offs_n, mask_n, HAS_EC: tl.constexpr, R: tl.constexpr):
    """(alpha·B)_tile [BN, R] fp16 (zeros without an EC)."""
    offs_r = tl.arange(0, R)
    if HAS_EC:
        b = tl.load(b_ptr + offs_n[:, None] * R + offs_r[None, :], mask=mask_n[:, None], other=0.0)
    else:
        b = tl.zeros((offs_n.shape[0], R), dtype=tl.float16)
    return b


@triton.jit
def _signal_peers(counter_ptr, arrivals, peer_signals_ptr, PEERS: tl.constexpr):
    """Count this program's stores to the ranks in; the last of `arrivals` resets the counter and adds 1 to its
    signal at every rank. Release at system scope after a CTA barrier: every arrived program's stores, over
    NVLink included, are visible to a rank that acquires the signal."""
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    if done == arrivals - 1:
        tl.atomic_xchg(counter_ptr, 0)
        for p in tl.static_range(PEERS):
            signal = tl.load(peer_signals_ptr + p).to(tl.pointer_type(tl.int32))
            tl.atomic_add(signal, 1, sem="release", scope="sys")


@triton.jit
def _g_cells(g, epoch):
    """g's cells: fp16 bits (the epilogue's dot takes g in fp16) under the launch's epoch (mod 2^48), one 64-bit word
    each, stored and loaded whole: a tile never sees a value without its tag."""
    return (epoch << 16) | g.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int64)


@triton.jit
def _read_g(g_rows, mask_m, epoch, WAIT: tl.constexpr):
    """g [BM, R] float32 from its cells, re-read until every row this launch has is tagged with its epoch."""
    cells = tl.load(g_rows, mask=mask_m[:, None], other=0, volatile=True)
    if WAIT:
        while tl.sum((((cells ^ (epoch << 16)) >> 16 != 0) & mask_m[:, None]).to(tl.int32)) > 0:
            cells = tl.load(g_rows, mask=mask_m[:, None], other=0, volatile=True)
    return cells.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


# --- decode: one launch ---------------------------------------------------------------


@triton.jit
def _a_tile(a_ptr, offs_r, k0, k_hi, K, BK: tl.constexpr):
    """The EC's A [R, BK] at columns k0 .. k0 + BK − 1, zeros from k_hi on (a u-program's slice ends there)."""
    offs_k = k0 + tl.arange(0, BK)
    return tl.load(a_ptr + offs_r[:, None] * K + offs_k[None, :], mask=offs_k[None, :] < k_hi, other=0.0)


@triton.jit
def _w4_decode_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr,
    a_ptr, b_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
    y_part_ptr, u_part_ptr, g_ptr, cnt_ptr, reads_ptr, peer_rows_ptr, peer_signals_ptr,
    res_ptr, nw_ptr, hw_ptr, ssq_ptr,
    M, N, K, KW, G, group_size, stride_xm, stride_ym, split_k, k_per_split, num_ax, ax_k_per_prog, num_tiles,
    num_ssq, eps,
    HAS_EC: tl.constexpr, GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr, R: tl.constexpr, H: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPG: tl.constexpr, GEMV_ROWS: tl.constexpr,
    GEMV_STAGES: tl.constexpr, GEMV_F16X2: tl.constexpr, F16X2_ASM: tl.constexpr,
    BKW: tl.constexpr, PER_CHANNEL: tl.constexpr, PEERS: tl.constexpr, U_CHUNK: tl.constexpr,
    EC_ABLATE: tl.constexpr, SWIGLU: tl.constexpr, PDL: tl.constexpr, PDL_LATE: tl.constexpr,
    PRELOAD: tl.constexpr, WORD_CHAIN: tl.constexpr = 1, EVEN: tl.constexpr = False,
    ADD_NORM: tl.constexpr = False, RMS_IN: tl.constexpr = False, SSQ_BLOCK: tl.constexpr = 1, WIDE: tl.constexpr = 1,
    DOT_ASM: tl.constexpr = False,
):
    # y_part [split_k, BM, N] and u_part [num_ax, BM, R]: float32 partial sums, each summed in a fixed order by
    # the program that arrives last (no float atomics: the result is bit-reproducible).
    # g_ptr [BM, R] int64: g = gamma(u) ⊙ u in cells tagged with the launch's epoch (_g_cells). The last u-program
    # stores it; a tile takes a cell as ready when its tag is this launch's epoch (flag in the data, as in NCCL's
    # LL protocol: one load, no separate flag to acquire first). reads_ptr: an int64 count that every launch with
    # an EC advances by exactly READS_PER_LAUNCH = 2^READS_SHIFT, each tile adding its share once it has read g
    # (relaxed, no result waited for, never reset). Until a tile has added its share the count is below
    # (epoch + 1) · 2^READS_SHIFT, and the tiles add only after g is stored, so every program of a launch reads
    # the same epoch from it.
    # cnt_ptr: [0] u-programs arrived, [1] tiles finished (PEERS), [2 + n] splits arrived at tile n.
    # PEERS > 0 (tensor parallelism, row-parallel layers: w4_decode_to_peers): no output here; the float32
    # partials y_r and (with HAS_EC) the ungated u_r go to the [y | u] rows at peer_rows_ptr[p] of every rank p
    # (stride_ym apart), and the last of the tiles and the u-sum to finish signals every rank (_signal_peers).
    # PDL (kernels.pdl): a tile may first load B and its first code step (PRELOAD: the single-stage GEMV loops then
    # load each step's codes one step ahead, two steps in flight), then waits for the launch before it; the next
    # launch may start after this one's main loops (PDL_LATE) or at once.
    # An RMSNorm folded across two launches (FoldedNorm): ADD_NORM, this launch's epilogue stores h = y + residual
    # (res_ptr) at y_ptr, hw = h ⊙ w_norm (nw_ptr) at hw_ptr and the tile's Σ h² per row at ssq_ptr[m, tile];
    # RMS_IN, x is such an hw and the tiles' acc and the u-sum are scaled by rstd = 1 / sqrt(Σ_tiles ssq / K + eps)
    # (num_ssq tiles): norm(h) Wᵀ = rstd ⊙ (hw Wᵀ), exact up to rounding.
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BM)
    mask_m = offs_m < M
    offs_r = tl.arange(0, R)
    g_rows = g_ptr + offs_m[:, None] * R + offs_r[None, :]
    if pid < num_ax:
        # u += A[:, slice] x[slice]  over this program's slice of K; with PRELOAD each step's A tile is loaded a
        # step ahead, the first before the PDL wait (A is a weight), as the tiles load their codes
        a_lo = pid * ax_k_per_prog
        a_hi = tl.minimum(a_lo + ax_k_per_prog, K)
        a_ahead = tl.zeros((R, BK), dtype=tl.float16)
        if PRELOAD:
            a_ahead = _a_tile(a_ptr, offs_r, a_lo, a_hi, K, BK)
        pdl_enter(PDL, PDL_LATE)
        if RMS_IN:  # loaded now, used after the u-sum: no load on the gate's critical path
            rstd = _row_rstd(ssq_ptr, offs_m, mask_m, num_ssq, K, eps, SSQ_BLOCK)
        u = tl.zeros((BM, R), dtype=tl.float32)
        for k0 in range(a_lo, a_lo + ax_k_per_prog, BK):
            offs_k = k0 + tl.arange(0, BK)
            xk = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                         mask=mask_m[:, None] & (offs_k[None, :] < K), other=0.0)
            if PRELOAD:
                ak = a_ahead
                a_ahead = _a_tile(a_ptr, offs_r, k0 + BK, a_hi, K, BK)
            else:
                ak = _a_tile(a_ptr, offs_r, k0, a_hi, K, BK)
            u += tl.dot(xk, tl.trans(ak))
        tl.store(u_part_ptr + pid * BM * R + offs_m[:, None] * R + offs_r[None, :], u, mask=mask_m[:, None])
        pdl_release(PDL and PDL_LATE)
        tl.debug_barrier()
        arrived_u = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
        if arrived_u == num_ax - 1:  # the last u-program: g = gamma(u) ⊙ u once, for every tile
            tl.atomic_xchg(cnt_ptr, 0)  # every u-program has arrived
            u = tl.zeros((BM, R), dtype=tl.float32)
            offs_p = tl.arange(0, U_CHUNK)
            for p0 in range(0, num_ax, U_CHUNK):  # U_CHUNK partials a load, in program order
                p = p0 + offs_p
                parts = tl.load(u_part_ptr + p[:, None, None] * BM * R + offs_m[None, :, None] * R
                                + offs_r[None, None, :], mask=(p < num_ax)[:, None, None] & mask_m[None, :, None],
                                other=0.0, cache_modifier=".cg")
                u += tl.sum(parts, axis=0)
            if RMS_IN:
                u = u * rstd[:, None]
            if PEERS > 0:  # u_r, ungated: the gate needs the sum over the ranks
                for p in tl.static_range(PEERS):
                    rows = tl.load(peer_rows_ptr + p).to(tl.pointer_type(tl.float32))
                    tl.store(rows + offs_m[:, None] * stride_ym + N + offs_r[None, :], u, mask=mask_m[:, None])
                _signal_peers(cnt_ptr + 1, num_tiles + 1, peer_signals_ptr, PEERS)
            else:
                g = _gate(u, w1_ptr, b1_ptr, w2_ptr, b2_ptr, GATED, R, H)
                epoch = tl.load(reads_ptr, volatile=True) >> READS_SHIFT
                tl.store(g_rows, _g_cells(g, epoch), mask=mask_m[:, None])
    else:
        gid = pid - num_ax
        pid_n = gid // split_k
        pid_k = gid % split_k
        offs_n, mask_n = _tile_rows(pid_n, N, BN, SWIGLU)  # SWIGLU: BN / 2 rows of gate and the same of up
        k_hi = tl.minimum((pid_k + 1) * k_per_split, KW * 8)
        # Weights only before the PDL wait (kernels.pdl): B, the folded norm's weights, and with PRELOAD the GEMV
        # loop's first codes, so that their HBM latency overlaps the tail of the launch before this one
        if HAS_EC and PEERS == 0:
            b = _load_b_tile(b_ptr, offs_n, mask_n, HAS_EC, R)
        GEMV_PRELOAD: tl.constexpr = PRELOAD and GEMV_ROWS > 0 and GEMV_STAGES == 1
        if GEMV_PRELOAD:
            first = _code_tile(qw_ptr, offs_n, mask_n, pid_k * k_per_split, k_hi, KW, BKW, EVEN)
        else:
            first = tl.zeros((BN, BKW), dtype=tl.int32)  # unused
        if ADD_NORM:  # the norm's weight before the wait (a weight), the residual tile after it: both before the
            # main loop, so that the epilogue waits for no load (FoldedNorm)
            norm_w = tl.load(nw_ptr + offs_n, mask=mask_n, other=0.0)
        pdl_enter(PDL, PDL_LATE)
        if ADD_NORM:
            res = tl.load(res_ptr + offs_m[None, :] * stride_ym + offs_n[:, None],
                          mask=mask_n[:, None] & mask_m[None, :], other=0.0)
        if RMS_IN:
            rstd = _row_rstd(ssq_ptr, offs_m, mask_m, num_ssq, K, eps, SSQ_BLOCK)
        if HAS_EC and PEERS == 0:  # read before the main loop: later waves of tiles find g there and wait for nothing
            epoch = tl.load(reads_ptr, volatile=True) >> READS_SHIFT
            if BM * R <= 2048:  # (wide row tiles: g's registers through the main loop would spill; read it after)
                g = _read_g(g_rows, mask_m, epoch, False)
        if GEMV_ROWS == 1 and GEMV_F16X2 and PER_CHANNEL and WORD_CHAIN > 1:  # fp16 chains over words
            acc = _w4_gemv_f16x2_words(x_ptr, stride_xm, M, qw_ptr, z_ptr, offs_n, mask_n, pid_k * k_per_split, k_hi,
                                       K, KW, G, BN, BKW, GEMV_STAGES, F16X2_ASM, first, GEMV_PRELOAD, WORD_CHAIN,
                                       EVEN)
            no_xsum = tl.zeros((BKW,), dtype=tl.float32)  # per-channel z is in the codes: no Σ x term
            acc = _gemv_tile(acc, acc, acc, acc, no_xsum, no_xsum, no_xsum, no_xsum, s_ptr, z_ptr, offs_n, mask_n, G,
                             256.0, offs_m, 1, PER_CHANNEL, BN)
        elif GEMV_ROWS > 0 and GEMV_F16X2:  # M ≤ GEMV_ROWS ≤ 4: the GEMV main loop, in fp16x2 or in float32
            acc = _w4_gemv_f16x2(x_ptr, stride_xm, M, offs_m, qw_ptr, s_ptr, z_ptr, offs_n, mask_n, pid_k * k_per_split,
                                 k_hi, K, KW, G, group_size, SPG, PER_CHANNEL, BN, BM, BKW, GEMV_ROWS, GEMV_STAGES,
                                 F16X2_ASM, first, GEMV_PRELOAD, EVEN)
        elif GEMV_ROWS > 0:
            acc = _w4_gemv(x_ptr, stride_xm, M, offs_m, qw_ptr, s_ptr, z_ptr, offs_n, mask_n, pid_k * k_per_split, k_hi,
                           K, KW, G, group_size, SPG, PER_CHANNEL, BN, BM, BKW, GEMV_ROWS, GEMV_STAGES, first,
                           GEMV_PRELOAD, EVEN)
        else:
            acc = _w4_dot_loop(x_ptr, stride_xm, offs_m, mask_m, qw_ptr, s_ptr, z_ptr, offs_n, mask_n,
                               pid_k * k_per_split, k_hi, K, KW, G, group_size, SPG, BN, BM, PER_CHANNEL, WIDE, DOT_ASM)
        pdl_release(PDL and PDL_LATE)
        last = pid_k >= 0  # True, as a tensor: the branch below may replace it
        if split_k > 1:
            tile = offs_m[None, :] * N + offs_n[:, None]
            mask = mask_n[:, None] & mask_m[None, :]
            tl.store(y_part_ptr + pid_k * BM * N + tile, acc, mask=mask)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + 2 + pid_n, 1, sem="acq_rel")
            last = arrived == split_k - 1
            if last:  # every split has stored its share: sum them in split order
                acc = tl.zeros((BN, BM), dtype=tl.float32)
                for split in range(split_k):
                    acc += tl.load(y_part_ptr + split * BM * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + 2 + pid_n, 0)
        if last and PEERS > 0:
            for p in tl.static_range(PEERS):
                rows = tl.load(peer_rows_ptr + p).to(tl.pointer_type(tl.float32))
                tl.store(rows + offs_m[None, :] * stride_ym + offs_n[:, None], acc,
                         mask=mask_n[:, None] & mask_m[None, :])
            _signal_peers(cnt_ptr + 1, num_tiles + HAS_EC, peer_signals_ptr, PEERS)
        elif last:
            if HAS_EC and PEERS == 0:
                if BM * R > 2048 or EC_ABLATE == 0 or EC_ABLATE == 6:  # until the last u-program has stored g
                    g = _read_g(g_rows, mask_m, epoch, EC_ABLATE == 0 or EC_ABLATE == 6)
                # g is in registers: add this tile's share to the reads (relaxed, nothing waits for it); the
                # first tile's share makes the launch's total READS_PER_LAUNCH
                tl.debug_barrier()
                if EC_ABLATE != 6:  # lab 6: no count, the epoch stays (later launches read a stale g)
                    tl.atomic_add(reads_ptr, tl.where(pid_n == 0, 1 - num_tiles + READS_PER_LAUNCH, 1).to(tl.int64),
                                  sem="relaxed")
            else:
                g = tl.zeros((BM, R), dtype=tl.float32)
                b = tl.zeros((BN, R), dtype=tl.float16)
            if RMS_IN:
                acc = acc * rstd[None, :]
            acc = _add_ec_and_bias(acc, g, b, offs_n, mask_n, bias_ptr, HAS_EC and EC_ABLATE != 4, HAS_BIAS)
            if SWIGLU:
                _store_swiglu(acc, offs_m, mask_m, pid_n, N, y_ptr, stride_ym, BN, BM)
            elif ADD_NORM:
                store_add_norm(acc, res, norm_w, offs_m, mask_m, offs_n, mask_n, pid_n, y_ptr, stride_ym, hw_ptr,
                               ssq_ptr, num_ssq)
            else:
                _store_tile(acc, offs_m, mask_m, offs_n, mask_n, y_ptr, stride_ym)


# --- prefill: rank-space kernel + tensor-core GEMM ---------------------------------------


@triton.jit
def _rank_u(x_ptr, a_ptr, offs_m, mask_m, offs_r, k_lo, k_hi, K, stride_xm, BM: tl.constexpr, R: tl.constexpr,
            BK: tl.constexpr):
    """u = A x [BM, R] in float32 for the rows offs_m over columns [k_lo, k_hi) of K."""
    u = tl.zeros((BM, R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        offs_k = k0 + tl.arange(0, BK)
        xk = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                     mask=mask_m[:, None] & (offs_k[None, :] < k_hi), other=0.0)
        u += tl.dot(xk, tl.trans(_a_tile(a_ptr, offs_r, k0, k_hi, K, BK)))
    return u


@triton.jit
def _store_g(u, w1_ptr, b1_ptr, w2_ptr, b2_ptr, g_ptr, offs_m, mask_m, offs_r, stride_gm, GATED: tl.constexpr,
             R: tl.constexpr, H: tl.constexpr):
    """g = gamma(u) ⊙ u stored in fp16 at the rows offs_m of g [M, R] (row stride stride_gm)."""
    g = _gate(u, w1_ptr, b1_ptr, w2_ptr, b2_ptr, GATED, R, H)
    tl.store(g_ptr + offs_m[:, None] * stride_gm + offs_r[None, :], g.to(tl.float16), mask=mask_m[:, None])


@triton.jit(do_not_specialize=["M"])  # M: as _w4_prefill_kernel's (k_per_split is always a multiple of 64)
def _ec_rank_kernel(x_ptr, a_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, g_ptr, u_part_ptr, M, K, stride_xm, stride_gm,
                    k_per_split, GATED: tl.constexpr, R: tl.constexpr, H: tl.constexpr, BM: tl.constexpr,
                    BK: tl.constexpr, SPLIT: tl.constexpr):
    """g [M, R] = gamma(A x) ⊙ A x in fp16, for BM rows over columns [k_per_split · s, k_per_split · (s + 1)) of K,
    s = program_id(1); SPLIT: store the float32 partial u in u_part [splits, M, R] instead (_ec_gate_kernel sums
    them and applies the gate)."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    offs_r = tl.arange(0, R)
    k_lo = tl.program_id(1) * k_per_split
    u = _rank_u(x_ptr, a_ptr, offs_m, mask_m, offs_r, k_lo, tl.minimum(k_lo + k_per_split, K), K, stride_xm, BM, R, BK)
    if SPLIT:
        tl.store(u_part_ptr + (tl.program_id(1) * M + offs_m[:, None]) * R + offs_r[None, :], u, mask=mask_m[:, None])
    else:
        _store_g(u, w1_ptr, b1_ptr, w2_ptr, b2_ptr, g_ptr, offs_m, mask_m, offs_r, stride_gm, GATED, R, H)


@triton.jit(do_not_specialize=["M", "splits"])
def _ec_gate_kernel(u_part_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, g_ptr, M, splits, stride_gm, GATED: tl.constexpr,
                    R: tl.constexpr, H: tl.constexpr, BM: tl.constexpr):
    """g = gamma(u) ⊙ u in fp16, u the sum of the splits' partials in split order (bit-reproducible)."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    offs_r = tl.arange(0, R)
    u = tl.zeros((BM, R), dtype=tl.float32)
    for s in range(splits):
        u += tl.load(u_part_ptr + (s * M + offs_m[:, None]) * R + offs_r[None, :], mask=mask_m[:, None], other=0.0)
    _store_g(u, w1_ptr, b1_ptr, w2_ptr, b2_ptr, g_ptr, offs_m, mask_m, offs_r, stride_gm, GATED, R, H)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, KW, G, group_size, stride_wn, BN: tl.constexpr):
    """W_hat[tile, block] in fp16, exactly as the record's dequantize: (q − z) · s, rounded once."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    kb = tl.program_id(1) * 128
    for h in tl.static_range(2):
        words = tl.load(qw_ptr + offs_n[:, None] * KW + (kb // 8 + 8 * h + tl.arange(0, 8))[None, :],
                        mask=mask_n[:, None], other=0)  # [BN, 8]: slices 4 h .. 4 h + 3
        words8 = words >> 8
        for jj in tl.static_range(4):
            first = kb + 16 * (4 * h + jj)  # a slice's 16 columns lie in one group (group sizes 32, 64, 128 n, K)
            offs_k = first + tl.arange(0, 16)
            mask = mask_n[:, None] & (offs_k[None, :] < K)
            g = first // group_size
            s = _group_column(s_ptr, offs_n, mask_n, g, G)[:, None]  # one scale and zero a row
            z = _group_column(z_ptr, offs_n, mask_n, g, G)[:, None]
            q = _slice_f16(words, words8, jj, 1024.0, 64.0, BN)  # q, exactly
            tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], (q - z) * s, mask=mask)


@triton.jit(do_not_specialize=["M"])  # M: as _w4_prefill_kernel's
def _ec_rank_programs_kernel(x_ptr, a_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, g_ptr, M, K, stride_xm, stride_gm,
                             GATED: tl.constexpr, R: tl.constexpr, H: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                             PDL: tl.constexpr):
    """g [M, R] = gamma(A x) ⊙ A x in fp16 from a few programs beside the prefill tile GEMM (w4_prefill_fused):
    program p takes row blocks p, p + P, ... (P programs), each over all of K. With PDL it waits for the launch
    before it (x's producer) and then at once lets the next launch, the GEMM, start on the other SMs."""
    pdl_enter(PDL)
    offs_r = tl.arange(0, R)
    for block in range(tl.program_id(0), tl.cdiv(M, BM), tl.num_programs(0)):
        offs_m = block * BM + tl.arange(0, BM)
        mask_m = offs_m < M
        u = _rank_u(x_ptr, a_ptr, offs_m, mask_m, offs_r, 0, K, K, stride_xm, BM, R, BK)
        _store_g(u, w1_ptr, b1_ptr, w2_ptr, b2_ptr, g_ptr, offs_m, mask_m, offs_r, stride_gm, GATED, R, H)


# M is not specialized: a prefill chunk's row count changes from step to step, and Triton would otherwise compile
# a variant of this kernel the first time M is a multiple of 16 (seconds in the middle of serving).
@triton.jit(do_not_specialize=["M"])
def _w4_prefill_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, g_ptr, b_ptr,
    M, N, K, KW, G, group_size, stride_xm, stride_ym,
    HAS_EC: tl.constexpr, HAS_BIAS: tl.constexpr, R: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, SPG: tl.constexpr, GROUP_M: tl.constexpr, PER_CHANNEL: tl.constexpr,
    WIDE: tl.constexpr = 0, DOT_ASM: tl.constexpr = False, SCALE_CODES: tl.constexpr = True, PDL: tl.constexpr = False,
):
    # PDL (with an EC, after _ec_rank_programs_kernel): the main loop runs beside the rank programs, which let this
    # launch start once each has waited for the launch before it (so x is written); g is read after the wait for
    # their launch to complete.
    # grouped tile order (Triton tutorial 03): neighbouring programs share weight tiles in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # yᵀ tile: the dequantized weight is the dot's first operand
    acc = _w4_dot_loop(x_ptr, stride_xm, offs_m, mask_m, qw_ptr, s_ptr, z_ptr, offs_n, mask_n, 0, KW * 8, K, KW, G,
                       group_size, SPG, BN, BM, PER_CHANNEL, WIDE, DOT_ASM, SCALE_CODES)
    g = tl.zeros((BM, R), dtype=tl.float32)
    if HAS_EC:
        pdl_enter(PDL)
        offs_r = tl.arange(0, R)
        g = tl.load(g_ptr + offs_m[:, None] * R + offs_r[None, :], mask=mask_m[:, None], other=0.0).to(tl.float32)
    b = _load_b_tile(b_ptr, offs_n, mask_n, HAS_EC, R)
    _add_ec_and_store(acc, g, b, offs_m, mask_m, offs_n, mask_n, y_ptr, stride_ym, bias_ptr, HAS_EC, HAS_BIAS)


# --- host side ------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 32  # untuned defaults: the H200's most frequent pick at M = 1 (BENCHMARKS.md §4)
    split_k: int = 0  # 0: pick so that the grid fills the GPU (`fill` programs an SM)
    num_warps: int = 8
    num_stages: int = 3
    gemv_rows: int = 4  # up to this many rows (≤ 4), the GEMV main loop instead of tensor-core dots
    block_kw: int = 128  # GEMV loop: code words per row per step (a multiple of 16: 128 columns each)
    gemv_f16x2: bool = False  # GEMV loop in fp16x2 arithmetic (_w4_gemv_f16x2), else float32 FMAs (_w4_gemv)
    fill: int = 2  # with split_k = 0, K is split until the grid has this many programs an SM (or one step each)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


# Dot-loop candidates whose K is split for more programs an SM (DecodeConfig.fill; lab: SPEAR_W4_DOT_FILLS="2 4 8"
# adds BN 64 / 128 at 4 and 8). Session 14 timed them beside the one-dot-a-block loop: within 1–4% of fill 2 where
# they won at all (`ec_ablation_h200_wide*_b807cd4`), so the tuner does not spend time on them by default.
DOT_FILLS = tuple(int(f) for f in os.environ.get("SPEAR_W4_DOT_FILLS", "2").split())

# Candidate configs for `tune_w4`; the untuned default is each dataclass's defaults.
# The H200's picks over the 7B/8B/13B/70B shapes (bench/results/kernels_h200*.json, sessions 3–4): every
# winner, and the configs that came second or third most often; the 13 former candidates dropped never won
# (each cost a compile and a timing at engine start-up: 227 s for a 7B engine on a fresh machine). Session 9
# dropped four more that no shape's W4 or W4+EC picked first in sessions 8–9 (ec_ablation per_config, the tuner
# caches): the 8-warp dot loop, and the 4-warp 128-word and 8-warp 4-stage GEMV configs.
DECODE_CANDIDATES = [  # the tensor-core dot loop (any M ≤ DECODE_KERNEL_MAX_M), then the GEMV loop (M ≤ 4)
    DecodeConfig(bn, 0, warps, stages, gemv_rows=0)
    for bn, warps, stages in ((32, 4, 3), (64, 4, 3), (64, 4, 4), (128, 4, 3))
] + [DecodeConfig(bn, 0, 4, 3, gemv_rows=0, fill=fill) for bn in (64, 128) for fill in DOT_FILLS if fill != 2
] + [DecodeConfig(bn, 0, warps, stages, gemv_rows=4, block_kw=bkw) for bn, warps, stages, bkw in
     ((16, 4, 3, 256), (32, 8, 1, 128))  # the float32 GEMV loop: 3 stages through shared memory, or none
] + [DecodeConfig(bn, 0, warps, stages, gemv_rows=4, block_kw=bkw, gemv_f16x2=True) for bn, warps, stages, bkw in
     ((16, 4, 2, 256), (32, 8, 1, 128), (32, 4, 1, 64), (32, 4, 2, 64), (32, 4, 4, 64))]  # the fp16x2 GEMV loop
# Session 10 kept every config that came within 3% of the best W4 or W4+EC time on some 7B / 70B shape at M = 1 or
# 16 (`ab_pairlayout_1a95746_gpu{0,1}.json`), the one the 13B qkvo tuning picked, and the BN 32 dot loop for
# narrow layers; dropped (never within 3%): the float32 twins of the fp16x2 configs, (32 rows, 8 warps, 3 stages),
# (16, 4, 2, 256) in float32 and the 4-stage BN 128 dot loop. Tuning a shape times 10 candidates instead of 16.
# Session 14 added the 4-stage BN 64 dot loop (3–6% faster than 3 stages on 7B gate/up and down at 16–32 rows, slower
# at 64: `ec_ablation_h200_extra_77e62e7.json`; the tuner decides per bucket); 8 warps and 5 stages never won.
# At one row the GEMV loop's candidates are timed with K split a fixed number of ways too, beside the automatic split
# (fill 2 programs an SM). Session 22 (S22A, `ec_ablation_h200_gemv_splits_82ce0f1.json`, one timing each): fixed
# splits beat it on 7B o (6.1 µs split once against 6.7) and down (10.7 split twice against 12.0), not on q|k|v or
# gate|up. SPEAR_W4_GEMV_SPLITS="" times the automatic split alone (the A/B's other arm).
GEMV_SPLITS = tuple(int(s) for s in os.environ.get("SPEAR_W4_GEMV_SPLITS", "1 2 4").split())
PREFILL_CANDIDATES = [
    PrefillConfig(128, 128, 8, 8, 3), PrefillConfig(128, 128, 8, 4, 4), PrefillConfig(64, 128, 8, 4, 4),
    PrefillConfig(128, 64, 8, 4, 4), PrefillConfig(64, 64, 8, 4, 4), PrefillConfig(128, 256, 8, 8, 3),
]
_TUNED: dict[tuple, DecodeConfig | PrefillConfig] = {}
# The rank programs beside the prefill tile GEMM (w4_prefill_fused). Session 17 (bench/prefill_lab.py --rank-programs,
# S17C): one program streams x at 43–57 GB/s, and the GEMM's tiles wait at the end of their first wave for the whole
# of g, so a program takes at most two row blocks: 4 programs at 1024 rows (W4+EC / W4 1.00–1.04 on the 7B shapes),
# 8 at 2048 (0.97–1.05; with 4 programs of 4 blocks, 1.06–1.22).
PREFILL_RANK_BK = 128  # columns of x and A a step: three steps of 128 rows in flight, 120 KB (offline: 90 registers)
PREFILL_RANK_WARPS = 8
PREFILL_RANK_STAGES = 3
PREFILL_RANK_PROGRAMS = 8  # the most programs
PREFILL_RANK_BLOCKS = 2  # the most row blocks a program takes
RANK_PROGRAMS_ON = os.environ.get("SPEAR_PREFILL_RANK_PROGRAMS", "1") == "1"  # lab switch: 0 always launches ec_rank
AX_BLOCK = 128  # columns of A per step of the decode kernel's u-programs (ax_block)
# Lab switch for bench/ec_ablation.py (timing only: results are wrong for 1, 3, 4 and 6): 1 tiles do not wait for
# g, 3 no u-programs (tiles do not wait), 4 no u-programs and no EC epilogue, 6 no reads count (the epoch never
# advances: after the first launch tiles neither wait nor read their launch's g). Measured in sessions 6-9
# (NOTES-kernels.md): 4 alone keeps most of W4+EC's cost at M = 1; 6 was 1-4 µs faster than the former
# per-tile count of readers that emptied g (session 9), hence the epoch tags.
EC_ABLATE = 0
TUNE_BYTES = 128 << 20  # weight bytes per timed graph when tuning: more than the H200's 50 MB L2


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
    """W4 alone, or with an EC of this padded rank (tuned apart at M = 1: for W4+EC, W4's pick was 1.05-1.23x
    slower than W4+EC's own on 4 of 5 Llama shapes, BENCHMARKS §4 session 6)."""
    return (w.out_features, w.in_features, w.group_size, _m_bucket(m), 0 if ec is None else ec.padded_rank)


def decode_config(w: PackedW4, m: int, ec: PackedEC | None = None) -> DecodeConfig:
    """The decode launch's config: W4+EC's own pick where tune_w4 timed it with an EC of this rank, else W4's,
    else the untuned default."""
    return _TUNED.get(_tune_key(w, m, ec)) or _TUNED.get(_tune_key(w, m), DecodeConfig())


def ax_block(gemv_rows: int, block_kw: int) -> int:
    """Columns of A a u-program step takes: AX_BLOCK, or half of it where the GEMV loop takes as many code words a
    step. With the two ranges of one length, the compiler lays the GEMV loop's x out as the u-programs' dot wants
    it, in every program (sm_90 SASS, triton 3.6, W4 and W4+EC alike, `python -m spear.kernels.offline`): 8 warps
    and 128 words went from 117 to 74 registers and from 585 to 516 instructions a step with half the columns;
    64-word configs were as much worse with 64 columns of A as they are better with 128 (session 8)."""
    return AX_BLOCK // 2 if gemv_rows and block_kw == AX_BLOCK else AX_BLOCK


def u_chunk(bm: int, rank: int) -> int:
    """Partial u tiles [bm, rank] the last u-program sums per load: 4,096 floats at a time."""
    return max(1, 4096 // (bm * rank))


def _gemv_rows(m: int, limit: int) -> int:
    """The GEMV loop's row count for m rows (a power of two ≥ m), or 0 when m is above the config's limit."""
    return 0 if m > min(limit, 4) else 1 << (m - 1).bit_length()


def _slices_per_group(group_size: int) -> int:
    """16-column slices per group span inside a 128-column block (pack_w4 admits g = 32, 64, 128·n, K)."""
    return min(8, group_size // 16)


class _Workspace:
    """Per-device scratch for the decode kernel: float32 partial sums of y and u, g's int64 cells, the int32
    counters and the int64 reads count. The counters are zero between launches (each launch restores them), the
    reads count a multiple of 2^READS_SHIFT, and g's cells start tagged with an epoch no launch reaches (2^48 − 1);
    the partial sums need no reset (a launch reads only what it wrote).

    Launches on one stream run in order, so one workspace serves every layer. It only grows;
    buffers it outgrows stay alive because a captured CUDA graph may still point at them.
    """

    def __init__(self) -> None:
        self.buffers: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        self.retired: list[torch.Tensor] = []

    def get(self, device: torch.device, y_elems: int, u_elems: int, g_elems: int, tiles: int) -> tuple[torch.Tensor, ...]:
        """(y_part, u_part, g, counters, reads) with at least these many elements (counters: 2 + tiles)."""
        want = (y_elems, max(u_elems, 1), max(g_elems, 1), 2 + tiles, 1)
        have = self.buffers.get(device)
        if have is None or any(t.numel() < n for t, n in zip(have, want, strict=True)):
            if have is not None:
                want = tuple(max(t.numel(), n) for t, n in zip(have, want, strict=True))
                self.retired.extend(have)
            have = (torch.empty(want[0], dtype=torch.float32, device=device),
                    torch.empty(want[1], dtype=torch.float32, device=device),
                    torch.full((want[2],), -1 << 16, dtype=torch.int64, device=device),
                    torch.zeros(want[3], dtype=torch.int32, device=device),
                    torch.zeros(1, dtype=torch.int64, device=device))
            self.buffers[device] = have
        return have


_WORKSPACE = _Workspace()


def split_count(cfg: DecodeConfig, tiles: int, steps: int, sms: int) -> int:
    """How many ways a decode launch splits K (before whole steps round it): cfg.split_k, or with 0 enough for
    cfg.fill programs an SM, at most one a main-loop step."""
    return cfg.split_k or max(1, min(triton.cdiv(cfg.fill * sms, tiles), steps))


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere, so that CPU tests see split grids)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.cache
def ec_ax_columns() -> int:
    """Columns of A per u-program of a W4+EC launch (at most; more where a quarter of the SMs would not do): 256,
    two steps of 128 (session 12; 512 before), so that the chain A x → g, which every tile waits for at its end, is
    short where the tiles' own loops are (7B q/k/v/o: ~6 µs). SPEAR_EC_AX_COLUMNS sets it, to time the difference
    (read once a process, as are the other switches: w4_decode runs on every eager step)."""
    columns = os.environ.get("SPEAR_EC_AX_COLUMNS", "256")
    if not columns.isdigit() or int(columns) < 64:
        raise ValueError(f"SPEAR_EC_AX_COLUMNS is the columns of A a u-program takes, at least 64; got {columns!r}")
    return int(columns)


@functools.cache
def f16x2_word_chain() -> int:
    """Words per fp16 chain of the fp16x2 GEMV loop at one row, per-channel (_w4_gemv_f16x2_words; 1: a chain per
    word, _w4_gemv_f16x2). SPEAR_W4_WORD_CHAIN (1, 2 or 4) sets it, to time the difference."""
    chain = os.environ.get("SPEAR_W4_WORD_CHAIN", "2")
    if chain not in ("1", "2", "4"):
        raise ValueError(f"SPEAR_W4_WORD_CHAIN is the words per fp16 chain, 1, 2 or 4; got {chain!r}")
    return int(chain)


@functools.cache
def unmasked_loads() -> bool:
    """Whether the GEMV loops may load whole code tiles unmasked where the shape allows (w4_decode's `even`);
    SPEAR_W4_EVEN=0: masked anyway, to time the difference."""
    return os.environ.get("SPEAR_W4_EVEN", "1") != "0"


def _flatten(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@dataclass(frozen=True)
class PeerRows:
    """Where w4_decode_to_peers writes, for each rank p of the tensor-parallel group: rows[p] (int64) the address of
    this rank's float32 [y | u] row block in p's buffer, `width` floats a row; signals[p] (int64) the address of
    this rank's int32 signal at p."""

    rows: torch.Tensor
    signals: torch.Tensor
    width: int


def w4_decode_to_peers(x: torch.Tensor, w: PackedW4, ec: PackedEC | None, peers: PeerRows,
                       cfg: DecodeConfig | None = None) -> None:
    """A row-parallel layer's partials in the W4 decode launch: y_r = x Ŵ_rᵀ and, with an EC, the ungated u_r = x A_rᵀ
    (float32) into this rank's row block of every rank's buffer, from the tiles' and the u-sum's epilogues; the
    last of them to finish adds 1 to this rank's signal at every rank. The EC's B and gate act after the sum
    over the ranks (kernels.ec_epilogue.peer_epilogue)."""
    w4_decode(x, w, ec, cfg=cfg, peers=peers)


def w4_decode_add_norm(x: torch.Tensor, w: PackedW4, ec: PackedEC | None, bias: torch.Tensor | None,
                       residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       cfg: DecodeConfig | None = None) -> FoldedNorm:
    """y = x Ŵᵀ + bias + EC(x) (w4_decode), then the next add + RMSNorm's share in the same launch's epilogue:
    the FoldedNorm of h = y + residual [M, N] with norm_weight [N]."""
    m, n = x.shape[0], w.out_features
    if residual.shape != (m, n) or norm_weight.shape != (n,):
        raise ValueError(f"residual {tuple(residual.shape)} and norm weight {tuple(norm_weight.shape)} do not fit "
                         f"the layer's output [{m}, {n}]")
    h = torch.empty(m, n, dtype=torch.float16, device=x.device)
    hw = torch.empty_like(h)
    cfg = cfg or decode_config(w, m, ec)
    ssq = torch.empty(m, triton.cdiv(n, cfg.block_n), dtype=torch.float32, device=x.device)
    w4_decode(x, w, ec, bias, cfg, out=h, add_norm=(residual.contiguous(), norm_weight.contiguous(), hw, ssq))
    return FoldedNorm(h, hw, ssq, eps)


def w4_decode(x: torch.Tensor, w: PackedW4, ec: PackedEC | None = None, bias: torch.Tensor | None = None,
              cfg: DecodeConfig | None = None, out: torch.Tensor | None = None,
              peers: PeerRows | None = None, swiglu: bool = False, rms: FoldedNorm | None = None,
              add_norm: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """y [M, N] for x [M, K] with M ≤ DECODE_KERNEL_MAX_M, in one launch (see the module docstring); into `out`
    if given. With `peers`, see w4_decode_to_peers (and the result is x, untouched). With `swiglu`, w stacks
    [gate; up] (N / 2 rows each) and the result is silu(gate) ⊙ up [M, N / 2], from the tiles' epilogue (each tile
    computes rows of gate and the same rows of up). With `rms`, x is rms.hw and y = norm(rms.h) Ŵᵀ + ...
    (FoldedNorm); `add_norm` (residual, w_norm, hw, ssq) is w4_decode_add_norm's."""
    m, k = x.shape
    n = w.out_features
    if m > DECODE_KERNEL_MAX_M:
        raise ValueError(f"the decode kernel takes at most {DECODE_KERNEL_MAX_M} rows, got {m}")
    if swiglu and (n % 2 or peers is not None):
        raise ValueError(f"swiglu needs [gate; up] stacked in equal halves and no peers (out_features {n})")
    if (rms is not None or add_norm is not None) and peers is not None:
        raise ValueError("a folded RMSNorm (rms, add_norm) does not combine with peers")
    if add_norm is not None and (swiglu or (out is not None and out.stride(0) != n)):
        raise ValueError("add_norm stores h [M, N] densely: no swiglu, no strided out")
    bm = _row_tile(m)
    cfg = cfg or decode_config(w, m, ec)
    kw = w.qweight.shape[1]
    blocks = kw // 16
    tiles = triton.cdiv(n, cfg.block_n)
    sms = num_sms(x.device)
    gemv_rows = _gemv_rows(m, cfg.gemv_rows)
    if gemv_rows and (x.stride(0) % 2 or x.data_ptr() % 4):  # the GEMV loops read x as int32 pairs (_x_pairs)
        x = x.clone(memory_format=torch.contiguous_format)
    step = cfg.block_kw * 8 if gemv_rows else 128  # columns per main-loop step; a split holds whole steps
    steps = triton.cdiv(blocks * 128, step)
    k_per_split = triton.cdiv(steps, split_count(cfg, tiles, steps, sms)) * step
    split_k = triton.cdiv(blocks * 128, k_per_split)
    even = (bool(gemv_rows) and n % cfg.block_n == 0 and k % step == 0 and kw * 8 == k  # unmasked code loads
            and unmasked_loads())
    R = ec.padded_rank if ec is not None else 16
    H = ec.W1.shape[0] if ec is not None else 16
    bk = ax_block(gemv_rows, cfg.block_kw)
    num_ax, ax_k = 0, bk
    if ec is not None:
        num_ax = max(1, min(triton.cdiv(k, ec_ax_columns()), triton.cdiv(sms, 4)))  # ≤ ec_ax_columns() of A each
        ax_k = triton.cdiv(triton.cdiv(k, num_ax), bk) * bk
        num_ax = triton.cdiv(k, ax_k) if EC_ABLATE not in (3, 4) else 0  # 3, 4: no u-programs
    assert tiles < READS_PER_LAUNCH.value, "the reads count's per-launch total must exceed the tiles"
    y_part, u_part, g_cells, counters, reads = _WORKSPACE.get(x.device, split_k * bm * n, num_ax * bm * R, bm * R, tiles)
    if peers is not None:  # no output tensor: y is a dummy pointer and the rows' stride is the buffer's
        y, stride_y = x, peers.width
    else:
        width = n // 2 if swiglu else n
        y = out if out is not None else torch.empty(m, width, dtype=x.dtype, device=x.device)
        stride_y = y.stride(0)

    num_ssq = tiles if add_norm is not None else rms.ssq.shape[1] if rms is not None else 0
    if rms is not None and rms.ssq.shape[0] != m:
        raise ValueError(f"rms holds {rms.ssq.shape[0]} rows, x {m}")
    pdl = w4_launch()
    _w4_decode_kernel[(num_ax + tiles * split_k,)](
        x, w.qweight, w.scales, w.zeros, bias if bias is not None else y, y,
        *((ec.A, ec.B, ec.W1, ec.b1, ec.W2, ec.b2) if ec is not None else (x,) * 6),  # fp16 dummies: y may be fp32
        y_part, u_part, g_cells, counters, reads,
        *((peers.rows, peers.signals) if peers is not None else (counters,) * 2),
        *(add_norm if add_norm is not None else (y, y, y, rms.ssq if rms is not None else reads)),
        m, n, k, kw, w.scales.shape[1], w.group_size, x.stride(0), stride_y,
        split_k, k_per_split, num_ax, ax_k, tiles, num_ssq, rms.eps if rms is not None else 0.0,
        HAS_EC=ec is not None, GATED=bool(ec is not None and ec.gated), HAS_BIAS=bias is not None, R=R, H=H,
        BM=bm, BN=cfg.block_n, BK=bk, SPG=_slices_per_group(w.group_size),
        GEMV_ROWS=gemv_rows, GEMV_STAGES=cfg.num_stages, GEMV_F16X2=cfg.gemv_f16x2,
        F16X2_ASM=runs_compiled(x), BKW=cfg.block_kw, PER_CHANNEL=w.scales.shape[1] == 1,
        PEERS=0 if peers is None else peers.rows.numel(), U_CHUNK=u_chunk(bm, R),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        EC_ABLATE=EC_ABLATE, SWIGLU=swiglu, PDL_LATE=pdl.late_gemv if gemv_rows else pdl.late,
        PRELOAD=pdl.preload, WORD_CHAIN=f16x2_word_chain(), EVEN=even, ADD_NORM=add_norm is not None,
        RMS_IN=rms is not None, SSQ_BLOCK=triton.next_power_of_2(max(num_ssq, 1)), WIDE=DOT_WIDE,
        DOT_ASM=DOT_ASM and runs_compiled(x), **launch_options(x),
    )
    return y


def ec_rank(x: torch.Tensor, ec: PackedEC, block_m: int = 64, block_k: int = 64, out: torch.Tensor | None = None,
            splits: int | None = None, num_warps: int = 4, num_stages: int = 4, fill: int = 1) -> torch.Tensor:
    """g = gamma(A x) ⊙ A x  [M, R] fp16; into `out` (any row stride) if given.

    K is split (`splits`, default rank_splits) where the row blocks alone would leave most SMs idle: at 1024 rows,
    32 programs each streamed a whole 32-row slice of x, which cost W4+EC 20–70 µs over W4 on the 7B shapes (session
    16). Split, the partial u go to a float32 scratch and a second launch sums them in order and applies the gate.
    `fill`: programs an SM that the default split aims at. The defaults were the most even of 14 tilings on the H200
    (bench/prefill_lab.py --ec-rank 32, session 17): 7.9–17.0 µs on the 7B shapes at 1024–2048 rows where
    (32, 64, 3 stages, 2 an SM) took 7.8–22.6."""
    m, k = x.shape
    g = out if out is not None else torch.empty(m, ec.padded_rank, dtype=torch.float16, device=x.device)
    row_blocks = triton.cdiv(m, block_m)
    splits = splits or rank_splits(row_blocks, k, block_k, num_sms(x.device), fill)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    u_part = torch.empty(splits, m, ec.padded_rank, dtype=torch.float32, device=x.device) if splits > 1 else g
    common = dict(GATED=ec.gated, R=ec.padded_rank, H=ec.W1.shape[0], BM=block_m, num_warps=num_warps)
    _ec_rank_kernel[(row_blocks, splits)](
        x, ec.A, ec.W1, ec.b1, ec.W2, ec.b2, g, u_part, m, k, x.stride(0), g.stride(0), k_per_split,
        BK=block_k, SPLIT=splits > 1, num_stages=num_stages, **common)
    if splits > 1:
        _ec_gate_kernel[(row_blocks,)](u_part, ec.W1, ec.b1, ec.W2, ec.b2, g, m, splits, g.stride(0), **common)
    return g


def rank_splits(row_blocks: int, k: int, block_k: int, sms: int, fill: int = 2) -> int:
    """Ways to split K in ec_rank: enough programs for `fill` an SM, each split at least two block_k steps."""
    return max(1, min(triton.cdiv(fill * sms, row_blocks), triton.cdiv(k, 2 * block_k)))


def w4_prefill_fused(x: torch.Tensor, w: PackedW4, ec: PackedEC | None = None, bias: torch.Tensor | None = None,
                     cfg: PrefillConfig | None = None, g: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, rank_programs: int | None = None) -> torch.Tensor:
    """y [M, N] for any M from one Triton tensor-core GEMM that dequantizes in its main loop, with (alpha·B) g added
    in its epilogue. g may be passed in. Else, where the tiles leave SMs idle in their last wave, `rank_programs`
    programs (None: `prefill_rank_programs`'s count; only under PDL) compute it on those SMs while the tiles run their
    main loops (_ec_rank_programs_kernel, then this launch as its programmatic dependent); with none, `ec_rank`'s
    launch computes it before the GEMM.

    Untuned, the config is prefill_config's.
    """
    m, k = x.shape
    n = w.out_features
    cfg = cfg or _TUNED.get(_tune_key(w, m)) or prefill_config(m, w.scales.shape[1] == 1)
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    row_blocks = triton.cdiv(m, cfg.block_m)
    tiles = row_blocks * triton.cdiv(n, cfg.block_n)
    beside = {"PDL": False}  # the GEMM's launch options: PDL after the rank programs
    if ec is not None and g is None:
        if rank_programs is None:
            rank_programs = prefill_rank_programs(row_blocks, tiles, cfg, num_sms(x.device)) if uses_pdl(x) else 0
        if rank_programs:
            g = torch.empty(m, ec.padded_rank, dtype=torch.float16, device=x.device)
            beside = launch_options(x)
            _ec_rank_programs_kernel[(rank_programs,)](
                x, ec.A, ec.W1, ec.b1, ec.W2, ec.b2, g, m, k, x.stride(0), g.stride(0), GATED=ec.gated,
                R=ec.padded_rank, H=ec.W1.shape[0], BM=cfg.block_m, BK=PREFILL_RANK_BK, num_warps=PREFILL_RANK_WARPS,
                num_stages=PREFILL_RANK_STAGES, **beside)
        else:
            g = ec_rank(x, ec)
    _w4_prefill_kernel[(tiles,)](
        x, w.qweight, w.scales, w.zeros, bias if bias is not None else y, y,
        g if g is not None else y, ec.B if ec is not None else y,
        m, n, k, w.qweight.shape[1], w.scales.shape[1], w.group_size, x.stride(0), y.stride(0),
        HAS_EC=ec is not None, HAS_BIAS=bias is not None, R=ec.padded_rank if ec is not None else 16,
        BM=cfg.block_m, BN=cfg.block_n, SPG=_slices_per_group(w.group_size), GROUP_M=cfg.group_m,
        PER_CHANNEL=w.scales.shape[1] == 1, WIDE=DOT_WIDE, DOT_ASM=DOT_ASM and runs_compiled(x),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **beside,
    )
    return y


def prefill_rank_programs(row_blocks: int, tiles: int, cfg: PrefillConfig, sms: int) -> int:
    """Programs of _ec_rank_programs_kernel beside the tile GEMM (0: ec_rank's launch before it): the fewest that take
    at most PREFILL_RANK_BLOCKS row blocks each, where that is at most PREFILL_RANK_PROGRAMS and fits the SMs that
    the tiles leave idle in their last wave; only with the 128 × 256 tile (one CTA an SM: its slots are the SMs).
    Session 16 gave the GEMM's own launch a rank program for every SM (5532723): they took the whole GPU before the
    tiles, level with ec_rank's launch; session 17's programs inside the GEMM's launch cost its main loop 309 → 323
    instructions (offline SASS), hence a launch of their own."""
    if cfg.block_n != 256 or not RANK_PROGRAMS_ON:
        return 0
    programs = triton.cdiv(row_blocks, PREFILL_RANK_BLOCKS)
    return programs if programs <= min(-tiles % sms, PREFILL_RANK_PROGRAMS) else 0


def prefill_config(m: int, per_channel: bool) -> PrefillConfig:
    """The tile GEMM's untuned config for m rows: 128 × 128 tiles; 128 × 256 from 1024 rows with per-channel scales.
    Session 15 (bench/prefill_lab.py): per-channel, this was within 17% of each row's best of PREFILL_CANDIDATES on the
    7B shapes at 256–2048 rows, and faster than dequantize + cuBLAS at every one; with groups of 128 the wide tile's
    per-group scale FMAs on a 128 × 256 float32 tile made it 1.8–2.4× slower than 128 × 128 at 1024 rows."""
    return PrefillConfig(block_n=256) if m >= 1024 and per_channel else PrefillConfig()


class _Scratch:
    """Per-device fp16 scratch for the prefill path's dequantized weight; grows, never shrinks.
    Layers run one after another on a stream, so one buffer serves them all."""

    def __init__(self) -> None:
        self.buffers: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, rows: int, cols: int) -> torch.Tensor:
        buf = self.buffers.get(device)
        if buf is None or buf.numel() < rows * cols:
            buf = self.buffers[device] = torch.empty(rows * cols, dtype=torch.float16, device=device)
        return buf[: rows * cols].view(rows, cols)


_SCRATCH = _Scratch()


def dequantize_w4_into(w: PackedW4, out: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    """Write W_hat [N, K] (fp16, bit-exact with the record's dequantize) into `out` (any row stride)."""
    n, kw = w.qweight.shape
    _dequant_kernel[(triton.cdiv(n, block_n), kw // 16)](
        w.qweight, w.scales, w.zeros, out, n, w.in_features, kw, w.scales.shape[1], w.group_size, out.stride(0),
        BN=block_n, num_warps=4,
    )
    return out


def w4_prefill(x: torch.Tensor, w: PackedW4, ec: PackedEC | None = None, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] for many rows: dequantize W once into scratch, then one cuBLAS GEMM.

    With an EC (semi-fused): on CUDA the rank-space kernel computes g = gamma(A x) ⊙ A x on a side stream while the
    main stream dequantizes; then y = g (alpha·B)ᵀ (+ bias), and the GEMM adds x W_hatᵀ to it (beta = 1: cuBLAS reads
    the EC term in its epilogue, where the GEMM's compute hides it, instead of a pass of its own over y afterwards).
    Measured on the H200 this order of ops beat running the EC as R extra GEMM columns ([x | g]·[W_hat | alpha·B]ᵀ,
    which must copy x) in 5 of 6 shapes at M ≥ 1024 (BENCHMARKS.md §4, with y += g (alpha·B)ᵀ after the GEMM then).
    A narrow weight (4 N ≤ K: 8B/70B k/v) runs the GEMM first, beside the rank kernel, then y += g (alpha·B)ᵀ: the
    pass over y (4 M N bytes) costs less than the wait for g, whose kernel reads 2 M K (session 17: the EC cost
    1.35–1.43× there with g first).
    """
    n, k = w.out_features, w.in_features
    side = _side_stream(x.device) if ec is not None and x.is_cuda else None
    if side is not None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            g = ec_rank(x, ec)
        g.record_stream(main)
    w_hat = dequantize_w4_into(w, _SCRATCH.get(x.device, n, k))
    if ec is None:
        return _mm_bias(x, w_hat.t(), bias, out)
    if side is not None and 4 * n <= k:  # a narrow weight: the GEMM first, beside the rank kernel, then y += g Bᵀ
        y = _mm_bias(x, w_hat.t(), bias, out)
        main.wait_stream(side)
        return y.addmm_(g, ec.B.t())
    if side is not None:
        main.wait_stream(side)
    else:
        g = ec_rank(x, ec)
    return _mm_bias(g, ec.B.t(), bias, out).addmm_(x, w_hat.t())


def _mm_bias(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """a @ b (+ bias), into `out` if given: one cuBLAS call."""
    return torch.mm(a, b, out=out) if bias is None else torch.addmm(bias, a, b, out=out)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def takes_tile_gemm(m: int, n: int, per_channel: bool, sms: int) -> bool:
    """Whether w4_linear runs m prefill rows of an n-row weight through the tile GEMM rather than dequantize + cuBLAS:
    up to FUSED_PREFILL_MAX_M rows (FUSED_PREFILL_MAX_M_GROUPED with groups), and only where its untuned tiles fill
    at least half the SMs (one tile an SM: on 70b k/v, N = 1024 at 1024 rows, 32 tiles took 103.7 µs where dequantize
    + cuBLAS took 34.6, session 16). The 128 × 256 tile (one CTA an SM) also needs its waves full to TILE_WAVE_FILL:
    on 13B q/k/v/o and down (N = 5120) 1024 rows make 160 tiles, 1.2 waves of 132, and took 135 / 348 µs against
    dequantize + cuBLAS's 93 / 243 (session 17, BENCHMARKS §4). W4 alone, every shape timed with its waves under 0.84
    full was faster through cuBLAS (13b gate/up at 1024 rows, 0.82 full: 4%); with an EC the tile GEMM's rank
    programs make up for that much (13b gate/up 6% ahead), not for 13b q/k/v/o or down."""
    cfg = prefill_config(m, per_channel)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if m > (FUSED_PREFILL_MAX_M if per_channel else FUSED_PREFILL_MAX_M_GROUPED) or 2 * tiles < sms:
        return False
    return cfg.block_n != 256 or tiles / (triton.cdiv(tiles, sms) * sms) >= TILE_WAVE_FILL


def w4_linear(x: torch.Tensor, w: PackedW4, ec: PackedEC | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Phase-adaptive dispatch by rows: the decode kernel up to DECODE_PATH_MAX_M rows, then the prefill tile GEMM
    (takes_tile_gemm), else dequantize + cuBLAS."""
    x2 = _flatten(x)
    if x2.dtype != torch.float16:
        raise ValueError(f"the W4A16 kernels take fp16 activations, got {x2.dtype}")
    if x2.shape[0] <= DECODE_PATH_MAX_M:
        y = w4_decode(x2, w, ec, bias)
    elif takes_tile_gemm(x2.shape[0], w.out_features, w.scales.shape[1] == 1, num_sms(x2.device)):
        y = w4_prefill_fused(x2, w, ec, bias)
    else:
        y = w4_prefill(x2, w, ec, bias)
    return y.view(*x.shape[:-1], w.out_features)


def _tune_candidates(m: int) -> list[DecodeConfig] | list[PrefillConfig]:
    """The configs tune_w4 times at m rows: the decode kernel's (the GEMV loop only where m ≤ 4; at one row each GEMV
    config also with K split GEMV_SPLITS ways), else prefill's."""
    if m > DECODE_KERNEL_MAX_M:
        return PREFILL_CANDIDATES
    candidates = [c for c in DECODE_CANDIDATES if m <= 4 or c.gemv_rows == 0]
    if m == 1:
        candidates += [dataclasses.replace(c, split_k=s) for c in candidates if c.gemv_rows for s in GEMV_SPLITS]
    return candidates


def tune_w4(w: PackedW4, ms: tuple[int, ...] = (1, 4, 16, 32, 64, 128), timings: dict | None = None,
            ec: PackedEC | None = None) -> dict[int, DecodeConfig | PrefillConfig]:
    """Time the candidate configs of the Triton GEMMs for this weight shape at each M (CUDA only, outside
    graph capture; about 10 ms a candidate): the decode kernel up to DECODE_KERNEL_MAX_M rows (its GEMV loop
    only where M ≤ 4), the fused prefill kernel above. Later calls with the same shape and M bucket use the
    fastest. Returns the choice per M. With `timings`, every bucket is timed again and every candidate's
    median µs goes into `timings[m]`; without, buckets tuned before keep their choice (an engine rebuilt in
    the same process does not tune twice). With `ec`, the decode launch with that EC (rows ≤
    DECODE_KERNEL_MAX_M only); launches with an EC of a rank not tuned use W4's choice. Choices persist in a
    JSON file, per GPU, Triton and torch version and kernel source (kernels.tune_cache; $SPEAR_TUNE_CACHE names
    another file, or 0 for none): without `timings`, a bucket found there is not timed again."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from spear.kernels.timing import time_in_graph

    # Timed in a CUDA graph over enough weight copies to overflow the L2 cache: HBM reads, no launch overhead.
    if ec is not None:
        ms = tuple(m for m in ms if m <= DECODE_KERNEL_MAX_M)
    cache = tune_cache.path()
    if timings is None and cache is not None and any(_tune_key(w, m, ec) not in _TUNED for m in ms):
        entries = tune_cache.read(cache)  # another process's choices, for the buckets not tuned in this one
        for m in ms:
            cfg = tune_cache.config(entries.get(tune_cache.key(w.qweight.device, _tune_key(w, m, ec))),
                                    (DecodeConfig, PrefillConfig), _tune_candidates(m))
            if cfg is not None:
                _TUNED.setdefault(_tune_key(w, m, ec), cfg)
    chosen = {m: _TUNED[_tune_key(w, m, ec)] for m in ms if timings is None and _tune_key(w, m, ec) in _TUNED}
    if len(chosen) == len(ms):
        return chosen
    to_time = [m for m in ms if m not in chosen]
    fastest = {}  # m → the fastest candidates' (µs, config), kept in the cache beside the choice
    copies = [w] + [w.clone() for _ in range(max(1, triton.cdiv(TUNE_BYTES, w.nbytes())) - 1)]
    for m in to_time:
        x = torch.randn(m, w.in_features, dtype=torch.float16, device=w.qweight.device)
        run = w4_decode if m <= DECODE_KERNEL_MAX_M else w4_prefill_fused
        measured = []
        for cfg in _tune_candidates(m):
            try:
                calls = [functools.partial(run, x, copy, ec, cfg=cfg) for copy in copies]
                measured.append((time_in_graph(calls, reps=5), cfg))
            except (OutOfResources, CompilationError):  # e.g. out of shared memory: not a candidate
                pass
        ranked = [(round(us, 2), cfg) for us, cfg in sorted(measured, key=lambda t: t[0])]
        chosen[m] = _TUNED[_tune_key(w, m, ec)] = ranked[0][1]
        fastest[m] = ranked[:3]
        if timings is not None:
            timings[m] = ranked
    if cache is not None:
        keys = {m: tune_cache.key(w.qweight.device, _tune_key(w, m, ec)) for m in to_time}
        tune_cache.write(cache, {keys[m]: chosen[m] for m in to_time}, {keys[m]: fastest[m] for m in to_time})
    return chosen
