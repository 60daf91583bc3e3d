"""The W4 decode kernel: M ≤ DECODE_KERNEL_MAX_M = 128 rows in one launch, split-K, the EC fused.

All rows sit in one [BN, BM] tile column (BM is the power of two ≥ max(16, M)). The grid is 1-D: its first num_ax
programs compute partial u = A x over slices of K and store them in a float32 workspace; the remaining programs
stream the int4 weight (split-K when N alone gives too few programs), with one of two main loops: for up to 4 rows
a GEMV loop (gemv.py), else tensor-core dots (dot.py). The last program to finish an output tile (a per-tile
arrival counter) sums the splits' partials in split order, and adds (alpha·B)_tile g in registers to it,
g = gamma(u) ⊙ u, then writes the output once. The last u-program to arrive sums the partial u in program order,
applies the gate once and stores g in cells tagged with the launch's epoch: the flag is in the data (NCCL's LL
protocol), so a tile reads g with one load and no flag to acquire first. Each tile issues that read and its B
tile's before its main loop, so that only the first wave of tiles can find g not yet written (and re-reads it).
The epoch comes from a count of g's reads that each tile advances when done, without waiting for the atomic's
result; nothing is emptied or reset between launches. No float atomics: the result is bit-reproducible. The
u-programs have the lowest ids, so they are dispatched first and the wait cannot deadlock. Each launch leaves its
counters zeroed for the next one. (The u-programs in a launch of their own, the tiles loading g without waiting,
measured slower at every shape and row count on the H200: bench/NOTES-kernels.md.) The epilogue may also do the
layer's next op (w4_decode's `swiglu`: silu(gate) ⊙ up of stacked [gate; up]; `add_norm` / `rms`: an RMSNorm
folded across two launches, kernels.norm_fold). An EC with int8 factors (kernels.pack) is read as int8: the
u-programs dequantize each A tile at its dot, the tiles hold B's codes through the main loop and dequantize them in
the epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spear.kernels import options
from spear.kernels.norm_fold import FoldedNorm
from spear.kernels.pack import PackedEC, PackedW4
from spear.kernels.pdl import W4Launch, launch_options, pdl_enter, pdl_release, runs_compiled, w4_launch
from spear.kernels.w4.config import (
    DECODE_KERNEL_MAX_M,
    DecodeConfig,
    _row_tile,
    _slices_per_group,
    decode_config,
    num_sms,
)
from spear.kernels.w4.dot import _w4_dot_loop
from spear.kernels.w4.epilogue import (
    READS_PER_LAUNCH,
    READS_SHIFT,
    _a_tile,
    _add_ec_and_bias,
    _f16_factor,
    _g_cells,
    _gate,
    _load_b_tile,
    _rank_scales,
    _read_g,
    _row_rstd,
    _signal_peers,
    _store_swiglu,
    _store_tile,
    _tile_rows,
    store_add_norm,
)
from spear.kernels.w4.gemv import _code_tile, _gemv_tile, _w4_gemv, _w4_gemv_f16x2, _w4_gemv_f16x2_words


@triton.jit
def _u_program(pid, x_ptr, a_ptr, a_scale_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, u_part_ptr, g_rows, cnt_ptr,
               reads_ptr, peer_rows_ptr, peer_signals_ptr, ssq_ptr, offs_m, mask_m, offs_r, N, K, stride_xm, stride_ym,
               num_ax, ax_k_per_prog, num_tiles, num_ssq, eps,
               GATED: tl.constexpr, R: tl.constexpr, H: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
               PEERS: tl.constexpr, U_CHUNK: tl.constexpr, PDL: tl.constexpr, PDL_LATE: tl.constexpr,
               PRELOAD: tl.constexpr, RMS_IN: tl.constexpr, SSQ_BLOCK: tl.constexpr, INT8_FACTORS: tl.constexpr):
    """A u-program of the decode kernel: u += A[:, slice] x[slice] over its slice of K into u_part; the last to
    arrive sums the partials in program order and stores g = gamma(u) ⊙ u in g's epoch-tagged cells (with PEERS,
    the ungated u into every rank's rows, then the signals). With PRELOAD each step's A tile is loaded a step
    ahead, the first before the PDL wait (A is a weight), as the tiles load their codes; int8 codes are held as
    loaded and dequantized at their dot."""
    a_lo = pid * ax_k_per_prog
    a_hi = tl.minimum(a_lo + ax_k_per_prog, K)
    a_scale = _rank_scales(a_scale_ptr, R, INT8_FACTORS)[:, None]  # A's row scales (int8), a weight
    a_ahead = tl.zeros((R, BK), dtype=a_ptr.dtype.element_ty)
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
        u += tl.dot(xk, tl.trans(_f16_factor(ak, a_scale, INT8_FACTORS)))
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


@triton.jit
def _tile_main_loop(x_ptr, stride_xm, M, offs_m, mask_m, qw_ptr, s_ptr, z_ptr, offs_n, mask_n, pid_k, k_per_split,
                    k_hi, K, KW, G, group_size, first,
                    SPG: tl.constexpr, PER_CHANNEL: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                    BKW: tl.constexpr, GEMV_ROWS: tl.constexpr, GEMV_STAGES: tl.constexpr, GEMV_F16X2: tl.constexpr,
                    F16X2_ASM: tl.constexpr, GEMV_PRELOAD: tl.constexpr, WORD_CHAIN: tl.constexpr,
                    EVEN: tl.constexpr, DOT_ASM: tl.constexpr):
    """A tile's partial acc [BN, BM] over its split of K, by one of the main loops: the fp16x2 GEMV with chains over
    words (one row, per-channel), the GEMV loop in fp16x2 or float32 (M ≤ GEMV_ROWS ≤ 4), else tensor-core dots."""
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
                           pid_k * k_per_split, k_hi, K, KW, G, group_size, SPG, BN, BM, PER_CHANNEL, DOT_ASM)
    return acc


@triton.jit
def _sum_splits(acc, pid_n, pid_k, offs_m, mask_m, offs_n, mask_n, y_part_ptr, cnt_ptr, N, split_k,
                BN: tl.constexpr, BM: tl.constexpr):
    """(acc, last): with K split, each split stores its partial acc and the last to arrive at the tile sums them all
    in split order (last: whether this program holds the tile's sum and writes it)."""
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
    return acc, last


@triton.jit
def _tile_epilogue(acc, last, b, b_scale, epoch, res, norm_w, rstd, pid_n, offs_m, mask_m, offs_n, mask_n, g_rows,
                   bias_ptr, y_ptr, hw_ptr, ssq_ptr, cnt_ptr, reads_ptr, peer_rows_ptr, peer_signals_ptr, N,
                   stride_ym, num_tiles, num_ssq,
                   HAS_EC: tl.constexpr, HAS_BIAS: tl.constexpr, R: tl.constexpr, BN: tl.constexpr,
                   BM: tl.constexpr, PEERS: tl.constexpr, SWIGLU: tl.constexpr, ADD_NORM: tl.constexpr,
                   RMS_IN: tl.constexpr, INT8_FACTORS: tl.constexpr):
    """The program holding a tile's sum (last) writes it: to every rank's rows and the signals (PEERS), or with
    (alpha·B) g and the bias added, as y, silu(gate) ⊙ up (SWIGLU) or h and the folded norm's share (ADD_NORM).
    b (as stored: int8 codes are dequantized here, with b_scale), epoch, res, norm_w and rstd are the prologue's
    loads (unused where their switch is off)."""
    if last and PEERS > 0:
        for p in tl.static_range(PEERS):
            rows = tl.load(peer_rows_ptr + p).to(tl.pointer_type(tl.float32))
            tl.store(rows + offs_m[None, :] * stride_ym + offs_n[:, None], acc,
                     mask=mask_n[:, None] & mask_m[None, :])
        _signal_peers(cnt_ptr + 1, num_tiles + HAS_EC, peer_signals_ptr, PEERS)
    elif last:
        if HAS_EC and PEERS == 0:
            g = _read_g(g_rows, mask_m, epoch, True)  # until the last u-program has stored g
            # g is in registers: add this tile's share to the reads (relaxed, nothing waits for it); the
            # first tile's share makes the launch's total READS_PER_LAUNCH
            tl.debug_barrier()
            tl.atomic_add(reads_ptr, tl.where(pid_n == 0, 1 - num_tiles + READS_PER_LAUNCH, 1).to(tl.int64),
                          sem="relaxed")
            b16 = _f16_factor(b, b_scale[None, :], INT8_FACTORS)
        else:
            g = tl.zeros((BM, R), dtype=tl.float32)
            b16 = tl.zeros((BN, R), dtype=tl.float16)
        if RMS_IN:
            acc = acc * rstd[None, :]
        acc = _add_ec_and_bias(acc, g, b16, offs_n, mask_n, bias_ptr, HAS_EC, HAS_BIAS)
        if SWIGLU:
            _store_swiglu(acc, offs_m, mask_m, pid_n, N, y_ptr, stride_ym, BN, BM)
        elif ADD_NORM:
            store_add_norm(acc, res, norm_w, offs_m, mask_m, offs_n, mask_n, pid_n, y_ptr, stride_ym, hw_ptr,
                           ssq_ptr, num_ssq)
        else:
            _store_tile(acc, offs_m, mask_m, offs_n, mask_n, y_ptr, stride_ym)


@triton.jit
def _w4_decode_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr,
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
    y_part_ptr, u_part_ptr, g_ptr, cnt_ptr, reads_ptr, peer_rows_ptr, peer_signals_ptr,
    res_ptr, nw_ptr, hw_ptr, ssq_ptr,
    M, N, K, KW, G, group_size, stride_xm, stride_ym, split_k, k_per_split, num_ax, ax_k_per_prog, num_tiles,
    num_ssq, eps,
    HAS_EC: tl.constexpr, GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr, R: tl.constexpr, H: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPG: tl.constexpr, GEMV_ROWS: tl.constexpr,
    GEMV_STAGES: tl.constexpr, GEMV_F16X2: tl.constexpr, F16X2_ASM: tl.constexpr,
    BKW: tl.constexpr, PER_CHANNEL: tl.constexpr, PEERS: tl.constexpr, U_CHUNK: tl.constexpr,
    SWIGLU: tl.constexpr, PDL: tl.constexpr, PDL_LATE: tl.constexpr,
    PRELOAD: tl.constexpr, WORD_CHAIN: tl.constexpr = 1, EVEN: tl.constexpr = False,
    ADD_NORM: tl.constexpr = False, RMS_IN: tl.constexpr = False, SSQ_BLOCK: tl.constexpr = 1,
    DOT_ASM: tl.constexpr = False, INT8_FACTORS: tl.constexpr = False,
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
    # INT8_FACTORS: the EC's A and B are int8 codes with float32 scales per rank direction (a_scale_ptr, b_scale_ptr;
    # kernels.pack), each tile dequantized in registers before its dot.
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BM)
    mask_m = offs_m < M
    offs_r = tl.arange(0, R)
    g_rows = g_ptr + offs_m[:, None] * R + offs_r[None, :]
    if pid < num_ax:
        _u_program(pid, x_ptr, a_ptr, a_scale_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, u_part_ptr, g_rows, cnt_ptr,
                   reads_ptr, peer_rows_ptr, peer_signals_ptr, ssq_ptr, offs_m, mask_m, offs_r, N, K, stride_xm,
                   stride_ym, num_ax, ax_k_per_prog, num_tiles, num_ssq, eps, GATED, R, H, BM, BK, PEERS, U_CHUNK,
                   PDL, PDL_LATE, PRELOAD, RMS_IN, SSQ_BLOCK, INT8_FACTORS)
    else:
        gid = pid - num_ax
        pid_n = gid // split_k
        pid_k = gid % split_k
        offs_n, mask_n = _tile_rows(pid_n, N, BN, SWIGLU)  # SWIGLU: BN / 2 rows of gate and the same of up
        k_hi = tl.minimum((pid_k + 1) * k_per_split, KW * 8)
        # Weights only before the PDL wait (kernels.pdl): B, the folded norm's weights, and with PRELOAD the GEMV
        # loop's first codes, so that their HBM latency overlaps the tail of the launch before this one. (Where a
        # switch is off, its value is a placeholder the epilogue does not read.)
        if HAS_EC and PEERS == 0:
            b = _load_b_tile(b_ptr, offs_n, mask_n, HAS_EC, R)
            b_scale = _rank_scales(b_scale_ptr, R, INT8_FACTORS)
        else:
            b = tl.zeros((BN, R), dtype=tl.float16)
            b_scale = tl.zeros((R,), dtype=tl.float32)
        GEMV_PRELOAD: tl.constexpr = PRELOAD and GEMV_ROWS > 0 and GEMV_STAGES == 1
        if GEMV_PRELOAD:
            first = _code_tile(qw_ptr, offs_n, mask_n, pid_k * k_per_split, k_hi, KW, BKW, EVEN)
        else:
            first = tl.zeros((BN, BKW), dtype=tl.int32)  # unused
        if ADD_NORM:  # the norm's weight before the wait (a weight), the residual tile after it: both before the
            # main loop, so that the epilogue waits for no load (FoldedNorm)
            norm_w = tl.load(nw_ptr + offs_n, mask=mask_n, other=0.0)
        else:
            norm_w = 0.0
        pdl_enter(PDL, PDL_LATE)
        if ADD_NORM:
            res = tl.load(res_ptr + offs_m[None, :] * stride_ym + offs_n[:, None],
                          mask=mask_n[:, None] & mask_m[None, :], other=0.0)
        else:
            res = 0.0
        if RMS_IN:
            rstd = _row_rstd(ssq_ptr, offs_m, mask_m, num_ssq, K, eps, SSQ_BLOCK)
        else:
            rstd = 1.0
        epoch = 0
        if HAS_EC and PEERS == 0:  # read before the main loop: later waves of tiles find g there and wait for nothing
            epoch = tl.load(reads_ptr, volatile=True) >> READS_SHIFT
            if BM * R <= 2048:  # (wide row tiles: g's registers through the main loop would spill; read it after)
                g = _read_g(g_rows, mask_m, epoch, False)
        acc = _tile_main_loop(x_ptr, stride_xm, M, offs_m, mask_m, qw_ptr, s_ptr, z_ptr, offs_n, mask_n, pid_k,
                              k_per_split, k_hi, K, KW, G, group_size, first, SPG, PER_CHANNEL, BN, BM, BKW,
                              GEMV_ROWS, GEMV_STAGES, GEMV_F16X2, F16X2_ASM, GEMV_PRELOAD, WORD_CHAIN, EVEN, DOT_ASM)
        pdl_release(PDL and PDL_LATE)
        acc, last = _sum_splits(acc, pid_n, pid_k, offs_m, mask_m, offs_n, mask_n, y_part_ptr, cnt_ptr, N, split_k,
                                BN, BM)
        _tile_epilogue(acc, last, b, b_scale, epoch, res, norm_w, rstd, pid_n, offs_m, mask_m, offs_n, mask_n,
                       g_rows, bias_ptr, y_ptr, hw_ptr, ssq_ptr, cnt_ptr, reads_ptr, peer_rows_ptr, peer_signals_ptr,
                       N, stride_ym, num_tiles, num_ssq, HAS_EC, HAS_BIAS, R, BN, BM, PEERS, SWIGLU, ADD_NORM,
                       RMS_IN, INT8_FACTORS)


# With split_k = 0, K is split until the grid has FILL programs an SM (or one step each). Dot-loop candidates at 4 and
# 8 were within 1–4% of 2 where they won at all (bench/NOTES-kernels.md): not worth the tuner's time.
FILL = 2
AX_BLOCK = 128  # columns of A per step of the decode kernel's u-programs (ax_block)
# Columns of A per u-program of a W4+EC launch (at most; more where a quarter of the SMs would not do): two steps of
# 128, so that the chain A x → g, which every tile waits for at its end, is short where the tiles' own loops are
# (7B q/k/v/o: ~6 µs); 512 was slower (bench/NOTES-kernels.md).
EC_AX_COLUMNS = 256
# Words per fp16 chain of the fp16x2 GEMV loop at one row, per-channel (_w4_gemv_f16x2_words): two words' chain end
# (two HADD2.F32 and two FADD) instead of one a word (bench/NOTES-kernels.md); the loop takes 2 or 4.
WORD_CHAIN = 2




def ax_block(gemv_rows: int, block_kw: int) -> int:
    """Columns of A a u-program step takes: AX_BLOCK, or half of it where the GEMV loop takes as many code words a
    step. With the two ranges of one length, the compiler lays the GEMV loop's x out as the u-programs' dot wants
    it, in every program (sm_90 SASS, triton 3.6, W4 and W4+EC alike, `python -m spear.kernels.offline`): 8 warps
    and 128 words went from 117 to 74 registers and from 585 to 516 instructions a step with half the columns;
    64-word configs were as much worse with 64 columns of A as they are better with 128."""
    return AX_BLOCK // 2 if gemv_rows and block_kw == AX_BLOCK else AX_BLOCK


def u_chunk(bm: int, rank: int) -> int:
    """Partial u tiles [bm, rank] the last u-program sums per load: 4,096 floats at a time."""
    return max(1, 4096 // (bm * rank))


def _gemv_rows(m: int, limit: int) -> int:
    """The GEMV loop's row count for m rows (a power of two ≥ m), or 0 when m is above the config's limit."""
    return 0 if m > min(limit, 4) else 1 << (m - 1).bit_length()


def decode_flags(m: int, cfg: DecodeConfig, group_size: int, per_channel: bool,
                 ec: tuple[int, int, bool, bool] | None,
                 *, launch: W4Launch, compiled: bool, has_bias: bool = False, peers: int = 0, swiglu: bool = False,
                 add_norm: bool = False, num_ssq: int = 0, rms_in: bool = False, even: bool = False) -> dict:
    """The decode kernel's compile-time arguments (its constexprs, num_warps and num_stages) for a launch of m rows
    under `cfg`: w4_decode launches with exactly these and kernels.offline compiles its variants from them.
    `ec`: PackedEC.dims (padded rank R, the gate's hidden size H, gated, int8 factors), or None; `launch`: the PDL
    switches (kernels.pdl.W4Launch); `compiled`: compiled code (inline PTX), not the interpreter; `num_ssq`: the
    folded norm's tiles; `even`: unmasked code loads. PDL itself is the launch's (kernels.pdl.launch_options)."""
    gemv_rows = _gemv_rows(m, cfg.gemv_rows)
    bm = _row_tile(m)
    rank, hidden, gated, int8 = ec if ec is not None else (16, 16, False, False)
    return dict(HAS_EC=ec is not None, GATED=gated, HAS_BIAS=has_bias, R=rank, H=hidden, BM=bm, BN=cfg.block_n,
                BK=ax_block(gemv_rows, cfg.block_kw), SPG=_slices_per_group(group_size), GEMV_ROWS=gemv_rows,
                GEMV_STAGES=cfg.num_stages, GEMV_F16X2=cfg.gemv_f16x2, F16X2_ASM=compiled, BKW=cfg.block_kw,
                PER_CHANNEL=per_channel, PEERS=peers, U_CHUNK=u_chunk(bm, rank), SWIGLU=swiglu,
                PDL_LATE=launch.late_gemv if gemv_rows else launch.late, PRELOAD=launch.preload,
                WORD_CHAIN=WORD_CHAIN, EVEN=even, ADD_NORM=add_norm, RMS_IN=rms_in,
                SSQ_BLOCK=triton.next_power_of_2(max(num_ssq, 1)), DOT_ASM=compiled, INT8_FACTORS=int8,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


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
    FILL programs an SM, at most one a main-loop step."""
    return cfg.split_k or max(1, min(triton.cdiv(FILL * sms, tiles), steps))


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
            and options.OPTIONS.w4_even)
    num_ssq = tiles if add_norm is not None else rms.ssq.shape[1] if rms is not None else 0
    if rms is not None and rms.ssq.shape[0] != m:
        raise ValueError(f"rms holds {rms.ssq.shape[0]} rows, x {m}")
    flags = decode_flags(m, cfg, w.group_size, w.scales.shape[1] == 1, ec.dims() if ec is not None else None,
                         launch=w4_launch(), compiled=runs_compiled(x), has_bias=bias is not None,
                         peers=0 if peers is None else peers.rows.numel(), swiglu=swiglu, add_norm=add_norm is not None,
                         num_ssq=num_ssq, rms_in=rms is not None, even=even)
    bm, R, bk = flags["BM"], flags["R"], flags["BK"]
    num_ax, ax_k = 0, bk
    if ec is not None:
        num_ax = max(1, min(triton.cdiv(k, EC_AX_COLUMNS), triton.cdiv(sms, 4)))  # ≤ EC_AX_COLUMNS of A each
        ax_k = triton.cdiv(triton.cdiv(k, num_ax), bk) * bk
        num_ax = triton.cdiv(k, ax_k)
    assert tiles < READS_PER_LAUNCH.value, "the reads count's per-launch total must exceed the tiles"
    y_part, u_part, g_cells, counters, reads = _WORKSPACE.get(x.device, split_k * bm * n, num_ax * bm * R, bm * R, tiles)
    if peers is not None:  # no output tensor: y is a dummy pointer and the rows' stride is the buffer's
        y, stride_y = x, peers.width
    else:
        width = n // 2 if swiglu else n
        y = out if out is not None else torch.empty(m, width, dtype=x.dtype, device=x.device)
        stride_y = y.stride(0)
    _w4_decode_kernel[(num_ax + tiles * split_k,)](
        x, w.qweight, w.scales, w.zeros, bias if bias is not None else y, y,
        *((ec.A, ec.B, *ec.scale_args(), ec.W1, ec.b1, ec.W2, ec.b2) if ec is not None
          else (x,) * 8),  # fp16 dummies: y may be fp32
        y_part, u_part, g_cells, counters, reads,
        *((peers.rows, peers.signals) if peers is not None else (counters,) * 2),
        *(add_norm if add_norm is not None else (y, y, y, rms.ssq if rms is not None else reads)),
        m, n, k, kw, w.scales.shape[1], w.group_size, x.stride(0), stride_y,
        split_k, k_per_split, num_ax, ax_k, tiles, num_ssq, rms.eps if rms is not None else 0.0,
        **flags, **launch_options(x),
    )
    return y
