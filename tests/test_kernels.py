"""Triton W4A16 kernels against their PyTorch references (CPU: TRITON_INTERPRET=1, set in conftest).

Inputs are drawn fresh each run (the seed is in every failure message) and outputs are
poisoned with NaN before each launch, so an unwritten element fails the comparison.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from spear.errors import SpearError
from spear.kernels import options
from spear.kernels import tune_cache as tune_cache_module
from spear.kernels import w4 as w4_module
from spear.kernels.w4 import config as w4_config
from spear.kernels.w4 import decode as w4_decode_module
from spear.kernels.w4 import prefill as w4_prefill_module
from spear.kernels.w4 import tuning as w4_tuning
from spear.kernels.pack import pack_ec, pack_w4, unpack_w4
from spear.kernels.reference import dequantize_w4, ec_gated_rank_ref, w4_linear_ref
from spear.kernels.w4 import (
    DecodeConfig,
    PrefillConfig,
    dequantize_w4_into,
    ec_rank,
    w4_decode,
    w4_linear,
    w4_prefill,
    w4_prefill_fused,
)
from spear.kernels.w4.config import DECODE_CANDIDATES
from spear.kernels.w4.decode import _WORKSPACE
from spear.kernels.w4.epilogue import READS_SHIFT
from spear.layer import ErrorCompensator, SpearLinear
from spear.record import QuantConfig, QuantizedWeight, rtn_quantize

SEED = int.from_bytes(os.urandom(4), "little")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL_DECODE = DecodeConfig(block_n=32)
SMALL_PREFILL = PrefillConfig(block_m=32, block_n=32, group_m=2, num_warps=4, num_stages=2)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


def random_w4(n: int, k: int, group: int, gen: torch.Generator, sym: bool = True):
    w = torch.randn(n, k, generator=gen) * (1 + torch.rand(n, 1, generator=gen))
    return rtn_quantize(w, QuantConfig(4, group, sym=sym))


def random_ec(n: int, k: int, rank: int, gen: torch.Generator, gate_hidden: int = 8,
              factor_bits: int = 16) -> ErrorCompensator:
    ec = ErrorCompensator(k, n, rank, gate_hidden=gate_hidden, alpha=0.5 + torch.rand(1, generator=gen).item(),
                          factor_bits=factor_bits)
    with torch.no_grad():
        for name, p in ec.named_parameters():
            if name != "alpha":
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() < 2 else 1 / p.shape[1] ** 0.5))
    return ec


def poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=torch.float16, device=DEVICE)


def assert_close(y: torch.Tensor, ref: torch.Tensor, what: str, rtol: float = 2e-3) -> None:
    assert not y.isnan().any(), f"{what}: unwritten (NaN) outputs; seed {SEED}"
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < rtol, f"{what}: relative error {err:.2e}; seed {SEED}"


def test_packing_round_trips_codes_and_dequantizes_bit_exactly(gen):
    for group in (-1, 32, 64, 128):
        record = random_w4(64, 256, group, gen, sym=group != 64)
        packed = pack_w4(record)
        assert packed.qweight.dtype == torch.int32 and packed.qweight.shape == (64, 32)
        assert packed.in_features == 256
        assert torch.equal(unpack_w4(packed), record.codes)
        assert torch.equal(dequantize_w4(packed), record.dequantize(torch.float16))


def test_packing_puts_column_pairs_in_the_halves_of_a_word():
    """The pair layout (pack.py): word 16 b + 8 h + p holds columns 128 b + 16 (4 h + jj) + 2 p (bits 4 jj) and
    + 1 (bits 16 + 4 jj). Each code here is its column mod 16 (2 p + t), its slice's jj in the row below."""
    k = 256
    col = torch.arange(k)
    codes = torch.stack([col % 16, (col // 16) % 4]).repeat(32, 1).to(torch.uint8)  # [64, K]
    record = QuantizedWeight(codes, torch.ones(64, 1), torch.zeros(64, 1), 4, k)
    words = pack_w4(record).qweight.view(32, 2, 2, 2, 8)  # [row pair, row, b, h, p]
    for p in range(8):
        # every nibble of the low half is 2 p, of the high half 2 p + 1: 0x(2p+1)(2p+1)(2p+1)(2p+1)(2p)(2p)(2p)(2p)
        pair = (2 * p + 1) * 0x11110000 + 2 * p * 0x1111
        assert (words[:, 0, :, :, p] == pair - (pair >= 2**31) * 2**32).all()
    assert (words[:, 1] == 0x32103210).all()  # jj at bits 4 jj and 16 + 4 jj, in every word
    assert torch.equal(unpack_w4(pack_w4(record)), codes)


def test_packing_rejects_what_the_kernels_cannot_take(gen):
    with pytest.raises(SpearError, match="4-bit"):
        pack_w4(rtn_quantize(torch.randn(64, 64, generator=gen), QuantConfig(3, -1)))
    with pytest.raises(SpearError, match="multiples of 64"):
        pack_w4(rtn_quantize(torch.randn(64, 96, generator=gen), QuantConfig(4, 32)))


def test_int8_ec_packs_as_stored_and_round_trips(gen):
    """An 8-bit EC packs as it is stored (kernels.pack): int8 A [R, K] and B [N, R] with float32 scales per rank
    direction (alpha folded into B's), zero codes and scale 0 on the padded rank; dense_A / dense_B give factors()
    (and alpha·B) to fp16 rounding; nbytes counts a byte a factor entry; .to keeps the form. An fp16 EC packs as
    before, without scales."""
    n, k, r = 96, 128, 12
    ec = random_ec(n, k, r, gen, factor_bits=8)
    packed = pack_ec(ec)
    R, H = 16, 16  # rank 12 and gate hidden 8 padded
    assert packed.rank == r and packed.int8 and packed.dims() == (R, H, True, True)
    assert (packed.A.dtype, packed.A.shape, packed.B.dtype, packed.B.shape) == (torch.int8, (R, k), torch.int8, (n, R))
    assert packed.a_scale.dtype == packed.b_scale.dtype == torch.float32
    assert not (packed.A[r:].any() or packed.B[:, r:].any() or packed.a_scale[r:].any() or packed.b_scale[r:].any())
    (qa, _), (qb, _) = ec.int8_factors()
    assert torch.equal(packed.A[:r], qa) and torch.equal(packed.B[:, :r], qb)
    A, B = (t.detach() for t in ec.factors())
    assert packed.dense_A().dtype == packed.dense_B().dtype == torch.float16
    torch.testing.assert_close(packed.dense_A()[:r].float(), A, rtol=1e-3, atol=0)
    torch.testing.assert_close(packed.dense_B()[:, :r].float(), ec.alpha.detach() * B, rtol=1e-3, atol=0)
    gate = 2 * (2 * H * R + H + R)
    assert packed.nbytes() == R * k + n * R + 2 * 4 * R + gate
    moved = packed.to(torch.device("cpu"))
    assert moved.int8 and torch.equal(moved.b_scale, packed.b_scale) and moved.A.dtype == torch.int8
    fp16 = pack_ec(random_ec(n, k, r, gen))
    assert not fp16.int8 and fp16.a_scale is None and fp16.A.dtype == torch.float16 and fp16.dense_A() is fp16.A
    assert fp16.nbytes() == 2 * (R * k + n * R) + gate and fp16.scale_args() == (fp16.A, fp16.A)


def test_int8_ec_kernels_equal_the_fp16_path_on_its_dequantized_factors(gen):
    """Every W4 launch with an int8 EC (A and B read as int8, each tile dequantized in registers) gives what the same
    launch gives with an fp16 EC holding its dequantized factors (dense_A, dense_B), within fp16 rounding, and the
    reference: the GEMV loops (float32 with A's steps loaded ahead, fp16x2), the dot loop with K split, SwiGLU in
    the epilogue, the prefill tile GEMM after ec_rank's launch and beside the rank programs, dequantize + cuBLAS."""
    n, k = 128, 320
    w = pack_w4(random_w4(n, k, 64, gen)).to(DEVICE)
    int8 = pack_ec(random_ec(n, k, 24, gen, factor_bits=8)).to(DEVICE)
    fp16 = dataclasses.replace(int8, A=int8.dense_A(), B=int8.dense_B(), a_scale=None, b_scale=None)
    assert fp16.dims() == (32, 16, True, False)

    def same(y8, y16, what):
        assert_close(y8, y16, f"int8 EC {what} against fp16", rtol=1e-3)
        torch.testing.assert_close(y8, y16, rtol=2e-3, atol=1e-3, msg=f"{what}; seed {SEED}")

    for m, cfg in ((1, DecodeConfig(block_n=32, gemv_rows=4, block_kw=128, num_stages=1)),
                   (2, DecodeConfig(block_n=32, split_k=2, gemv_rows=4, block_kw=32, num_stages=1, gemv_f16x2=True)),
                   (16, DecodeConfig(block_n=64, split_k=3, gemv_rows=0, num_warps=4))):
        x = torch.randn(m, k, generator=gen).half().to(DEVICE)
        y8 = w4_decode(x, w, int8, None, cfg, out=poisoned(m, n))
        same(y8, w4_decode(x, w, fp16, None, cfg), f"decode m={m}")
        assert_close(y8, w4_linear_ref(x, w, int8), f"int8 EC decode m={m} against the reference")
    act = w4_decode(x, w, int8, None, cfg, swiglu=True)
    same(act, w4_decode(x, w, fp16, None, cfg, swiglu=True), "swiglu")
    x = torch.randn(45, k, generator=gen).half().to(DEVICE)
    for programs in (0, 2):
        y8 = w4_prefill_fused(x, w, int8, None, SMALL_PREFILL, out=poisoned(45, n), rank_programs=programs)
        same(y8, w4_prefill_fused(x, w, fp16, None, SMALL_PREFILL, rank_programs=programs), f"prefill {programs}")
    assert_close(y8, w4_linear_ref(x, w, int8), "int8 EC prefill against the reference")
    same(w4_prefill(x, w, int8), w4_prefill(x, w, fp16), "dequantize + cuBLAS")


@pytest.mark.parametrize("group,ec_bits", [(g, bits) for g in (-1, 32, 64, 128) for bits in (None, 16)]
                         + [(-1, 8), (32, 8)])  # no EC, fp16 factors, int8 factors
def test_decode_kernel_matches_reference(group, ec_bits, gen):
    n, k = 192, 256  # odd tile counts: 192 / 32 = 6 tiles, K splits unevenly
    packed = pack_w4(random_w4(n, k, group, gen, sym=group != 32)).to(DEVICE)
    ec = pack_ec(random_ec(n, k, 8, gen, factor_bits=ec_bits)).to(DEVICE) if ec_bits else None
    bias = torch.randn(n, generator=gen).half().to(DEVICE)
    for m, split_k in ((1, 1), (3, 2), (16, 3), (40, 2), (100, 1)):  # row tiles 16, 16, 16, 64, 128
        x = torch.randn(m, k, generator=gen).half().to(DEVICE)
        y = w4_decode(x, packed, ec, bias, DecodeConfig(block_n=32, split_k=split_k, gemv_rows=0), out=poisoned(m, n))
        assert_close(y, w4_linear_ref(x, packed, ec, bias), f"decode m={m} split_k={split_k} g={group} ec={ec_bits}")


def test_one_row_tuning_also_times_the_gemv_loop_split_fixed_ways():
    """At one row the tuner times each GEMV-loop candidate with the automatic split and with K split each of
    options' gemv_splits ways (fixed splits won on 7B o and down); at 2–4 rows the automatic split alone, above 4
    the dot loop alone."""
    from spear.kernels.w4.config import _tune_candidates

    splits = options.OPTIONS.gemv_splits
    gemv = [c for c in DECODE_CANDIDATES if c.gemv_rows]
    one, four, sixteen = _tune_candidates(1), _tune_candidates(4), _tune_candidates(16)
    assert splits and all(c.split_k == 0 for c in four) and not any(c.gemv_rows for c in sixteen)
    fixed = [dataclasses.replace(c, split_k=s) for c in gemv for s in splits]
    assert one == four + fixed and len(set(one)) == len(one)


def test_dot_loop_split_k_matches_reference(gen):
    """split_count: K split until the grid has decode.FILL programs an SM (at most one a step), or as the config
    says; the dot loop's result does not depend on the split."""
    from spear.kernels.w4.decode import split_count

    assert split_count(DecodeConfig(block_n=64, gemv_rows=0), tiles=2, steps=8, sms=4) == 4
    assert split_count(DecodeConfig(block_n=64, gemv_rows=0), tiles=2, steps=3, sms=4) == 3  # one step each
    assert split_count(DecodeConfig(block_n=64, split_k=3), tiles=2, steps=8, sms=4) == 3  # explicit wins
    n, k = 128, 1024
    packed = pack_w4(random_w4(n, k, -1, gen, sym=True)).to(DEVICE)
    ec = pack_ec(random_ec(n, k, 8, gen)).to(DEVICE)
    x = torch.randn(16, k, generator=gen).half().to(DEVICE)
    for split_k in (0, 8):
        y = w4_decode(x, packed, ec, None, DecodeConfig(block_n=64, split_k=split_k, gemv_rows=0, num_warps=4),
                      out=poisoned(16, n))
        assert_close(y, w4_linear_ref(x, packed, ec), f"dot loop split_k={split_k}")


@pytest.mark.parametrize("group", [-1, 128])
def test_wide_dot_loop_takes_a_partial_last_block(group, gen):
    """The one-dot-a-block loop (_w4_block_wide) where K is not a whole number of 128-column blocks: the packed codes
    pad the last block and x's load is masked there (per-channel, and one group of 128 a block)."""
    n, k = 64, 320 if group == -1 else 384
    packed = pack_w4(random_w4(n, k, group, gen, sym=False)).to(DEVICE)
    for m in (5, 16, 33):
        x = torch.randn(m, k, generator=gen).half().to(DEVICE)
        y = w4_decode(x, packed, None, None, DecodeConfig(block_n=32, split_k=2, gemv_rows=0), out=poisoned(m, n))
        assert_close(y, w4_linear_ref(x, packed), f"wide dot loop m={m} k={k} g={group}")


@pytest.mark.parametrize("group", [32, 64, 128])
def test_wide_dot_loop_with_groups_matches_reference(group, gen, monkeypatch):
    """Groups of 64 and 32 columns take one dot each (_span_wide: the half block's
    planes joined back into column order), a group of 128 one a block. The decode kernel scales each group's float32
    partial tile; the prefill tile GEMM multiplies the codes by their scale in fp16 (SCALE_CODES: W_hat as the
    reference rounds it). With and without the EC, partial last block included."""
    n, k = 64, 320 if group < 128 else 384
    packed = pack_w4(random_w4(n, k, group, gen, sym=False)).to(DEVICE)
    ec = pack_ec(random_ec(n, k, 8, gen)).to(DEVICE)
    for m, e in ((16, None), (33, ec)):
        x = torch.randn(m, k, generator=gen).half().to(DEVICE)
        y = w4_decode(x, packed, e, None, DecodeConfig(block_n=32, split_k=2, gemv_rows=0), out=poisoned(m, n))
        assert_close(y, w4_linear_ref(x, packed, e), f"decode g={group} m={m}")
    x = torch.randn(45, k, generator=gen).half().to(DEVICE)
    y = w4_prefill_fused(x, packed, ec, None, SMALL_PREFILL, out=poisoned(45, n))
    assert_close(y, w4_linear_ref(x, packed, ec), f"prefill tile GEMM g={group}")


@pytest.mark.parametrize("with_ec", [False, True])
def test_folded_norm_matches_add_rms_norm_between_two_launches(with_ec, gen):
    """An RMSNorm folded into the W4 launches around it (FoldedNorm): the producer's h, its per-tile Σ h², and
    the consumer's output (plain or SwiGLU) against ops.add_rms_norm between two reference layers; every main
    loop (fp16x2 word chains at one row, float32 GEMV, tensor-core dots) and split-K on both sides."""
    from spear.kernels.w4 import w4_decode_add_norm
    from spear.kernels.ops import add_rms_norm_ref

    k, n, n2 = 256, 192, 128
    producer = pack_w4(random_w4(n, k, -1, gen)).to(DEVICE)
    consumer = pack_w4(random_w4(2 * n2, n, -1, gen)).to(DEVICE)  # [gate; up] for the SwiGLU case
    ec_p = pack_ec(random_ec(n, k, 8, gen)).to(DEVICE) if with_ec else None
    ec_c = pack_ec(random_ec(2 * n2, n, 8, gen)).to(DEVICE) if with_ec else None
    bias = torch.randn(n, generator=gen).half().to(DEVICE)
    norm_w = (1 + torch.rand(n, generator=gen)).half().to(DEVICE)
    f16x2 = DecodeConfig(block_n=32, split_k=2, gemv_rows=4, block_kw=32, num_stages=1, gemv_f16x2=True)
    f32 = DecodeConfig(block_n=64, split_k=3, gemv_rows=4, block_kw=16, num_stages=1)
    dot = DecodeConfig(block_n=32, split_k=2, gemv_rows=0)
    for m, cfg_p, cfg_c in ((1, f16x2, f32), (3, f32, f16x2), (5, dot, dot), (1, dot, f16x2)):
        x = torch.randn(m, k, generator=gen).half().to(DEVICE)
        residual = (torch.randn(m, n, generator=gen) * 4).half().to(DEVICE)
        folded = w4_decode_add_norm(x, producer, ec_p, bias, residual, norm_w, 1e-5, cfg_p)
        normed, h = add_rms_norm_ref(w4_linear_ref(x, producer, ec_p, bias), norm_w, 1e-5, residual)
        what = f"m={m} producer {cfg_p} consumer {cfg_c} ec={with_ec}"
        assert_close(folded.h, h, f"h {what}", rtol=1e-3)
        tiles = -(-n // cfg_p.block_n)
        assert folded.ssq.shape == (m, tiles)
        hf = folded.h.float().view(m, tiles, -1)
        torch.testing.assert_close(folded.ssq, (hf * hf).sum(-1), rtol=1e-5, atol=0, msg=what)
        assert_close(folded.hw, folded.h * norm_w, f"hw {what}", rtol=1e-3)
        y = w4_decode(folded.hw, consumer, ec_c, None, cfg_c, out=poisoned(m, 2 * n2), rms=folded)
        assert_close(y, w4_linear_ref(normed, consumer, ec_c), f"consumer {what}")
        act = w4_decode(folded.hw, consumer, ec_c, None, cfg_c, out=poisoned(m, n2), rms=folded, swiglu=True)
        gate, up = w4_linear_ref(normed, consumer, ec_c).float().chunk(2, dim=-1)
        assert_close(act, torch.nn.functional.silu(gate) * up, f"swiglu consumer {what}")


def test_folded_norm_rejects_what_it_cannot_take(gen):
    from spear.kernels.w4 import w4_decode_add_norm

    packed = pack_w4(random_w4(64, 64, -1, gen)).to(DEVICE)
    x = torch.randn(1, 64, generator=gen).half().to(DEVICE)
    with pytest.raises(ValueError, match="residual"):
        w4_decode_add_norm(x, packed, None, None, torch.zeros(2, 64).half(), torch.ones(64).half(), 1e-5)


def test_decode_kernel_stores_float32_into_a_strided_view(gen):
    """Tensor parallelism's symmetric path: the partial y_r in float32 straight into the [y | u] staging rows."""
    n, k = 192, 256
    packed = pack_w4(random_w4(n, k, -1, gen)).to(DEVICE)
    for m, cfg in ((1, DecodeConfig(block_n=32, gemv_rows=4)), (5, DecodeConfig(block_n=32, gemv_rows=0))):
        x = torch.randn(m, k, generator=gen).half().to(DEVICE)
        rows = torch.full((m, n + 40), float("nan"), device=DEVICE)
        w4_decode(x, packed, None, None, cfg, out=rows[:, :n])
        assert rows[:, n:].isnan().all(), "wrote past the view"
        assert_close(rows[:, :n], w4_linear_ref(x, packed).float(), f"float32 strided out m={m}")


@pytest.mark.parametrize("group", [-1, 32, 64, 128])
def test_decode_gemv_loop_matches_reference(group, gen):
    """The few-row GEMV main loop (DecodeConfig.gemv_rows) at 1–4 rows, one or several 128-column blocks per
    step (K = 576 pads to 640; 640 = 2.5 steps of 32 words: the last step is partial), and the dot loop above
    its row limit."""
    n, k = 128, 640 if group == 128 else 576
    packed = pack_w4(random_w4(n, k, group, gen, sym=group == -1)).to(DEVICE)
    ec = pack_ec(random_ec(n, k, 8, gen)).to(DEVICE)
    # 128 words a step: the u-programs take 64 columns of A a step (w4.ax_block), the others 128
    # single-stage loops load each step's codes a step ahead (W4Launch.preload), pipelined ones through shared memory
    for m, split_k, block_kw, stages in ((1, 1, 32, 1), (2, 3, 16, 3), (3, 2, 32, 1), (4, 1, 16, 3), (5, 2, 32, 1),
                                         (1, 1, 128, 3), (2, 2, 128, 1)):
        x = torch.randn(m, k, generator=gen).half().to(DEVICE)
        cfg = DecodeConfig(block_n=32, split_k=split_k, gemv_rows=4, block_kw=block_kw, num_stages=stages)
        y = w4_decode(x, packed, ec, None, cfg, out=poisoned(m, n))
        assert_close(y, w4_linear_ref(x, packed, ec), f"gemv m={m} g={group} split_k={split_k} block_kw={block_kw}")


@pytest.mark.parametrize("f16x2", [False, True])
def test_decode_gemv_loops_take_x_rows_at_any_alignment(f16x2, gen):
    """The GEMV loops read x as int32 pairs of adjacent columns: a view of x with an odd row stride and an odd
    element offset gives the same result as its contiguous copy."""
    n, k = 64, 256
    packed = pack_w4(random_w4(n, k, 64, gen)).to(DEVICE)
    x = torch.randn(2, k + 1, generator=gen).half().to(DEVICE)[:, 1:]
    cfg = DecodeConfig(block_n=32, gemv_rows=4, block_kw=16, gemv_f16x2=f16x2)
    assert torch.equal(w4_decode(x, packed, None, None, cfg), w4_decode(x.contiguous(), packed, None, None, cfg))


@pytest.mark.parametrize("group", [-1, 32, 64, 128])
@pytest.mark.parametrize("with_ec", [False, True])
def test_decode_gemv_f16x2_loop_matches_reference(group, with_ec, gen):
    """The GEMV loop in fp16x2 (DecodeConfig.gemv_f16x2; under the interpreter its Triton twin of the inline PTX) at
    1–4 rows, per-channel (z in the codes) and grouped (chains of two pairs at g = 32, two spans a chain at g = 64),
    partial last steps (K = 576 pads to 640), split K. Its fp16 sums of four products cost precision: relative
    error ~4e-4 per-channel and grouped (float32 loop 1-3e-4), within the tolerance."""
    n, k = 128, 640 if group == 128 else 576
    packed = pack_w4(random_w4(n, k, group, gen, sym=group == -1)).to(DEVICE)
    ec = pack_ec(random_ec(n, k, 8, gen)).to(DEVICE) if with_ec else None
    for m, split_k, block_kw, stages in ((1, 1, 32, 1), (2, 3, 16, 1), (3, 2, 32, 3), (4, 1, 16, 1)):
        x = torch.randn(m, k, generator=gen).half().to(DEVICE)
        cfg = DecodeConfig(block_n=32, split_k=split_k, gemv_rows=4, block_kw=block_kw, gemv_f16x2=True,
                           num_stages=stages)
        y = w4_decode(x, packed, ec, None, cfg, out=poisoned(m, n))
        assert_close(y, w4_linear_ref(x, packed, ec), f"gemv f16x2 m={m} g={group} ec={with_ec} split_k={split_k}")


@pytest.mark.parametrize("chain", ["1", "2", "4"])
@pytest.mark.parametrize("k", [576, 1024])  # partial last steps (masked loads), whole ones (w4_decode's `even`)
def test_decode_gemv_f16x2_word_chains_match_reference_and_take_large_x(chain, k, gen, monkeypatch):
    """One row, per-channel: the fp16 chains over 2 or 4 words (decode.WORD_CHAIN, codes (q − z) / 256) match the
    reference, with split K and partial steps, and stay finite for x = 30,000 everywhere: the one-word chain's codes
    (q − z) / 16 overflow fp16 there (row 0's chains of four products 15/16 · 30,000); 2 words of (q − z) / 256
    reach 8 · 15/256 · 30,000 = 14,063."""
    monkeypatch.setattr(w4_decode_module, "WORD_CHAIN", int(chain))
    n = 64
    w = torch.randn(n, k, generator=gen).abs() * 1e-3  # small scales: y stays within fp16 for the large x below
    w[0, :64] = 0.005  # row 0's largest weights: q − z = 15 on the first 64 columns, whole chains of them
    packed = pack_w4(rtn_quantize(w, QuantConfig(4, -1, sym=False))).to(DEVICE)
    for split_k, block_kw in ((1, 16), (2, 32)):
        cfg = DecodeConfig(block_n=32, split_k=split_k, gemv_rows=4, block_kw=block_kw, gemv_f16x2=True, num_stages=1)
        x = torch.randn(1, k, generator=gen).half().to(DEVICE)
        assert_close(w4_decode(x, packed, None, None, cfg, out=poisoned(1, n)), w4_linear_ref(x, packed),
                     f"word chain {chain} split_k={split_k}")
        x = torch.full((1, k), 30000.0, dtype=torch.float16, device=DEVICE)
        y = w4_decode(x, packed, None, None, cfg, out=poisoned(1, n))
        if chain == "1":
            assert not y.isfinite().all(), "the one-word chain was expected to overflow at |x| = 30,000"
        else:
            assert_close(y, w4_linear_ref(x, packed), f"word chain {chain}, |x| = 30,000")


@pytest.mark.parametrize("f16x2", [False, True])
def test_decode_gemv_preload_changes_no_bit(f16x2, gen, monkeypatch):
    """Loading each step's codes a step ahead (options' w4_preload, the first before the PDL wait) only moves loads:
    the single-stage GEMV loops give the same bits with it and without, over several steps and splits of K."""
    n, k = 64, 1024
    packed = pack_w4(random_w4(n, k, 128, gen)).to(DEVICE)
    ec = pack_ec(random_ec(n, k, 8, gen)).to(DEVICE)
    x = torch.randn(2, k, generator=gen).half().to(DEVICE)
    cfg = DecodeConfig(block_n=32, split_k=2, gemv_rows=4, block_kw=16, num_stages=1, gemv_f16x2=f16x2)
    out = {}
    for preload in (False, True):
        monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, w4_preload=preload))
        out[preload] = w4_decode(x, packed, ec, None, cfg, out=poisoned(2, n))
    assert torch.equal(out[False], out[True])
    assert_close(out[True], w4_linear_ref(x, packed, ec), f"gemv preload f16x2={f16x2}")


def test_decode_kernel_leaves_its_workspace_ready_for_the_next_launch(gen):
    """The in-kernel counters reset themselves and each launch with an EC advances the reads count by exactly
    2^READS_SHIFT (the epoch g's cells are tagged with): repeated launches with new inputs stay exact, with split-K
    and without, and a launch without an EC leaves the count alone."""
    n, k = 128, 576  # SmolLM2's hidden size
    packed = pack_w4(random_w4(n, k, 64, gen)).to(DEVICE)
    ec = pack_ec(random_ec(n, k, 24, gen)).to(DEVICE)  # rank 24 → padded to 32
    for m, split_k, with_ec in ((1, 4, True), (7, 1, True), (2, 4, False), (2, 2, True), (1, 1, True)):
        x = torch.randn(m, k, generator=gen).half().to(DEVICE)
        e = ec if with_ec else None
        held = _WORKSPACE.buffers.get(x.device)
        before = held[4].item() if held is not None else 0
        y = w4_decode(x, packed, e, None, DecodeConfig(block_n=32, split_k=split_k), out=poisoned(m, n))
        if _WORKSPACE.buffers[x.device] is not held:  # the workspace grew: a fresh count
            before = 0
        assert_close(y, w4_linear_ref(x, packed, e), f"repeat m={m} split_k={split_k} ec={with_ec}")
        _, _, g_cells, counters, reads = _WORKSPACE.buffers[x.device]
        assert (counters == 0).all(), f"counters left at {counters.nonzero().flatten().tolist()} after m={m}"
        assert reads.item() - before == (1 << READS_SHIFT.value) * with_ec, f"reads advanced by {reads.item() - before}"
        if with_ec:  # g's cells of the launch's rows carry its epoch (the count's high bits before it advanced)
            assert ((g_cells[: m * 32] >> 16) == (reads.item() >> READS_SHIFT.value) - 1).all(), "g's tags"


def test_decode_kernel_is_bit_reproducible(gen):
    """No float atomics: the same inputs give the same bits, whatever ran in between."""
    n, k = 128, 576
    packed = pack_w4(random_w4(n, k, -1, gen)).to(DEVICE)
    ec = pack_ec(random_ec(n, k, 16, gen)).to(DEVICE)
    x = torch.randn(3, k, generator=gen).half().to(DEVICE)
    cfg = DecodeConfig(block_n=32, split_k=4)
    first = w4_decode(x, packed, ec, None, cfg)
    w4_decode(torch.randn(16, k, generator=gen).half().to(DEVICE), packed, ec, None, DecodeConfig(block_n=64, split_k=2))
    assert torch.equal(w4_decode(x, packed, ec, None, cfg), first)


@pytest.mark.parametrize("bits", [16, 8])
def test_decode_ec_term_alone_matches_reference(bits, gen):
    """The EC's share of the output, isolated: (kernel with EC) − (kernel without) vs the rank-space reference."""
    n, k = 128, 256
    packed = pack_w4(random_w4(n, k, -1, gen)).to(DEVICE)
    ec = random_ec(n, k, 16, gen, factor_bits=bits)
    with torch.no_grad():
        ec.B.mul_(30)  # an EC term of the size of the W4 output, so that rounding of y does not hide it
    ec = pack_ec(ec).to(DEVICE)
    x = torch.randn(4, k, generator=gen).half().to(DEVICE)
    with_ec = w4_decode(x, packed, ec, None, SMALL_DECODE).float()
    without = w4_decode(x, packed, None, None, SMALL_DECODE).float()
    ref = ec_gated_rank_ref(x, ec) @ ec.dense_B().float().t()
    assert ref.norm() > 0.3 * without.norm()  # the EC term is not negligible
    err = ((with_ec - without - ref).norm() / ref.norm()).item()
    assert err < 2e-2, f"EC term relative error {err:.2e}; seed {SEED}"


@pytest.mark.parametrize("bits", [16, 8])
def test_prefill_path_on_a_narrow_weight_matches_reference(bits, gen):
    """Dequantize + cuBLAS with an EC and a bias on a weight with 4 N ≤ K (k/v of GQA models): on CUDA the GEMM runs
    first, beside the rank kernel on its side stream, and y += g Bᵀ after it (int8 B dequantized: dense_B)."""
    n, k, m = 64, 320, 45
    packed = pack_w4(random_w4(n, k, -1, gen)).to(DEVICE)
    ec = pack_ec(random_ec(n, k, 32, gen, factor_bits=bits)).to(DEVICE)
    bias = torch.randn(n, generator=gen).half().to(DEVICE)
    x = torch.randn(m, k, generator=gen).half().to(DEVICE)
    assert_close(w4_prefill(x, packed, ec, bias, out=poisoned(m, n)), w4_linear_ref(x, packed, ec, bias), "narrow")


@pytest.mark.parametrize("group", [-1, 64])
@pytest.mark.parametrize("ec_bits", [None, 16, 8])
def test_prefill_kernel_matches_reference(group, ec_bits, gen):
    n, k, m = 192, 320, 45  # M not a multiple of the tile, K not a multiple of block_k
    packed = pack_w4(random_w4(n, k, group, gen)).to(DEVICE)
    ec = pack_ec(random_ec(n, k, 32, gen, factor_bits=ec_bits)).to(DEVICE) if ec_bits else None
    bias = torch.randn(n, generator=gen).half().to(DEVICE) if ec_bits else None
    x = torch.randn(m, k, generator=gen).half().to(DEVICE)
    ref = w4_linear_ref(x, packed, ec, bias)
    assert_close(w4_prefill(x, packed, ec, bias, out=poisoned(m, n)), ref, f"prefill g={group} ec={ec_bits}")
    y = w4_prefill_fused(x, packed, ec, bias, SMALL_PREFILL, out=poisoned(m, n))
    assert_close(y, ref, f"fused prefill g={group} ec={ec_bits}")


def test_prefill_rank_programs_beside_the_gemm(gen):
    """The rank programs beside the prefill tile GEMM (two for three row blocks, the last one partial: program 0 takes
    blocks 0 and 2), launches back to back and a decode launch between them (which shares the EC workspace): each
    matches the reference and repeats bit for bit; so does the GEMM after ec_rank's launch."""
    n, k, m = 64, 1088, 70
    packed = pack_w4(random_w4(n, k, -1, gen)).to(DEVICE)
    ec = pack_ec(random_ec(n, k, 16, gen)).to(DEVICE)
    x = torch.randn(m, k, generator=gen).half().to(DEVICE)
    ref = w4_linear_ref(x, packed, ec)
    first = w4_prefill_fused(x, packed, ec, None, SMALL_PREFILL, out=poisoned(m, n), rank_programs=2)
    assert_close(first, ref, "prefill with rank programs")
    xd = torch.randn(3, k, generator=gen).half().to(DEVICE)
    assert_close(w4_decode(xd, packed, ec, None, SMALL_DECODE), w4_linear_ref(xd, packed, ec), "decode between")
    again = w4_prefill_fused(x, packed, ec, None, SMALL_PREFILL, out=poisoned(m, n), rank_programs=2)
    assert torch.equal(first, again)
    before = w4_prefill_fused(x, packed, ec, None, SMALL_PREFILL, out=poisoned(m, n), rank_programs=0)
    assert_close(before, ref, "prefill after ec_rank's launch")


def test_prefill_rank_programs_only_on_idle_sms():
    """Rank programs only with the 128 × 256 tile (one CTA an SM): the fewest that take PREFILL_RANK_BLOCKS (2) row
    blocks each, where the last wave leaves that many SMs idle; else none (ec_rank's launch before the GEMM)."""
    wide, narrow = PrefillConfig(block_n=256), PrefillConfig()
    assert w4_prefill_module.prefill_rank_programs(8, 128, wide, 132) == 4  # 7B q/k/v/o at 1024 rows: 4 SMs idle, 2 blocks each
    assert w4_prefill_module.prefill_rank_programs(8, 128, narrow, 132) == 0
    assert w4_prefill_module.prefill_rank_programs(8, 344, wide, 132) == 4  # 52 idle: still 2 blocks each
    assert w4_prefill_module.prefill_rank_programs(16, 256, wide, 132) == 8  # 2048 rows: 8 idle
    assert w4_prefill_module.prefill_rank_programs(18, 250, wide, 132) == 0  # 14 idle, but 9 programs (8 at most)
    assert w4_prefill_module.prefill_rank_programs(8, 131, wide, 132) == 0  # 1 idle SM for 8 blocks
    assert w4_prefill_module.prefill_rank_programs(8, 264, wide, 132) == 0  # two full waves


def test_prefill_tile_gemm_config_follows_rows_and_scales():
    """Untuned, the prefill tile GEMM widens its tile to 128 × 256 from 1024 rows, per-channel only (with groups the
    wide tile's per-group scale FMAs made it 1.8–2.4× slower on the H200, BENCHMARKS §4)."""
    from spear.kernels.w4.prefill import prefill_config

    assert (prefill_config(512, True).block_n, prefill_config(1024, True).block_n) == (128, 256)
    assert prefill_config(2048, False).block_n == 128


def test_prefill_tile_gemm_compiles_once_for_any_row_count():
    """Triton specializes integer arguments that are multiples of 16; the tile GEMM's row count changes with every
    prefill chunk (and with it the rank kernel's and the gate kernel's, and the gate's count of K splits), so they
    must not be specialized (else a compile mid-serving the first time M % 16 == 0)."""
    import subprocess
    import sys

    # outside the interpreter (CI runs the tests under it), where the kernel is a JITFunction; no GPU needed
    code = ("from spear.kernels.w4 import prefill as w4; "
            "print([[p.name for p in k.params if p.do_not_specialize] "
            "for k in (w4._w4_prefill_kernel, w4._ec_rank_kernel, w4._ec_gate_kernel, w4._ec_rank_programs_kernel)])")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    # the tile GEMM, the EC's rank and gate kernels, the rank programs beside the GEMM
    assert out.strip() == "[['M'], ['M'], ['M', 'splits'], ['M']]"


def test_dequantize_kernel_is_bit_exact(gen):
    for group in (-1, 32, 64):
        record = random_w4(128, 576, group, gen, sym=group != 32)
        packed = pack_w4(record).to(DEVICE)
        out = torch.full((128, 576 + 16), float("nan"), dtype=torch.float16, device=DEVICE)  # a strided view
        dequantize_w4_into(packed, out[:, :576])
        assert torch.equal(out[:, :576].cpu(), record.dequantize(torch.float16)), f"g={group}; seed {SEED}"
        assert out[:, 576:].isnan().all()


@pytest.mark.parametrize("bits", [16, 8])
def test_rank_kernel_matches_reference(bits, gen):
    n, k, m = 64, 192, 37
    for gated in (True, False):
        ec = pack_ec(random_ec(n, k, 8, gen, gate_hidden=8 if gated else 0, factor_bits=bits)).to(DEVICE)
        x = torch.randn(m, k, generator=gen).half().to(DEVICE)
        # one launch; K in three or two (the partial u summed and gated by a second launch); wider tiles
        for block_m, block_k, splits in ((16, 64, 1), (16, 64, 3), (64, 128, 2)):
            g = ec_rank(x, ec, block_m=block_m, block_k=block_k, splits=splits)
            assert_close(g, ec_gated_rank_ref(x, ec),
                         f"rank kernel gated={gated} bits={bits} {block_m}x{block_k} splits={splits}", rtol=5e-3)


@pytest.mark.parametrize("bits", [16, 8])
def test_dispatch_by_rows_and_the_shared_layer(bits, gen, monkeypatch):
    """w4_linear picks the decode kernel, the prefill tile GEMM or dequantize + cuBLAS by M; SpearLinear.use_kernels
    routes through it on CUDA (an 8-bit EC packed as int8)."""
    n, k = 128, 192
    record = random_w4(n, k, 64, gen)
    layer = SpearLinear(record, bias=torch.randn(n, generator=gen), dtype=torch.float16)
    layer.ec = random_ec(n, k, 8, gen, factor_bits=bits).half()
    assert layer.use_kernels() and layer.packed_ec.int8 == (bits == 8)
    layer.to(DEVICE)  # the packed tensors follow the module
    w, ec, bias = layer.packed, layer.packed_ec, layer.bias.half()
    for m in (1, 17, 40, 70):  # 2, 34, 80 and 140 rows: the decode kernel (row tiles 16, 64, 128), prefill
        x = torch.randn(2, m, k, generator=gen).half().to(DEVICE)  # leading dims are flattened
        ref = w4_linear_ref(x.reshape(-1, k), w, ec, bias).view(2, m, n)
        assert_close(w4_linear(x, w, ec, bias), ref, f"dispatch m={m}")
        assert_close(layer(x), ref, f"SpearLinear m={m}", rtol=5e-3)  # CPU: the PyTorch backend; CUDA: the kernels
    monkeypatch.setattr(w4_prefill_module, "FUSED_PREFILL_MAX_M_GROUPED", 139)  # 140 rows: dequantize + cuBLAS
    assert_close(w4_linear(x, w, ec, bias), ref, "dispatch past FUSED_PREFILL_MAX_M_GROUPED")
    assert not SpearLinear(rtn_quantize(torch.randn(64, 96, generator=gen), QuantConfig(4, 32))).use_kernels()


def test_prefill_path_follows_rows_scales_and_tiles():
    """Per-channel weights take the tile GEMM up to 2048 rows; grouped ones up to 512, where dequantize + cuBLAS draws
    level (it is 13–35% ahead at 1024 rows on the H200); a weight too narrow to give half the SMs a tile
    takes dequantize + cuBLAS (70b k/v: 3× faster there), and so does one whose 128 × 256 tiles leave the last wave
    mostly empty (13b q/k/v/o and down: 1.3–1.45× faster through cuBLAS)."""
    from spear.kernels.w4 import takes_tile_gemm

    h200 = dict(n=4096, sms=132)  # 7b q/k/v/o: 128 tiles of 128 × 256 at 1024 rows
    assert takes_tile_gemm(2048, per_channel=True, **h200) and not takes_tile_gemm(2049, per_channel=True, **h200)
    assert takes_tile_gemm(512, per_channel=False, **h200) and not takes_tile_gemm(513, per_channel=False, **h200)
    assert takes_tile_gemm(1024, per_channel=True, **h200)
    assert not takes_tile_gemm(1024, n=1024, per_channel=True, sms=132)  # 70b k/v: 32 tiles
    assert not takes_tile_gemm(1024, n=5120, per_channel=True, sms=132)  # 13b q/k/v/o: 160 tiles, waves 0.61 full
    assert not takes_tile_gemm(2048, n=5120, per_channel=True, sms=132)  # 320 tiles, 0.81 full
    assert takes_tile_gemm(1024, n=11008, per_channel=True, sms=132)  # 7b gate/up: 344 tiles, 0.87 full


def test_decode_config_prefers_the_one_tuned_with_the_ec(gen, monkeypatch):
    """A launch with an EC takes the config tune_w4 timed with an EC of that rank, else W4's, else the default."""
    packed = pack_w4(random_w4(128, 256, -1, gen))
    ec16, ec64 = pack_ec(random_ec(128, 256, 16, gen)), pack_ec(random_ec(128, 256, 64, gen))
    w4_pick, ec_pick = DecodeConfig(block_n=64, num_warps=4), DecodeConfig(block_n=16, num_warps=4, block_kw=64)
    monkeypatch.setattr(w4_config, "_TUNED", {w4_config._tune_key(packed, 1): w4_pick,
                                             w4_config._tune_key(packed, 1, ec16): ec_pick})
    assert w4_config.decode_config(packed, 1, ec16) == ec_pick
    assert w4_config.decode_config(packed, 1) == w4_pick
    assert w4_config.decode_config(packed, 1, ec64) == w4_pick  # rank 64 was not tuned
    int8 = pack_ec(random_ec(128, 256, 16, gen, factor_bits=8))
    assert w4_config.decode_config(packed, 1, int8) == w4_pick  # nor rank 16 with int8 factors
    assert w4_config.decode_config(packed, 16, ec16) == DecodeConfig()  # nothing tuned at 16 rows


@pytest.fixture
def tune_cache(tmp_path, monkeypatch) -> Path:
    """tune_w4's cache file in this test's tmp dir (never the user's), and nothing tuned yet in this process."""
    path = tmp_path / "cache" / "w4_tuning.json"
    monkeypatch.setenv("SPEAR_TUNE_CACHE", str(path))
    monkeypatch.setattr(w4_config, "_TUNED", {})
    return path


def tune_score(cfg: DecodeConfig | PrefillConfig) -> float:
    """The fake timer's µs: the widest tile 'wins', then the fewest warps and stages (one winner per bucket,
    not the untuned default)."""
    return -10 * cfg.block_n + cfg.num_warps + cfg.num_stages / 10


def fake_timer(monkeypatch) -> list:
    """time_in_graph faked (CUDA graphs need a GPU) by tune_score, without launching; returns the configs it
    timed, in order."""
    from spear.kernels import timing

    timed = []

    def fake_time(calls, reps=20):
        timed.append(calls[0].keywords["cfg"])
        return tune_score(calls[0].keywords["cfg"])

    monkeypatch.setattr(timing, "time_in_graph", fake_time)
    monkeypatch.setattr(w4_tuning, "TUNE_BYTES", 1)
    return timed


def test_tune_w4_with_an_ec_times_the_ec_launch_and_keeps_w4_s_pick(gen, monkeypatch, tune_cache):
    """tune_w4(..., ec=) runs each candidate with the EC (decode rows only) and stores its pick under the EC's key;
    W4's own pick is untouched. Timing is faked (CUDA graphs need a GPU): the candidate with the narrowest tile
    'wins', so the test knows which one must be chosen."""
    from spear.kernels import timing

    packed = pack_w4(random_w4(128, 256, -1, gen)).to(DEVICE)
    ec = pack_ec(random_ec(128, 256, 16, gen)).to(DEVICE)
    launched = []

    def fake_time(calls, reps=20):
        launched.append(calls[0].args[2])  # w4_decode(x, w, ec, cfg=...)
        calls[0]()
        return calls[0].keywords["cfg"].block_n + calls[0].keywords["cfg"].num_warps / 100

    w4_pick = DecodeConfig(block_n=64, num_warps=4)
    monkeypatch.setattr(timing, "time_in_graph", fake_time)
    monkeypatch.setattr(w4_tuning, "TUNE_BYTES", 1)
    monkeypatch.setattr(w4_config, "_TUNED", {w4_config._tune_key(packed, 1): w4_pick})
    chosen = w4_module.tune_w4(packed, (1, 256), ec=ec)
    best = min(w4_config._tune_candidates(1), key=lambda c: c.block_n + c.num_warps / 100)
    assert list(chosen) == [1] and chosen[1] == best  # 256 rows is not a decode launch: not tuned with the EC
    assert all(e is ec for e in launched) and len(launched) == len(w4_config._tune_candidates(1))
    assert w4_config.decode_config(packed, 1, ec) == best and w4_config.decode_config(packed, 1) == w4_pick


def test_tune_w4_reuses_the_choices_of_an_earlier_process(gen, monkeypatch, tune_cache):
    """The choices go to the cache file; a new process (an empty _TUNED) takes them from it without timing."""
    packed = pack_w4(random_w4(128, 256, -1, gen)).to(DEVICE)
    timed = fake_timer(monkeypatch)
    first = w4_module.tune_w4(packed, (1, 256))  # a decode bucket and a prefill one
    assert first == {1: min(w4_config._tune_candidates(1), key=tune_score),
                     256: min(w4_config.PREFILL_CANDIDATES, key=tune_score)}
    assert first[1] != DecodeConfig() and first[256] != PrefillConfig()  # not what an untuned launch would take
    assert len(timed) == len(w4_config._tune_candidates(1)) + len(w4_config.PREFILL_CANDIDATES)
    entries = json.loads(tune_cache.read_text())
    written = sorted(entries.values(), key=lambda e: e["kind"])
    assert [{k: e[k] for k in ("kind", "fields")} for e in written] == [
        {"kind": "DecodeConfig", "fields": dataclasses.asdict(first[1])},
        {"kind": "PrefillConfig", "fields": dataclasses.asdict(first[256])}]
    for e in written:  # the race beside each choice: the fastest three, the choice first
        times = [us for us, _ in e["fastest_us"]]
        assert len(times) == 3 and times == sorted(times) and e["fastest_us"][0][1] == e["fields"]
    assert all(key.startswith(str(DEVICE.type) if DEVICE.type != "cuda" else torch.cuda.get_device_name(DEVICE))
               for key in entries)

    monkeypatch.setattr(w4_config, "_TUNED", {})  # a new process
    timed.clear()
    assert w4_module.tune_w4(packed, (1, 256)) == first and timed == []
    assert w4_config.decode_config(packed, 1) == first[1]
    assert w4_module.tune_w4(packed, (1,), timings={}) == {1: first[1]}  # an explicit timing request re-times
    assert len(timed) == len(w4_config._tune_candidates(1))
    monkeypatch.setattr(w4_config, "_TUNED", {})  # a new process with changed kernels: the old choices do not apply
    monkeypatch.setattr(tune_cache_module, "_kernel_hash", lambda: "changed")
    timed.clear()
    w4_module.tune_w4(packed, (1,))
    assert len(timed) == len(w4_config._tune_candidates(1))


def test_a_corrupt_or_stale_tune_cache_is_timed_again_and_rewritten(gen, monkeypatch, tune_cache):
    """A file that is not JSON, or an entry that no longer rebuilds as one of the candidates (a field the
    dataclass lacks or is missing, another kind, a config no longer timed), is ignored: the bucket is timed
    again and the file rewritten with a valid entry."""
    packed = pack_w4(random_w4(128, 256, -1, gen)).to(DEVICE)
    timed = fake_timer(monkeypatch)
    tune_cache.parent.mkdir()
    tune_cache.write_text('{"truncated": ')
    chosen = w4_module.tune_w4(packed, (1,))
    assert len(timed) == len(w4_config._tune_candidates(1))
    (key, entry), = json.loads(tune_cache.read_text()).items()
    assert {k: entry[k] for k in ("kind", "fields")} == {"kind": "DecodeConfig", "fields": dataclasses.asdict(chosen[1])}

    fields = entry["fields"]
    stale = [{"kind": "DecodeConfig", "fields": {**fields, "unroll": 2}},
             {"kind": "DecodeConfig", "fields": {k: v for k, v in fields.items() if k != "block_kw"}},
             {"kind": "PrefillConfig", "fields": fields},
             {"kind": ["DecodeConfig"], "fields": fields},
             {"kind": "DecodeConfig", "fields": {**fields, "block_n": 8}},
             "decode"]
    for bad in stale:
        tune_cache.write_text(json.dumps({key: bad}))
        monkeypatch.setattr(w4_config, "_TUNED", {})
        timed.clear()
        assert w4_module.tune_w4(packed, (1,)) == chosen, bad
        assert len(timed) == len(w4_config._tune_candidates(1)), f"{bad} was taken from the cache"
        assert json.loads(tune_cache.read_text()) == {key: entry}


def test_tune_cache_key_follows_the_kernel_code_and_the_switches_not_the_prose(tmp_path, monkeypatch):
    """code_hash ignores comments and docstrings (editing prose keeps the tuned choices) and follows any code change;
    the key also names the kernels.options switches off their defaults."""
    source = 'def f(x):\n    """Doubles."""\n    return 2 * x  # twice\n'
    file = tmp_path / "k.py"
    file.write_text(source)
    before = tune_cache_module.code_hash(file)
    file.write_text(source.replace("Doubles.", "Twice x.").replace("# twice", "# 2x"))
    assert tune_cache_module.code_hash(file) == before
    file.write_text(source.replace("2 * x", "3 * x"))
    assert tune_cache_module.code_hash(file) != before
    default = tune_cache_module.key(torch.device("cpu"), (1,))
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, w4_even=False))
    changed = tune_cache_module.key(torch.device("cpu"), (1,))
    assert "w4_even=False" in changed and "w4_even" not in default


def test_tune_cache_off_or_unwritable(gen, monkeypatch, tmp_path):
    """SPEAR_TUNE_CACHE=0 writes no file anywhere (and reads none); a cache that cannot be written warns once
    and tuning goes on."""
    packed = pack_w4(random_w4(128, 256, -1, gen)).to(DEVICE)
    timed = fake_timer(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "spear"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPEAR_TUNE_CACHE", "0")
    for _ in range(2):  # the second time as a new process: no cache to read, timed again
        monkeypatch.setattr(w4_config, "_TUNED", {})
        timed.clear()
        assert w4_module.tune_w4(packed, (1,)) == {1: min(w4_config.DECODE_CANDIDATES, key=tune_score)}
        assert len(timed) == len(w4_config._tune_candidates(1))
    assert list(tmp_path.rglob("*")) == []

    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("SPEAR_TUNE_CACHE", str(tmp_path / "a_file" / "w4_tuning.json"))  # its folder is a file
    monkeypatch.setattr(tune_cache_module, "_warned", False)
    with pytest.warns(UserWarning, match="not written"):
        assert w4_module.tune_w4(packed, (4,)) == {4: min(w4_config.DECODE_CANDIDATES, key=tune_score)}
    assert [p.name for p in tmp_path.rglob("*")] == ["a_file"]


def test_pdl_is_off_where_it_cannot_run(monkeypatch):
    """Programmatic dependent launch only for compiled launches on a GPU (never on CPU, under the interpreter or with
    SPEAR_PDL=0), and then the kernel's PDL flag and triton's launch_pdl go together."""
    from spear.kernels.pdl import launch_options, uses_pdl

    assert launch_options(torch.empty(1)) == {"PDL": False}
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, pdl=False))
    assert not uses_pdl(torch.empty(1, device=DEVICE))
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, pdl=True))
    launch = launch_options(torch.empty(1, device=DEVICE))
    assert launch.get("launch_pdl", False) == launch["PDL"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch needs a GPU")
def test_pdl_chain_in_a_graph_matches_serial_launches(gen, monkeypatch):
    """A chain of dependent launches (W4, norm, W4+EC with SiLU·up, W4+EC), each reading the one before, captured in a
    CUDA graph and replayed many times with PDL: every replay gives the bits of the same chain launched without it."""
    from spear.kernels.ops import add_rms_norm

    k = 576
    up = pack_w4(random_w4(2 * 1536, k, -1, gen)).to(DEVICE)
    down = pack_w4(random_w4(k, 1536, -1, gen)).to(DEVICE)
    first = pack_w4(random_w4(k, k, -1, gen)).to(DEVICE)
    ec_up, ec_down = (pack_ec(random_ec(n, kk, 16, gen)).to(DEVICE) for n, kk in ((2 * 1536, k), (k, 1536)))
    norm_w = torch.randn(k, generator=gen).half().to(DEVICE)
    x = torch.randn(1, k, generator=gen).half().to(DEVICE)

    def chain():
        h = w4_decode(x, first, None)
        y, _ = add_rms_norm(h, norm_w, 1e-5, x)
        return w4_decode(w4_decode(y, up, ec_up, swiglu=True), down, ec_down)

    inputs = [torch.randn(1, k, generator=gen).half().to(DEVICE) for _ in range(20)]
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, pdl=False))
    serial = []  # a replay whose launches overlap unordered would read the previous input's intermediates
    for x_i in inputs:
        x.copy_(x_i)
        serial.append(chain())
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, pdl=True))
    chain()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(5):
        for x_i, expected in zip(inputs, serial):
            x.copy_(x_i)
            graph.replay()
            assert torch.equal(out, expected)


@pytest.mark.parametrize("bits", [16, 8])
def test_precompile_jobs_describe_the_tensors_a_worker_makes_up(bits, gen):
    """A compile job carries each packed tensor's shape and dtype; the worker's made-up tensors have exactly those
    (a compile is keyed by them), and the launch it makes takes them: an int8 EC's codes and scales too."""
    from spear.kernels.pack import PackedEC
    from spear.kernels.w4 import precompile

    w = pack_w4(rtn_quantize(torch.randn(128, 256, generator=gen), QuantConfig(4, -1)))
    ec = pack_ec(ErrorCompensator(256, 128, rank=8, gate_hidden=8, factor_bits=bits))
    job = precompile.compile_job(w, (1, 4), ec)
    made = precompile._made_up(job.weight, torch.device("cpu"))
    assert {k: (t.shape, t.dtype) for k, t in made.items()} == {
        k: (getattr(w, k).shape, getattr(w, k).dtype) for k in ("qweight", "scales", "zeros")}
    made_ec = precompile._made_up(job.ec, torch.device("cpu"))
    assert {k: (t.shape, t.dtype) for k, t in made_ec.items()} == {
        k: (t.shape, t.dtype) for k, t in ec.tensors().items()}
    assert PackedEC(**made_ec, rank=job.ec_rank, gated=job.ec_gated).dims() == ec.dims()
    assert (job.ms, job.ec_rank, job.ec_gated) == ((1, 4), ec.rank, ec.gated)
    assert precompile.precompile_w4([job], workers=1) == 0  # one worker: not worth a process


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for a GPU")
def test_precompile_fills_the_triton_cache_the_tuner_then_reads(tmp_path, monkeypatch, gen):
    """Two worker processes compile the one-row candidates into the TRITON_CACHE_DIR they inherit; tune_w4 in this
    process then times them all and compiles nothing of its own (no kernel is added to that cache)."""
    from spear.kernels.w4 import precompile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPEAR_TUNE_CACHE", "0")
    w = pack_w4(rtn_quantize(torch.randn(192, 320, generator=gen), QuantConfig(4, -1))).to(torch.device("cuda"))
    assert precompile.precompile_w4([precompile.compile_job(w, (1,))], workers=2) == 2
    compiled = sorted(p.name for p in tmp_path.rglob("*.cubin"))
    assert compiled
    w4_tuning.tune_w4(w, (1,))
    assert sorted(p.name for p in tmp_path.rglob("*.cubin")) == compiled
