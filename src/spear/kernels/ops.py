"""Fused Triton kernels for the runtime model's non-linear work (spear.runtime.model), each beside its PyTorch reference.

A decode step of a 7B model is mostly small kernels between the W4 linears; in plain PyTorch
each layer launches ~40 of them. Fused here, one launch each:

  add_rms_norm            h = x + residual;  y = weight * rmsnorm(h)       (vLLM's "fused add + norm":
                          the residual add of one sub-layer rides in the next norm; h is the new
                          residual stream)
  silu_mul                silu(gate) * up                                  (the SwiGLU activation)
  rope_write_kv           RoPE on q and k, k and v stored at their cache slots, rotated q returned
  paged_decode_attention  one-token queries over their sequences' cached blocks (flash-decoding:
                          splits of the context in parallel, then a small combine kernel); with
                          `tiles`, up to 16 rows of one sequence at consecutive positions (a prefill
                          chunk's tokens as rows) share one pass over the keys

The references (`*_ref`) are the specification and what runs off CUDA; every public op takes
`use_triton` (None: Triton when the input is on CUDA, else the reference; tests force True
on CPU with TRITON_INTERPRET=1). Kernels compute in float32 and store in the input's dtype.
Nothing here syncs with the host or sizes anything by tensor values, so all of it can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    from spear.kernels.pdl import launch_options, pdl_enter
except ImportError:  # triton is a dev extra: without it every op runs its reference
    triton = None


def _jit(fn=None, *, do_not_specialize: tuple[str, ...] = ()):
    """triton.jit where triton is installed. `do_not_specialize`: integer arguments that change from step to
    step (a mixed step's table width); Triton would otherwise compile a variant the first time one of them
    is 1 or a multiple of 16 — hundreds of ms in the middle of serving (measured: 650–780 ms steps)."""
    if fn is None:
        return lambda f: _jit(f, do_not_specialize=do_not_specialize)
    return fn if triton is None else triton.jit(fn, do_not_specialize=list(do_not_specialize))


# Keys per inner step of the attention kernel (a power of two >= 16). With a short context each split is one step,
# so this also sets how many programs share a sequence's keys at batch 1. 32 against 64 made Llama-2-7B W4 decode 7%
# faster per token at batch 8 and 10–12% at 16 (bench/NOTES-kernels.md).
BLOCK_N = 32
# Decode attention's splits of the keys (flash-decoding, decode_splits). Fixed 256-key partitions
# took 11 µs a layer at batch 1 on the H200 (Llama-2-7B, ~130 keys: 2-3 dependent steps in one program).
MAX_SPLITS = 16
ATTENTION_PROGRAMS_PER_SM = 4


def _triton(use_triton: bool | None, x: torch.Tensor) -> bool:
    if use_triton is None:
        return x.is_cuda and triton is not None
    return use_triton


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor, head_dim: int) -> None:
    """The kernels address a slot's KV heads as one dense [KV, D] row, the same way in both pools."""
    assert k_pool.stride() == v_pool.stride() and k_pool.stride()[2:] == (head_dim, 1), \
        "pools must be [num_blocks, block_size, KV, D] with dense [KV, D] rows, K and V alike"


# ---------------------------------------------------------------- add + RMSNorm

def add_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual;  y = weight * (h / sqrt(mean(h²) + eps)), normalised in float32 and cast to x's
    dtype before the weight (as transformers' LlamaRMSNorm). Returns (y, h)."""
    h = x if residual is None else x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), h


@_jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, N, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)  # a weight: loaded before the wait
    pdl_enter(PDL)  # every kernel here launches dependent on the one before (kernels.pdl)
    h = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0)  # [BLOCK]
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * N + cols, mask=ok, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)  # x + residual, rounded to x's dtype
        tl.store(h_ptr + row * N + cols, h, mask=ok)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)
    normed = (hf * rstd).to(h.dtype).to(tl.float32)  # cast to x's dtype before the weight
    tl.store(y_ptr + row * N + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
                 use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, dim], weight [dim] -> (y, h) [T, dim]: the norm of h = x + residual, and h itself."""
    if not _triton(use_triton, x):
        return add_rms_norm_ref(x, weight, eps, residual)
    x = x.contiguous()
    dim = x.shape[-1]
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    h = x if residual is None else torch.empty_like(x)
    block = _next_pow2(dim)
    _add_rms_norm_kernel[(x.numel() // dim,)](
        x, x if residual is None else residual.contiguous(), weight, y, h, dim, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 8), **launch_options(x))
    return y, h


# ---------------------------------------------------------------- SwiGLU

def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float32, in the input dtype."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


@_jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, stride_gate, stride_up, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row t, columns of block j: out[t] = silu(gate[t]) * up[t] (gate and up may be strided row views)."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(gate_ptr + t * stride_gate + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + t * stride_up + offs, mask=ok, other=0.0).to(tl.float32)
    y = g / (1 + tl.exp(-g)) * u  # silu(g) = g * sigmoid(g)
    tl.store(out_ptr + t * n + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, n] with unit stride along n (a view when it can be: the halves of a fused GEMM's output)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """gate, up [..., n] -> silu(gate) * up [..., n] (contiguous)."""
    if not _triton(use_triton, gate):
        return silu_mul_ref(gate, up)
    g2, u2 = _rows(gate), _rows(up)
    rows, n = g2.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = min(1024, _next_pow2(n))
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](g2, u2, out, n, g2.stride(0), u2.stride(0), BLOCK=block,
                                                     **launch_options(gate))
    return out


# ---------------------------------------------------------------- RoPE + KV write

def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, gain: float = 1.0) -> torch.Tensor:
    """x [T, H, D] rotated by position, the rotate-half convention of transformers' Llama:

        θ = position * inv_freq (cat'ed with itself to R = 2 len(inv_freq));  x * cos θ + rotate_half(x) * sin θ,
        rotate_half([x1, x2]) = [-x2, x1],  cos and sin times `gain` (LongRoPE's attention factor), cast to x's dtype,

    on the first R dims of each head (R < D: partial rotary, Phi-3.5's partial_rotary_factor); the rest pass.
    """
    return _rotate(x, rope_cos_sin(positions, inv_freq, gain))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 gain: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_ref's cos θ and sin θ [T, 1, R] in float32, times `gain`: what a step's layers rotate by (on a CPU the
    step builds them once for all of them: kv_cache.Batch.rope_cos_sin)."""
    freqs = positions[:, None].float() * inv_freq[None]  # [T, R / 2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [T, 1, R]
    return emb.cos() * gain, emb.sin() * gain


def _rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, H, D] rotated by rope_cos_sin's angles (cast to x's dtype) on its first R dims."""
    cos, sin = (t.to(x.dtype) for t in cos_sin)
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return torch.cat((_rotate(x[..., :R], cos_sin), x[..., R:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      inv_freq: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      slots: torch.Tensor, gain: float = 1.0,
                      cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Rotate q [T, H, D] and k [T, KV, D]; store k and v at `slots` in the pools [N, block_size, KV, D]
    (slot = block * block_size + offset), in the pools' dtype; return the rotated q. `cos_sin`: the angles
    (rope_cos_sin) where the caller holds them already."""
    cos_sin = cos_sin or rope_cos_sin(positions, inv_freq, gain)
    k_pool.view(-1, *k.shape[1:]).index_copy_(0, slots, _rotate(k, cos_sin).to(k_pool.dtype))
    v_pool.view(-1, *v.shape[1:]).index_copy_(0, slots, v.to(v_pool.dtype))
    return _rotate(q, cos_sin)


@_jit
def _rope_row(src_ptr, dst_ptr, cos, sin, i, ok, HALF: tl.constexpr, D: tl.constexpr, BLOCK_TAIL: tl.constexpr):
    """dst = [x1 cos - x2 sin, x2 cos + x1 sin, x3] for one head's row x = [x1, x2, x3] (float32 math; x3, past
    the rotated 2 HALF dims, is empty unless the rotary is partial, and copied)."""
    x1 = tl.load(src_ptr + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + HALF + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst_ptr + i, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=ok)
    tl.store(dst_ptr + HALF + i, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=ok)
    if D > 2 * HALF:
        j = 2 * HALF + tl.arange(0, BLOCK_TAIL)
        tl.store(dst_ptr + j, tl.load(src_ptr + j, mask=j < D), mask=j < D)


@_jit
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, q_out_ptr, k_pool_ptr, v_pool_ptr, slots_ptr,
                          gain, H, KV, block_size, stride_pool_block, stride_pool_offset, stride_qt, stride_kt, stride_vt,
                          HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, D: tl.constexpr, BLOCK_TAIL: tl.constexpr,
                          PDL: tl.constexpr):
    """Program (t, j): j < H rotates query head j of token t; j >= H rotates key head j - H and stores it,
    and the token's value head, at the token's slot. The step's positions and slots (written by the host, never by
    a kernel) and the angles come before the PDL wait; the rows of q, k and v after it."""
    t, j = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, BLOCK_HALF)
    ok = i < HALF
    theta = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + i, mask=ok, other=0.0)  # [BLOCK_HALF]
    cos, sin = tl.cos(theta) * gain, tl.sin(theta) * gain
    slot = tl.load(slots_ptr + t, mask=j >= H, other=0)  # key programs only (host-written: before the wait)
    pdl_enter(PDL)
    if j < H:
        _rope_row(q_ptr + t * stride_qt + j * D, q_out_ptr + (t * H + j) * D, cos, sin, i, ok, HALF, D, BLOCK_TAIL)
    else:
        kv = j - H
        dst = (slot // block_size) * stride_pool_block + (slot % block_size) * stride_pool_offset + kv * D
        _rope_row(k_ptr + t * stride_kt + kv * D, k_pool_ptr + dst, cos, sin, i, ok, HALF, D, BLOCK_TAIL)
        for half in tl.static_range(2):  # v as it is, in two halves, then the tail past them
            val = tl.load(v_ptr + t * stride_vt + kv * D + half * HALF + i, mask=ok)
            tl.store(v_pool_ptr + dst + half * HALF + i, val, mask=ok)
        if D > 2 * HALF:
            tail = 2 * HALF + tl.arange(0, BLOCK_TAIL)
            val = tl.load(v_ptr + t * stride_vt + kv * D + tail, mask=tail < D)
            tl.store(v_pool_ptr + dst + tail, val, mask=tail < D)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, *, gain: float = 1.0,
                  use_triton: bool | None = None,
                  cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [T, H, D], k, v [T, KV, D], positions, slots [T], inv_freq [R / 2] float32 (R = D, or fewer: partial
    rotary), pools [N, block_size, KV, D] -> rotated q [T, H, D]; rotated k and v land in the pools; cos and sin
    times `gain` (LongRoPE's attention factor). One launch over (token, head). `cos_sin`: the reference path's
    angles (rope_cos_sin) where the caller holds them (the kernel computes its own)."""
    if not _triton(use_triton, q):
        return rope_write_kv_ref(q, k, v, positions, inv_freq, k_pool, v_pool, slots, gain, cos_sin)
    T, H, D = q.shape
    KV = k.shape[1]
    _check_pools(k_pool, v_pool, D)
    # Each token's heads must be contiguous; tokens may be strided (q, k, v as views of a fused q|k|v GEMM output).
    q, k, v = (_dense_heads(x) for x in (q, k, v))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _rope_write_kv_kernel[(T, H + KV)](
        q, k, v, positions, inv_freq, q_out, k_pool, v_pool, slots, gain, H, KV, k_pool.shape[1],
        k_pool.stride(0), k_pool.stride(1), q.stride(0), k.stride(0), v.stride(0),
        HALF=inv_freq.shape[0], BLOCK_HALF=_next_pow2(inv_freq.shape[0]), D=D,
        BLOCK_TAIL=_next_pow2(max(D - 2 * inv_freq.shape[0], 1)), num_warps=1, **launch_options(q))
    return q_out


# ---------------------------------------------------------------- paged decode attention

def paged_decode_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float | None = None, window: int | None = None,
                               mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ * scale) v of each sequence's one query over its keys 0 .. seq_len - 1 (with a sliding
    `window`, seq_len - window .. seq_len - 1).

    q [B, H, D]; pools [N, block_size, KV, D]; block_tables [B, W]; seq_lens [B] -> [B, H, D].
    Query head h reads KV head h // (H // KV) (GQA). Pools in another dtype than q's are read back in q's.
    `mask`: decode_key_mask's, where the caller holds it already.
    """
    B, W = block_tables.shape
    shape = (B, W * k_pool.shape[1], *k_pool.shape[2:])  # [B, W * block_size, KV, D], position order
    # index_select over the flat table: the same copy as k_pool[block_tables], 7× faster for 8 rows on a 2-core EPYC
    k = k_pool.index_select(0, block_tables.reshape(-1)).view(shape).transpose(1, 2).to(q.dtype)  # [B, KV, W bs, D]
    v = v_pool.index_select(0, block_tables.reshape(-1)).view(shape).transpose(1, 2).to(q.dtype)
    if mask is None:
        mask = decode_key_mask(seq_lens, shape[1], window)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[:, :, 0]  # [B, H, D]


def decode_key_mask(seq_lens: torch.Tensor, keys: int, window: int | None = None) -> torch.Tensor:
    """[B, 1, 1, keys]: which of the first `keys` positions each decode row sees (positions < seq_len, and with a
    sliding `window` ≥ seq_len - window)."""
    key_pos = torch.arange(keys, device=seq_lens.device)
    mask = key_pos < seq_lens[:, None]
    if window is not None:
        mask &= key_pos >= seq_lens[:, None] - window
    return mask[:, None, None]


def attention_tile_rows(group: int) -> int:
    """Query rows per tile of the attention kernel for `group` query heads per KV head: as many as fill the
    tensor-core dot's 16 rows (16 with MHA, 4 with 4-way GQA, 1 from 16-way up)."""
    return max(1, 16 // _next_pow2(group))


@_jit
def _softmax_step(q, m, l, acc, k, v, t, visible, scale, PRECISION: tl.constexpr, WINDOW: tl.constexpr):
    """One online-softmax step of the query rows q [BLOCK_Q, D] over the keys k, v [BLOCK_N, D] at positions t:
    row r sees the keys t < visible_r (and t >= visible_r - WINDOW with a sliding window, WINDOW > 0)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_Q, BLOCK_N]
    seen = t[None, :] < visible[:, None]
    if WINDOW > 0:
        seen = seen & (t[None, :] >= visible[:, None] - WINDOW)
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp(-inf) = 0, not NaN
    alpha = tl.exp(m - m_safe)  # rescales what came before
    prob = tl.exp(s - m_safe[:, None])
    l = l * alpha + tl.sum(prob, axis=1)
    acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=PRECISION)  # prob in v's dtype
    return m_new, l, acc


@_jit
def _head_mask(rows_ok, d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """[rows, BLOCK_D] mask of rows_ok and, where the head dim is padded to a power of two (D = 96 in 128), d < D."""
    mask = rows_ok[:, None]
    if BLOCK_D != D:  # compile time: a power-of-two D keeps the row mask alone
        mask = mask & (d < D)[None, :]
    return mask


@_jit
def _attention_step(q, m, l, acc, block, t, end, visible, k_pool_ptr, v_pool_ptr, kv, d, scale, block_size,
                    stride_pool_block, stride_pool_offset, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    PRECISION: tl.constexpr, WINDOW: tl.constexpr):
    """A step over the cached keys at positions t [BLOCK_N] (< end), in the pool blocks `block`."""
    kv_off = block * stride_pool_block + (t % block_size) * stride_pool_offset + kv * D
    mask = _head_mask(t < end, d, D, BLOCK_D)
    k = tl.load(k_pool_ptr + kv_off[:, None] + d[None, :], mask=mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(v_pool_ptr + kv_off[:, None] + d[None, :], mask=mask, other=0.0)
    return _softmax_step(q, m, l, acc, k, v, t, visible, scale, PRECISION, WINDOW)


@_jit(do_not_specialize=("stride_table",))
def _paged_decode_split_kernel(q_ptr, k_pool_ptr, v_pool_ptr, tables_ptr, seq_lens_ptr, tiles_ptr,
                               m_ptr, l_ptr, acc_ptr, out_ptr,
                               scale, H, block_size, stride_table, stride_tiles, stride_qt,
                               stride_pool_block, stride_pool_offset,
                               GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
                               HAS_TILES: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                               SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                               WINDOW: tl.constexpr, PDL: tl.constexpr):
    """Program (tile, kv, p): the GROUP query heads of KV head kv, for each of the tile's rows (up to
    BLOCK_Q // BLOCK_G query rows of one sequence at consecutive positions, so they share its block table
    and the keys they read: a prefill chunk's tokens as rows), over split p of the tile's keys by online
    softmax; row r sees keys 0 .. seq_len_r - 1. The keys of the tile's longest row are cut into SPLITS
    splits of whole BLOCK_N steps, split p = [p * L, (p + 1) * L) with L = BLOCK_N * cdiv(seq_len, SPLITS *
    BLOCK_N): the splits follow the sequence's length, not the table's width, so a short context is one
    step a program. Writes each (row, head)'s running max m, sum l = Σ exp(s - m) and acc = Σ exp(s - m) v
    (float32) for the split; a split past a row's end writes m = -inf, l = 0 only. With one split, the output
    acc / l itself (no combine launch). Without tiles every row is a tile of its own (a decode step). With a
    sliding window (WINDOW > 0) row r sees keys seq_len_r - WINDOW .. seq_len_r - 1 only, and the splits cut
    the tile's keys from its first row's first one, lo = seq_len_first - WINDOW, instead of 0. A head dim D that
    is no power of two (Phi-3's 96) runs in BLOCK_D = the next one, its padding lanes zero in q, k and v.
    The step's tiles, lengths and block tables (written by the host, never by a kernel) are read before the PDL
    wait, the first step's table entries included; q and the keys after it."""
    tile, kv, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if HAS_TILES:
        first = tl.load(tiles_ptr + stride_tiles * tile)  # the tile's first row and its row count (0: a padding tile)
        count = tl.load(tiles_ptr + stride_tiles * tile + 1)
    else:
        first, count = tile, 1
    last = first + count - 1  # the tile's last row sees the most keys, and its table has all their blocks
    seq_len = tl.load(seq_lens_ptr + last, mask=count > 0, other=0)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(tl.load(seq_lens_ptr + first, mask=count > 0, other=0) - WINDOW, 0)
    split_len = tl.cdiv(seq_len - lo, SPLITS * BLOCK_N) * BLOCK_N
    start = lo + p * split_len
    end = tl.minimum(start + split_len, seq_len)
    t = start + tl.arange(0, BLOCK_N)  # the first step's key positions
    block = tl.load(tables_ptr + last * stride_table + t // block_size, mask=t < end, other=0)  # [BLOCK_N]
    d = tl.arange(0, BLOCK_D)
    pdl_enter(PDL)
    if count > 0:
        i = tl.arange(0, BLOCK_Q)  # dot row i: query row first + i // BLOCK_G, head kv * GROUP + i % BLOCK_G
        r, g = i // BLOCK_G, i % BLOCK_G
        ok = (r < count) & (g < GROUP)  # rows past the tile or the group are padding (tl.dot needs 16)
        row = first + r
        head = kv * GROUP + g
        row_len = tl.load(seq_lens_ptr + row, mask=ok, other=0)  # [BLOCK_Q] keys each row sees
        q = tl.load(q_ptr + (row * stride_qt + head * D)[:, None] + d[None, :], mask=_head_mask(ok, d, D, BLOCK_D),
                    other=0.0)

        m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
        if start < end:  # the first step, its table entries read before the wait
            m, l, acc = _attention_step(q, m, l, acc, block, t, end, row_len, k_pool_ptr, v_pool_ptr, kv, d, scale,
                                        block_size, stride_pool_block, stride_pool_offset, D, BLOCK_D, PRECISION,
                                        WINDOW)
        for n0 in range(start + BLOCK_N, end, BLOCK_N):  # no steps past the end: an empty split writes (-inf, 0)
            t = n0 + tl.arange(0, BLOCK_N)  # key positions
            block = tl.load(tables_ptr + last * stride_table + t // block_size, mask=t < end, other=0)  # [BLOCK_N]
            m, l, acc = _attention_step(q, m, l, acc, block, t, end, row_len, k_pool_ptr, v_pool_ptr, kv, d, scale,
                                        block_size, stride_pool_block, stride_pool_offset, D, BLOCK_D, PRECISION,
                                        WINDOW)

        if SPLITS == 1:  # every key in this program: the output
            out = (row * H + head)[:, None] * D + d[None, :]
            l = tl.where(ok, l, 1.0)  # padding lanes saw no key: l = 0
            tl.store(out_ptr + out, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=_head_mask(ok, d, D, BLOCK_D))
        else:
            out = (row * H + head) * SPLITS + p  # [BLOCK_Q] into the [B, H, SPLITS] workspace
            tl.store(m_ptr + out, m, mask=ok)
            tl.store(l_ptr + out, l, mask=ok)
            # the combine never reads the acc of a split that starts past a row's end (its m is -inf)
            tl.store(acc_ptr + out[:, None] * D + d[None, :], acc, mask=_head_mask(ok & (start < row_len), d, D, BLOCK_D))


@_jit
def _paged_decode_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                                 SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, PDL: tl.constexpr):
    """Program (b, h): merge the splits, all at once (a split that saw no key has m = -inf, weight 0):

        M = max m_p;  out = Σ exp(m_p - M) acc_p / Σ exp(m_p - M) l_p
    """
    pdl_enter(PDL)
    bh = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    p = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, BLOCK_D)
    m = tl.load(m_ptr + bh * SPLITS + p, mask=p < SPLITS, other=float("-inf"))  # [SPLITS_P2]
    saw_keys = m > float("-inf")  # every row sees a key, so at least one split did
    weight = tl.exp(m - tl.max(m, axis=0))
    l = tl.sum(weight * tl.load(l_ptr + bh * SPLITS + p, mask=saw_keys, other=0.0), axis=0)
    acc = tl.load(acc_ptr + (bh * SPLITS + p)[:, None] * D + d[None, :], mask=_head_mask(saw_keys, d, D, BLOCK_D),
                  other=0.0)
    acc = tl.sum(weight[:, None] * acc, axis=0)  # [BLOCK_D]
    tl.store(out_ptr + bh * D + d, (acc / l).to(out_ptr.dtype.element_ty), mask=d < D)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float | None = None, *, use_triton: bool | None = None,
                           splits: int | None = None, block_n: int = BLOCK_N, tiles: torch.Tensor | None = None,
                           tile_rows: int = 1, window: int | None = None,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] (row b: a query at position seq_len_b - 1 over keys 0 .. seq_len_b - 1; rows may be strided),
    pools [N, block_size, KV, D], block_tables [B, W] (padded with block 0), seq_lens [B] >= 1 -> [B, H, D] in q's
    dtype. `tiles` [NT, 2] (first row, row count ≤ tile_rows; count 0: padding) groups rows of one sequence
    at consecutive positions, which then read each key once for all of them (kv_cache.Batch builds them for
    a mixed step's prefill tokens as rows); None: every row alone. `window`: each row sees only the keys of its
    last `window` positions (a sliding-window layer); None: all. `mask`: the reference path's decode_key_mask, where the
    caller holds it already.

    Triton: grid (NT or B, KV, splits), then with more than one split a combine launch, grid (B, H); `splits`
    None: decode_splits's pick, `block_n` keys a step. Shapes alone set the grids and the float32 workspace,
    so the launch can be captured in a CUDA graph.
    """
    if not _triton(use_triton, q):
        return paged_decode_attention_ref(q, k_pool, v_pool, block_tables, seq_lens, scale, window, mask)
    B, H, D = q.shape
    _, block_size, KV, _ = k_pool.shape
    assert D >= 16, f"head_dim must be at least 16 (a dot tile), got {D}"
    _check_pools(k_pool, v_pool, D)
    assert block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n must be a power of two >= 16, got {block_n}"
    num_tiles = tiles.shape[0] if tiles is not None else B
    if splits is None:
        splits = decode_splits(num_tiles * KV, block_tables.shape[1] * block_size, block_n, q.device)
    q = _dense_heads(q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if splits > 1:
        m = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
    else:  # the split kernel writes the output itself
        m = l = acc = out
    _paged_decode_split_kernel[(num_tiles, KV, splits)](
        q, k_pool, v_pool, block_tables, seq_lens, tiles if tiles is not None else seq_lens, m, l, acc, out,
        D**-0.5 if scale is None else scale, H, block_size, block_tables.stride(0),
        tiles.stride(0) if tiles is not None else 0, q.stride(0), k_pool.stride(0), k_pool.stride(1),
        **attention_flags(H // KV, D, splits, tiles=tiles is not None, tile_rows=tile_rows, block_n=block_n,
                          dtype=q.dtype, window=window), **launch_options(q))
    if splits > 1:
        _paged_decode_combine_kernel[(B, H)](m, l, acc, out, D=D, BLOCK_D=_next_pow2(D), SPLITS=splits,
                                             SPLITS_P2=_next_pow2(splits),
                                             num_warps=1 if splits * D <= 1024 else 2, **launch_options(q))
    return out


def attention_flags(group: int, head_dim: int, splits: int, *, tiles: bool = False, tile_rows: int = 1,
                    block_n: int = BLOCK_N, dtype: torch.dtype = torch.float16, window: int | None = None) -> dict:
    """_paged_decode_split_kernel's compile-time arguments for `group` query heads a KV head, in `splits` splits:
    paged_decode_attention launches with these, kernels.offline compiles them. `tiles`: rows in tiles of up to
    `tile_rows` (else each row alone); `dtype`: q's (float32 dots in IEEE precision, else TF32). PDL is the
    launch's (kernels.pdl.launch_options)."""
    block_g = _next_pow2(group)
    return dict(GROUP=group, BLOCK_G=block_g, BLOCK_Q=max(16, (tile_rows if tiles else 1) * block_g), HAS_TILES=tiles,
                D=head_dim, BLOCK_D=_next_pow2(head_dim), SPLITS=splits, BLOCK_N=block_n, PRECISION="ieee" if dtype == torch.float32 else "tf32",
                WINDOW=window or 0)


def _dense_heads(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with each token's heads dense (tokens may be strided), copied only where they are not."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def decode_splits(programs: int, max_keys: int, block_n: int, device: torch.device) -> int:
    """Splits of each row's keys for decode attention with `programs` (tile, KV head) pairs: a power of two that
    brings the grid to about ATTENTION_PROGRAMS_PER_SM an SM (a step of few rows is one dependent chain of
    loads a program: splitting is what runs it in parallel), at most MAX_SPLITS and no more than the table
    has BLOCK_N steps."""
    from spear.kernels.w4 import num_sms  # the Triton path only: triton is there

    want = max(1, ATTENTION_PROGRAMS_PER_SM * num_sms(device) // programs)
    return min(1 << (want.bit_length() - 1), MAX_SPLITS, triton.cdiv(max_keys, block_n))
