"""The decode kernel's epilogue pieces: the EC's gate and (alpha·B) g, the stores (plain, SiLU·up, add + RMSNorm),
and the hand-over of g from the u-programs to the tiles (cells tagged with the launch's epoch); and the EC's factor
tiles, fp16 or int8 codes dequantized in registers (INT8_FACTORS: kernels.pack's int8 form), which every W4 kernel
reading A or B loads through.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Each decode launch with an EC advances the workspace's reads count by 2^READS_SHIFT (its tiles' shares), so that
# the count's high bits are the launch's epoch, the tag of g's cells (the kernel's comment); a launch has fewer tiles.
READS_SHIFT: tl.constexpr = tl.constexpr(20)


READS_PER_LAUNCH: tl.constexpr = tl.constexpr(1 << 20)


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
    """(alpha·B)_tile [BN, R] as stored, fp16 or int8 codes (_f16_factor makes it the dot's operand); fp16 zeros
    without an EC."""
    offs_r = tl.arange(0, R)
    if HAS_EC:
        b = tl.load(b_ptr + offs_n[:, None] * R + offs_r[None, :], mask=mask_n[:, None], other=0)
    else:
        b = tl.zeros((offs_n.shape[0], R), dtype=tl.float16)
    return b


@triton.jit
def _rank_scales(scale_ptr, R: tl.constexpr, INT8_FACTORS: tl.constexpr):
    """An int8 factor's scales, one a rank direction: float32 [R] (A's rows, or alpha times B's columns); zeros, never
    read, for fp16 factors."""
    if INT8_FACTORS:
        scales = tl.load(scale_ptr + tl.arange(0, R))
    else:
        scales = tl.zeros((R,), dtype=tl.float32)
    return scales


@triton.jit
def _f16_factor(tile, scales, INT8_FACTORS: tl.constexpr):
    """A tile of A or alpha·B as the dots take it: int8 codes times their rank directions' scales (`scales`, shaped
    to broadcast along the tile) in float32, rounded once to fp16, the numbers of PackedEC.dense_A / dense_B; fp16
    factors as loaded."""
    if INT8_FACTORS:
        tile = (tile.to(tl.float32) * scales).to(tl.float16)
    return tile


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


@triton.jit
def _a_tile(a_ptr, offs_r, k0, k_hi, K, BK: tl.constexpr):
    """The EC's A [R, BK] as stored (fp16, or int8 codes: _f16_factor) at columns k0 .. k0 + BK − 1, zeros from
    k_hi on (a u-program's slice ends there)."""
    offs_k = k0 + tl.arange(0, BK)
    return tl.load(a_ptr + offs_r[:, None] * K + offs_k[None, :], mask=offs_k[None, :] < k_hi, other=0)
