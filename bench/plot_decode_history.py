"""Llama-2-7B decode speed through the engine, every committed H200 run in date order (issue 5).

    python bench/plot_decode_history.py --out bench/results/decode_history_h200.png
    python bench/plot_decode_history.py --batch 32 --since 2026-11-30T02:00 --out bench/results/decode_history_h200_b32.png

Reads bench/decode.py's single-GPU runs: the past ones from bench/results/history.jsonl (a line a run) and the
current `decode_h200*.json` files, and plots ms/token of fp16, W4 and W4+EC38 per run at one batch size; at batch 1 with the issue's targets as
lines: W4 within 1.5× of its bandwidth floor, W4 at 2.5× fp16's tokens/s (from the run's own fp16), fp16 within 1.2×
of its floor. A run made with a lab knob set away from today's default (a SPEAR_* switch in its provenance whose
value is not the one src/ defaults it to: one arm of an A/B) is a hollow marker off the lines.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = {"fp16": "tab:gray", "w4": "tab:blue", "w4+ec38": "tab:orange"}
NOT_KNOBS = ("SPEAR_TUNE_CACHE", "SPEAR_CACHE", "SPEAR_COMMIT")  # recorded in provenance, but change no code path
SRC = Path(__file__).resolve().parent.parent / "src"


def knob_defaults() -> dict[str, str]:
    """Today's default of each SPEAR_* knob, as src/ reads it: os.environ.get("SPEAR_X", "default") or env(...)."""
    found = {}
    for path in SRC.rglob("*.py"):
        found.update(re.findall(r'"(SPEAR_[A-Z0-9_]+)", "([^"]*)"\)', path.read_text()))
    return found


def is_arm(env: dict[str, str], defaults: dict[str, str]) -> bool:
    """Whether a run's knobs took a path other than today's defaults. A knob since removed counts as one unless it
    was set to "0": a lab switch turned off took the path that stayed (the SPEAR_L2_PREFETCH=0 arms)."""
    return any(k.startswith("SPEAR_") and k not in NOT_KNOBS and defaults.get(k, "0") != v for k, v in env.items())


def runs(model: str = "llama2-7b", batch: int = 1) -> list[dict]:
    """One entry per run with any of SETTINGS at this model and batch: its date, commit, file, ms/token per setting
    and (current runs only: history keeps no floors) floor per setting."""
    out = []
    defaults = knob_defaults()
    for line in (RESULTS / "history.jsonl").read_text().splitlines():
        run = json.loads(line)
        if not run.get("file", "").startswith("decode_h200") or "figures" not in run:
            continue
        ms = {s: run["figures"][f"{model}/{s}/{batch}"] for s in SETTINGS if f"{model}/{s}/{batch}" in run["figures"]}
        if ms:
            out.append({"date": run["date"], "commit": run["commit"][:7], "file": run["file"],
                        "arm": is_arm(run.get("env", {}), defaults), "ms": ms, "floor": {}})
    for path in RESULTS.glob("decode_h200*.json"):
        data = json.loads(path.read_text())
        rows = {r["setting"]: r for r in data["rows"] if r["model"] == model and r["batch"] == batch}
        if any(s in rows for s in SETTINGS):
            prov = data["provenance"]
            out.append({"date": prov["date"], "commit": prov["commit"][:7], "file": path.name,
                        "arm": is_arm(prov.get("env", {}), defaults),
                        "ms": {s: rows[s]["ms_per_token"] for s in SETTINGS if s in rows},
                        "floor": {s: rows[s]["floor_ms_per_token"] for s in SETTINGS if s in rows}})
    return sorted(out, key=lambda r: r["date"])


def plot(history: list[dict], out: Path, batch: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.4))
    xs = range(len(history))
    for setting, color in SETTINGS.items():
        points = [(x, r["ms"][setting]) for x, r in zip(xs, history) if setting in r["ms"] and not r["arm"]]
        ax.plot(*zip(*points), "o-", color=color, label=setting)
        arms = [(x, r["ms"][setting]) for x, r in zip(xs, history) if setting in r["ms"] and r["arm"]]
        if arms:
            ax.plot(*zip(*arms), "o", color=color, markerfacecolor="none",
                    label=f"{setting}, an A/B arm (a SPEAR_* knob off today's default)")
    if batch == 1:  # the targets are set at batch 1
        w4_floor = next(r["floor"]["w4"] for r in reversed(history) if "w4" in r["floor"])
        fp16_floor = next(r["floor"]["fp16"] for r in reversed(history) if "fp16" in r["floor"])
        ax.axhline(1.5 * w4_floor, color="tab:blue", ls=":",
                   label=f"target: W4 ≤ 1.5× its floor ({1.5 * w4_floor:.2f} ms)")
        ax.axhline(1.2 * fp16_floor, color="tab:gray", ls=":",
                   label=f"target: fp16 ≤ 1.2× its floor ({1.2 * fp16_floor:.2f} ms)")
        goal = [(x, r["ms"]["fp16"] / 2.5) for x, r in zip(xs, history) if "fp16" in r["ms"] and not r["arm"]]
        ax.plot(*zip(*goal), "_", color="tab:blue", markersize=14, label="target: W4 at 2.5× fp16 tokens/s")
    every = max(1, len(history) // 30)  # at most ~30 labels, or they overlap
    ax.set_xticks(list(xs)[::every], [f"{r['date'][5:16].replace('T', ' ')} {r['commit']}" for r in history][::every],
                  fontsize=7, rotation=35, ha="right")
    ax.set_ylabel(f"ms / token (batch {batch})")
    ax.set_ylim(0, None)
    ax.set_title(f"Llama-2-7B decode at batch {batch} through the SPEAR engine on one H200, every committed run")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.rename(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS / "decode_history_h200.png")
    p.add_argument("--batch", type=int, default=1, help="the batch size to plot (default 1; targets only at 1)")
    p.add_argument("--since", default="", help="only runs from this ISO date on (e.g. 2026-11-30T02:00)")
    args = p.parse_args()
    history = [r for r in runs(batch=args.batch) if r["date"] >= args.since]
    if not history:
        p.error(f"no run under {RESULTS} has Llama-2-7B rows at batch {args.batch} since {args.since!r}")
    for r in history:
        print(f"{r['date'][:16]}  {r['commit']}  " + "  ".join(f"{s} {ms:.2f}" for s, ms in r["ms"].items())
              + f"  ({r['file']})")
    plot(history, args.out, args.batch)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
