"""Compile the Triton kernels for a GPU on a machine without one (triton ships ptxas), and read their SASS.

    python -m spear.kernels.offline        # every variant the host code launches; JSON on stdout

The interpreter (TRITON_INTERPRET=1, what CI runs) executes a kernel as NumPy and never type-checks
it the way the compiler does: a name bound to two shapes in the branches of a run-time `if`, for
example, passes the interpreter and fails to compile on the GPU. `compile_for_gpu` runs the real
compiler (frontend to cubin) for sm_90, so CI catches that; `loop_mix` counts the instructions of
each loop in the SASS, which is how the decode kernel's instructions per weight are read off
(bench/NOTES-kernels.md). Run it without TRITON_INTERPRET: under the interpreter `triton.jit` gives
interpreted functions, which the compiler cannot take. Every variant takes its compile-time flags from the function
its launcher launches with: the decode kernel's from decode.decode_flags (w4_decode), the others' from prefill's
ec_rank_flags, ec_gate_flags, dequant_flags, rank_programs_flags and prefill_flags, ec_epilogue's epilogue_flags and
peer_epilogue_flags, ops.attention_flags and f16_gemv.f16_gemv_flags; a variant overrides one only for a comparison
no launch makes (`lab`). tests/test_kernels_compile.py checks that each launcher passes what is compiled here.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from spear.kernels.pdl import W4Launch
from spear.kernels.w4 import decode
from spear.kernels.w4.config import DecodeConfig, PrefillConfig

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


F16, I8, I32, F32, I64 = "*fp16", "*i8", "*i32", "*fp32", "*i64"
_DIVISIBLE = ("KW", "K", "N", "stride_xm", "stride_ym", "k_per_split", "ax_k_per_prog", "group_size", "stride_gm",
              "stride_wn", "H", "block_size", "stride_pool_block", "stride_pool_offset")  # as a Llama launch has them


_F16_PTRS = {n: F16 for n in ("x_ptr", "s_ptr", "z_ptr", "bias_ptr", "y_ptr", "a_ptr", "b_ptr", "w1_ptr", "b1_ptr",
                                "w2_ptr", "b2_ptr", "g_ptr", "w_ptr", "a_scale_ptr", "b_scale_ptr")}  # scales: dummies
_INT8_EC_PTRS = {"a_ptr": I8, "b_ptr": I8, "a_scale_ptr": F32, "b_scale_ptr": F32}  # an EC's int8 form (kernels.pack)


@dataclass(frozen=True)
class Variant:
    """A kernel as the host code launches it: its pointers' types, constexprs, num_warps and num_stages."""

    kernel: object
    pointers: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 3


def compile_variant(v: Variant):
    return compile_for_gpu(v.kernel, v.pointers, v.constexprs, _DIVISIBLE, num_warps=v.num_warps,
                           num_stages=v.num_stages)


def _variant(kernel, pointers: dict[str, str], flags: dict) -> Variant:
    """A Variant from a launch's keywords: constexprs, with num_warps and num_stages where the launch sets them
    (else Triton's defaults, 4 and 3)."""
    constexprs = dict(flags)
    warps, stages = constexprs.pop("num_warps", 4), constexprs.pop("num_stages", 3)
    return Variant(kernel, pointers, constexprs, warps, stages)


def variants() -> dict[str, Variant]:
    """name → Variant for each kernel variant the host code launches (and the few comparisons the tests read)."""
    return {name: launch.variant() for name, launch in {**decode_launches(), **launches()}.items()}


_DECODE_PTRS = {**_F16_PTRS, "qw_ptr": I32, "y_part_ptr": F32, "u_part_ptr": F32, "g_ptr": I64, "cnt_ptr": I32,
                "reads_ptr": I64}
_K = 4096  # the columns a per-channel group spans (Llama-2-7B's hidden size)
_EC = (32, 16, True, False)  # an EC's padded rank 32, the gate's hidden size 16, gated, fp16 factors (PackedEC.dims)
_EC8 = (32, 16, True, True)  # the same with int8 factors
_NO_PRELOAD = W4Launch(late=True, preload=False)  # SPEAR_W4_PRELOAD=0: each step's codes loaded in their step
_PRELOAD = W4Launch(late=True, preload=True)  # the default (kernels.options)


@dataclass(frozen=True)
class DecodeLaunch:
    """A W4 decode launch by its inputs: m rows under `cfg`, groups of `group_size` columns (None: per-channel), the
    EC (PackedEC.dims: padded rank, gate hidden size, gated, int8 factors) or None, PDL, the W4Launch switches and
    decode_flags's other keywords (`flags`). Its constexprs are decode.decode_flags's, as w4_decode launches it, but
    for `lab`: overrides for a comparison no launch makes (the tests read them). `pointers`: types beyond the decode
    kernel's usual ones (an int8 EC's come with it)."""

    m: int
    cfg: DecodeConfig
    group_size: int | None = None
    ec: tuple[int, int, bool, bool] | None = None
    pdl: bool = False
    launch: W4Launch = _NO_PRELOAD
    flags: dict = field(default_factory=dict)
    pointers: dict = field(default_factory=dict)
    lab: dict = field(default_factory=dict)

    def launch_flags(self) -> dict:
        """What w4_decode passes for these inputs on an sm_90 GPU: constexprs with PDL, num_warps, num_stages."""
        return {**decode.decode_flags(self.m, self.cfg, self.group_size or _K, self.group_size is None, self.ec,
                                      launch=self.launch, compiled=True, **self.flags),
                "PDL": self.pdl}

    def variant(self) -> Variant:
        pointers = {**_DECODE_PTRS, **(_INT8_EC_PTRS if self.ec is not None and self.ec[3] else {}), **self.pointers}
        return _variant(decode._w4_decode_kernel, pointers, {**self.launch_flags(), **self.lab})


def decode_launches() -> dict[str, DecodeLaunch]:
    """The W4 decode kernel's variants (kernels.w4.decode): the tuner's configs (w4.config.DECODE_CANDIDATES) and
    the untuned default at 1 to 128 rows, with and without the EC, groups, PDL and the epilogues' extra ops."""
    ec = _EC
    gemv32 = DecodeConfig(32, 0, 4, 1, gemv_rows=4, block_kw=64)  # the float32 GEMV loop, 4 warps, one stage
    gemv32_w8 = DecodeConfig(32, 0, 8, 1, gemv_rows=4, block_kw=128)  # the same at 8 warps (a candidate)
    f16x2, f16x2_w8 = (replace(c, gemv_f16x2=True) for c in (gemv32, gemv32_w8))  # candidates
    dot = DecodeConfig(32, 0, 4, 3, gemv_rows=0)  # the tensor-core dot loop (a candidate)
    out = {}
    for rows, has_ec, g, m in ((0, True, None, 16), (1, True, None, 1), (1, False, None, 1), (1, False, 32, 1),
                               (2, True, 64, 2), (4, True, None, 4), (0, True, None, 64), (0, True, 32, 128)):
        name = (f"decode rows={rows or 'dot'} ec={has_ec} spg={min(8, (g or _K) // 16)} per_channel={g is None}"
                + (f" bm={m}" if m > 16 else ""))
        out[name] = DecodeLaunch(m, gemv32 if rows else dot, g, ec if has_ec else None, flags=dict(has_bias=True))
    # the dot loop at 16 rows as the tuner picks it (BN 64 / 128: wgmma, one K = 128 dot a block, _w4_block_wide);
    # groups of 64 and 32 with one dot a group, and g = 128 (the decode kernel's float32 scale a group). The codes
    # go through inline PTX (DOT_ASM), as compiled code launches them; each "... asm" variant's twin without the
    # suffix compiles the same without it (the test's contrast)
    no_asm, dot128 = dict(DOT_ASM=False), replace(dot, block_n=128)
    out["decode rows=dot ec=False bn=64 wide"] = DecodeLaunch(16, replace(dot, block_n=64))
    out["decode rows=dot ec=False bn=128 wide"] = DecodeLaunch(16, dot128, lab=no_asm)
    for g in (64, 32):
        out[f"decode rows=dot ec=True bn=128 spg={g // 16} wide=2"] = DecodeLaunch(16, dot128, g, ec,
                                                                                  lab=no_asm if g == 64 else {})
    out["decode rows=dot ec=False bn=128 wide asm"] = DecodeLaunch(16, dot128)
    out["decode rows=dot ec=True bn=128 spg=4 wide=2 asm"] = DecodeLaunch(16, dot128, 64, ec)
    out["decode rows=dot ec=True bn=128 spg=8 wide=2 grouped"] = DecodeLaunch(16, dot128, 128, ec)
    for has_ec in (True, False):  # the one-row GEMV as the tuner most often picks it: 8 warps
        out[f"decode rows=1 ec={has_ec} warps=8"] = DecodeLaunch(1, gemv32_w8, ec=ec if has_ec else None)
    # W4+EC with as many columns of A a u-program step as GEMV words a step (what decode.ax_block avoids)
    out["decode rows=1 ec=True warps=8 bk=128"] = DecodeLaunch(1, gemv32_w8, ec=ec, lab=dict(BK=128))
    # gate/up with silu(gate) ⊙ up in the epilogue (model.FUSE_SWIGLU): the GEMV loop, and the untuned default at
    # 16 rows (the dot loop)
    out["decode rows=1 ec=True swiglu"] = DecodeLaunch(1, gemv32_w8, ec=ec, flags=dict(swiglu=True))
    out["decode rows=dot ec=True swiglu"] = DecodeLaunch(16, DecodeConfig(), ec=ec, flags=dict(swiglu=True))
    # the GEMV loop pipelined through shared memory: the untuned default (3 stages)
    out["decode rows=1 ec=False warps=8 stages=3"] = DecodeLaunch(1, DecodeConfig())
    # the GEMV loop in fp16x2 (DecodeConfig.gemv_f16x2): 8 warps, and 4 warps, 16 rows of W and 256 words a step,
    # 2 stages (in float32 too); its 4-row and grouped (g = 32, 128) branches
    out["decode rows=1 ec=False warps=8 f16x2"] = DecodeLaunch(1, f16x2_w8)
    for on in (False, True):
        out["decode rows=1 ec=False warps=4 bn=16 bkw=256 stages=2" + " f16x2" * on] = DecodeLaunch(
            1, DecodeConfig(16, 0, 4, 2, gemv_rows=4, block_kw=256, gemv_f16x2=on))
    for rows, g in ((4, None), (1, 32), (1, 128)):
        out[f"decode rows={rows} ec=True spg={min(8, (g or _K) // 16)} per_channel={g is None} f16x2"] = (
            DecodeLaunch(rows, f16x2, g, ec))
    # launched dependent on the launch before (kernels.pdl): griddepcontrol.wait first, the release after the loop
    out["decode rows=1 ec=True f16x2 pdl"] = DecodeLaunch(1, f16x2, ec=ec, pdl=True)
    # each step's codes loaded a step ahead, the first before griddepcontrol.wait (W4Launch.preload), as the
    # single-stage GEMV configs run under PDL: 8 warps, float32 and fp16x2; 4 warps, 64 words, fp16x2, EC
    for name, cfg, with_ec in (("decode rows=1 ec=False warps=8 preload", gemv32_w8, None),
                               ("decode rows=1 ec=False warps=8 f16x2 preload", f16x2_w8, None),
                               ("decode rows=1 ec=True warps=4 f16x2 preload", f16x2, ec)):
        out[name] = DecodeLaunch(1, cfg, ec=with_ec, pdl=True, launch=_PRELOAD)
    # an EC with int8 factors (kernels.pack): A's tiles held as codes a step ahead and dequantized at their dot, B's
    # codes through the main loop to the epilogue; the one-row GEMV as served, and the dot loop
    out["decode rows=1 ec=True int8 f16x2 preload"] = DecodeLaunch(1, f16x2, ec=_EC8, pdl=True, launch=_PRELOAD)
    out["decode rows=dot ec=True int8"] = DecodeLaunch(16, dot, ec=_EC8, flags=dict(has_bias=True))
    # an RMSNorm folded across two launches (kernels.norm_fold): the producer's add + Σ h² epilogue (128 tiles), the
    # consumer's rstd scaling (SwiGLU, as gate/up takes it) at one row and (the dot loop) at 16
    out["decode rows=1 ec=True f16x2 add_norm"] = DecodeLaunch(
        1, f16x2, ec=ec, pdl=True, launch=_PRELOAD, flags=dict(add_norm=True, num_ssq=128),
        pointers={"res_ptr": F16, "nw_ptr": F16, "hw_ptr": F16, "ssq_ptr": F32})
    for rows in (1, 0):
        out[f"decode rows={rows or 'dot'} ec=True swiglu rms_in"] = DecodeLaunch(
            rows or 16, f16x2 if rows else dot, ec=ec, pdl=True, launch=_PRELOAD,
            flags=dict(swiglu=True, rms_in=True, num_ssq=128), pointers={"ssq_ptr": F32, "eps": "fp32"})
    out["decode rows=dot ec=True swiglu pdl"] = DecodeLaunch(16, dot, ec=ec, pdl=True, flags=dict(swiglu=True))
    # tensor parallelism's symmetric path: the float32 partial into the staging rows, no EC (fp16 dummies)
    out["decode rows=1 float32 out"] = DecodeLaunch(1, gemv32, pointers={"y_ptr": F32, "bias_ptr": F32})
    for rows, e in ((1, ec), (0, ec), (1, _EC8)):  # tensor parallelism: the partials y_r and u_r into two ranks'
        # buffers, then the signals (an int8 EC's A: tp.RankSpaceEC.packed_a)
        out[f"decode rows={rows or 'dot'} to peers" + " int8" * e[3]] = DecodeLaunch(
            rows or 16, gemv32 if rows else dot, ec=e, flags=dict(peers=2),
            pointers={"peer_rows_ptr": I64, "peer_signals_ptr": I64})
    return out


@dataclass(frozen=True)
class Launch:
    """A launch of `kernel` by its launcher's inputs: its constexprs (num_warps and num_stages where the launcher sets
    them) are `flags(**inputs)`, what the launcher passes for those inputs, with PDL (None: the kernel takes none)
    as kernels.pdl.launch_options gives it; `lab`: overrides for a comparison no launch makes (the tests read them)."""

    kernel: object
    pointers: dict[str, str]
    flags: Callable[..., dict]
    inputs: dict = field(default_factory=dict)
    pdl: bool | None = None
    lab: dict = field(default_factory=dict)

    def launch_flags(self) -> dict:
        """What the launcher passes for these inputs on an sm_90 GPU: constexprs with PDL, num_warps and num_stages
        where it sets them."""
        return {**self.flags(**self.inputs), **({} if self.pdl is None else {"PDL": self.pdl})}

    def variant(self) -> Variant:
        return _variant(self.kernel, self.pointers, {**self.launch_flags(), **self.lab})


def launches() -> dict[str, Launch]:
    """The variants of every kernel but the decode kernel's (decode_launches), by their launchers' inputs."""
    return {**_prefill_and_epilogue_launches(), **_attention_and_f16_launches()}


def _prefill_and_epilogue_launches() -> dict[str, Launch]:
    """The prefill paths' kernels (kernels.w4.prefill) and tensor parallelism's EC epilogues (kernels.ec_epilogue)."""
    from spear.kernels import ec_epilogue
    from spear.kernels.w4 import prefill

    f16 = _F16_PTRS
    w4 = {**f16, "qw_ptr": I32}
    out = {}
    for split, ec in ((False, _EC), (True, _EC), (False, _EC8)):  # the EC's rank-space kernel for the prefill paths
        # (ec_rank's defaults): whole K, or K split; int8 A
        out["ec_rank" + " split" * split + " int8" * ec[3]] = Launch(
            prefill._ec_rank_kernel, {**f16, "u_part_ptr": F32 if split else F16, **(_INT8_EC_PTRS if ec[3] else {})},
            prefill.ec_rank_flags, dict(ec=ec, split=split))
    out["ec_gate"] = Launch(prefill._ec_gate_kernel, {**f16, "u_part_ptr": F32}, prefill.ec_gate_flags, dict(ec=_EC))
    out["dequant"] = Launch(prefill._dequant_kernel, w4, prefill.dequant_flags)

    def fused(group_size: int | None, cfg: PrefillConfig | None = None, pdl: bool = False, lab: dict | None = None,
              ec: tuple[int, int, bool, bool] = _EC):
        """The tile GEMM with the EC `ec`, no bias, compiled, under `cfg` (None: PrefillConfig's default); groups of
        `group_size` columns (None: per-channel)."""
        return Launch(prefill._w4_prefill_kernel, {**w4, **(_INT8_EC_PTRS if ec[3] else {})}, prefill.prefill_flags,
                      dict(cfg=cfg or PrefillConfig(), group_size=group_size or _K, per_channel=group_size is None,
                           ec=ec, has_bias=False, compiled=True), pdl, lab or {})

    # the wide dot loop (one dot a block, or a group of 64 with its codes scaled) in the prefill tile GEMM, as
    # PrefillConfig's default (128 × 128, 8 warps, 3 stages) runs it; the codes without inline PTX (DOT_ASM), as no
    # launch compiles them: each "... asm" variant is its twin as launched (the test's contrast)
    no_asm = dict(DOT_ASM=False)
    out["prefill_fused wide=2 spg=8"] = fused(None, lab=no_asm)
    out["prefill_fused wide=2 spg=4"] = fused(64, lab=no_asm)
    out["prefill_fused wide=2 spg=8 asm"] = fused(None)
    # g = 128: the float32 scale a group (the compile test's contrast), and the codes scaled (launched)
    out["prefill_fused wide=2 spg=8 grouped"] = fused(128, lab=dict(DOT_ASM=False, SCALE_CODES=False))
    out["prefill_fused wide=2 spg=8 scale_codes asm"] = fused(128)
    # from 1024 rows with an EC: the 128 × 256 tile as the programmatic dependent of the rank programs beside it
    wide = PrefillConfig(block_n=256)
    out["prefill_fused wide=2 spg=8 asm bn=256 pdl"] = fused(None, wide, pdl=True)
    # an EC with int8 factors: the rank programs' A, the GEMM epilogue's B
    out["prefill_fused wide=2 spg=8 asm bn=256 pdl int8"] = fused(None, wide, pdl=True, ec=_EC8)
    for ec in (_EC, _EC8):
        out["ec_rank_programs pdl" + " int8" * ec[3]] = Launch(
            prefill._ec_rank_programs_kernel, {**f16, **(_INT8_EC_PTRS if ec[3] else {})}, prefill.rank_programs_flags,
            dict(ec=ec, cfg=wide), pdl=True)
    rank, hidden, _, _ = _EC
    int8_b = {"b_ptr": I8, "b_scale_ptr": F32}
    for has_ec, int8 in ((True, False), (False, False), (True, True)):  # tensor parallelism: on the reduced fp32
        # [y | u] rows, into fp16 (an fp16 EC's dummy scale pointer is y's); int8 B
        out[f"ec_epilogue ec={has_ec}" + " int8" * int8] = Launch(
            ec_epilogue._ec_epilogue_kernel, {**f16, "y_ptr": F32, "u_ptr": F32, "out_ptr": F16, "bias_ptr": F16,
                                              "b_scale_ptr": F32, **(int8_b if int8 else {})},
            ec_epilogue.epilogue_flags, dict(rank=rank if has_ec else 1, hidden=hidden if has_ec else 1,
                                             has_ec=has_ec, gated=has_ec, has_bias=True, int8=int8))
    peer = {**f16, "slots_ptr": F32, "signals_ptr": I32, "state_ptr": I32, "out_ptr": F16}
    for add_norm, int8 in ((False, False), (True, False), (False, True)):
        out["peer_epilogue" + " add_norm" * add_norm + " int8" * int8] = Launch(
            ec_epilogue._peer_epilogue_kernel,
            {**peer, **({"res_ptr": F16, "nw_ptr": F16, "hw_ptr": F16, "ssq_ptr": F32} if add_norm else {}),
             **(int8_b if int8 else {})},
            ec_epilogue.peer_epilogue_flags,
            dict(world=2, rank=rank, hidden=hidden, has_ec=True, gated=True, has_bias=True, add_norm=add_norm,
                 int8=int8))
    return out


def _attention_and_f16_launches() -> dict[str, Launch]:
    """Decode attention (kernels.ops) and the float model's one-row GEMV (kernels.f16_gemv)."""
    from spear.kernels import f16_gemv, ops

    out = {}
    # decode attention, rows alone or tiled: Llama-2-7B's heads (MHA, D = 128) in 4 splits
    attention_ptrs = {**{n: F16 for n in ("q_ptr", "k_pool_ptr", "v_pool_ptr", "out_ptr")},
                      **{n: I32 for n in ("tables_ptr", "seq_lens_ptr", "tiles_ptr")},
                      **{n: F32 for n in ("m_ptr", "l_ptr", "acc_ptr")}, "scale": "fp32"}
    for tiles in (False, True):
        out[f"decode attention tiles={tiles}"] = Launch(
            ops._paged_decode_split_kernel, attention_ptrs, ops.attention_flags,
            dict(group=1, head_dim=128, splits=4, tiles=tiles, tile_rows=ops.attention_tile_rows(1)), pdl=True)
    # Phi-3-mini's heads (MHA, D = 96): the head dim padded to 128 with masked lanes
    out["decode attention D=96 tiles=True"] = Launch(
        ops._paged_decode_split_kernel, attention_ptrs, ops.attention_flags,
        dict(group=1, head_dim=96, splits=4, tiles=True, tile_rows=ops.attention_tile_rows(1)), pdl=True)
    # the float model's one-row GEMV: one row block and K = 4096, and runs of four with a masked K (11008, down's)
    gemv_ptrs = {n: F16 for n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")}
    for cfg, k in ((f16_gemv.GemvConfig(2, 1024, 4), _K), (f16_gemv.GemvConfig(4, 1024, 4, 4), 11008)):
        out[f"f16 gemv {cfg.block_n}x{cfg.block_k} warps={cfg.num_warps} row_blocks={cfg.row_blocks} "
            f"even_k={k % cfg.block_k == 0}"] = Launch(f16_gemv._f16_gemv_kernel, gemv_ptrs, f16_gemv.f16_gemv_flags,
                                                       dict(cfg=cfg, k=k, has_bias=True), pdl=True)
    return out


def main() -> None:
    report = {}
    for name, v in variants().items():
        try:
            compiled = compile_variant(v)
            report[name] = {"ok": True, "warps": v.num_warps, "stages": v.num_stages, "registers": registers(compiled),
                            "loops": [vars(loop) for loop in loop_mix(sass(compiled))]}
        except Exception as e:  # noqa: BLE001 — reported per variant
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
