"""Every Triton kernel variant the host code launches compiles for the H200 (sm_90), on this CPU machine.

The interpreter runs a kernel as NumPy and misses what only the compiler checks (a name bound to
two shapes in the branches of a run-time `if` once reached the GPU untested). So each variant goes
through the real compiler, down to a cubin, in a subprocess without TRITON_INTERPRET
(spear.kernels.offline).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from spear.kernels import offline


@pytest.fixture(scope="module")
def report() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "spear.kernels.offline"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _recorded(module, monkeypatch) -> dict[str, dict]:
    """Replaces the Triton kernels of `module` with recorders: kernel name → the keyword arguments of its launch
    (triton's launch_pdl left out)."""
    seen = {}

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen[self.name] = {k: v for k, v in kwargs.items() if k != "launch_pdl"}

            return launch

    for name in dir(module):
        if name.endswith("_kernel"):
            monkeypatch.setattr(module, name, Recorder(name))
    return seen


def _pdl_options(pdl: bool) -> dict:
    """kernels.pdl.launch_options on an sm_90 GPU with PDL on (pdl) or off."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


def _packed_w4(n: int, k: int, group_size: int):
    from spear.kernels.pack import PackedW4

    f16 = dict(dtype=torch.float16)
    return PackedW4(torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n, k // group_size, **f16),
                    torch.zeros(n, k // group_size, **f16), group_size, k)


def _gate(r: int, h: int) -> tuple[torch.Tensor, ...]:
    """An EC's gate: W1 [h, r], b1 [h], W2 [r, h], b2 [r]."""
    f16 = dict(dtype=torch.float16)
    return torch.zeros(h, r, **f16), torch.zeros(h, **f16), torch.zeros(r, h, **f16), torch.zeros(r, **f16)


def _packed_ec(ec: tuple[int, int, bool, bool], n: int, k: int):
    """A PackedEC of (padded rank, the gate's hidden size, gated, int8 factors) on an [n, k] weight."""
    from spear.kernels.pack import PackedEC

    r, h, gated, int8 = ec
    factor = torch.int8 if int8 else torch.float16
    scales = dict(a_scale=torch.zeros(r), b_scale=torch.zeros(r)) if int8 else {}
    return PackedEC(torch.zeros(r, k, dtype=factor), torch.zeros(n, r, dtype=factor), *_gate(r, h), rank=r,
                    gated=gated, **scales)


def _launch_kwargs(launch, monkeypatch) -> dict:
    """The keyword arguments w4_decode passes to the decode kernel for an offline.DecodeLaunch's inputs, as on an
    sm_90 GPU (compiled code, PDL as the launch has it), from its host code with the kernel replaced by a recorder."""
    from spear.kernels.norm_fold import FoldedNorm
    from spear.kernels.w4 import decode

    seen = _recorded(decode, monkeypatch)
    monkeypatch.setattr(decode, "runs_compiled", lambda x: True)
    monkeypatch.setattr(decode, "w4_launch", lambda: launch.launch)
    monkeypatch.setattr(decode, "launch_options", lambda x: _pdl_options(launch.pdl))
    cfg, m, flags = launch.cfg, launch.m, launch.flags
    k = 2048 if flags.get("even") else 2176  # 2176: no GEMV step divides it, so the code loads stay masked
    n = cfg.block_n * flags.get("num_ssq", 4)  # with add_norm, num_ssq is the tiles
    f16 = dict(dtype=torch.float16)
    w = _packed_w4(n, k, launch.group_size or k)
    ec = _packed_ec(launch.ec, n, k) if launch.ec is not None else None
    x = torch.zeros(m, k, **f16)
    peers = None
    if flags.get("peers"):
        peers = decode.PeerRows(torch.zeros(flags["peers"], dtype=torch.int64),
                                torch.zeros(flags["peers"], dtype=torch.int64), n + 32)
    decode.w4_decode(x, w, ec, torch.zeros(n, **f16) if flags.get("has_bias") else None, cfg, peers=peers,
                     swiglu=flags.get("swiglu", False),
                     rms=FoldedNorm(x, x, torch.zeros(m, flags["num_ssq"]), 1e-6) if flags.get("rms_in") else None,
                     add_norm=(torch.zeros(m, n, **f16), torch.zeros(n, **f16), torch.zeros(m, n, **f16),
                               torch.zeros(m, n // cfg.block_n)) if flags.get("add_norm") else None)
    return seen["_w4_decode_kernel"]


def test_offline_decode_variants_compile_what_w4_decode_launches(monkeypatch):
    """kernels.offline compiles each decode variant with the flags w4_decode passes for the same inputs (constexprs,
    num_warps, num_stages): both take them from decode.decode_flags, and only a variant's `lab` overrides differ."""
    for name, launch in offline.decode_launches().items():
        variant = launch.variant()
        launched = _launch_kwargs(launch, monkeypatch)
        compiled = {**variant.constexprs, "num_warps": variant.num_warps, "num_stages": variant.num_stages}
        assert compiled == {**launched, **launch.lab}, name
        assert all(launched[key] != value for key, value in launch.lab.items()), name


def _launcher_kwargs(launch, monkeypatch) -> dict:
    """The keyword arguments the launcher behind an offline.Launch's flags function passes to its kernel for the
    launch's inputs, as on an sm_90 GPU (compiled code, PDL as the launch has it), from its host code with the
    module's kernels replaced by recorders."""
    from spear.kernels import ec_epilogue, f16_gemv, ops
    from spear.kernels.w4 import prefill

    module = sys.modules[launch.flags.__module__]
    seen = _recorded(module, monkeypatch)
    for name, fake in (("launch_options", lambda x: _pdl_options(bool(launch.pdl))), ("runs_compiled", lambda x: True)):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, fake)
    inputs, flags, f16, f32 = launch.inputs, launch.flags, dict(dtype=torch.float16), dict(dtype=torch.float32)
    m, n, k = 64, 256, 1024
    if flags in (prefill.ec_rank_flags, prefill.ec_gate_flags):  # the gate's launch follows a split rank launch
        split = flags is prefill.ec_gate_flags or inputs["split"]
        prefill.ec_rank(torch.zeros(m, k, **f16), _packed_ec(inputs["ec"], n, k), splits=2 if split else 1)
    elif flags is prefill.dequant_flags:
        prefill.dequantize_w4_into(_packed_w4(n, k, 128), torch.zeros(n, k, **f16), **inputs)
    elif flags in (prefill.prefill_flags, prefill.rank_programs_flags):  # rank programs beside the GEMM under PDL
        ec = _packed_ec(inputs["ec"], n, k) if inputs["ec"] is not None else None
        w = _packed_w4(n, k, k if inputs.get("per_channel", True) else inputs["group_size"])
        bias = torch.zeros(n, **f16) if inputs.get("has_bias") else None
        g = torch.zeros(m, ec.padded_rank, **f16) if ec is not None and not launch.pdl else None
        prefill.w4_prefill_fused(torch.zeros(m, k, **f16), w, ec, bias, inputs["cfg"], g=g,
                                 rank_programs=int(bool(launch.pdl)))
    elif flags in (ec_epilogue.epilogue_flags, ec_epilogue.peer_epilogue_flags):
        r, h, int8 = inputs["rank"], inputs["hidden"], inputs.get("int8", False)
        b = torch.zeros(n, r, dtype=torch.int8 if int8 else torch.float16) if inputs["has_ec"] else None
        b_scale = torch.zeros(r) if int8 else None
        gate, bias = _gate(r, h) if inputs["gated"] else (), torch.zeros(n, **f16) if inputs["has_bias"] else None
        if flags is ec_epilogue.epilogue_flags:
            ec_epilogue.ec_epilogue(torch.zeros(m, n, **f32), torch.zeros(m, r, **f32) if inputs["has_ec"] else None,
                                    b, *gate, bias=bias, out=torch.zeros(m, n, **f16), b_scale=b_scale)
        else:
            world, width = inputs["world"], n + r
            add_norm = (torch.zeros(m, n, **f16), torch.zeros(n, **f16), torch.zeros(m, n, **f16),
                        torch.zeros(m, n // 128)) if inputs.get("add_norm") else None
            ec_epilogue.peer_epilogue(torch.zeros(world, m, width, **f32), torch.zeros(world, dtype=torch.int32),
                                      torch.zeros(2, dtype=torch.int32), m, n, width, b, *gate, bias=bias, rank=r,
                                      add_norm=add_norm, b_scale=b_scale)
    elif flags is ops.attention_flags:  # two KV heads of `group` query heads each, blocks of 16 keys
        kv, d = 2, inputs["head_dim"]
        pools = [torch.zeros(8, 16, kv, d, **f16) for _ in range(2)]
        tiles = torch.zeros(1, 2, dtype=torch.int32) if inputs.get("tiles") else None
        q = torch.zeros(2, inputs["group"] * kv, d, dtype=inputs.get("dtype", torch.float16))
        ops.paged_decode_attention(q, *pools, torch.zeros(2, 4, dtype=torch.int32),
                                   torch.full((2,), 40, dtype=torch.int32), use_triton=True, splits=inputs["splits"],
                                   tiles=tiles,
                                   **{key: inputs[key] for key in ("tile_rows", "block_n", "window") if key in inputs})
    elif flags is f16_gemv.f16_gemv_flags:
        cfg, k = inputs["cfg"], inputs["k"]
        rows = cfg.block_n * cfg.row_blocks
        f16_gemv.f16_gemv(torch.zeros(1, k, **f16), torch.zeros(rows, k, **f16),
                          torch.zeros(rows, **f16) if inputs["has_bias"] else None, cfg)
    return seen[launch.kernel.__name__]


def test_offline_variants_compile_what_their_launchers_launch(monkeypatch):
    """kernels.offline compiles every other kernel's variants with the keyword arguments their launchers pass for the
    same inputs (constexprs, num_warps, num_stages, PDL): both take them from the launcher's flags function
    (prefill_flags, epilogue_flags, attention_flags, ...), and only a variant's `lab` overrides differ."""
    launches = offline.launches()
    assert set(offline.variants()) == set(offline.decode_launches()) | set(launches)
    for name, launch in launches.items():
        variant = launch.variant()
        launched = {"num_warps": 4, "num_stages": 3, **_launcher_kwargs(launch, monkeypatch)}  # Triton's defaults
        compiled = {**variant.constexprs, "num_warps": variant.num_warps, "num_stages": variant.num_stages}
        assert compiled == {**launched, **launch.lab}, name
        defaults = {p.name: p.default for p in inspect.signature(launch.kernel.fn).parameters.values()
                    if p.default is not p.empty}
        assert all({**defaults, **launched}[key] != value for key, value in launch.lab.items()), name


def test_every_kernel_variant_compiles(report):
    failed = {name: r["error"] for name, r in report.items() if not r["ok"]}
    assert not failed, failed
    assert len(report) >= 8


def test_gemv_main_loop_stays_in_registers(report):
    """The one-row GEMV loop never moves the codes through shared memory (a 3-D accumulator once made the
    compiler do that: 64 barriers per step) and runs few instructions per weight."""
    loops = report["decode rows=1 ec=False spg=8 per_channel=True"]["loops"]
    main = max(loops, key=lambda loop: dict(loop["mix"]).get("FFMA", 0))
    ops = dict(main["mix"])
    weights_per_thread = 32 * 64 * 8 // 128  # BN × BKW words × 8 codes, over 4 warps
    assert ops["FFMA"] == weights_per_thread, main["mix"]
    assert not any(op.startswith(("BAR", "STS", "LDS")) for op in ops), main["mix"]
    assert main["instructions"] / weights_per_thread < 6, main["mix"]


def test_grouped_gemv_scales_once_per_block(report):
    """Grouped weights (here g = 32) apply s and z once per row and 128-column block after summing the
    span over the block's words, instead of loading them per word (11.4 instructions per weight before)."""
    loops = report["decode rows=1 ec=False spg=2 per_channel=False"]["loops"]
    main = max(loops, key=lambda loop: dict(loop["mix"]).get("FFMA", 0))
    assert main["instructions"] / (32 * 64 * 8 // 128) < 8, main["mix"]
    assert dict(main["mix"]).get("LDG.E.U16", 0) < 32, main["mix"]  # s and z per block (per word: 128 loads)




def test_pipelined_gemv_loop_loads_its_code_tiles_ahead(report):
    """With stages (the tuner's GEMV candidates of 2–4 stages), the code tiles of later steps are in flight by
    cp.async (LDGSTS) while a step computes: one step's 16 KB a program did not cover HBM's latency."""
    loops = report["decode rows=1 ec=False warps=8 stages=3"]["loops"]
    main = max(loops, key=lambda loop: dict(loop["mix"]).get("FFMA", 0))
    one_tile = 32 * 128 * 4 // (8 * 32) // 16  # BN × BKW int32 words over 8 warps, 16 bytes a copy
    assert dict(main["mix"]).get("LDGSTS.E.BYPASS.128", 0) >= one_tile, main["mix"]
    plain = max(report["decode rows=1 ec=False warps=8"]["loops"], key=lambda loop: dict(loop["mix"]).get("FFMA", 0))
    assert "LDGSTS.E.BYPASS.128" not in dict(plain["mix"]), plain["mix"]


def test_u_program_block_keeps_the_gemv_loop_lean(report):
    """kernels.w4.ax_block: with as many columns of A a u-program step as GEMV code words a step (128), the GEMV
    loop of the 8-warp config compiled to 117 registers and 585 instructions a step; with half the columns, to
    74 and 516 (triton 3.6, sm_90; triton 3.9, W4+EC as launched: 121 and 530 against 95 and 454). The launched
    variant must keep that edge."""
    def main_loop(name: str) -> int:
        return max(loop["instructions"] for loop in report[name]["loops"])

    launched, same = report["decode rows=1 ec=True warps=8"], report["decode rows=1 ec=True warps=8 bk=128"]
    assert launched["registers"] < same["registers"], (launched["registers"], same["registers"])
    assert main_loop("decode rows=1 ec=True warps=8") < main_loop("decode rows=1 ec=True warps=8 bk=128")


def test_wide_dot_loop_issues_its_wgmma_without_a_fence_per_slice(report):
    """kernels.w4._w4_block_wide: one K = 128 dot a 128-column block. Its eight k-steps per 64 rows of W follow each
    other without the fence (MEMBAR) and wait that each K = 16 dot of the slice loop had (469 → 372 SASS a block,
    b807cd4), and the joined code planes stay in registers (no STS / LDS round trip; the wide loop on the old layout,
    d98406d, had one)."""
    main = max(report["decode rows=dot ec=False bn=128 wide"]["loops"],
               key=lambda loop: dict(loop["mix"]).get("HGMMA.64x16x16.F32", 0))
    ops = dict(main["mix"])
    assert ops.get("HGMMA.64x16x16.F32") == 16, main["mix"]  # 2 × 64 rows × 8 k-steps
    assert sum(n for op, n in ops.items() if op.startswith("MEMBAR")) <= 2, main["mix"]
    assert not any(op.startswith("STS") for op in ops), main["mix"]
    for spg in (4, 2):  # one dot a group of 16 · spg columns, so 8 / spg fences a block
        grouped = max(report[f"decode rows=dot ec=True bn=128 spg={spg} wide=2"]["loops"],
                      key=lambda loop: dict(loop["mix"]).get("HGMMA.64x16x16.F32", 0))
        assert sum(n for op, n in dict(grouped["mix"]).items() if op.startswith("MEMBAR")) <= 8 // spg, grouped["mix"]


def test_prefill_tile_gemm_takes_the_wide_dot_loop(report):
    """The prefill tile GEMM (w4_prefill_fused) runs the decode kernel's wide loop: a 128-column block is
    one dot (per-channel) or one a group of 64, so at most 2 fences a block where a dot a 16-column slice had 8,
    and the joined code planes stay in registers."""
    for spg in (8, 4):
        ops = _dot_loop(report, f"prefill_fused wide=2 spg={spg}")
        assert _count(ops, "MEMBAR") <= 2 and _count(ops, "STS") == 0, ops


def test_dot_loop_codes_through_inline_ptx_drop_the_mask_rematerialisation(report):
    """In compiled code (DOT_ASM) the wide loop's codes through one inline LOP3 + HFMA2 a pair (_plane's ASM)
    instead of LOP3 on a mask that ptxas rematerialises with an IMAD.MOV before every use (378 → 297
    SASS a block at BN 128, 16 rows; IMAD.MOV 88 → 2, or 6 at the rank 16 a launch without an EC compiles). The
    dots, fences and the registers-only join must stay as they are."""
    for name in ("decode rows=dot ec=False bn=128 wide", "prefill_fused wide=2 spg=8"):
        plain, asm = _dot_loop(report, name), _dot_loop(report, name + " asm")
        assert sum(asm.values()) < 0.9 * sum(plain.values()), (name, sum(plain.values()), sum(asm.values()))
        assert asm.get("IMAD.MOV.U32", 0) <= 8 < plain.get("IMAD.MOV.U32", 0), (name, asm, plain)
        assert all(_count(asm, op) == _count(plain, op) for op in ("HGMMA", "MEMBAR", "STS")), (name, asm, plain)


def test_prefill_tile_gemm_scales_grouped_codes_in_fp16(report):
    """The prefill tile GEMM with groups scales the codes in fp16 (one HMUL2 a pair, packed in the inline PTX) and
    every dot accumulates into the tile, so the float32 FMAs that scaled each group's partial tile go, and no PRMT
    repacks the scale (f77b692, g = 128: 372 → 331 SASS a block, 6–11% faster on the H200)."""
    before = _dot_loop(report, "prefill_fused wide=2 spg=8 grouped")
    after = _dot_loop(report, "prefill_fused wide=2 spg=8 scale_codes asm")
    assert _count(before, "FFMA") > 0 == _count(after, "FFMA"), (before, after)
    assert _count(after, "HMUL2") > 0 and _count(after, "PRMT") < _count(before, "PRMT"), (before, after)
    assert _count(after, "HGMMA") == _count(before, "HGMMA") and _count(after, "STS") == 0, after


def _dot_loop(report, name: str) -> dict[str, int]:
    """The instruction mix of a variant's tensor-core main loop (the loop with the most HGMMA)."""
    return dict(max(report[name]["loops"], key=lambda loop: _count(dict(loop["mix"]), "HGMMA"))["mix"])


def _count(ops: dict[str, int], prefix: str) -> int:
    return sum(n for op, n in ops.items() if op.startswith(prefix))


def test_int8_ec_variants_keep_the_main_loops(report):
    """An EC with int8 factors (kernels.pack: A and B read as int8, dequantized in registers) compiles in every kernel
    that reads A or B, and leaves the decode kernel's one-row GEMV loop and the prefill tile GEMM's wgmma pipeline as
    with fp16 factors: the tile GEMM dequantizes B before its main loop, as after it the epilogue dot's operand made
    in registers there had ptxas serialize every wgmma of the kernel (C7515: a wait after each, 16 a block where 2
    were)."""
    int8 = [name for name in report if name.endswith("int8") or " int8 " in name]
    assert {"decode", "prefill_fused", "ec_rank", "ec_rank_programs", "ec_epilogue", "peer_epilogue"} <= {
        name.split()[0] for name in int8}
    gemv = [max(report[name]["loops"], key=lambda loop: loop["instructions"])["instructions"]
            for name in ("decode rows=1 ec=True int8 f16x2 preload", "decode rows=1 ec=True warps=4 f16x2 preload")]
    assert abs(gemv[0] - gemv[1]) <= 0.05 * gemv[1], gemv
    name = "prefill_fused wide=2 spg=8 asm bn=256 pdl"
    fp16, int8_loop = _dot_loop(report, name), _dot_loop(report, name + " int8")
    assert _count(int8_loop, "WARPGROUP.ARRIVE") == _count(fp16, "WARPGROUP.ARRIVE") <= 2, (fp16, int8_loop)
