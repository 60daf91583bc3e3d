"""The fp16 GEMV (spear.kernels.f16_gemv) against cuBLAS at one row, on the weight shapes a float model's decode
step launches (q/k/v and gate/up fused, as the runtime model runs them on CUDA), with the copy bandwidth of the
same call (issue 5's fp16 baseline, BENCHMARKS §5).

    python bench/f16_gemv.py --models 7b 8b 13b 70b --json bench/results/f16_gemv_h200.json

Every candidate and cuBLAS are timed as tune_gemv times them (a CUDA graph over weight copies that overflow L2);
the table gives cuBLAS, the fastest kernel config, and each one's share of the copy bandwidth. (The add + RMSNorm and
SiLU·up folded into the GEMV, timed against the launches they replace, measured 0.89–0.92× and was removed; it is at
3e55312.)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import copy_bandwidth, write_json
from shapes import SHORT, launches

from spear.kernels.f16_gemv import CUBLAS, f16_gemv, tune_gemv

# (name, N = out, K = in) as the runtime model launches them at one row: q|k|v and gate|up stacked
SHAPES = {m: [(name, n, k) for name, (n, k) in launches(m).items()] for m in SHORT}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["7b"], choices=list(SHAPES))
    p.add_argument("--json", required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/f16_gemv.py needs a CUDA GPU")
    bandwidth = max(copy_bandwidth(torch.device("cuda")).values())
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for model in args.models:
        for name, n, k in SHAPES[model]:
            w = torch.randn(n, k, device="cuda", dtype=torch.float16) * k**-0.5
            timings: list = []
            tune_gemv(w, timings=timings)
            cublas = next(us for us, cfg in timings if cfg == CUBLAS)
            best_us, best = next((us, cfg) for us, cfg in timings if cfg != CUBLAS)
            x = torch.randn(1, k, device="cuda", dtype=torch.float16)
            ref = x.float() @ w.float().T
            err = ((f16_gemv(x, w, None, best).float() - ref).abs().max() / ref.abs().max()).item()
            row = {"shape": f"{model}/{name}", "N": n, "K": k, "bytes": w.nbytes, "cublas_us": cublas,
                   "gemv_us": best_us, "gemv_config": dataclasses.asdict(best), "rel_err": err,
                   "timings": [(us, dataclasses.asdict(cfg)) for us, cfg in timings]}
            rows.append(row)
            print(f"{row['shape']:<12} {w.nbytes / 1e6:7.1f} MB  cuBLAS {cublas:7.1f} µs ({100 * w.nbytes / cublas * 1e6 / bandwidth:3.0f}%)"
                  f"  ours {best_us:7.1f} µs ({100 * w.nbytes / best_us * 1e6 / bandwidth:3.0f}%)  {cublas / best_us:5.2f}×"
                  f"  {best}  rel err {err:.1e}", flush=True)
            write_json(args.json, {"copy_bandwidth_Bps": bandwidth, "rows": rows})
            del w


if __name__ == "__main__":
    main()
