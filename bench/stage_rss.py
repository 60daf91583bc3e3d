"""Peak RSS of a command by stage: run it, poll its resident memory every `--every` seconds, and split the polls by
the progress bar or line its stderr printed last (tqdm's bars end in carriage returns, so both count as lines).

    python bench/stage_rss.py --json F -- spear compensate ART --budget 1% --calib-samples 128 --calib-len 128 \
        --steps 3 --device cpu

Prints each stage's peak (GB = 1e9) in the order the stages came, and writes them with the whole run's peak and the
provenance. Linux only (/proc/PID/status). BENCHMARKS §8's compensate table.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json  # noqa: E402


def rss_bytes(pid: int) -> int:
    """VmRSS of process `pid`, 0 once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"VmRSS:\s+(\d+) kB", text)
    return 1024 * int(match.group(1)) if match else 0


def stage_name(line: str) -> str:
    """A progress bar's description ("sensitivity (1 - CKA): 13%|..." → "sensitivity (1 - CKA)"), else the line."""
    return re.split(r":\s+\d+%", line)[0].strip()[:60]


def run(cmd: list[str], every: float) -> list[dict]:
    """[{stage, peak_bytes, polls}] in the order the stages came ("start" until the first line)."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    current = ["start"]

    def read() -> None:
        buffer = ""
        for chunk in iter(lambda: proc.stderr.read1(4096).decode(errors="replace"), ""):
            buffer += chunk
            *lines, buffer = re.split(r"[\r\n]", buffer)
            for line in filter(str.strip, lines):
                current[0] = stage_name(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stages: list[dict] = []
    while proc.poll() is None:
        rss = rss_bytes(proc.pid)
        if not stages or stages[-1]["stage"] != current[0]:
            stages.append({"stage": current[0], "peak_bytes": 0, "polls": 0})
        stages[-1]["peak_bytes"] = max(stages[-1]["peak_bytes"], rss)
        stages[-1]["polls"] += 1
        time.sleep(every)
    reader.join(timeout=5)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}")
    return stages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=float, default=0.5, help="seconds between polls")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    args = p.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise SystemExit("give the command after --")
    stages = run(cmd, args.every)
    for s in stages:
        print(f"{s['stage']:60s} {s['peak_bytes'] / 1e9:6.2f} GB  ({s['polls']} polls)")
    peak = max((s["peak_bytes"] for s in stages), default=0)
    print(f"peak {peak / 1e9:.2f} GB")
    if args.json:
        write_json(args.json, {"command": cmd, "every_s": args.every, "peak_bytes": peak, "stages": stages})


if __name__ == "__main__":
    main()
