"""Lab probe (bench/NOTES-kernels.md, session 9): the tensor-core dot loop's dequantization in today's code layout
against a pair layout, compiled for sm_90 on a CPU machine (no GPU needed) and read off the SASS.

    python bench/probe_pair_layout.py      # per variant: registers, loop instructions, instructions a weight

Today (pack.py): nibble j of word w of a 128-column block is column 16 j + w, so the two codes an MMA register pairs
(columns k, k + 1 of a 16-column slice) sit in two words, and the compiler shifts, masks and PRMTs each one. The
pair layout puts columns 2p and 2p + 1 of slice 4 s + jj at bits 4 jj and 16 + 4 jj of word 8 s + p: one LOP3 then
makes both codes as 1024 + q in one register (pair2), and with Marlin's masks (0x000F000F, 0x00F000F0, on the word
and on the word >> 8) one HADD2 / HFMA2 more makes q − z (pair3). Standalone kernels, not the decode kernel.
"""
import triton
import triton.language as tl

from spear.kernels import offline


@triton.jit
def cur(qw_ptr, x_ptr, z_ptr, y_ptr, K, KW, BN: tl.constexpr, BM: tl.constexpr):
    # today's layout: nibble j of word w = column 16 j + w
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    acc = tl.zeros((BN, BM), tl.float32)
    bz = tl.load(z_ptr + offs_n) + 1024.0
    for kb in range(0, K, 128):
        packed = tl.load(qw_ptr + offs_n[:, None] * KW + (kb // 8 + tl.arange(0, 16))[None, :])
        for j in tl.static_range(8):
            offs_k = kb + 16 * j + tl.arange(0, 16)
            xt = tl.load(x_ptr + offs_m[None, :] * K + offs_k[:, None])
            bits = ((packed >> (4 * j)) & 0xF) | 0x6400
            q = bits.to(tl.int16).to(tl.float16, bitcast=True) - bz[:, None]
            acc += tl.dot(q, xt)
    tl.store(y_ptr + offs_m[None, :] * 4096 + offs_n[:, None], acc)

@triton.jit
def pair(qw_ptr, x_ptr, z_ptr, y_ptr, K, KW, BN: tl.constexpr, BM: tl.constexpr):
    # pair layout: word u of a 128-column block: slices 4 (u // 8) + jj, columns 2 (u % 8) + {0, 1}
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    acc = tl.zeros((BN, BM), tl.float32)
    bz = tl.load(z_ptr + offs_n) + 1024.0
    for kb in range(0, K, 128):
        for s in tl.static_range(2):
            words = tl.load(qw_ptr + offs_n[:, None] * KW + (kb // 8 + 8 * s + tl.arange(0, 8))[None, :])  # [BN, 8]
            for jj in tl.static_range(4):
                j = 4 * s + jj
                offs_k = kb + 16 * j + tl.arange(0, 16)
                xt = tl.load(x_ptr + offs_m[None, :] * K + offs_k[:, None])
                lo = (((words >> (4 * jj)) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
                hi = (((words >> (16 + 4 * jj)) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
                q = tl.reshape(tl.join(lo, hi), (BN, 16)) - bz[:, None]  # columns 2p, 2p + 1 side by side
                acc += tl.dot(q, xt)
    tl.store(y_ptr + offs_m[None, :] * 4096 + offs_n[:, None], acc)


@triton.jit
def pair2(qw_ptr, x_ptr, z_ptr, y_ptr, K, KW, BN: tl.constexpr, BM: tl.constexpr):
    # pair layout, the two codes of a pair made in one 32-bit op (lop3), then split into halves
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    acc = tl.zeros((BN, BM), tl.float32)
    bz = tl.load(z_ptr + offs_n) + 1024.0
    for kb in range(0, K, 128):
        for s in tl.static_range(2):
            words = tl.load(qw_ptr + offs_n[:, None] * KW + (kb // 8 + 8 * s + tl.arange(0, 8))[None, :])  # [BN, 8]
            for jj in tl.static_range(4):
                j = 4 * s + jj
                offs_k = kb + 16 * j + tl.arange(0, 16)
                xt = tl.load(x_ptr + offs_m[None, :] * K + offs_k[:, None])
                w32 = ((words >> (4 * jj)) & 0x000F000F) | 0x64006400
                lo = w32.to(tl.int16).to(tl.float16, bitcast=True)
                hi = (w32.to(tl.uint32, bitcast=True) >> 16).to(tl.int16).to(tl.float16, bitcast=True)
                q = tl.reshape(tl.join(lo, hi), (BN, 16)) - bz[:, None]
                acc += tl.dot(q, xt)
    tl.store(y_ptr + offs_m[None, :] * 4096 + offs_n[:, None], acc)

@triton.jit
def pair3(qw_ptr, x_ptr, z_ptr, y_ptr, K, KW, BN: tl.constexpr, BM: tl.constexpr):
    # pair layout, Marlin's masks: nibble pairs at bits 0/16 and 4/20 of the word and of the word >> 8
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    acc = tl.zeros((BN, BM), tl.float32)
    z = tl.load(z_ptr + offs_n)
    bz = z + 1024.0
    bz_hi = z + 64.0
    for kb in range(0, K, 128):
        for s in tl.static_range(2):
            words = tl.load(qw_ptr + offs_n[:, None] * KW + (kb // 8 + 8 * s + tl.arange(0, 8))[None, :])  # [BN, 8]
            words8 = words >> 8
            for jj in tl.static_range(4):
                j = 4 * s + jj
                offs_k = kb + 16 * j + tl.arange(0, 16)
                xt = tl.load(x_ptr + offs_m[None, :] * K + offs_k[:, None])
                if jj < 2:
                    src = words
                else:
                    src = words8
                if jj % 2 == 0:
                    w32 = (src & 0x000F000F) | 0x64006400
                else:
                    w32 = (src & 0x00F000F0) | 0x64006400
                lo = w32.to(tl.int16).to(tl.float16, bitcast=True)
                hi = (w32.to(tl.uint32, bitcast=True) >> 16).to(tl.int16).to(tl.float16, bitcast=True)
                q = tl.reshape(tl.join(lo, hi), (BN, 16))
                if jj % 2 == 0:
                    q = q - bz[:, None]
                else:
                    q = q * 0.0625 - bz_hi[:, None]
                acc += tl.dot(q, xt)
    tl.store(y_ptr + offs_m[None, :] * 4096 + offs_n[:, None], acc)



def main() -> None:
    ptrs = {"qw_ptr": "*i32", "x_ptr": "*fp16", "z_ptr": "*fp16", "y_ptr": "*fp32"}
    for name, kernel in (("cur", cur), ("pair", pair), ("pair2", pair2), ("pair3", pair3)):
        for bn, warps in ((64, 4), (128, 4)):
            compiled = offline.compile_for_gpu(kernel, ptrs, {"BN": bn, "BM": 16}, ("K", "KW"), num_warps=warps)
            print(name, f"BN {bn}, {warps} warps: {offline.registers(compiled)} registers")
            for loop in offline.loop_mix(offline.sass(compiled)):
                per_thread = bn * 128 / (32 * warps)  # weights a thread dequantizes per 128-column block
                print(f"   loop {loop.instructions} ({loop.instructions / per_thread:.2f} a weight)", loop.mix[:12])


if __name__ == "__main__":
    main()
