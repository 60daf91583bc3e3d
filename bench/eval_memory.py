"""`spear eval`'s perplexity on an artifact with and without dense copies of its linears (issue 50): the same
windows scored twice, each in a process of its own, and what each holds.

    dense   api.load(ART): each quantized linear holds a dequantized copy in the compute dtype (the old `spear eval`)
    codes   api.load(ART, dense=False): each linear holds its codes and dequantizes them as it runs (`spear eval` now)

Per variant: load seconds, perplexity seconds, the perplexity (equal by construction: the same values are multiplied),
and the peak: on CUDA the allocator's peak allocated bytes, on a CPU the process's peak RSS (ru_maxrss).

    python bench/eval_memory.py ART [--device cuda] [--max-windows 4] [--batch-size 1 4] --json F
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json  # noqa: E402

VARIANT = """import json, resource, sys, time, torch
from spear import api
from spear.eval import perplexity
artifact, device = sys.argv[1], torch.device(sys.argv[2])
windows, dense, batch = int(sys.argv[3]), sys.argv[4] == "dense", int(sys.argv[5])
start = time.perf_counter()
lm = api.load(artifact, device, dense=dense)
loaded = time.perf_counter()
r = perplexity(lm.model, lm.tokenizer, "wikitext2", 2048, windows, batch, progress=False)
done = time.perf_counter()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else rss
print(json.dumps({"load_s": loaded - start, "eval_s": done - loaded, "ppl": r.ppl, "windows": r.windows,
                  "peak_bytes": peak, "peak_kind": "cuda allocated" if device.type == "cuda" else "rss"}))
"""


def run_variant(artifact: str, device: str, windows: int, variant: str, batch: int = 1) -> dict:
    out = subprocess.run([sys.executable, "-c", VARIANT, artifact, device, str(windows), variant, str(batch)],
                         capture_output=True, text=True)
    if out.returncode:
        return {"variant": variant, "rc": out.returncode, "error": out.stderr.strip().splitlines()[-1:]}
    return {"variant": variant, "rc": 0, **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-windows", type=int, default=4)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1], help="windows a forward; each is a row")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    rows = []
    for batch in args.batch_size:
        for variant in ("dense", "codes"):
            row = {"batch_size": batch, **run_variant(args.artifact, args.device, args.max_windows, variant, batch)}
            rows.append(row)
            if row["rc"]:
                print(f"{variant:<6} batch {batch}: failed: {row['error']}")
            else:
                print(f"{variant:<6} batch {batch}: load {row['load_s']:6.1f} s  eval {row['eval_s']:7.1f} s  "
                      f"ppl {row['ppl']:.6f}  peak {row['peak_bytes'] / 1e9:.2f} GB ({row['peak_kind']})")
    write_json(args.json, {"artifact": args.artifact, "device": args.device, "max_windows": args.max_windows,
                           "variants": rows})


if __name__ == "__main__":
    main()
