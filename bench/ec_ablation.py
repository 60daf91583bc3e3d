"""Where the fused EC's time goes at few rows (lab book, bench/NOTES-kernels.md): the decode kernel timed as
W4, as W4+EC, and with parts of the EC switched off (kernels.w4.EC_ABLATE; those outputs are wrong, only
their time counts).

    python bench/ec_ablation.py --json bench/results/ec_ablation.json     # H200, about a minute

Each figure is the median µs per launch of a CUDA graph over weight copies larger than the L2 (as
bench/kernels.py), the tuned config of the W4 launch for every variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import LAB_SHAPES, write_json
from kernels import random_ec

from spear.kernels import w4 as w4mod
from spear.kernels.pack import pack_ec, pack_w4
from spear.kernels.timing import time_in_graph
from spear.quant.record import QuantConfig, rtn_quantize

SHAPES = LAB_SHAPES
VARIANTS = {"ec": 0, "no_wait": 1, "no_u_programs": 3, "no_u_no_epilogue": 4,  # sessions 6-7
            "no_count": 6}  # session 8-9: what the count of g's readers costs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--ms", type=int, nargs="+", default=[1, 16])
    p.add_argument("--configs-only", action="store_true",
                   help="time only every decode candidate as W4 and W4+EC (no tuning, no ablated variants)")
    p.add_argument("--shapes", nargs="+", default=[s for s in SHAPES if "fused" not in s], choices=list(SHAPES))
    p.add_argument("--split-ks", type=int, nargs="+", default=[0],
                   help="split-K of the dot-loop candidates (0: the launch's own choice, ≥ 2 programs an SM)")
    p.add_argument("--gemv-split-ks", type=int, nargs="+", default=[0],
                   help="split-K of the GEMV-loop candidates (M ≤ 4; 0: the launch's own choice), e.g. 0 1 2 4 8")
    p.add_argument("--group-size", type=int, default=-1, choices=[-1, 32, 64, 128],
                   help="quantization groups of the random weights (default -1: per-channel)")
    p.add_argument("--extra-dot", nargs="+", default=[], metavar="BN:WARPS:STAGES",
                   help="dot-loop configs to time beside the candidates (lab), e.g. 64:4:4 128:8:3")
    args = p.parse_args()
    extra = []
    for spec in args.extra_dot:
        try:
            bn, warps, stages = (int(v) for v in spec.split(":"))
        except ValueError:
            p.error(f"--extra-dot takes BN:WARPS:STAGES, got {spec!r}")
        extra.append(w4mod.DecodeConfig(bn, 0, warps, stages, gemv_rows=0))
    quant = QuantConfig(4, args.group_size)
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        packed = pack_w4(rtn_quantize(torch.randn(n, k, device="cuda", dtype=torch.float16), quant))
        ec = pack_ec(random_ec(n, k, 32))
        copies = [packed] + [packed.clone() for _ in range(max(1, math.ceil((128 << 20) / packed.nbytes())) - 1)]
        if not args.configs_only:
            w4mod.tune_w4(packed, tuple(args.ms))
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            us = {} if args.configs_only else {"w4": time_in_graph([lambda w=w, x=x: w4mod.w4_decode(x, w) for w in copies])}
            for variant, code in ({} if args.configs_only else VARIANTS).items():
                w4mod.EC_ABLATE = code
                try:
                    us[variant] = time_in_graph([lambda w=w, x=x, ec=ec: w4mod.w4_decode(x, w, ec) for w in copies])
                except Exception as error:  # noqa: BLE001 — a variant the compiler refuses is reported, not fatal
                    us[variant] = float("nan")
                    print(f"{name} M={m} {variant}: {str(error).splitlines()[-1][:300]}", flush=True)
                finally:
                    w4mod.EC_ABLATE = 0
                    if code == 6:  # the epoch did not advance: advance it for the variants after
                        w4mod._WORKSPACE.buffers[x.device][4].add_(w4mod.READS_PER_LAUNCH.value)
            # every decode candidate for this M, with and without the EC: is W4's tuned config also W4+EC's best?
            per_config = []
            configs = [dataclasses.replace(c, split_k=k) for c in w4mod.DECODE_CANDIDATES + extra
                       for k in (args.split_ks if c.gemv_rows == 0 else args.gemv_split_ks)]
            for cfg in configs:
                if cfg.gemv_rows and m > cfg.gemv_rows:
                    continue
                try:
                    per_config.append({"config": dataclasses.asdict(cfg), "w4": time_in_graph(
                        [lambda w=w, x=x, c=cfg: w4mod.w4_decode(x, w, cfg=c) for w in copies], reps=5), "ec": time_in_graph(
                        [lambda w=w, x=x, c=cfg, e=ec: w4mod.w4_decode(x, w, e, cfg=c) for w in copies], reps=5)})
                except Exception as error:  # noqa: BLE001
                    print(f"{name} M={m} {cfg}: {str(error).splitlines()[-1][:300]}", flush=True)
            best_w4 = min(per_config, key=lambda r: r["w4"])
            best_ec = min(per_config, key=lambda r: r["ec"])
            rows.append({"shape": name, "N": n, "K": k, "M": m, "us": us, "per_config": per_config})
            print(f"{name:<12} M={m:<3} " + "  ".join(f"{v} {t:6.1f}" for v, t in us.items())
                  + f" | best w4 {best_w4['w4']:.1f} {best_w4['config']} | best ec {best_ec['ec']:.1f} "
                    f"(w4 {best_ec['w4']:.1f}) {best_ec['config']}", flush=True)
            write_json(args.json, {"group_size": args.group_size, "rows": rows})


if __name__ == "__main__":
    main()
