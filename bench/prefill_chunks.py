"""The W4 prefill path (dequantize, then cuBLAS) with its fp16 weight in L2-sized chunks, against the whole weight
at once and against cuBLAS fp16 on the same x (issue 4's target: W4 at M >= 1024 within 0.8x of fp16's throughput).

    python bench/prefill_chunks.py --json bench/results/prefill_chunks_h200.json [--chunks-mb 0 8 16 32]

Chunk 0 is the path as it was: the whole W_hat [N, K] dequantized into scratch, written to HBM and read back by the
GEMM. A chunk of C MB dequantizes C MB of W_hat's rows into the same scratch and multiplies them at once
(w4.PREFILL_CHUNK_BYTES), so the GEMM may read them from L2. Random weights in the real shapes; each variant is
checked against the whole-weight result, then timed as kernels.py times (median over CUDA-graph replays on enough
weight copies to overflow L2). A short table is printed last; --json writes every figure.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import LAB_SHAPES, provenance, write_json
from spear.kernels.pack import pack_w4
from spear.kernels.timing import time_in_graph
from spear.kernels.w4 import w4_prefill
from spear.quant.record import QuantConfig, rtn_quantize

L2_FLUSH_BYTES = 256 << 20  # as bench/kernels.py


def bench_shape(name: str, n: int, k: int, ms: list[int], chunks_mb: list[int], log) -> list[dict]:
    w_fp = torch.randn(n, k, device="cuda", dtype=torch.float16)
    packed = pack_w4(rtn_quantize(w_fp, QuantConfig(4, -1)))
    fps = [w_fp] + [w_fp.clone() for _ in range(max(2, math.ceil(L2_FLUSH_BYTES / (2 * n * k))) - 1)]
    w4s = [packed] + [packed.clone() for _ in range(max(2, math.ceil(L2_FLUSH_BYTES / packed.nbytes())) - 1)]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        whole = w4_prefill(x, packed, chunk_bytes=0)
        us = {"fp16_cublas": time_in_graph([lambda w=w, x=x: x @ w.t() for w in fps])}
        same = {}
        for mb in chunks_mb:
            same[mb] = torch.equal(w4_prefill(x, packed, chunk_bytes=mb << 20), whole)
            us[f"w4_chunk_{mb}mb"] = time_in_graph([lambda w=w, x=x, mb=mb: w4_prefill(x, w, chunk_bytes=mb << 20)
                                                    for w in w4s])
        rows.append({"shape": name, "N": n, "K": k, "M": m, "us": us, "equal_to_whole": same,
                     "vs_fp16": {key: us["fp16_cublas"] / v for key, v in us.items() if key != "fp16_cublas"}})
        log(f"{name:18} M={m:<5} " + "  ".join(f"{key} {v:8.1f}" for key, v in us.items())
            + "  | equal " + " ".join(f"{mb}:{int(ok)}" for mb, ok in same.items()))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["7b/qkv_fused", "7b/gate_up_fused", "7b/down", "70b/gate_up",
                                                   "70b/down"], choices=list(LAB_SHAPES))
    p.add_argument("--ms", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--chunks-mb", type=int, nargs="+", default=[0, 8, 16, 32], help="0: the whole weight at once")
    p.add_argument("--json", default="bench/results/prefill_chunks.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("prefill_chunks.py: needs a CUDA GPU")
    rows = []
    for name in args.shapes:
        n, k = LAB_SHAPES[name]
        rows += bench_shape(name, n, k, args.ms, args.chunks_mb, lambda line: print(line, flush=True))
    write_json(args.json, {"provenance": provenance(), "rows": rows})
    print("\nW4 throughput / fp16 cuBLAS (target >= 0.8 at M >= 1024)")
    print(f"{'shape':18} {'M':>5} " + " ".join(f"{mb:>7}MB" for mb in args.chunks_mb))
    for row in rows:
        print(f"{row['shape']:18} {row['M']:>5} "
              + " ".join(f"{row['vs_fp16'][f'w4_chunk_{mb}mb']:>9.2f}" for mb in args.chunks_mb))


if __name__ == "__main__":
    main()
