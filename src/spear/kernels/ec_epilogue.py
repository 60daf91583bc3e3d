"""The epilogue of a row-parallel layer, on the reduced partials: y = y_sum + bias + (alpha·B) (gamma(u) ⊙ u).

    gamma(u) = 1 + tanh(W2 silu(W1 u + b1) + b2)          (gamma ≡ 1 for a static EC: W1 is None)

Under tensor parallelism the gate needs the globally reduced u, so this runs after the
reduction (spear.runtime.tp), on every rank, on identical data. Its inputs may be strided views
of any float dtype: the symmetric-memory path reduces [y_r | u_r] rows in float32 and this kernel
reads both halves of the sum and writes the layer's fp16 output (no EC: the bias and the cast
alone). The Triton kernel is one launch over (row, block of N); each program recomputes the
row's tiny gate (r → h → r) and adds its block of B·g. Math in float32; 1 + tanh(z) is computed
as 2·sigmoid(2z). B may be int8 codes with one scale a column (alpha folded in: an 8-bit EC as
kernels.pack holds it), dequantized in registers as the W4 kernels do: q · scale in float32, rounded
to fp16. Its reference is kernels.reference.ec_epilogue_ref, what CPU ranks run (this
module needs triton; tests: TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spear.kernels.w4.epilogue import _f16_factor, store_add_norm


@triton.jit
def _bias_and_ec(y, u, n, n_ok, r, r_ok, b_ptr, b_scale_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, bias_ptr, R, H,
                 HAS_EC: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr,
                 INT8_FACTORS: tl.constexpr):
    """y [BLOCK_N] (float32) + bias + (alpha·B)_n (gamma(u) ⊙ u) for one row's u [BLOCK_R] (float32); int8 B
    dequantized after its load, with b_scale [R]."""
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_EC:
        g = u
        if GATED:
            h = tl.arange(0, BLOCK_H)
            h_ok = h < H
            w1 = tl.load(w1_ptr + h[:, None] * R + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
            hidden = tl.sum(w1.to(tl.float32) * u[None, :], axis=1)
            hidden += tl.load(b1_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
            hidden = hidden / (1 + tl.exp(-hidden))  # silu
            w2 = tl.load(w2_ptr + r[:, None] * H + h[None, :], mask=r_ok[:, None] & h_ok[None, :], other=0.0)
            z = tl.sum(w2.to(tl.float32) * hidden[None, :], axis=1)
            z += tl.load(b2_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
            g = u * (2 / (1 + tl.exp(-2 * z)))  # u * (1 + tanh(z))
        b = tl.load(b_ptr + n[:, None] * R + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0)
        if INT8_FACTORS:
            b = _f16_factor(b, tl.load(b_scale_ptr + r, mask=r_ok, other=0.0)[None, :], INT8_FACTORS)
        y += tl.sum(b.to(tl.float32) * g[None, :], axis=1)
    return y


@triton.jit
def _ec_epilogue_kernel(y_ptr, u_ptr, out_ptr, b_ptr, b_scale_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, bias_ptr, N, R, H,
                        stride_y, stride_u, stride_out,
                        HAS_EC: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                        INT8_FACTORS: tl.constexpr):
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    y = tl.load(y_ptr + m * stride_y + n, mask=n_ok, other=0.0).to(tl.float32)
    u = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if HAS_EC:
        u = tl.load(u_ptr + m * stride_u + r, mask=r_ok, other=0.0).to(tl.float32)
    y = _bias_and_ec(y, u, n, n_ok, r, r_ok, b_ptr, b_scale_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, bias_ptr, R, H,
                     HAS_EC, GATED, HAS_BIAS, BLOCK_H, INT8_FACTORS)
    tl.store(out_ptr + m * stride_out + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _peer_epilogue_kernel(slots_ptr, signals_ptr, state_ptr, out_ptr, b_ptr, b_scale_ptr, w1_ptr, b1_ptr, w2_ptr,
                          b2_ptr, bias_ptr, res_ptr, nw_ptr, hw_ptr, ssq_ptr, N, R, H, width, slot_stride, stride_out,
                          WORLD: tl.constexpr, HAS_EC: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                          INT8_FACTORS: tl.constexpr, ADD_NORM: tl.constexpr = False):
    """Program (row m, block of N): wait until every rank's signal reached this call's epoch (state[0] + 1), sum
    the ranks' [y_r | u_r] rows in rank order (every rank sums the same numbers in the same order: identical
    outputs), add bias and EC; the last program to finish advances the epoch (state[1] counts them).
    ADD_NORM (kernels.norm_fold.FoldedNorm): out gets h = y + residual instead, hw_ptr h ⊙ w_norm and
    ssq_ptr[m, block] the block's Σ h² (the residual and the norm's weights are loaded before the wait)."""
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    if ADD_NORM:
        res = tl.load(res_ptr + m * stride_out + n, mask=n_ok, other=0.0)
        norm_w = tl.load(nw_ptr + n, mask=n_ok, other=0.0)
    epoch = tl.atomic_add(state_ptr, 0) + 1
    for s in tl.static_range(WORLD):
        seen = tl.atomic_add(signals_ptr + s, 0, sem="acquire", scope="sys")
        while seen < epoch:
            seen = tl.atomic_add(signals_ptr + s, 0, sem="acquire", scope="sys")
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    u = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for s in tl.static_range(WORLD):  # in rank order
        row = slots_ptr + s * slot_stride + m * width
        y += tl.load(row + n, mask=n_ok, other=0.0, cache_modifier=".cg")
        if HAS_EC:
            u += tl.load(row + N + r, mask=r_ok, other=0.0, cache_modifier=".cg")
    y = _bias_and_ec(y, u, n, n_ok, r, r_ok, b_ptr, b_scale_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, bias_ptr, R, H,
                     HAS_EC, GATED, HAS_BIAS, BLOCK_H, INT8_FACTORS)
    if ADD_NORM:  # the W4 decode epilogue's own, on this row as a [BLOCK_N, 1] tile
        rows = tl.full((1,), m, tl.int32)
        store_add_norm(y[:, None], res[:, None], norm_w, rows, rows == m, n, n_ok, tl.program_id(1), out_ptr,
                       stride_out, hw_ptr, ssq_ptr, tl.num_programs(1))
    else:
        tl.store(out_ptr + m * stride_out + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)
    tl.debug_barrier()
    done = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel")
    if done == tl.num_programs(0) * tl.num_programs(1) - 1:  # every program has read this epoch
        tl.atomic_xchg(state_ptr + 1, 0)
        tl.atomic_add(state_ptr, 1)


def ec_epilogue(y: torch.Tensor, u: torch.Tensor | None, B: torch.Tensor | None, W1: torch.Tensor | None = None,
                b1: torch.Tensor | None = None, W2: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None, block_n: int = 128,
                b_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel: ec_epilogue_ref's result into `out` (default: in place on y). y, u and out may be row-strided
    views (unit column stride); out's dtype is the result's. `b_scale` (float32 [r]): B is int8 codes, one scale a
    column."""
    M, N = y.shape
    out = y if out is None else out
    for name, t in (("y", y), ("u", u), ("out", out)):
        assert t is None or t.stride(-1) == 1, f"{name} needs unit column stride"
    R = 1 if u is None else u.shape[1]
    H = 1 if W1 is None else W1.shape[0]
    gated = W1 is not None
    _ec_epilogue_kernel[(M, triton.cdiv(N, block_n))](
        y, u if u is not None else y, out, B if B is not None else y, b_scale if b_scale is not None else y,
        *((W1, b1, W2, b2) if gated else (y,) * 4), bias if bias is not None else y, N, R, H,
        y.stride(0), 0 if u is None else u.stride(0), out.stride(0),
        **epilogue_flags(R, H, has_ec=u is not None, gated=gated, has_bias=bias is not None, block_n=block_n,
                         int8=b_scale is not None),
    )
    return out


def epilogue_flags(rank: int, hidden: int, *, has_ec: bool, gated: bool, has_bias: bool, block_n: int = 128,
                   int8: bool = False) -> dict:
    """_ec_epilogue_kernel's compile-time arguments, which _peer_epilogue_kernel shares (peer_epilogue_flags): the
    EC's rank R and the gate's hidden size H (1 where there is none) padded to powers of two of at least 16,
    block_n columns a program, and whether B is int8 codes. ec_epilogue launches with these, kernels.offline compiles
    them."""
    return dict(HAS_EC=has_ec, GATED=gated, HAS_BIAS=has_bias, BLOCK_N=block_n,
                BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_H=max(16, triton.next_power_of_2(hidden)),
                INT8_FACTORS=int8)


def peer_epilogue_flags(world: int, rank: int, hidden: int, *, has_ec: bool, gated: bool, has_bias: bool,
                        add_norm: bool = False, block_n: int = 128, int8: bool = False) -> dict:
    """_peer_epilogue_kernel's compile-time arguments over `world` ranks (peer_epilogue's): epilogue_flags's, and
    ADD_NORM where the next RMSNorm's share is formed."""
    return dict(WORLD=world, **epilogue_flags(rank, hidden, has_ec=has_ec, gated=gated, has_bias=has_bias,
                                              block_n=block_n, int8=int8), ADD_NORM=add_norm)


def peer_epilogue(slots: torch.Tensor, signals: torch.Tensor, state: torch.Tensor, rows: int, n: int, width: int,
                  B: torch.Tensor | None, W1: torch.Tensor | None = None, b1: torch.Tensor | None = None,
                  W2: torch.Tensor | None = None, b2: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, rank: int = 0, block_n: int = 128,
                  add_norm: tuple[torch.Tensor, ...] | None = None,
                  b_scale: torch.Tensor | None = None) -> torch.Tensor:
    """After every rank's w4_decode_to_peers: y [rows, n] = Σ_ranks y_r + bias + (alpha·B)(gamma(u) ⊙ u), u = Σ u_r.

    slots float32 [world, max_rows, width] (this rank's buffer: rank s's rows in slot s), signals int32 [world]
    (rank s's arrivals), state int32 [2] (epoch, programs done; zero at first). `rank` (that of u's true width)
    is the EC's rank r ≤ width − n; `b_scale` as ec_epilogue's; out: default a new tensor of a float B's dtype, else
    fp16. `add_norm` (residual [rows, n], w_norm [n], hw [rows, n], ssq [rows, cdiv(n, block_n)]): out gets
    y + residual and the next RMSNorm's share is formed too (kernels.norm_fold.FoldedNorm); residual, hw and out
    share a row stride."""
    world = slots.shape[0]
    R = max(rank, 1)
    H = 1 if W1 is None else W1.shape[0]
    gated = W1 is not None
    dtype = B.dtype if B is not None and B.is_floating_point() else torch.float16
    out = out if out is not None else torch.empty(rows, n, dtype=dtype, device=slots.device)
    dummy = out
    _peer_epilogue_kernel[(rows, triton.cdiv(n, block_n))](
        slots, signals, state, out, B if B is not None else dummy, b_scale if b_scale is not None else dummy,
        *((W1, b1, W2, b2) if gated else (dummy,) * 4),
        bias if bias is not None else dummy, *(add_norm if add_norm is not None else (dummy,) * 4),
        n, R, H, width, slots.stride(0), out.stride(0),
        **peer_epilogue_flags(world, R, H, has_ec=B is not None, gated=gated, has_bias=bias is not None,
                              add_norm=add_norm is not None, block_n=block_n, int8=b_scale is not None),
    )
    return out
