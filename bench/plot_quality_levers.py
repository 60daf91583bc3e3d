"""Every lever measured on the hard case (SmolLM2-135M, W4 per-channel, SPEAR at 1%, full WikiText-2 / PTB on the
H200) as one bar chart of the RTN gap closed, against issue 32's 80% target: BENCHMARKS §2's picture of why the
data-free calibration, not the EC, is the ceiling.

    python bench/plot_quality_levers.py --out bench/results/quality/levers_rtn_w4pc.png

Reads the rows from their JSON under bench/results/quality/ (LEVERS below names file, table and row); the gap is
RTN's (FP 21.770 / 41.601, W4 RTN 47.960 / 91.946) for every row, the other bases included.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "quality"
FP = {"wikitext2": 21.770, "ptb": 41.601}
W4_RTN = {"wikitext2": 47.960, "ptb": 91.946}

SPEAR_RUN = "spear run"  # the table of a `spear run --json` record: its one compensated row
# (label, kind, file, table or None, row): kind groups the bars by colour
LEVERS = [
    ("earlier default: 512 × 512 self-samples, top-p 0.95", "default", "sampler_sweep.json", None, "512 samples, top-p 0.95"),
    ("128 samples, top-p 1", "data", "sampler_sweep.json", None, "default sampler"),
    ("1024 samples", "data", "sampler_sweep.json", None, "1024 samples, top-p 0.95"),
    ("top-p 1", "data", "sampler_sweep.json", None, "512 samples"),
    ("top-p 0.9", "data", "sampler_sweep.json", None, "512 samples, top-p 0.9"),
    ("temperature 0.8", "data", "sampler_sweep.json", None, "512 samples, temperature 0.8"),
    ("temperature 1.2", "data", "grid_T12.json", None, "+SPEAR 1%"),
    ("16 sequences a KL step", "data", "grid_L512n512b16.json", None, "+SPEAR 1%"),
    ("random first token", "data", "grid_L512n512rand.json", None, "+SPEAR 1%"),
    ("256 × 1024 tokens", "data", "grid_L1024n256b4.json", None, "+SPEAR 1%"),
    ("128 × 2048 tokens", "data", "grid_L2048.json", None, "+SPEAR 1%"),
    ("1024 × 256 tokens", "data", "short_h200_e8ae281.json", "short_1024x256", "+SPEAR 1%"),
    ("2048 × 128 tokens", "data", "short_h200_e8ae281.json", "short_2048x128", "+SPEAR 1%"),
    ("512 samples, 400 KL steps", "data", "steps_h200_22475a7.json", "steps_400", "+SPEAR 1%"),
    ("512 samples, 800 KL steps", "data", "steps_h200_22475a7.json", "steps_800", "+SPEAR 1%"),
    ("1024 samples, 400 KL steps", "data", "steps_n1024_h200_f8c296d.json", "steps_400_n1024", "+SPEAR 1%"),
    ("1024 samples × 400 steps (spear run)", "data", "spear_run_h200_3b67092_n1024_s400.json", SPEAR_RUN, ""),
    ("2048 samples, 700 KL steps", "data", "calib_n2048_b8_s700_h200_73ff09e.json", None, "+SPEAR 1%"),
    ("2048 samples, 32 a step × 400 steps", "data", "calib_n2048_b32_s400_h200_73ff09e.json", None, "+SPEAR 1%"),
    ("4096 samples, 1000 KL steps (spear run)", "data", "spear_run_h200_73aa306_n4096_s1000.json", SPEAR_RUN, ""),
    ("4096 × 1000, another draw (spear run)", "data", "spear_run_h200_f69a084_defaults.json", SPEAR_RUN, ""),
    ("today's defaults: 4096 × 1500", "default", "full_rtn_w4pc_h200_dab78b8.json", None, "+SPEAR 1%"),
    ("4096 × 1500, another draw", "data", "full_rtn_w4pc_s1500_h200_f69a084.json", None, "+SPEAR 1%"),
    ("today's defaults end to end (spear run)", "data", "spear_run_h200_dab78b8_defaults.json", SPEAR_RUN, ""),
    ("4 samples end to end", "data", "pack_h200_f8c296d.json", "pack4", "+SPEAR 1%"),
    ("windows from mid-text", "data", "levers_h200_4a615ac.json", "lev_calib_mid", "+SPEAR 1%"),
    ("surprise share 0.05", "data", "levers_h200_4a615ac.json", "lev_surprise05", "+SPEAR 1%"),
    ("gate off (top-p 0.9)", "EC", "sampler_sweep.json", None, "512 samples, top-p 0.9, gate off"),
    ("gate off, today's defaults", "EC", "full_rtn_w4pc_gateoff_h200_dab78b8.json", None,
     "ablation: gate off (static EC, KL-trained)"),
    ("per-token scalar gate (top-p 0.9)", "EC", "sampler_sweep.json", None, "512 samples, top-p 0.9, per-token scalar gate"),
    ("norm tweaking, LR 2e-4", "EC", "norms_h200_c9de89c.json", "norm_rtn_w4pc_2e-4", "+SPEAR 1%"),
    ("ranks priced by latency", "EC", "levers_h200_4a615ac.json", "lev_cost_latency", "+SPEAR 1%"),
    ("2% budget", "EC", "grid_B2.json", None, "+SPEAR 2%"),
    ("AWQ base", "base", "bases_h200_c4ec3ff.json", "base_awq_w4pc", "+SPEAR 1%"),
    ("OmniQuant base", "base", "bases_h200_c4ec3ff.json", "base_omniquant_w4pc", "+SPEAR 1%"),
    ("real text, 128 × 512 (not data-free)", "real text", "abl_data_wikivalid.json", None, "+SPEAR 1%"),
]
COLOURS = {"default": "#1f77b4", "data": "#7fb3d5", "EC": "#f5b041", "base": "#82c785", "real text": "#b0b0b0"}


def _rows(record: dict, table: str | None) -> list[dict]:
    """The rows of a compensate_table JSON, a quality suite's table, a transcribed table, or a spear run."""
    if table == SPEAR_RUN:
        return [{"label": "", **record["report"]["compensated"]}]
    if table is None:
        return record["rows"]
    found = record["tables"][table]
    return found["rows"] if isinstance(found, dict) else found


def _ppl(row: dict, dataset: str) -> float:
    return row.get(dataset, row.get(f"{dataset}_ppl"))


def lever_gaps(results: Path = RESULTS) -> list[tuple[str, str, float, float]]:
    """(label, kind, WikiText-2 gap closed, PTB gap closed) of every lever, as shares of RTN's gap."""
    out = []
    for label, kind, file, table, name in LEVERS:
        rows = _rows(json.loads((results / file).read_text()), table)
        row = next(r for r in rows if name in (r.get("label"), r.get("row"), r.get("method")))
        gaps = [(W4_RTN[ds] - _ppl(row, ds)) / (W4_RTN[ds] - FP[ds]) for ds in ("wikitext2", "ptb")]
        out.append((label, kind, *gaps))
    return out


def plot(levers: list[tuple[str, str, float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 0.32 * len(levers) + 1.2), sharey=True)
    labels = [label for label, *_ in levers]
    for ax, column, title in ((axes[0], 2, "WikiText-2"), (axes[1], 3, "PTB")):
        values = [100 * lever[column] for lever in levers]
        ax.barh(range(len(levers)), values, color=[COLOURS[kind] for _, kind, *_ in levers])
        ax.axvline(80, color="#c0392b", ls="--", lw=1)
        ax.text(80.2, -0.9, "target 80%", color="#c0392b", fontsize=8)
        for y, v in enumerate(values):
            ax.text(v + 0.2, y, f"{v:.1f}", va="center", fontsize=7)
        ax.set_xlim(65, 85)
        ax.set_title(f"{title}: share of W4 RTN's gap closed (%)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(levers)), labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle("SmolLM2-135M, W4 per-channel + SPEAR at 1%, H200: more self-samples with more KL steps is the one "
                 "data-free lever that reaches 80% (4096 × 1500)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS / "levers_rtn_w4pc.png")
    args = p.parse_args()
    levers = lever_gaps()
    for label, _, wiki, ptb in levers:
        print(f"{label:<46} {100 * wiki:5.1f}% / {100 * ptb:5.1f}%")
    plot(levers, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
