"""What serving a gated artifact without its gate costs: stock vLLM's LoRA path (`spear export-vllm`'s static_lora)
applies alpha·B·A x, i.e. the EC with gamma = 1. Perplexity of one compensated artifact with its gates, then with
every gate removed, beside the W4 and FP figures of its `spear run` report (README, "Serving with vLLM").

    spear run smollm2 --out RUN [--no-gate] ...        # a compensated artifact in RUN/artifact
    python bench/gate_drop.py RUN --json F [--max-windows N]

A gate-less artifact (`--no-gate`) is its own static form: this script refuses it (nothing to drop).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402

from spear import api  # noqa: E402
from spear.compensate.calibrate import ec_modules  # noqa: E402
from spear.eval import perplexity  # noqa: E402
from spear.run import gap_closed  # noqa: E402

DATASETS = ("wikitext2", "ptb")


def gated_ecs(model: torch.nn.Module) -> list:
    return [ec for ec in ec_modules(model).values() if ec.gate is not None]


def drop_gates(model: torch.nn.Module) -> int:
    """Remove every EC's gate in place (gamma = 1: the static form alpha·B·A x); returns how many were dropped."""
    gated = gated_ecs(model)
    for ec in gated:
        ec.gate = None
    return len(gated)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a `spear run --out` directory (report.json and artifact/)")
    p.add_argument("--max-windows", type=int, default=None, help="windows a dataset (default: the run's own)")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    report = json.loads((args.run / "report.json").read_text())
    windows = {ds: args.max_windows or report["windows"][ds] for ds in DATASETS}
    lm = api.load(str(args.run / "artifact"))
    if not gated_ecs(lm.model):
        raise SystemExit("gate_drop: the artifact has no gated EC (a --no-gate or static run): nothing to drop")

    def score() -> dict:
        return {ds: perplexity(lm.model, lm.tokenizer, ds, max_windows=windows[ds]).ppl for ds in DATASETS}

    rows = {"with gate": score()}
    print(f"dropped {drop_gates(lm.model)} gates")
    rows["gate dropped"] = score()
    fp, w4 = report["fp"], report["quantized"]
    for label, ppl in rows.items():
        ppl["gap_closed"] = {ds: gap_closed(fp[ds], w4[ds], ppl[ds]) for ds in DATASETS}
        print(f"{label:<14} " + "  ".join(f"{ds} {ppl[ds]:8.3f} ({100 * ppl['gap_closed'][ds]:.1f}%)"
                                          for ds in DATASETS))
    write_json(args.json, {"command": " ".join(["python bench/gate_drop.py", *sys.argv[1:]]),
                           "run": str(args.run), "windows": windows, "fp": fp, "w4": w4,
                           "run_compensated": report["compensated"], "rows": rows})


if __name__ == "__main__":
    main()
