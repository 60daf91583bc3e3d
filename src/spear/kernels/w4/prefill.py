"""W4A16 for many rows (M > DECODE_PATH_MAX_M): the tile GEMM that dequantizes in its main loop, the EC's
rank-space kernels, and dequantize + cuBLAS.

Up to FUSED_PREFILL_MAX_M rows (per-channel; FUSED_PREFILL_MAX_M_GROUPED with groups), where the tiles fill half
the SMs and, 128 × 256 wide, their waves (`takes_tile_gemm`), one Triton tile GEMM (the decode kernel's dot loop)
adds (alpha·B) g in its epilogue (`w4_prefill_fused`). g comes from a few rank programs on the SMs the GEMM's last
wave leaves idle, a launch of their own that the GEMM follows as its programmatic dependent
(`_ec_rank_programs_kernel`); else from the EC's rank-space kernel before the GEMM (`ec_rank`, K split across the
SMs). Beyond that the weight is dequantized once into scratch and multiplied by cuBLAS, the rank-space kernel on a
side stream (`w4_prefill`). Per-channel, the tile GEMM runs at 0.77–0.87× of cuBLAS fp16's throughput at
1024–2048 rows on the 7B shapes, W4+EC at 1.00–1.06× of W4; with groups, dequantize + cuBLAS is ahead from 1024
rows (BENCHMARKS §4). An EC with int8 factors (kernels.pack) is read as int8 by every kernel here, each tile
dequantized in registers after its load; dequantize + cuBLAS multiplies by its dequantized B (dense_B).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spear.kernels.pack import PackedEC, PackedW4
from spear.kernels.pdl import launch_options, pdl_enter, runs_compiled, uses_pdl
from spear.kernels.w4.codes import _group_column, _slice_f16
from spear.kernels.w4.config import PrefillConfig, _slices_per_group, num_sms, prefill_choice
from spear.kernels.w4.dot import _w4_dot_loop
from spear.kernels.w4.epilogue import _a_tile, _add_ec_and_store, _f16_factor, _gate, _load_b_tile, _rank_scales


# Prefill rows up to which w4_linear takes the tile GEMM (w4_prefill_fused), else dequantize + cuBLAS
# (bench/prefill_lab.py, BENCHMARKS §4). Per-channel: the most it was timed at, and faster on every 7B
# shape. With groups (128 or 64) dequantize + cuBLAS is level at 512 rows and 13–35% faster at 1024.
FUSED_PREFILL_MAX_M = 2048


FUSED_PREFILL_MAX_M_GROUPED = 512


TILE_WAVE_FILL = 0.84  # how full the 128 × 256 tile GEMM's waves must be on average (takes_tile_gemm)


@triton.jit
def _rank_u(x_ptr, a_ptr, a_scale_ptr, offs_m, mask_m, offs_r, k_lo, k_hi, K, stride_xm, BM: tl.constexpr,
            R: tl.constexpr, BK: tl.constexpr, INT8_FACTORS: tl.constexpr):
    """u = A x [BM, R] in float32 for the rows offs_m over columns [k_lo, k_hi) of K (int8 A: each tile dequantized
    after its load, with a_scale)."""
    a_scale = _rank_scales(a_scale_ptr, R, INT8_FACTORS)[:, None]
    u = tl.zeros((BM, R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        offs_k = k0 + tl.arange(0, BK)
        xk = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                     mask=mask_m[:, None] & (offs_k[None, :] < k_hi), other=0.0)
        a = _f16_factor(_a_tile(a_ptr, offs_r, k0, k_hi, K, BK), a_scale, INT8_FACTORS)
        u += tl.dot(xk, tl.trans(a))
    return u


@triton.jit
def _store_g(u, w1_ptr, b1_ptr, w2_ptr, b2_ptr, g_ptr, offs_m, mask_m, offs_r, stride_gm, GATED: tl.constexpr,
             R: tl.constexpr, H: tl.constexpr):
    """g = gamma(u) ⊙ u stored in fp16 at the rows offs_m of g [M, R] (row stride stride_gm)."""
    g = _gate(u, w1_ptr, b1_ptr, w2_ptr, b2_ptr, GATED, R, H)
    tl.store(g_ptr + offs_m[:, None] * stride_gm + offs_r[None, :], g.to(tl.float16), mask=mask_m[:, None])


@triton.jit(do_not_specialize=["M"])  # M: as _w4_prefill_kernel's (k_per_split is always a multiple of 64)
def _ec_rank_kernel(x_ptr, a_ptr, a_scale_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, g_ptr, u_part_ptr, M, K, stride_xm,
                    stride_gm, k_per_split, GATED: tl.constexpr, R: tl.constexpr, H: tl.constexpr, BM: tl.constexpr,
                    BK: tl.constexpr, SPLIT: tl.constexpr, INT8_FACTORS: tl.constexpr):
    """g [M, R] = gamma(A x) ⊙ A x in fp16, for BM rows over columns [k_per_split · s, k_per_split · (s + 1)) of K,
    s = program_id(1); SPLIT: store the float32 partial u in u_part [splits, M, R] instead (_ec_gate_kernel sums
    them and applies the gate)."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    offs_r = tl.arange(0, R)
    k_lo = tl.program_id(1) * k_per_split
    u = _rank_u(x_ptr, a_ptr, a_scale_ptr, offs_m, mask_m, offs_r, k_lo, tl.minimum(k_lo + k_per_split, K), K,
                stride_xm, BM, R, BK, INT8_FACTORS)
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
def _ec_rank_programs_kernel(x_ptr, a_ptr, a_scale_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, g_ptr, M, K, stride_xm,
                             stride_gm, GATED: tl.constexpr, R: tl.constexpr, H: tl.constexpr, BM: tl.constexpr,
                             BK: tl.constexpr, PDL: tl.constexpr, INT8_FACTORS: tl.constexpr):
    """g [M, R] = gamma(A x) ⊙ A x in fp16 from a few programs beside the prefill tile GEMM (w4_prefill_fused):
    program p takes row blocks p, p + P, ... (P programs), each over all of K. With PDL it waits for the launch
    before it (x's producer) and then at once lets the next launch, the GEMM, start on the other SMs."""
    pdl_enter(PDL)
    offs_r = tl.arange(0, R)
    for block in range(tl.program_id(0), tl.cdiv(M, BM), tl.num_programs(0)):
        offs_m = block * BM + tl.arange(0, BM)
        mask_m = offs_m < M
        u = _rank_u(x_ptr, a_ptr, a_scale_ptr, offs_m, mask_m, offs_r, 0, K, K, stride_xm, BM, R, BK, INT8_FACTORS)
        _store_g(u, w1_ptr, b1_ptr, w2_ptr, b2_ptr, g_ptr, offs_m, mask_m, offs_r, stride_gm, GATED, R, H)


# M is not specialized: a prefill chunk's row count changes from step to step, and Triton would otherwise compile
# a variant of this kernel the first time M is a multiple of 16 (seconds in the middle of serving).
@triton.jit(do_not_specialize=["M"])
def _w4_prefill_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, g_ptr, b_ptr, b_scale_ptr,
    M, N, K, KW, G, group_size, stride_xm, stride_ym,
    HAS_EC: tl.constexpr, HAS_BIAS: tl.constexpr, R: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, SPG: tl.constexpr, GROUP_M: tl.constexpr, PER_CHANNEL: tl.constexpr,
    DOT_ASM: tl.constexpr = False, SCALE_CODES: tl.constexpr = True, PDL: tl.constexpr = False,
    INT8_FACTORS: tl.constexpr = False,
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
    if INT8_FACTORS:  # int8 B (a weight) dequantized before the main loop: after it, the epilogue dot's operand made
        # in registers there had ptxas serialize every wgmma of the kernel (C7515, sm_90, offline SASS)
        b = _f16_factor(_load_b_tile(b_ptr, offs_n, mask_n, HAS_EC, R),
                        _rank_scales(b_scale_ptr, R, INT8_FACTORS)[None, :], INT8_FACTORS)
    # yᵀ tile: the dequantized weight is the dot's first operand
    acc = _w4_dot_loop(x_ptr, stride_xm, offs_m, mask_m, qw_ptr, s_ptr, z_ptr, offs_n, mask_n, 0, KW * 8, K, KW, G,
                       group_size, SPG, BN, BM, PER_CHANNEL, DOT_ASM, SCALE_CODES)
    g = tl.zeros((BM, R), dtype=tl.float32)
    if HAS_EC:
        pdl_enter(PDL)
        offs_r = tl.arange(0, R)
        g = tl.load(g_ptr + offs_m[:, None] * R + offs_r[None, :], mask=mask_m[:, None], other=0.0).to(tl.float32)
    if not INT8_FACTORS:
        b = _load_b_tile(b_ptr, offs_n, mask_n, HAS_EC, R)
    _add_ec_and_store(acc, g, b, offs_m, mask_m, offs_n, mask_n, y_ptr, stride_ym, bias_ptr, HAS_EC, HAS_BIAS)


# The rank programs beside the prefill tile GEMM (w4_prefill_fused), as timed by prefill_lab.py --rank-programs: one
# program streams x at 43–57 GB/s, and the GEMM's tiles wait at the end of their first wave for the whole
# of g, so a program takes at most two row blocks: 4 programs at 1024 rows (W4+EC / W4 1.00–1.04 on the 7B shapes),
# 8 at 2048 (0.97–1.05; with 4 programs of 4 blocks, 1.06–1.22).
PREFILL_RANK_BK = 128  # columns of x and A a step: three steps of 128 rows in flight, 120 KB (offline: 90 registers)


PREFILL_RANK_WARPS = 8


PREFILL_RANK_STAGES = 3


PREFILL_RANK_PROGRAMS = 8  # the most programs


PREFILL_RANK_BLOCKS = 2  # the most row blocks a program takes




def ec_rank(x: torch.Tensor, ec: PackedEC, block_m: int = 64, block_k: int = 64, out: torch.Tensor | None = None,
            splits: int | None = None, num_warps: int = 4, num_stages: int = 4, fill: int = 1) -> torch.Tensor:
    """g = gamma(A x) ⊙ A x  [M, R] fp16; into `out` (any row stride) if given.

    K is split (`splits`, default rank_splits) where the row blocks alone would leave most SMs idle: at 1024 rows,
    32 programs each streamed a whole 32-row slice of x, which cost W4+EC 20–70 µs over W4 on the 7B shapes
    unsplit. Split, the partial u go to a float32 scratch and a second launch sums them in order and applies the gate.
    `fill`: programs an SM that the default split aims at. The defaults were the most even of 14 tilings on the H200
    (bench/prefill_lab.py --ec-rank 32): 7.9–17.0 µs on the 7B shapes at 1024–2048 rows where
    (32, 64, 3 stages, 2 an SM) took 7.8–22.6."""
    m, k = x.shape
    g = out if out is not None else torch.empty(m, ec.padded_rank, dtype=torch.float16, device=x.device)
    row_blocks = triton.cdiv(m, block_m)
    splits = splits or rank_splits(row_blocks, k, block_k, num_sms(x.device), fill)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    u_part = torch.empty(splits, m, ec.padded_rank, dtype=torch.float32, device=x.device) if splits > 1 else g
    ec_dims = ec.dims()
    _ec_rank_kernel[(row_blocks, splits)](
        x, ec.A, ec.scale_args()[0], ec.W1, ec.b1, ec.W2, ec.b2, g, u_part, m, k, x.stride(0), g.stride(0), k_per_split,
        **ec_rank_flags(ec_dims, block_m, block_k, splits > 1, num_warps, num_stages))
    if splits > 1:
        _ec_gate_kernel[(row_blocks,)](u_part, ec.W1, ec.b1, ec.W2, ec.b2, g, m, splits, g.stride(0),
                                       **ec_gate_flags(ec_dims, block_m, num_warps))
    return g


def ec_gate_flags(ec: tuple[int, int, bool, bool], block_m: int = 64, num_warps: int = 4) -> dict:
    """_ec_gate_kernel's compile-time arguments for an EC (PackedEC.dims: padded rank R, the gate's hidden size H,
    gated, int8 factors, which this kernel does not read) at block_m rows a program: ec_rank launches with these,
    kernels.offline compiles them."""
    rank, hidden, gated, _ = ec
    return dict(GATED=gated, R=rank, H=hidden, BM=block_m, num_warps=num_warps)


def ec_rank_flags(ec: tuple[int, int, bool, bool], block_m: int = 64, block_k: int = 64, split: bool = False,
                  num_warps: int = 4, num_stages: int = 4) -> dict:
    """_ec_rank_kernel's compile-time arguments (ec_rank's defaults): ec_gate_flags's, block_k columns a step,
    SPLIT where K is split (the float32 partials to _ec_gate_kernel), INT8_FACTORS for int8 A."""
    return {**ec_gate_flags(ec, block_m, num_warps), "BK": block_k, "SPLIT": split, "num_stages": num_stages,
            "INT8_FACTORS": ec[3]}


def rank_programs_flags(ec: tuple[int, int, bool, bool], cfg: PrefillConfig) -> dict:
    """_ec_rank_programs_kernel's compile-time arguments beside the tile GEMM under `cfg` (its row blocks); PDL is
    the launch's (kernels.pdl.launch_options)."""
    return {**ec_gate_flags(ec, cfg.block_m, PREFILL_RANK_WARPS), "BK": PREFILL_RANK_BK,
            "num_stages": PREFILL_RANK_STAGES, "INT8_FACTORS": ec[3]}


def prefill_flags(cfg: PrefillConfig, group_size: int, per_channel: bool, ec: tuple[int, int, bool, bool] | None,
                  *, has_bias: bool, compiled: bool) -> dict:
    """_w4_prefill_kernel's compile-time arguments (constexprs, num_warps, num_stages) under `cfg`: w4_prefill_fused
    launches with these, kernels.offline compiles them. `ec` as ec_gate_flags's, or None; `compiled`: compiled code
    (the codes through inline PTX), not the interpreter. PDL is the launch's."""
    return dict(HAS_EC=ec is not None, HAS_BIAS=has_bias, R=ec[0] if ec is not None else 16, BM=cfg.block_m,
                BN=cfg.block_n, SPG=_slices_per_group(group_size), GROUP_M=cfg.group_m, PER_CHANNEL=per_channel,
                DOT_ASM=compiled, INT8_FACTORS=ec is not None and ec[3], num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


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
    cfg = cfg or prefill_choice(w, m) or prefill_config(m, w.scales.shape[1] == 1)
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    row_blocks = triton.cdiv(m, cfg.block_m)
    tiles = row_blocks * triton.cdiv(n, cfg.block_n)
    beside = {"PDL": False}  # the GEMM's launch options: PDL after the rank programs
    ec_dims = ec.dims() if ec is not None else None
    if ec is not None and g is None:
        if rank_programs is None:
            rank_programs = prefill_rank_programs(row_blocks, tiles, cfg, num_sms(x.device)) if uses_pdl(x) else 0
        if rank_programs:
            g = torch.empty(m, ec.padded_rank, dtype=torch.float16, device=x.device)
            beside = launch_options(x)
            _ec_rank_programs_kernel[(rank_programs,)](
                x, ec.A, ec.scale_args()[0], ec.W1, ec.b1, ec.W2, ec.b2, g, m, k, x.stride(0), g.stride(0),
                **rank_programs_flags(ec_dims, cfg), **beside)
        else:
            g = ec_rank(x, ec)
    _w4_prefill_kernel[(tiles,)](
        x, w.qweight, w.scales, w.zeros, bias if bias is not None else y, y,
        g if g is not None else y, *((ec.B, ec.scale_args()[1]) if ec is not None else (y, y)),
        m, n, k, w.qweight.shape[1], w.scales.shape[1], w.group_size, x.stride(0), y.stride(0),
        **prefill_flags(cfg, w.group_size, w.scales.shape[1] == 1, ec_dims, has_bias=bias is not None,
                        compiled=runs_compiled(x)), **beside,
    )
    return y


def prefill_rank_programs(row_blocks: int, tiles: int, cfg: PrefillConfig, sms: int) -> int:
    """Programs of _ec_rank_programs_kernel beside the tile GEMM (0: ec_rank's launch before it): the fewest that take
    at most PREFILL_RANK_BLOCKS row blocks each, where that is at most PREFILL_RANK_PROGRAMS and fits the SMs that
    the tiles leave idle in their last wave; only with the 128 × 256 tile (one CTA an SM: its slots are the SMs).
    A rank program for every SM in the GEMM's own launch (5532723): they took the whole GPU before the
    tiles, level with ec_rank's launch; a few programs inside the GEMM's launch cost its main loop 309 → 323
    instructions (offline SASS), hence a launch of their own."""
    if cfg.block_n != 256:
        return 0
    programs = triton.cdiv(row_blocks, PREFILL_RANK_BLOCKS)
    return programs if programs <= min(-tiles % sms, PREFILL_RANK_PROGRAMS) else 0


def prefill_config(m: int, per_channel: bool) -> PrefillConfig:
    """The tile GEMM's untuned config for m rows: 128 × 128 tiles; 128 × 256 from 1024 rows with per-channel scales.
    Timed with bench/prefill_lab.py: per-channel, this was within 17% of each row's best of PREFILL_CANDIDATES on the
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
        **dequant_flags(block_n),
    )
    return out


def dequant_flags(block_n: int = 64) -> dict:
    """_dequant_kernel's compile-time arguments for tiles of block_n rows (dequantize_w4_into's)."""
    return dict(BN=block_n, num_warps=4)


def w4_prefill(x: torch.Tensor, w: PackedW4, ec: PackedEC | None = None, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] for many rows: dequantize W once into scratch, then one cuBLAS GEMM.

    With an EC (semi-fused): on CUDA the rank-space kernel computes g = gamma(A x) ⊙ A x on a side stream while the
    main stream dequantizes; then y = g (alpha·B)ᵀ (+ bias), and the GEMM adds x W_hatᵀ to it (beta = 1: cuBLAS reads
    the EC term in its epilogue, where the GEMM's compute hides it, instead of a pass of its own over y afterwards).
    Measured on the H200 this order of ops beat running the EC as R extra GEMM columns ([x | g]·[W_hat | alpha·B]ᵀ,
    which must copy x) in 5 of 6 shapes at M ≥ 1024 (BENCHMARKS.md §4, with y += g (alpha·B)ᵀ after the GEMM then).
    A narrow weight (4 N ≤ K: 8B/70B k/v) runs the GEMM first, beside the rank kernel, then y += g (alpha·B)ᵀ: the
    pass over y (4 M N bytes) costs less than the wait for g, whose kernel reads 2 M K (the EC cost
    1.35–1.43× there with g first).
    """
    n, k = w.out_features, w.in_features
    # an int8 EC's alpha·B is dequantized each call (ec.dense_B()), not cached (a cache would hold B at three bytes an
    # entry): its N × R entries are R / K of the weight's N × K this path dequantizes each call too (1.6% at R = 64,
    # K = 4096), before a GEMM of more than DECODE_PATH_MAX_M rows
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
        return y.addmm_(g, ec.dense_B().t())
    if side is not None:
        main.wait_stream(side)
    else:
        g = ec_rank(x, ec)
    return _mm_bias(g, ec.dense_B().t(), bias, out).addmm_(x, w_hat.t())


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
    + cuBLAS took 34.6). The 128 × 256 tile (one CTA an SM) also needs its waves full to TILE_WAVE_FILL:
    on 13B q/k/v/o and down (N = 5120) 1024 rows make 160 tiles, 1.2 waves of 132, and took 135 / 348 µs against
    dequantize + cuBLAS's 93 / 243 (BENCHMARKS §4). W4 alone, every shape timed with its waves under 0.84
    full was faster through cuBLAS (13b gate/up at 1024 rows, 0.82 full: 4%); with an EC the tile GEMM's rank
    programs make up for that much (13b gate/up 6% ahead), not for 13b q/k/v/o or down."""
    cfg = prefill_config(m, per_channel)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if m > (FUSED_PREFILL_MAX_M if per_channel else FUSED_PREFILL_MAX_M_GROUPED) or 2 * tiles < sms:
        return False
    return cfg.block_n != 256 or tiles / (triton.cdiv(tiles, sms) * sms) >= TILE_WAVE_FILL
