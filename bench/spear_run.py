"""The main job timed end to end: `spear run MODEL [ARGS] --json` in a process of its own, its wall-clock seconds
(interpreter start, model load and GGUF conversion included) and its report, saved with the provenance.

    python bench/spear_run.py --model $GGUF --json bench/results/quality/spear_run_h200_COMMIT.json
    python bench/spear_run.py --model $GGUF --json F -- --steps 1000          # anything after -- goes to spear run
    python bench/spear_run.py --model smollm2 --json /tmp/r.json -- --quick    # CPU: the README's main job

The report's own `seconds` split the run (load, evaluate, calibration_ids = self-sampling, quantize, total; the
compensation's sensitivity, spectra and calibrate under `ec.seconds`); `wall_s` is what a user waits.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json  # noqa: E402


def timed_run(model: str, run_args: list[str], out: Path) -> dict:
    """Run `spear run` in a child process; its report (the one JSON object on its stdout) and wall seconds."""
    cmd = [sys.executable, "-m", "spear.cli", "run", model, *run_args, "--out", str(out), "--json"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr (progress bars, table) passes through
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"spear run exited {proc.returncode}")
    return {"command": " ".join(["spear run", model, *run_args, "--json"]), "wall_s": round(wall, 1),
            "report": json.loads(proc.stdout)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", default="/tmp/spear_run", help="the run directory (artifact, report, diagnostics)")
    p.add_argument("--json", required=True)
    p.add_argument("run_args", nargs="*", help="after --: options for spear run")
    args = p.parse_args()
    record = timed_run(args.model, args.run_args, Path(args.out))
    write_json(args.json, record)
    report = record["report"]
    print(f"{record['wall_s']:.0f} s, gap closed {100 * report['gap_closed']:.1f}% "
          f"(seconds: {', '.join(f'{k} {v:.0f}' for k, v in report['seconds'].items())})")


if __name__ == "__main__":
    main()
