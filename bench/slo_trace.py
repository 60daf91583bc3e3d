"""Where an SLO experiment's step time goes: per run, step times by the tokens a step carried, and the
slowest steps (from the per-step trace that bench/slo_experiment.py writes into its JSON).

    python bench/slo_trace.py bench/results/slo_experiment_h200_12a299d.json.gz [--density w4+ec15] [--slowest 5]

This is how the cuDNN plan builds (bimodal ~10 / ~55 ms mixed steps) and the Triton compiles mid-run (650–780 ms
steps at new attention shapes) were found. A committed result is gzipped (.json.gz): it holds every token's time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np

TOKEN_BUCKETS = [(0, 0), (1, 16), (17, 32), (33, 64), (65, 128), (129, 256), (257, 1024)]  # prefill tokens


def describe(run: dict, slowest: int) -> list[str]:
    trace = run["steps"].get("trace")
    if trace is None:
        return [f"{run['density']} {run['policy']}: no step trace (written since commit 085bf09)"]
    rows = np.array(trace["rows"], dtype=float).reshape(-1, 4)  # end_s, ms, decodes, prefill_tokens
    ms, decodes, prefill = rows[:, 1], rows[:, 2], rows[:, 3]
    lines = [f"{run['density']} {run['policy']}: {len(ms)} steps, P99 ITL {run['summary']['itl_ms']['p99']:.1f} ms"]
    for lo, hi in TOKEN_BUCKETS:
        pick = (prefill >= lo) & (prefill <= hi)
        if pick.any():
            lines.append(f"  prefill {lo:>4}–{hi:<4} {pick.sum():>4} steps  ms p50 {np.median(ms[pick]):6.1f}  "
                         f"p99 {np.percentile(ms[pick], 99):6.1f}  max {ms[pick].max():6.1f}  "
                         f"decodes p50 {np.median(decodes[pick]):4.0f}")
    for i in np.argsort(ms)[::-1][:slowest]:
        lines.append(f"  slow: step {i} at {rows[i, 0]:.3f} s: {ms[i]:.1f} ms, {decodes[i]:.0f} decodes + "
                     f"{prefill[i]:.0f} prefill tokens")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json")
    p.add_argument("--density", default=None, help="only this density (e.g. w4+ec15)")
    p.add_argument("--slowest", type=int, default=3, help="slowest steps listed per run")
    args = p.parse_args()
    try:
        raw = Path(args.json).read_bytes()
        runs = json.loads(gzip.decompress(raw) if args.json.endswith(".gz") else raw)["runs"]
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {args.json} is not an SLO experiment JSON ({type(e).__name__}: {e})", file=sys.stderr)
        raise SystemExit(2) from None
    for run in runs:
        if args.density in (None, run["density"]):
            print("\n".join(describe(run, args.slowest)))


if __name__ == "__main__":
    main()
