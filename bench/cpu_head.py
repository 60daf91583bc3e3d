"""The LM head on a CPU held compactly (runtime.tables.CompactLinear) against float32 F.linear (issues 50, 53).

    python bench/cpu_head.py --json bench/results/cpu_head.json [--rows 1 8] [--threads 2] [--forms fp16 q8_0]

A float32 model loaded from an fp16 checkpoint (or a Q8_0 GGUF's table, as the default model's) holds its tied
embedding / LM head upcast: 4 bytes a weight where 2 (or 1.06) hold every value. CompactLinear keeps that form and
multiplies in float32 a block of rows at a time through an 8 MiB scratch. Both are timed at M rows on random tables
of that form in real shapes, in interleaved rounds, with a 64 MB buffer written before every call (the table comes
from memory, as in a decode step); the outputs are compared bit for bit first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import write_json  # noqa: E402

from spear.runtime.tables import CompactLinear, CompactTable  # noqa: E402

SHAPES = {"smollm2-135m": (49152, 576), "qwen2.5-0.5b": (151936, 896), "llama3.2-1b": (128256, 2048)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--forms", nargs="+", default=["fp16", "q8_0"], choices=["fp16", "q8_0"])
    p.add_argument("--json", required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    flush = torch.zeros(16 << 20)
    results = []
    print(f"{'model':<14} {'form':<5} {'M':>3} {'fp32 ms':>9} {'compact ms':>11} {'ratio':>6}  equal  MB fp32 / held")
    for model in args.models:
        v, k = SHAPES[model]
        for form in args.forms:
            w = torch.randn(v, k, generator=gen) * k**-0.5
            if form == "fp16":
                w32 = w.half().float()
            else:  # Q8_0: int8 codes times an fp16 scale per block of 32
                d = (w.view(v, -1, 32).abs().amax(-1, keepdim=True) / 127).half().float()
                w32 = ((w.view(v, -1, 32) / d).round() * d).view(v, k)
            del w
            head = CompactLinear(CompactTable.of(w32), None)
            for m in args.rows:
                x = torch.randn(m, k, generator=gen)
                equal = torch.equal(head(x), F.linear(x, w32))
                times = {"fp32": [], "compact": []}
                for _ in range(args.rounds):
                    for name, f in (("fp32", lambda: F.linear(x, w32)), ("compact", lambda: head(x))):
                        flush.add_(1)
                        start = time.perf_counter()
                        f()
                        times[name].append((time.perf_counter() - start) * 1e3)
                ms = {name: statistics.median(t) for name, t in times.items()}
                held = head.table.nbytes() + head.scratch.nbytes
                row = {"model": model, "form": form, "V": v, "K": k, "M": m, "ms": ms,
                       "min_ms": {n: min(t) for n, t in times.items()}, "equal": equal,
                       "bytes": {"fp32": w32.nbytes, "compact": held}}
                results.append(row)
                print(f"{model:<14} {form:<5} {m:>3} {ms['fp32']:9.2f} {ms['compact']:11.2f} "
                      f"{ms['compact'] / ms['fp32']:6.2f}  {str(equal):>5}  {w32.nbytes / 1e6:.0f} / {held / 1e6:.0f}",
                      flush=True)
            del w32, head
    write_json(args.json, {"config": vars(args), "loadavg": os.getloadavg(), "rows": results})


if __name__ == "__main__":
    main()
