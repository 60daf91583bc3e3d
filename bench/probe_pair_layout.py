"""Lab probe (bench/NOTES-kernels.md, session 9): the tensor-core dot loop's dequantization in today's code layout
against a pair layout, compiled for sm_90 on a CPU machine (no GPU needed) and read off the SASS.

    python bench/probe_pair_layout.py      # per variant: registers, loop instructions, instructions a weight

Today (pack.py): nibble j of word w of a 128-column block is column 16 j + w, so the two codes an MMA register pairs
(columns k, k + 1 of a 16-column slice) sit in two words, and the compiler shifts, masks and PRMTs each one. The
pair layout puts columns 2p and 2p + 1 of slice 4 s + jj at bits 4 jj and 16 + 4 jj of word 8 s + p: one LOP3 then
makes both codes as 1024 + q in one register (pair2), and with Marlin's masks (0x000F000F, 0x00F000F0, on the word
and on the word >> 8) one HADD2 / HFMA2 more makes q − z (pair3). One standalone kernel, not the decode kernel, its
per-slice dequantization picked by VARIANT.
"""
import triton
import triton.language as tl

from spear.kernels import offline


@triton.jit
def _halves_f16(w32):
    """The two fp16 in the halves of int32 w32, side by side along a new last axis, as [.., 2 n] (columns 2p, 2p + 1)."""
    lo = w32.to(tl.int16).to(tl.float16, bitcast=True)
    hi = (w32.to(tl.uint32, bitcast=True) >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (w32.shape[0], 2 * w32.shape[1]))


@triton.jit
def _slice_codes(packed, words, words8, j: tl.constexpr, jj: tl.constexpr, bz, bz_hi, VARIANT: tl.constexpr):
    """q − z [BN, 16] of slice j = 4 s + jj of the block: `packed` its 16 words (today's layout), `words` the 8 words
    of its half s (pair layout) and `words8` those shifted right by 8."""
    if VARIANT == "cur":  # today's layout: nibble j of word w = column 16 j + w
        q = (((packed >> (4 * j)) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - bz[:, None]
    elif VARIANT == "pair":  # pair layout, each code on its own
        lo = (((words >> (4 * jj)) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        hi = (((words >> (16 + 4 * jj)) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        q = tl.reshape(tl.join(lo, hi), (words.shape[0], 16)) - bz[:, None]
    elif VARIANT == "pair2":  # pair layout, a pair's two codes in one 32-bit op (lop3), then split into halves
        q = _halves_f16(((words >> (4 * jj)) & 0x000F000F) | 0x64006400) - bz[:, None]
    else:  # pair3: Marlin's masks, nibble pairs at bits 0/16 and 4/20 of the word and of the word >> 8
        src = words if jj < 2 else words8
        if jj % 2 == 0:
            q = _halves_f16((src & 0x000F000F) | 0x64006400) - bz[:, None]
        else:
            q = _halves_f16((src & 0x00F000F0) | 0x64006400) * 0.0625 - bz_hi[:, None]
    return q


@triton.jit
def probe(qw_ptr, x_ptr, z_ptr, y_ptr, K, KW, BN: tl.constexpr, BM: tl.constexpr, VARIANT: tl.constexpr):
    """yᵀ [BN, BM] tile by tensor-core dots over 16-column slices, the codes dequantized as VARIANT says. Pair layout:
    word u of a 128-column block holds slices 4 (u // 8) + jj, columns 2 (u % 8) + {0, 1}."""
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    acc = tl.zeros((BN, BM), tl.float32)
    z = tl.load(z_ptr + offs_n)
    bz = z + 1024.0
    bz_hi = z + 64.0
    for kb in range(0, K, 128):
        packed = tl.load(qw_ptr + offs_n[:, None] * KW + (kb // 8 + tl.arange(0, 16))[None, :])  # unused but by cur
        for s in tl.static_range(2):
            words = tl.load(qw_ptr + offs_n[:, None] * KW + (kb // 8 + 8 * s + tl.arange(0, 8))[None, :])  # [BN, 8]
            words8 = words >> 8
            for jj in tl.static_range(4):
                offs_k = kb + 16 * (4 * s + jj) + tl.arange(0, 16)
                xt = tl.load(x_ptr + offs_m[None, :] * K + offs_k[:, None])
                q = _slice_codes(packed, words, words8, 4 * s + jj, jj, bz, bz_hi, VARIANT)
                acc += tl.dot(q, xt)
    tl.store(y_ptr + offs_m[None, :] * 4096 + offs_n[:, None], acc)


def main() -> None:
    ptrs = {"qw_ptr": "*i32", "x_ptr": "*fp16", "z_ptr": "*fp16", "y_ptr": "*fp32"}
    for variant in ("cur", "pair", "pair2", "pair3"):
        for bn, warps in ((64, 4), (128, 4)):
            compiled = offline.compile_for_gpu(probe, ptrs, {"BN": bn, "BM": 16, "VARIANT": variant}, ("K", "KW"),
                                               num_warps=warps)
            print(variant, f"BN {bn}, {warps} warps: {offline.registers(compiled)} registers")
            for loop in offline.loop_mix(offline.sass(compiled)):
                per_thread = bn * 128 / (32 * warps)  # weights a thread dequantizes per 128-column block
                print(f"   loop {loop.instructions} ({loop.instructions / per_thread:.2f} a weight)", loop.mix[:12])


if __name__ == "__main__":
    main()
