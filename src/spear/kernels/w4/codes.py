"""Code words → fp16: the bit tricks every W4 main loop shares (pack.py's pair layout).

A word holds, for each of its four planes jj, the codes of a column pair at bits 4 jj and 16 + 4 jj. One LOP3
with Marlin's masks OR 0x6400 makes both codes of a pair fp16 (1024 + q, or 1024 + 16 q) in one register; one
HADD2 / HFMA2 more gives q − z exactly. The `_h2_*` helpers do the packed fp16x2 arithmetic, as inline PTX in
compiled code (ASM) and as the same arithmetic in Triton under the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

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
