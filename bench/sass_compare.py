"""Fingerprint every kernel variant `spear.kernels.offline` compiles (sm_90, on a machine without a GPU): its
registers and a hash of its SASS with the addresses stripped. Run it at two commits and compare the JSON files to
show that a refactor left the compiled code unchanged.

    env -u TRITON_INTERPRET python bench/sass_compare.py --out FILE
    python bench/sass_compare.py --compare BEFORE.json AFTER.json

A helper moved between @triton.jit functions changes only the PTX's debug locations (.loc, inlined_at), yet triton
runs ptxas with -lineinfo and ptxas may then order a few instructions differently (the decode kernel's split into
helpers, bench/results/kernels/sass_before_after_decode_split.json). Both runs under TRITON_DISABLE_LINE_INFO=1
tell such a difference from a change of the code.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys


def fingerprints() -> dict[str, dict]:
    from spear.kernels import offline

    out = {}
    for name, variant in offline.variants().items():
        try:
            compiled = offline.compile_variant(variant)
        except Exception as e:  # noqa: BLE001 — reported per variant
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        lines = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip() for line in offline.sass(compiled).splitlines()
                 if line.strip().startswith("/*")]
        body = "\n".join(lines)
        out[name] = {"registers": offline.registers(compiled), "sass": hashlib.sha1(body.encode()).hexdigest()[:12],
                     "lines": len(lines)}
        print(name, out[name], file=sys.stderr, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write this commit's fingerprints here")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = p.parse_args()
    if args.compare:
        before, after = (json.load(open(f)) for f in args.compare)
        same = [k for k in before if after.get(k) == before[k]]
        for k in sorted(set(before) | set(after)):
            if after.get(k) != before.get(k):
                print(f"differs: {k}: {before.get(k)} -> {after.get(k)}")
        print(f"{len(same)} of {len(before)} variants identical")
        return
    with open(args.out, "w") as f:
        json.dump(fingerprints(), f, indent=1)


if __name__ == "__main__":
    main()
