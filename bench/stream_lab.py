"""Lab (bench/NOTES-kernels.md): how fast can the W4 decode kernel's tiling stream its codes at all?

    python bench/stream_lab.py --json bench/results/stream_lab_h200.json      # H200, about 3 minutes

A stand-in for the GEMV loop with the same grid, tiles and loads (an [N, K / 8] int32 code matrix read in
[BN, BKW] tiles along K, split K as w4_decode splits it) and a dial for the work per code word: WORK dependent
integer multiply-adds a word (the fp16x2 loop issues about 21 instructions a word, the float32 one 28). How the
next tiles are fetched: `s1` a plain loop, `s3` three stages through shared memory (cp.async), `a1`/`a2`/`a3` one,
two or three steps loaded ahead into registers, `k2`/`k4` stream-K (2 or 4 persistent programs an SM, each over a run
of (tile, step) pairs, loading ahead across tiles: no ramp and tail per tile; timed no faster than the grid on the 7B
MLP shapes: BENCHMARKS §4). WORK = 0 is the tiling's own streaming ceiling; the gap between
WORK = 0 and WORK = 20 is what the arithmetic costs where it does not overlap the loads. Each figure is the median
µs per launch of a CUDA graph over code copies larger than the L2 (bench/w4_kernels.py's method).

    python bench/stream_lab.py --layer --json bench/results/stream_lab_layer_h200.json   # H200, about a minute

`--layer` asks what a persistent decode launch could save at batch 1: a layer's four weights (q|k|v,
o, gate|up, down) streamed by the same persistent programs (two an SM, a tile of BN rows over all of K at a time,
the next step's codes loaded ahead) as four launches (`launches`), four launches under PDL (`launches_pdl`, each
program waits for the launch before it and lets the next one start at once, as the engine's kernels do), one
launch with a grid-wide barrier between the weights where the real layer has its dependencies (`persistent`), or
one launch without them (`persistent_free`: the ceiling). The first minus the third is the ramp and tail that four
launches a layer cost; the engine's W4 step pays that 32 times. The same call also times the W4 kernel's own four
launches of the layer (`w4_kernel`: per-channel codes, tuned configs, PDL as in the engine), the yardstick that
says how close the stand-in's WORK = 20 rows come to the real loop.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import triton
import triton.language as tl
from shapes import launches, linears

from spear.kernels.timing import time_in_graph

SHAPES = {**{f"7b/{name}": nk for name, nk in linears("7b").items()}, "7b/gate_up_fused": launches("7b")["gate_up"]}
TILES = [(16, 256, 4), (16, 128, 4), (32, 64, 4), (32, 128, 4), (32, 128, 8), (64, 64, 4), (64, 128, 8)]
MODES = ["s1", "s3", "a1", "a2", "a3", "k2", "k4"]
LAYERS = {m: tuple(launches(m).values()) for m in ("7b", "8b")}  # [N, K] of q|k|v, o, gate|up, down
LAYER_MODES = ["launches", "launches_pdl", "persistent", "persistent_free"]


def extra_copies(nbytes: int) -> int:
    """Copies beyond the first of `nbytes` of data that make the timed set exceed the L2 (128 MB in all)."""
    return max(1, math.ceil((128 << 20) / nbytes)) - 1


@triton.jit
def _work(acc, words, WORK: tl.constexpr):
    acc += words  # WORK = 0: every mode's row sums are the matrix's (mod 2^32), whatever its order
    for i in tl.static_range(WORK):
        acc = acc * words + i  # one IMAD a word, dependent on the last
    return acc


@triton.jit
def _stream_ahead1(acc, rows, mask_r, col, lo, hi, BKW: tl.constexpr, WORK: tl.constexpr):
    """acc after the words lo .. hi of a tile's rows, each step's loaded one step ahead (a1)."""
    ahead = tl.load(rows + lo, mask=mask_r & (lo + col < hi))
    for kw in tl.range(lo, hi, BKW, num_stages=1):
        cur = ahead
        ahead = tl.load(rows + kw + BKW, mask=mask_r & (kw + BKW + col < hi))
        acc = _work(acc, cur, WORK)
    return acc


@triton.jit
def _stream_kernel(qw_ptr, out_ptr, N, KW, kw_per_split, BN: tl.constexpr, BKW: tl.constexpr, AHEAD: tl.constexpr,
                   STAGES: tl.constexpr, WORK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    lo = pid_k * kw_per_split
    hi = tl.minimum(lo + kw_per_split, KW)
    col = tl.arange(0, BKW)[None, :]
    rows = qw_ptr + offs_n[:, None] * KW + col
    mask_r = mask_n[:, None]
    acc = tl.zeros((BN, BKW), dtype=tl.int32)
    if AHEAD == 0:
        for kw in tl.range(lo, hi, BKW, num_stages=STAGES):
            acc = _work(acc, tl.load(rows + kw, mask=mask_r & (kw + col < hi)), WORK)
    elif AHEAD == 1:
        acc = _stream_ahead1(acc, rows, mask_r, col, lo, hi, BKW, WORK)
    elif AHEAD == 2:
        a1 = tl.load(rows + lo, mask=mask_r & (lo + col < hi))
        a2 = tl.load(rows + lo + BKW, mask=mask_r & (lo + BKW + col < hi))
        for kw in tl.range(lo, hi, BKW, num_stages=1):
            cur = a1
            a1 = a2
            a2 = tl.load(rows + kw + 2 * BKW, mask=mask_r & (kw + 2 * BKW + col < hi))
            acc = _work(acc, cur, WORK)
    else:
        a1 = tl.load(rows + lo, mask=mask_r & (lo + col < hi))
        a2 = tl.load(rows + lo + BKW, mask=mask_r & (lo + BKW + col < hi))
        a3 = tl.load(rows + lo + 2 * BKW, mask=mask_r & (lo + 2 * BKW + col < hi))
        for kw in tl.range(lo, hi, BKW, num_stages=1):
            cur = a1
            a1 = a2
            a2 = a3
            a3 = tl.load(rows + kw + 3 * BKW, mask=mask_r & (kw + 3 * BKW + col < hi))
            acc = _work(acc, cur, WORK)
    tl.store(out_ptr + pid_k * N + offs_n, tl.sum(acc, axis=1), mask=mask_n)


@triton.jit
def _stream_k_kernel(qw_ptr, out_ptr, N, KW, steps_per_tile, total, per_program, BN: tl.constexpr, BKW: tl.constexpr,
                     WORK: tl.constexpr):
    """Stream-K: a persistent program walks a contiguous run of the (tile, step) pairs, `per_program` of `total`, with
    the next step's codes loaded ahead across tile boundaries (no per-tile ramp), and adds each tile's partial row sums
    into out[0] by atomics where its run of the tile ends."""
    start = tl.program_id(0) * per_program
    end = tl.minimum(start + per_program, total)
    col = tl.arange(0, BKW)[None, :]
    offs = tl.arange(0, BN)
    acc = tl.zeros((BN, BKW), dtype=tl.int32)
    tile = start // steps_per_tile  # the (tile, step) of `it`, then of `it + 1`, counted on (no division a step)
    step = start - tile * steps_per_tile
    next_tile, next_step = tile, step
    rows = tile * BN + offs
    base = qw_ptr + rows[:, None] * KW + col  # the tile's first step; recomputed only where the tile changes
    row_ok = rows[:, None] < N
    cur = tl.load(base + step * BKW, mask=row_ok & (step * BKW + col < KW) & (col * 0 + start < end))
    for it in range(start, end):
        next_step += 1
        if next_step == steps_per_tile:
            next_step = 0
            next_tile += 1
            rows = next_tile * BN + offs
            base = qw_ptr + rows[:, None] * KW + col
            row_ok = rows[:, None] < N
        nxt = tl.load(base + next_step * BKW, mask=row_ok & (next_step * BKW + col < KW) & (col * 0 + it + 1 < end))
        acc = _work(acc, cur, WORK)
        if (next_step == 0) | (it == end - 1):  # this run of the tile ends: its partial row sums out
            rows = tile * BN + offs
            tl.atomic_add(out_ptr + rows, tl.sum(acc, axis=1), mask=rows < N, sem="relaxed")
            acc = tl.zeros((BN, BKW), dtype=tl.int32)
        cur = nxt
        tile, step = next_tile, next_step


@triton.jit
def _grid_barrier(bar_ptr, programs):
    """Every program of the launch waits here until all have arrived (they must all be resident): bar_ptr[0] counts
    arrivals, bar_ptr[1] is the barrier's generation, which the last to arrive advances after resetting the count."""
    tl.debug_barrier()
    generation = tl.atomic_add(bar_ptr + 1, 0, sem="acquire")
    if tl.atomic_add(bar_ptr, 1, sem="acq_rel") == programs - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed")
        tl.atomic_add(bar_ptr + 1, 1, sem="release")
    else:
        while tl.atomic_add(bar_ptr + 1, 0, sem="acquire") == generation:
            pass
    tl.debug_barrier()


@triton.jit
def _stream_tiles(qw_ptr, out_ptr, N, KW, BN: tl.constexpr, BKW: tl.constexpr, WORK: tl.constexpr):
    """This program's tiles of one weight (tile pid, pid + programs, ...), each over all of K with the next step's
    codes loaded ahead (a1), its row sums stored at out_ptr."""
    col = tl.arange(0, BKW)[None, :]
    for tile in range(tl.program_id(0), tl.cdiv(N, BN), tl.num_programs(0)):
        offs_n = tile * BN + tl.arange(0, BN)
        rows = qw_ptr + offs_n[:, None] * KW + col
        mask_r = offs_n[:, None] < N
        acc = _stream_ahead1(tl.zeros((BN, BKW), dtype=tl.int32), rows, mask_r, col, 0, KW, BKW, WORK)
        tl.store(out_ptr + offs_n, tl.sum(acc, axis=1), mask=offs_n < N)


@triton.jit
def _layer_kernel(q0, q1, q2, q3, out_ptr, bar_ptr, N0, KW0, N1, KW1, N2, KW2, N3, KW3, O1, O2, O3,
                  FIRST: tl.constexpr, COUNT: tl.constexpr, BARRIER: tl.constexpr, PDL: tl.constexpr,
                  BN: tl.constexpr, BKW: tl.constexpr, WORK: tl.constexpr):
    """Weights FIRST .. FIRST + COUNT − 1 of a layer's four, streamed by persistent programs, with BARRIER a grid-wide
    barrier between them; each weight's row sums at out_ptr + its offset (O1..O3)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for m in tl.static_range(FIRST, FIRST + COUNT):
        if m == 0:
            _stream_tiles(q0, out_ptr, N0, KW0, BN, BKW, WORK)
        elif m == 1:
            _stream_tiles(q1, out_ptr + O1, N1, KW1, BN, BKW, WORK)
        elif m == 2:
            _stream_tiles(q2, out_ptr + O2, N2, KW2, BN, BKW, WORK)
        else:
            _stream_tiles(q3, out_ptr + O3, N3, KW3, BN, BKW, WORK)
        if BARRIER and m < FIRST + COUNT - 1:
            _grid_barrier(bar_ptr, tl.num_programs(0))


def launch_layer(weights: list[torch.Tensor], out: torch.Tensor, barrier: torch.Tensor, bn: int, bkw: int, warps: int,
                 mode: str, work: int, programs: int) -> None:
    """One layer's four [N, K / 8] code matrices streamed as `mode` says (LAYER_MODES), row sums into out (their N's
    in order); barrier: two int32 zeros (kept zero between launches)."""
    sizes = [w.shape for w in weights]
    offsets = [sum(n for n, _ in sizes[:i]) for i in range(1, 4)]
    args = [*weights, out, barrier, *(v for shape in sizes for v in shape), *offsets]
    pdl = mode == "launches_pdl"
    options = {"launch_pdl": True} if pdl else {}
    if mode.startswith("launches"):
        for first in range(4):
            _layer_kernel[(programs,)](*args, FIRST=first, COUNT=1, BARRIER=False, PDL=pdl, BN=bn, BKW=bkw, WORK=work,
                                       num_warps=warps, **options)
    else:
        _layer_kernel[(programs,)](*args, FIRST=0, COUNT=4, BARRIER=mode == "persistent", PDL=False, BN=bn, BKW=bkw,
                                   WORK=work, num_warps=warps)


def w4_layer_calls(shapes, device: torch.device, tune: bool = True) -> tuple[list, list, list]:
    """(calls, weights, xs): one call a copy of a layer's four W4 weights (per-channel RTN codes of random weights,
    tuned at one row on CUDA unless not `tune`; on CUDA copies enough to overflow the L2 when timed in turn), each
    making the W4 decode kernel's four one-row launches in the engine's order: q|k|v, o, gate|up with SiLU·up in its
    epilogue, down. The weights are the first copy's."""
    from spear.kernels.pack import pack_w4
    from spear.kernels.w4 import decode_config, tune_w4, w4_decode
    from spear.record import QuantConfig, rtn_quantize

    packed = [pack_w4(rtn_quantize(torch.randn(n, k, device=device, dtype=torch.float16), QuantConfig(4, -1)))
              for n, k in shapes]
    if tune and device.type == "cuda":
        for w in packed:
            tune_w4(w, (1,))
    extra = extra_copies(sum(w.nbytes() for w in packed)) if device.type == "cuda" else 0
    copies = [packed] + [[w.clone() for w in packed] for _ in range(extra)]
    xs = [torch.randn(1, k, device=device, dtype=torch.float16) for _, k in shapes]

    def layer(ws) -> list[torch.Tensor]:
        return [w4_decode(x, w, cfg=decode_config(w, 1), swiglu=i == 2)
                for i, (w, x) in enumerate(zip(ws, xs, strict=True))]

    return [lambda ws=ws: layer(ws) for ws in copies], packed, xs


def layer_lab(args, sms: int, bandwidth: dict) -> list[dict]:
    """The --layer rows: every layer × tiling × mode × WORK, µs a layer against the layer's read floor."""
    rows = []
    for name in args.layers:
        weights = [torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
                   for n, k in LAYERS[name]]
        layer_bytes = sum(w.numel() * 4 for w in weights)
        copies = [weights] + [[w.clone() for w in weights] for _ in range(extra_copies(layer_bytes))]
        out = torch.empty(sum(w.shape[0] for w in weights), device="cuda", dtype=torch.int32)
        barrier = torch.zeros(2, device="cuda", dtype=torch.int32)
        floor_us = layer_bytes / bandwidth["kernel_graph"] * 1e6
        us = time_in_graph(w4_layer_calls(LAYERS[name], torch.device("cuda"))[0], reps=10)  # the engine's launches
        rows.append({"layer": name, "mode": "w4_kernel", "us": us, "floor_us": floor_us})
        print(f"{name} layer the W4 kernel's four launches: {us:6.2f} µs ({floor_us / us:4.0%} of the read floor "
              f"{floor_us:.2f})", flush=True)
        for bn, bkw, warps in (tuple(int(v) for v in t.split("/")) for t in args.tiles):
            for mode in args.layer_modes:
                for work in args.works:
                    us = time_in_graph([lambda c=c: launch_layer(c, out, barrier, bn, bkw, warps, mode, work, 2 * sms)
                                        for c in copies], reps=10)
                    rows.append({"layer": name, "bn": bn, "bkw": bkw, "warps": warps, "mode": mode, "work": work,
                                 "us": us, "floor_us": floor_us})
                    print(f"{name} layer {bn:3d}/{bkw:3d}/{warps} {mode:15s} work {work:2d}: {us:6.2f} µs "
                          f"({floor_us / us:4.0%} of the read floor {floor_us:.2f})", flush=True)
    return rows


def launch(codes: torch.Tensor, out: torch.Tensor, bn: int, bkw: int, warps: int, mode: str, work: int, sms: int):
    n, kw = codes.shape
    tiles = triton.cdiv(n, bn)
    steps = triton.cdiv(kw, bkw)
    split = max(1, min(triton.cdiv(2 * sms, tiles), steps))  # as w4_decode: at least 2 programs an SM
    kw_per_split = triton.cdiv(steps, split) * bkw
    split = triton.cdiv(kw, kw_per_split)
    if mode.startswith("k"):  # stream-K over the whole GPU: int(mode[1]) programs an SM, adding into out[0]
        programs = sms * int(mode[1])
        total = tiles * steps
        _stream_k_kernel[(programs,)](codes, out, n, kw, steps, total, triton.cdiv(total, programs), BN=bn, BKW=bkw,
                                      WORK=work, num_warps=warps)
        return
    ahead = 0 if mode.startswith("s") else int(mode[1])
    stages = int(mode[1]) if mode.startswith("s") else 1
    _stream_kernel[(tiles, split)](codes, out, n, kw, kw_per_split, BN=bn, BKW=bkw, AHEAD=ahead, STAGES=stages,
                                   WORK=work, num_warps=warps, num_stages=stages)


def main() -> None:
    from common import copy_bandwidth, write_json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--works", type=int, nargs="+", default=[0, 20])
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--tiles", nargs="+", default=None, help="BN/BKW/warps of the tilings to time")
    p.add_argument("--layer", action="store_true", help="a layer's four weights: launches or one persistent launch")
    p.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    p.add_argument("--layer-modes", nargs="+", default=LAYER_MODES, choices=LAYER_MODES)
    args = p.parse_args()
    if args.tiles is None:
        args.tiles = ["16/256/4", "32/128/8"] if args.layer else [f"{bn}/{bkw}/{w}" for bn, bkw, w in TILES]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bandwidth = copy_bandwidth(torch.device("cuda"))
    if args.layer:
        write_json(args.json, {"copy_bandwidth": bandwidth, "rows": layer_lab(args, sms, bandwidth)})
        return
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        codes = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
        copies = [codes] + [codes.clone() for _ in range(extra_copies(codes.numel() * 4))]
        out = torch.empty(64, n, device="cuda", dtype=torch.int32)
        floor_us = codes.numel() * 4 / bandwidth["kernel_graph"] * 1e6  # the copy's DRAM rate (read + write bytes)
        for bn, bkw, warps in (tuple(int(v) for v in t.split("/")) for t in args.tiles):
            for mode in args.modes:
                for work in args.works:
                    try:
                        us = time_in_graph([lambda c=c, o=out: launch(c, o, bn, bkw, warps, mode, work, sms)
                                            for c in copies], reps=10)
                    except Exception as error:  # noqa: BLE001 — a variant the compiler refuses is reported
                        print(f"{name} {bn}/{bkw}/{warps} {mode} work {work}: {str(error).splitlines()[-1][:200]}")
                        continue
                    rows.append({"shape": name, "bn": bn, "bkw": bkw, "warps": warps, "mode": mode, "work": work,
                                 "us": us, "floor_us": floor_us})
                    print(f"{name:16s} {bn:3d}/{bkw:3d}/{warps} {mode} work {work:2d}: {us:6.2f} µs "
                          f"({floor_us / us:4.0%} of the read floor {floor_us:.2f})", flush=True)
    write_json(args.json, {"copy_bandwidth": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
