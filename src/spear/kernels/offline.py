"""Compile the Triton kernels for a GPU on a machine without one (triton ships ptxas), and read their SASS.

    python -m spear.kernels.offline        # every variant the host code launches; JSON on stdout

The interpreter (TRITON_INTERPRET=1, what CI runs) executes a kernel as NumPy and never type-checks
it the way the compiler does: a name bound to two shapes in the branches of a run-time `if`, for
example, passes the interpreter and fails to compile on the GPU. `compile_for_gpu` runs the real
compiler (frontend to cubin) for sm_90, so CI catches that; `loop_mix` counts the instructions of
each loop in the SASS, which is how the decode kernel's instructions per weight are read off
(bench/NOTES-kernels.md). Run it without TRITON_INTERPRET: under the interpreter `triton.jit` gives
interpreted functions, which the compiler cannot take.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H200 = GPUTarget("cuda", 90, 32)


def compile_for_gpu(kernel, pointers: dict[str, str], constexprs: dict[str, object], divisible_by_16: tuple[str, ...] = (),
                    num_warps: int = 4, num_stages: int = 3, target: GPUTarget = H200):
    """The compiled kernel (asm: ttir, ttgir, ptx, cubin). `pointers`: argument → Triton pointer type
    ("*fp16"); `constexprs`: their values; every other argument is an int32. Pointers and the ints in
    `divisible_by_16` carry the 16-divisibility hint the JIT gives such arguments at run time."""
    fn = kernel  # a JITFunction: run without TRITON_INTERPRET
    names = fn.arg_names
    # a constexpr parameter left out takes its default, as at a launch (not an int32: `if` on it would be a branch)
    constexprs = {**{q.name: q.default for q in fn.params if q.is_constexpr and q.has_default}, **constexprs}
    signature = {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in names}
    hinted = [n for n in names if (n in pointers or n in divisible_by_16) and n not in constexprs]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in hinted}
    source = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    return triton.compile(source, target=target, options={"num_warps": num_warps, "num_stages": num_stages})


@dataclass
class Loop:
    start: int  # SASS address of the loop head
    instructions: int  # per iteration
    mix: list[tuple[str, int]]  # opcode → count per iteration, most frequent first


def _cuobjdump(compiled, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def sass(compiled) -> str:
    return _cuobjdump(compiled, "-sass")


def registers(compiled) -> int:
    """Registers a thread of the kernel holds (cuobjdump -res-usage)."""
    return int(re.search(r"REG:(\d+)", _cuobjdump(compiled, "-res-usage")).group(1))


def loop_mix(sass_text: str, min_instructions: int = 60) -> list[Loop]:
    """The loops (backward branches) of at least `min_instructions`, with their opcode counts."""
    code = [(int(a, 16), ins.strip()) for a, ins in re.findall(r"^\s+/\*([0-9a-f]{4,6})\*/\s+(.*?);", sass_text, re.MULTILINE)]
    loops = []
    for address, ins in code:
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", ins)
        if target and int(target.group(1), 16) < address:
            body = [i for a, i in code if int(target.group(1), 16) <= a <= address]
            if len(body) >= min_instructions:
                ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0] for i in body)
                loops.append(Loop(int(target.group(1), 16), len(body), ops.most_common()))
    return loops


F16, I32, F32, I64 = "*fp16", "*i32", "*fp32", "*i64"
_DIVISIBLE = ("KW", "K", "N", "stride_xm", "stride_ym", "k_per_split", "ax_k_per_prog", "group_size", "stride_gm",
              "stride_wn", "H", "block_size", "stride_pool_block", "stride_pool_offset")  # as a Llama launch has them


_F16_PTRS = {n: F16 for n in ("x_ptr", "s_ptr", "z_ptr", "bias_ptr", "y_ptr", "a_ptr", "b_ptr", "w1_ptr", "b1_ptr",
                                "w2_ptr", "b2_ptr", "g_ptr", "w_ptr")}


def variants() -> dict[str, tuple]:
    """name → (kernel, pointer types, constexprs, num_warps) for each kernel variant the host code launches."""
    return {**_decode_variants(), **_prefill_and_epilogue_variants(), **_attention_and_f16_variants()}


def _decode_variants() -> dict[str, tuple]:
    """The W4 decode kernel's variants (kernels.w4.decode)."""
    from spear.kernels.w4 import decode

    f16 = _F16_PTRS
    decode_ptrs = {**f16, "qw_ptr": I32, "y_part_ptr": F32, "u_part_ptr": F32, "g_ptr": I64, "cnt_ptr": I32,
                   "reads_ptr": I64}
    out = {}
    lab_off = dict(GEMV_STAGES=1, SWIGLU=False, GEMV_F16X2=False, F16X2_ASM=True,  # GEMV loop unpipelined
                   PDL=False, PDL_LATE=False, PRELOAD=False)
    for rows, ec, spg, per_channel, bm in ((0, True, 8, True, 16), (1, True, 8, True, 16), (1, False, 8, True, 16),
                                           (1, False, 2, False, 16), (2, True, 4, False, 16), (4, True, 8, True, 16),
                                           (0, True, 8, True, 64), (0, True, 2, False, 128)):
        const = dict(HAS_EC=ec, GATED=ec, HAS_BIAS=True, R=32, H=16, BM=bm, BN=32, BK=128, SPG=spg, GEMV_ROWS=rows,
                     BKW=64, PER_CHANNEL=per_channel, PEERS=0, U_CHUNK=decode.u_chunk(bm, 32), **lab_off)
        name = f"decode rows={rows or 'dot'} ec={ec} spg={spg} per_channel={per_channel}" + (f" bm={bm}" if bm > 16 else "")
        out[name] = (decode._w4_decode_kernel, decode_ptrs, const, 4)
    # the dot loop at 16 rows as the tuner picks it (BN 64 / 128, 4 warps: wgmma, one K = 128 dot a
    # block, _w4_block_wide)
    for bn in (64, 128):
        const = dict(HAS_EC=False, GATED=False, HAS_BIAS=False, R=32, H=16, BM=16, BN=bn, BK=128, SPG=8, GEMV_ROWS=0,
                     BKW=64, PER_CHANNEL=True, PEERS=0, U_CHUNK=decode.u_chunk(16, 32), **lab_off)
        out[f"decode rows=dot ec=False bn={bn} wide"] = (decode._w4_decode_kernel, decode_ptrs, const, 4)
    # groups of 64 and 32 with one dot a group
    for spg in (4, 2):
        const = dict(HAS_EC=True, GATED=True, HAS_BIAS=False, R=32, H=16, BM=16, BN=128, BK=128, SPG=spg, GEMV_ROWS=0,
                     BKW=64, PER_CHANNEL=False, PEERS=0, U_CHUNK=decode.u_chunk(16, 32), **lab_off)
        out[f"decode rows=dot ec=True bn=128 spg={spg} wide=2"] = (decode._w4_decode_kernel, decode_ptrs, const, 4)
    # the wide loops with their codes through inline PTX (DOT_ASM: what compiled code launches)
    out["decode rows=dot ec=False bn=128 wide asm"] = (
        decode._w4_decode_kernel, decode_ptrs, {**out["decode rows=dot ec=False bn=128 wide"][2], "DOT_ASM": True}, 4)
    out["decode rows=dot ec=True bn=128 spg=4 wide=2 asm"] = (
        decode._w4_decode_kernel, decode_ptrs, {**out["decode rows=dot ec=True bn=128 spg=4 wide=2"][2], "DOT_ASM": True}, 4)
    # g = 128 with one dot a block (the decode kernel's float32 scale a group; the compile test's contrast)
    out["decode rows=dot ec=True bn=128 spg=8 wide=2 grouped"] = (
        decode._w4_decode_kernel, decode_ptrs, {**out["decode rows=dot ec=True bn=128 spg=4 wide=2"][2], "SPG": 8}, 4)
    for ec in (True, False):  # the one-row GEMV as the tuner most often picks it: 8 warps
        const = dict(HAS_EC=ec, GATED=ec, HAS_BIAS=False, R=32, H=16, BM=16, BN=32, BK=decode.ax_block(1, 128), SPG=8,
                     GEMV_ROWS=1, BKW=128, PER_CHANNEL=True, PEERS=0, U_CHUNK=8, **lab_off)
        out[f"decode rows=1 ec={ec} warps=8"] = (decode._w4_decode_kernel, decode_ptrs, const, 8)
    # the same with as many columns of A a u-program step as GEMV words a step (what decode.ax_block avoids), for the test
    out["decode rows=1 ec=False warps=8 bk=128"] = (decode._w4_decode_kernel, decode_ptrs,
                                                    {**const, "HAS_EC": False, "GATED": False, "BK": 128}, 8)
    for rows in (1, 0):  # gate/up with silu(gate) ⊙ up in the epilogue (model.FUSE_SWIGLU), GEMV and dot loops
        out[f"decode rows={rows or 'dot'} ec=True swiglu"] = (decode._w4_decode_kernel, decode_ptrs,
                                                              {**const, "HAS_EC": True, "GATED": True, "SWIGLU": True,
                                                               "GEMV_ROWS": rows}, 8)
    # the GEMV loop pipelined through shared memory (as the tuner's 3-stage candidates run it)
    out["decode rows=1 ec=False warps=8 stages=3"] = (decode._w4_decode_kernel, decode_ptrs,
                                                      {**const, "HAS_EC": False, "GATED": False, "GEMV_STAGES": 3}, 8)
    # the GEMV loop in fp16x2 (DecodeConfig.gemv_f16x2): as the 8-warp one-row GEMV above, and at 4 warps, 16 rows of W
    # and 256 words a step, 2 stages (both loops there); its 4-row and grouped (g = 32, 128) branches
    f16x2 = {**const, "HAS_EC": False, "GATED": False, "GEMV_F16X2": True, "WORD_CHAIN": decode.WORD_CHAIN}
    out["decode rows=1 ec=False warps=8 f16x2"] = (decode._w4_decode_kernel, decode_ptrs, f16x2, 8)
    for on in (False, True):
        out["decode rows=1 ec=False warps=4 bn=16 bkw=256 stages=2" + " f16x2" * on] = (
            decode._w4_decode_kernel, decode_ptrs, {**f16x2, "GEMV_F16X2": on, "BN": 16, "BKW": 256, "GEMV_STAGES": 2,
                                                "BK": decode.ax_block(1, 256)}, 4)
    for rows, spg, per_channel in ((4, 8, True), (1, 2, False), (1, 8, False)):
        out[f"decode rows={rows} ec=True spg={spg} per_channel={per_channel} f16x2"] = (
            decode._w4_decode_kernel, decode_ptrs, {**f16x2, "HAS_EC": True, "GATED": True, "GEMV_ROWS": rows, "SPG": spg,
                                                "PER_CHANNEL": per_channel, "BKW": 64, "BK": 128}, 4)
    # launched dependent on the launch before (kernels.pdl): griddepcontrol.wait first, the release after the loop
    out["decode rows=1 ec=True f16x2 pdl"] = (decode._w4_decode_kernel, decode_ptrs,
                                              {**f16x2, "HAS_EC": True, "GATED": True, "BKW": 64, "BK": 128,
                                               "PDL": True, "PDL_LATE": True}, 4)
    # each step's codes loaded a step ahead, the first before griddepcontrol.wait (PRELOAD: W4Launch.preload), as the
    # tuner's single-stage GEMV candidates run under PDL: 8 warps, float32 and fp16x2; 4 warps, 64 words, fp16x2, EC
    for name, extra, warps in (("decode rows=1 ec=False warps=8 preload", {**const, "HAS_EC": False, "GATED": False}, 8),
                               ("decode rows=1 ec=False warps=8 f16x2 preload", f16x2, 8),
                               ("decode rows=1 ec=True warps=4 f16x2 preload", {**f16x2, "HAS_EC": True, "GATED": True,
                                                                                "BKW": 64, "BK": 128}, 4)):
        out[name] = (decode._w4_decode_kernel, decode_ptrs, {**extra, "PDL": True, "PDL_LATE": True, "PRELOAD": True}, warps)
    # an RMSNorm folded across two launches (kernels.norm_fold): the producer's add + Σ h² epilogue, the consumer's
    # rstd scaling (SwiGLU, as gate/up takes it), both as the tuner's 4-warp fp16x2 EC candidate runs under PDL
    fold = {**f16x2, "HAS_EC": True, "GATED": True, "BKW": 64, "BK": 128, "PDL": True, "PDL_LATE": True, "PRELOAD": True}
    out["decode rows=1 ec=True f16x2 add_norm"] = (decode._w4_decode_kernel, {**decode_ptrs, "res_ptr": F16, "nw_ptr": F16,
                                                                         "hw_ptr": F16, "ssq_ptr": F32},
                                                   {**fold, "ADD_NORM": True}, 4)
    for rows in (1, 0):
        out[f"decode rows={rows or 'dot'} ec=True swiglu rms_in"] = (
            decode._w4_decode_kernel, {**decode_ptrs, "ssq_ptr": F32, "eps": "fp32"},
            {**fold, "SWIGLU": True, "GEMV_ROWS": rows, "RMS_IN": True, "SSQ_BLOCK": 128}, 4)
    out["decode rows=dot ec=True swiglu pdl"] = (decode._w4_decode_kernel, decode_ptrs,
                                                 {**const, "HAS_EC": True, "GATED": True, "SWIGLU": True,
                                                  "GEMV_ROWS": 0, "PDL": True}, 4)
    # tensor parallelism's symmetric path: the float32 partial into the staging rows, no EC (fp16 dummies)
    const = dict(HAS_EC=False, GATED=False, HAS_BIAS=False, R=16, H=16, BM=16, BN=32, BK=128, SPG=8, GEMV_ROWS=1,
                 BKW=64, PER_CHANNEL=True, PEERS=0, U_CHUNK=8, **lab_off)
    out["decode rows=1 float32 out"] = (decode._w4_decode_kernel, {**decode_ptrs, "y_ptr": F32, "bias_ptr": F32}, const, 4)
    for rows in (1, 0):  # tensor parallelism: the partials y_r and u_r into two ranks' buffers, then the signals
        const = dict(HAS_EC=True, GATED=True, HAS_BIAS=False, R=32, H=16, BM=16, BN=32, BK=128, SPG=8, GEMV_ROWS=rows,
                     BKW=64, PER_CHANNEL=True, PEERS=2, U_CHUNK=8, **lab_off)
        out[f"decode rows={rows or 'dot'} to peers"] = (decode._w4_decode_kernel, {**decode_ptrs, "peer_rows_ptr": I64,
                                                                               "peer_signals_ptr": I64}, const, 4)
    return out


def _prefill_and_epilogue_variants() -> dict[str, tuple]:
    """The prefill paths' kernels (kernels.w4.prefill) and tensor parallelism's EC epilogues (kernels.ec_epilogue)."""
    from spear.kernels import ec_epilogue
    from spear.kernels.w4 import prefill

    f16 = _F16_PTRS
    out = {}
    for split in (False, True):  # the EC's rank-space kernel for the prefill paths: whole K, or K split
        out["ec_rank" + " split" * split] = (prefill._ec_rank_kernel, {**f16, "u_part_ptr": F32 if split else F16},
                                             dict(GATED=True, R=32, H=16, BM=32, BK=64, SPLIT=split), 4)
    out["ec_gate"] = (prefill._ec_gate_kernel, {**f16, "u_part_ptr": F32}, dict(GATED=True, R=32, H=16, BM=32), 4)
    out["dequant"] = (prefill._dequant_kernel, {**f16, "qw_ptr": I32}, dict(BN=64), 4)
    for spg in (8, 4):  # the wide dot loop (one dot a block, or a group of 64 with its codes scaled) in the prefill
        # tile GEMM
        out[f"prefill_fused wide=2 spg={spg}"] = (
            prefill._w4_prefill_kernel, {**f16, "qw_ptr": I32},
            dict(HAS_EC=True, HAS_BIAS=False, R=32, BM=128, BN=128, SPG=spg, GROUP_M=8, PER_CHANNEL=spg == 8,
                 SCALE_CODES=spg != 8), 8)
    out["prefill_fused wide=2 spg=8 asm"] = (prefill._w4_prefill_kernel, {**f16, "qw_ptr": I32},
                                             {**out["prefill_fused wide=2 spg=8"][2], "DOT_ASM": True}, 8)
    # g = 128: the float32 scale a group (the compile test's contrast), and the codes scaled (launched)
    grouped = {**out["prefill_fused wide=2 spg=8"][2], "PER_CHANNEL": False, "SCALE_CODES": False}
    out["prefill_fused wide=2 spg=8 grouped"] = (prefill._w4_prefill_kernel, {**f16, "qw_ptr": I32}, grouped, 8)
    out["prefill_fused wide=2 spg=8 scale_codes asm"] = (
        prefill._w4_prefill_kernel, {**f16, "qw_ptr": I32}, {**grouped, "SCALE_CODES": True, "DOT_ASM": True}, 8)
    # from 1024 rows with an EC: the 128 × 256 tile as the programmatic dependent of the rank programs beside it
    out["prefill_fused wide=2 spg=8 asm bn=256 pdl"] = (prefill._w4_prefill_kernel, {**f16, "qw_ptr": I32},
                                                      {**out["prefill_fused wide=2 spg=8 asm"][2], "BN": 256,
                                                       "PDL": True}, 8)
    out["ec_rank_programs pdl"] = (prefill._ec_rank_programs_kernel, f16,
                                   dict(GATED=True, R=32, H=16, BM=128, BK=128, PDL=True), 8)
    for has_ec in (True, False):  # tensor parallelism: on the reduced fp32 [y | u] rows, into fp16
        out[f"ec_epilogue ec={has_ec}"] = (ec_epilogue._ec_epilogue_kernel, {**f16, "y_ptr": F32, "u_ptr": F32,
                                                                             "out_ptr": F16, "bias_ptr": F16},
                                           dict(HAS_EC=has_ec, GATED=has_ec, HAS_BIAS=True, BLOCK_N=128, BLOCK_R=32,
                                                BLOCK_H=16), 4)
    out["peer_epilogue"] = (ec_epilogue._peer_epilogue_kernel, {**f16, "slots_ptr": F32, "signals_ptr": I32,
                                                                 "state_ptr": I32, "out_ptr": F16},
                            dict(WORLD=2, HAS_EC=True, GATED=True, HAS_BIAS=True, BLOCK_N=128, BLOCK_R=32,
                                 BLOCK_H=16), 4)
    out["peer_epilogue add_norm"] = (ec_epilogue._peer_epilogue_kernel,
                                     {**f16, "slots_ptr": F32, "signals_ptr": I32, "state_ptr": I32, "out_ptr": F16,
                                      "res_ptr": F16, "nw_ptr": F16, "hw_ptr": F16, "ssq_ptr": F32},
                                     dict(WORLD=2, HAS_EC=True, GATED=True, HAS_BIAS=True, BLOCK_N=128, BLOCK_R=32,
                                          BLOCK_H=16, ADD_NORM=True), 4)
    return out


def _attention_and_f16_variants() -> dict[str, tuple]:
    """Decode attention (kernels.ops) and the float model's one-row GEMV (kernels.f16_gemv)."""
    from spear.kernels import f16_gemv, ops

    out = {}
    # decode attention, rows alone or tiled

    attention_ptrs = {**{n: F16 for n in ("q_ptr", "k_pool_ptr", "v_pool_ptr", "out_ptr")},
                      **{n: I32 for n in ("tables_ptr", "seq_lens_ptr", "tiles_ptr")},
                      **{n: F32 for n in ("m_ptr", "l_ptr", "acc_ptr")}, "scale": "fp32"}
    for tiles in (False, True):
        out[f"decode attention tiles={tiles}"] = (
            ops._paged_decode_split_kernel, attention_ptrs,
            dict(GROUP=1, BLOCK_G=1, BLOCK_Q=16, HAS_TILES=tiles, D=128, SPLITS=4, BLOCK_N=ops.BLOCK_N, PRECISION="tf32",
                 PDL=True), 4)
    # the float model's one-row GEMV: one row block, and runs of four with a masked K
    gemv_ptrs = {n: F16 for n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")}
    # (block_n, block_k, warps, row_blocks, even K)
    for block_n, block_k, warps, row_blocks, even in ((2, 1024, 4, 1, True), (4, 1024, 4, 4, False)):
        out[f"f16 gemv {block_n}x{block_k} warps={warps} row_blocks={row_blocks} even_k={even}"] = (
            f16_gemv._f16_gemv_kernel, gemv_ptrs,
            dict(HAS_BIAS=True, BLOCK_N=block_n, BLOCK_K=block_k, ROW_BLOCKS=row_blocks, EVEN_K=even,
                 PDL=True), warps)
    return out


def main() -> None:
    report = {}
    for name, (kernel, pointers, constexprs, warps) in variants().items():
        try:
            compiled = compile_for_gpu(kernel, pointers, constexprs, _DIVISIBLE, num_warps=warps)
            report[name] = {"ok": True, "warps": warps, "registers": registers(compiled),
                            "loops": [vars(loop) for loop in loop_mix(sass(compiled))]}
        except Exception as e:  # noqa: BLE001 — reported per variant
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
