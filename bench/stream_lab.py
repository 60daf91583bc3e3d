"""Lab (bench/NOTES-kernels.md, session 12): how fast can the W4 decode kernel's tiling stream its codes at all?

    python bench/stream_lab.py --json bench/results/stream_lab_h200.json      # H200, about 3 minutes

A stand-in for the GEMV loop with the same grid, tiles and loads (an [N, K / 8] int32 code matrix read in
[BN, BKW] tiles along K, split K as w4_decode splits it) and a dial for the work per code word: WORK dependent
integer multiply-adds a word (the fp16x2 loop issues about 21 instructions a word, the float32 one 28). How the
next tiles are fetched: `s1` a plain loop, `s3` three stages through shared memory (cp.async), `a1`/`a2`/`a3` one,
two or three steps loaded ahead into registers, `k2`/`k4` stream-K (2 or 4 persistent programs an SM, each over a run
of (tile, step) pairs, loading ahead across tiles: no ramp and tail per tile; timed in session 13, no faster than the
grid on the 7B MLP shapes: BENCHMARKS §4). WORK = 0 is the tiling's own streaming ceiling; the gap between
WORK = 0 and WORK = 20 is what the arithmetic costs where it does not overlap the loads. Each figure is the median
µs per launch of a CUDA graph over code copies larger than the L2 (bench/kernels.py's method).
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
from common import LAB_SHAPES

SHAPES = {name: LAB_SHAPES[name] for name in ("7b/qkvo", "7b/gate_up", "7b/down", "7b/gate_up_fused")}
TILES = [(16, 256, 4), (16, 128, 4), (32, 64, 4), (32, 128, 4), (32, 128, 8), (64, 64, 4), (64, 128, 8)]
MODES = ["s1", "s3", "a1", "a2", "a3", "k2", "k4"]


@triton.jit
def _work(acc, words, WORK: tl.constexpr):
    acc += words  # WORK = 0: every mode's row sums are the matrix's (mod 2^32), whatever its order
    for i in tl.static_range(WORK):
        acc = acc * words + i  # one IMAD a word, dependent on the last
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
        a1 = tl.load(rows + lo, mask=mask_r & (lo + col < hi))
        for kw in tl.range(lo, hi, BKW, num_stages=1):
            cur = a1
            a1 = tl.load(rows + kw + BKW, mask=mask_r & (kw + BKW + col < hi))
            acc = _work(acc, cur, WORK)
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

    from spear.kernels.timing import time_in_graph

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--works", type=int, nargs="+", default=[0, 20])
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--tiles", nargs="+", default=[f"{bn}/{bkw}/{w}" for bn, bkw, w in TILES],
                   help="BN/BKW/warps of the tilings to time")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        codes = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
        copies = [codes] + [codes.clone() for _ in range(max(1, math.ceil((128 << 20) / (codes.numel() * 4))) - 1)]
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
