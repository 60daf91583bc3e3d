"""The W4 tensor-core dot loop: the decode kernel's main loop from 16 rows (and the prefill tile GEMM's).

One tensor-core dot a 128-column block where one quantization group spans it (per-channel, g ≥ 128:
_w4_block_wide), one a group of 64 or 32 columns otherwise (_span_wide). On the H200 these replaced a dot a
16-column slice: 19–36% faster at 16–128 rows on the 7B shapes with one dot a block, 15–26% (g = 64) and 8–19%
(g = 32) with one a group (BENCHMARKS §4). In compiled code the codes become q − z through inline PTX
(codes._plane's ASM: ptxas then keeps the LOP3 masks in the instruction; the 7B shapes 9–17% faster at 16–32
rows); the interpreter runs the same arithmetic in Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from spear.kernels.w4.codes import _group_column, _plane, _planes


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
              z, SPG: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, PER_CHANNEL: tl.constexpr,
              ASM: tl.constexpr = False, SCALE_CODES: tl.constexpr = False):
    """acc [BN, BM] += W_hat[offs_n, kb : kb + 128] · x[offs_m, kb : kb + 128]ᵀ, one packed block
    (per-channel: without the scale, which _w4_dot_loop applies once at the end).

    The zero points are integers (≤ 15), so q − z is exact in fp16 and costs one HADD2 / HFMA2 a code pair, what
    turning the codes into fp16 costs anyway (codes._plane). Per group the tensor-core dot sums Σ (q − z) x and the
    scale acts once: acc += s · Σ (q − z) x. No Σ x correction term. Per-channel, `z` [BN] comes from the caller and
    the dots accumulate straight into acc. SCALE_CODES (the prefill tile GEMM): the groups scale the codes instead,
    one HMUL2 a pair, W_hat = (q − z) · s, and their dots accumulate straight into acc too: no wgmma wait and float32
    FMA pass a group. On the H200 (g = 128) that made the tile GEMM 6–11% faster at 1024–2048 rows, and the decode
    kernel 8–18% slower at 16–32 rows (its dot loop is bound by instructions a code, and a 16-row tile's FMA pass is
    small), so the decode kernel keeps the float32 scale.
    """
    if PER_CHANNEL or SPG == 8:  # one group spans the block: one dot (_w4_block_wide)
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
    for h in tl.static_range(2):  # groups of 64 / 32: one dot a group (_span_wide)
        words = tl.load(qw_ptr + offs_n[:, None] * KW + (kb // 8 + 8 * h + tl.arange(0, 8))[None, :],
                        mask=mask_n[:, None], other=0)  # [BN, 8] int32: slices 4 h .. 4 h + 3
        words8 = words >> 8
        for span in tl.static_range(4 // SPG):
            j = 4 * h + span * SPG  # the span's first slice
            g = (kb + 16 * j) // group_size
            z = _group_column(z_ptr, offs_n, mask_n, g, G)
            s16 = _group_column(s_ptr, offs_n, mask_n, g, G)
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


@triton.jit
def _w4_dot_loop(x_ptr, stride_xm, offs_m, mask_m, qw_ptr, s_ptr, z_ptr, offs_n, mask_n, k_lo, k_hi, K, KW, G,
                 group_size, SPG: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, PER_CHANNEL: tl.constexpr,
                 ASM: tl.constexpr = False, SCALE_CODES: tl.constexpr = False):
    """The [BN, BM] yᵀ tile over columns k_lo:k_hi by tensor-core dots (_w4_block per 128 columns; ASM: the codes
    through inline PTX, codes._plane; SCALE_CODES: the groups' codes scaled before the dot). Per-channel, z is
    loaded once and s applied once, after the loop."""
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    z = tl.zeros((BN,), dtype=tl.float16)
    if PER_CHANNEL:
        z = tl.load(z_ptr + offs_n * G, mask=mask_n, other=0.0)
    for kb in range(k_lo, k_hi, 128):
        acc = _w4_block(acc, x_ptr, stride_xm, offs_m, mask_m, qw_ptr, s_ptr, z_ptr, offs_n, mask_n, kb, K, KW, G,
                        group_size, z, SPG, BN, BM, PER_CHANNEL, ASM, SCALE_CODES)
    if PER_CHANNEL:
        acc *= tl.load(s_ptr + offs_n * G, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    return acc
