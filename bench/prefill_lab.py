"""The fused W4 prefill GEMM (`w4_prefill_fused`: dequantize in the main loop, one Triton tile GEMM) against the
prefill path (dequantize into scratch, then cuBLAS) and cuBLAS fp16, per config, from 256 rows up: where, if
anywhere, the fused GEMM is worth taking. Run it once per dot loop (SPEAR_W4_DOT_WIDE=2, the default, and =0):

    SPEAR_W4_DOT_WIDE=2 python bench/prefill_lab.py --json bench/results/prefill_lab_h200_wide2.json
    python bench/prefill_lab.py --ec-rank 32 --json FILE        # W4+EC: g from the rank kernel, B in the epilogue
    python bench/prefill_lab.py --rank-programs --json FILE     # W4+EC: g from rank programs beside the tile GEMM

Random weights (per-channel unless --group-size) in the 7B engine's shapes; each fused config is checked against the
prefill path, then timed as kernels.py times (median over CUDA-graph replays over enough weight copies to overflow
L2). A table is printed last; --json writes every config's µs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from common import LAB_SHAPES, provenance, write_json
from kernels import L2_FLUSH_BYTES, random_ec
from spear.kernels import w4 as w4mod
from spear.kernels.pack import pack_ec, pack_w4
from spear.kernels.timing import time_in_graph
from spear.kernels.w4 import (PREFILL_CANDIDATES, ec_rank, num_sms, prefill_config, prefill_rank_programs, w4_linear,
                             w4_prefill, w4_prefill_fused)
from spear.quant.record import QuantConfig, rtn_quantize


# (block_m, block_k, num_warps, num_stages, fill) of ec_rank timed with --ec-rank: its session-16 defaults first
# (8–22 µs at 1024–2048 rows on the 7B shapes, the whole of W4+EC's gap over W4), then wider row blocks (A re-read
# less often), longer steps (more bytes in flight), and fewer or more programs an SM (`fill`: K split less or more;
# the float32 partials of u grow with the splits)
RANK_CANDIDATES = [(32, 64, 4, 3, 2), (64, 64, 4, 3, 2), (64, 128, 4, 3, 2), (128, 64, 8, 3, 2), (128, 128, 8, 3, 2),
                   (64, 128, 4, 4, 2), (32, 128, 4, 4, 2), (128, 64, 4, 3, 1), (128, 64, 4, 4, 1), (128, 128, 8, 3, 1),
                   (64, 64, 4, 4, 1), (256, 64, 8, 3, 1), (64, 128, 4, 3, 4), (128, 64, 8, 3, 4)]


def _copies(weight, nbytes: int) -> list:
    """weight and clones of it, at least two and more bytes than L2_FLUSH_BYTES: calls over them read from HBM."""
    return [weight] + [weight.clone() for _ in range(max(2, math.ceil(L2_FLUSH_BYTES / nbytes)) - 1)]


def bench_shape(name: str, ms: list[int], group_size: int, rank: int, log) -> list[dict]:
    n, k = LAB_SHAPES[name]
    w_fp = torch.randn(n, k, device="cuda", dtype=torch.float16)
    packed = pack_w4(rtn_quantize(w_fp, QuantConfig(4, group_size)))
    ec = pack_ec(random_ec(n, k, rank)) if rank else None  # W4+EC: g from the rank kernel, B in the epilogue
    fps = _copies(w_fp, 2 * n * k)
    w4s = _copies(packed, packed.nbytes())
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        ref = w4_prefill(x, packed, ec).float()
        row = {"shape": name, "N": n, "K": k, "M": m, "group_size": group_size, "ec_rank": rank,
               "fp16_cublas": time_in_graph([lambda w=w, x=x: x @ w.t() for w in fps]),
               "w4_dequant_cublas": time_in_graph([lambda w=w, x=x: w4_prefill(x, w, ec) for w in w4s]),
               "w4_linear": time_in_graph([lambda w=w, x=x: w4_linear(x, w, ec) for w in w4s]), "fused": []}
        for cfg in PREFILL_CANDIDATES:
            try:
                y = w4_prefill_fused(x, packed, ec, cfg=cfg).float()
                err = ((y - ref).norm() / ref.norm()).item()
                us = time_in_graph([lambda w=w, x=x, cfg=cfg: w4_prefill_fused(x, w, ec, cfg=cfg) for w in w4s])
            except (OutOfResources, CompilationError) as e:  # not a config for this GPU
                log(f"  {cfg}: {type(e).__name__}")
                continue
            row["fused"].append({"config": dataclasses.asdict(cfg), "us": us, "rel_err": err})
        if ec is not None:  # where W4+EC's time goes: the rank kernel alone, and the GEMM with g computed outside
            cfg = prefill_config(m, packed.scales.shape[1] == 1)
            g = ec_rank(x, ec)
            row["ec_rank_alone"] = time_in_graph([lambda x=x: ec_rank(x, ec) for _ in w4s])
            row["fused_g_given"] = time_in_graph([lambda w=w, x=x: w4_prefill_fused(x, w, ec, cfg=cfg, g=g) for w in w4s])
            row["fused_w4_default"] = time_in_graph([lambda w=w, x=x: w4_prefill_fused(x, w, cfg=cfg) for w in w4s])
            log(f"  W4 {row['fused_w4_default']:.1f}  rank kernel {row['ec_rank_alone']:.1f}  "
                f"GEMM with g given {row['fused_g_given']:.1f} µs ({cfg})")
            row["rank_candidates"] = []  # the rank kernel's tiles (its defaults first), for the next tuning
            for bm, bk, warps, stages, fill in RANK_CANDIDATES:
                kw = dict(block_m=bm, block_k=bk, num_warps=warps, num_stages=stages, fill=fill)
                try:
                    err = ((ec_rank(x, ec, **kw).float() - g.float()).norm() / g.float().norm()).item()
                    us = time_in_graph([lambda x=x, kw=kw: ec_rank(x, ec, **kw) for _ in w4s])
                except (OutOfResources, CompilationError) as e:  # not a config for this GPU
                    log(f"  rank {kw}: {type(e).__name__}")
                    continue
                row["rank_candidates"].append({**kw, "us": us, "rel_err": err})
            log("  rank kernel by (block_m, block_k, warps, stages, fill): " + "  ".join(
                f"{c['block_m']},{c['block_k']},{c['num_warps']},{c['num_stages']},{c['fill']}: {c['us']:.1f}"
                for c in row["rank_candidates"]))
        # the dispatch again, after the configs: timed first, w4_linear ran 5–23% slower than its own config called
        # directly (sessions 15–16); timed again here it matches it, so the gap is the order of measurement
        row["w4_linear_after"] = time_in_graph([lambda w=w, x=x: w4_linear(x, w, ec) for w in w4s])
        best = min(row["fused"], key=lambda f: f["us"])
        row["fused_best_us"] = best["us"]
        log(f"{name:18} M={m:<5} fp16 {row['fp16_cublas']:8.1f}  dequant+cuBLAS {row['w4_dequant_cublas']:8.1f}  "
            f"w4_linear {row['w4_linear']:8.1f} / after {row['w4_linear_after']:8.1f}  "
            f"fused best {best['us']:8.1f} {best['config']} (rel err {best['rel_err']:.1e})")
        rows.append(row)
    return rows


# (BK, warps, stages) of the rank programs beside the tile GEMM (w4_prefill_fused), timed at 4 programs
RANK_PROGRAM_TILINGS = [(64, 4, 3), (64, 8, 4), (128, 8, 3), (128, 4, 3)]


def bench_rank_programs(name: str, ms: list[int], rank: int, log) -> list[dict]:
    """W4+EC through the tile GEMM at its default config: g from ec_rank's launch before it (0 rank programs), from
    the policy's count of rank programs beside it (prefill_rank_programs), and from forced counts; W4 alone and the
    dispatch beside them. Each output is checked against the dequantize path's."""
    n, k = LAB_SHAPES[name]
    packed = pack_w4(rtn_quantize(torch.randn(n, k, device="cuda", dtype=torch.float16), QuantConfig(4, -1)))
    ec = pack_ec(random_ec(n, k, rank))
    w4s = _copies(packed, packed.nbytes())
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        ref = w4_prefill(x, packed, ec).float()
        cfg = prefill_config(m, True)
        tiles = math.ceil(m / cfg.block_m) * math.ceil(n / cfg.block_n)
        policy = prefill_rank_programs(math.ceil(m / cfg.block_m), tiles, cfg, num_sms(x.device))
        row = {"shape": name, "N": n, "K": k, "M": m, "ec_rank": rank, "tiles": tiles, "policy_rank_programs": policy,
               "w4": time_in_graph([lambda w=w, x=x: w4_prefill_fused(x, w, cfg=cfg) for w in w4s]),
               "by_rank_programs": []}
        for count in sorted({0, policy, 1, 2, 4, 8, 16}):
            y = w4_prefill_fused(x, packed, ec, cfg=cfg, rank_programs=count).float()
            us = time_in_graph([lambda w=w, x=x, c=count: w4_prefill_fused(x, w, ec, cfg=cfg, rank_programs=c)
                                for w in w4s])
            row["by_rank_programs"].append({"rank_programs": count, "us": us,
                                            "rel_err": ((y - ref).norm() / ref.norm()).item()})
        row["w4_linear"] = time_in_graph([lambda w=w, x=x: w4_linear(x, w, ec) for w in w4s])
        row["by_rank_tiling"] = []  # the rank programs' (BK, warps, stages) at 4 programs
        for bk, warps, stages in RANK_PROGRAM_TILINGS:
            saved = w4mod.PREFILL_RANK_BK, w4mod.PREFILL_RANK_WARPS, w4mod.PREFILL_RANK_STAGES
            w4mod.PREFILL_RANK_BK, w4mod.PREFILL_RANK_WARPS, w4mod.PREFILL_RANK_STAGES = bk, warps, stages
            try:
                us = time_in_graph([lambda w=w, x=x: w4_prefill_fused(x, w, ec, cfg=cfg, rank_programs=4) for w in w4s])
            finally:
                w4mod.PREFILL_RANK_BK, w4mod.PREFILL_RANK_WARPS, w4mod.PREFILL_RANK_STAGES = saved
            row["by_rank_tiling"].append({"block_k": bk, "num_warps": warps, "num_stages": stages, "us": us})
        log(f"{name:18} M={m:<5} tiles {tiles:5}  W4 {row['w4']:7.1f}  W4+EC w4_linear {row['w4_linear']:7.1f} "
            f"({row['w4_linear'] / row['w4']:.3f}×)  by rank programs (policy {policy}): " + "  ".join(
                f"{c['rank_programs']}: {c['us']:.1f} ({c['us'] / row['w4']:.3f}×, err {c['rel_err']:.1e})"
                for c in row["by_rank_programs"]) + "  | 4 programs by (BK, warps, stages): " + "  ".join(
                f"{c['block_k']},{c['num_warps']},{c['num_stages']}: {c['us']:.1f}" for c in row["by_rank_tiling"]))
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["7b/qkv_fused", "7b/gate_up_fused", "7b/down"],
                   choices=list(LAB_SHAPES))
    p.add_argument("--ms", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--group-size", type=int, default=-1, help="-1: per-channel (default)")
    p.add_argument("--ec-rank", type=int, default=0, help="W4+EC with a gated EC of this rank (0: W4 alone)")
    p.add_argument("--rank-programs", action="store_true",
                   help="W4+EC (rank --ec-rank, default 32) with g from rank programs beside the tile GEMM, by count")
    p.add_argument("--json", default="bench/results/prefill_lab.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("prefill_lab.py: needs a CUDA GPU")
    rows = []

    def log(line: str) -> None:
        print(line, flush=True)

    for name in args.shapes:
        rows += (bench_rank_programs(name, args.ms, args.ec_rank or 32, log) if args.rank_programs
                 else bench_shape(name, args.ms, args.group_size, args.ec_rank, log))
        write_json(args.json, {"provenance": provenance(), "rows": rows})
    if args.rank_programs:
        return
    print("\nthroughput / cuBLAS fp16: dequant + cuBLAS, the best fused config, w4_linear (the dispatch) before / after")
    for row in rows:
        print(f"{row['shape']:18} {row['M']:>5} {row['fp16_cublas'] / row['w4_dequant_cublas']:6.2f} "
              f"{row['fp16_cublas'] / row['fused_best_us']:6.2f} {row['fp16_cublas'] / row['w4_linear']:6.2f} "
              f"{row['fp16_cublas'] / row['w4_linear_after']:6.2f}")


if __name__ == "__main__":
    main()
