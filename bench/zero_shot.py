"""Zero-shot table (issue 33): FP / W4 / +SPEAR on LAMBADA, ARC-e/c, PIQA, WinoGrande, BoolQ, HellaSwag, scored as
lm-eval scores them (spear.eval.tasks; ../shared/data/tasks/README.md).

    python bench/zero_shot.py --artifact runs/smollm2-w4-rtn-pc --json bench/results/zero_shot.json
    python bench/zero_shot.py --model smollm2 --limit 50 --json /tmp/zero_shot.json     # FP and W4 only
    python bench/zero_shot.py --model $GGUF --spear --json FILE      # FP, W4 RTN pc, + SPEAR 1% built here (one call)

Rows: FP (the artifact's base model), W4 (the artifact with its ECs removed: its own 4-bit weights), +SPEAR (the
artifact). Without --artifact: FP and W4 RTN per-channel (absmax grid) of --model, quantized in memory; with
--spear, that W4 model is written as an artifact to a temporary folder and compensated at the defaults (1% budget,
self-sampled calibration) first, as `spear quantize ... && spear compensate ...` would. Every row
runs on the same device in the same dtype (fp16 on CUDA, fp32 on CPU). The JSON (date, commit, device, versions)
is written after every row; the table is printed last. `avg acc` is the mean of the tasks' `acc`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import write_json  # noqa: E402

from spear import api  # noqa: E402
from spear.artifact import read_artifact_config  # noqa: E402
from spear.compensate.pipeline import CompensateConfig  # noqa: E402
from spear.data.calibration import CalibConfig  # noqa: E402
from spear.eval.tasks import evaluate_tasks, parse_tasks  # noqa: E402
from spear.layer import SpearLinear  # noqa: E402
from spear.models.loading import LoadedModel, default_device, default_dtype, load_float_model  # noqa: E402
from spear.quant.pipeline import QuantSettings, quantize_model  # noqa: E402
from spear.record import QuantConfig  # noqa: E402
from spear.run import quick_calibration  # noqa: E402

W4_RTN_PC = QuantSettings("rtn", QuantConfig(bits=4, group_size=-1, sym=True, sym_grid="absmax"))


def without_ecs(lm: LoadedModel) -> LoadedModel:
    for module in lm.model.modules():
        if isinstance(module, SpearLinear):
            module.ec = None
    return lm


def build_spear_artifact(model: str, out_dir: Path, device: torch.device, quick: bool) -> str:
    """W4 RTN per-channel of `model` plus SPEAR at the defaults (or `spear run --quick`'s short calibration),
    written to out_dir: the artifact the rows load."""
    path = api.quantize(model, W4_RTN_PC, out_dir, device=device)
    calib, cfg = CalibConfig(), CompensateConfig()
    if quick:
        calib, cfg = quick_calibration(calib, cfg)
    report = api.compensate_artifact(path, cfg, calib, device=device)
    print(f"compensated: {report.summary()}", file=sys.stderr)
    return str(path)


def rows_to_run(args, device: torch.device) -> tuple[str, dict, list[tuple[str, object]]]:
    """The base model, the quantization of the W4 row, and (label, loader) for each row."""
    if args.artifact:
        config = read_artifact_config(args.artifact)
        base = config["base_model"]
        rows = [("FP", lambda: load_float_model(base, device)),
                ("W4", lambda: without_ecs(api.load(args.artifact, device))),
                ("+SPEAR", lambda: api.load(args.artifact, device))]
        return base, config["quant"], rows

    def w4_rtn():
        lm = load_float_model(args.model, device)
        quantize_model(lm.model, W4_RTN_PC, None)
        return lm

    quant = {"method": "rtn", **W4_RTN_PC.quant.to_dict()}
    return args.model, quant, [("FP", lambda: load_float_model(args.model, device)), ("W4", w4_rtn)]


ROWS = {"fp": "FP", "w4": "W4", "spear": "+SPEAR"}


def parse_rows(text: str) -> list[str]:
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        raise ValueError(f"unknown rows {unknown or text!r}; choose from {', '.join(ROWS)}")
    return [ROWS[n] for n in names]


SHORT = {"lambada_openai": "lambada", "arc_easy": "arc_e", "arc_challenge": "arc_c", "winogrande": "wino"}


def format_table(rows: dict[str, list[dict]]) -> str:
    first = next(iter(rows.values()))
    columns = [(r["task"], name) for r in first for name in r["metrics"]]
    names = [f"{SHORT.get(task, task)}/{name.replace('perplexity', 'ppl')}" for task, name in columns]
    lines = [f"{'row':<8}" + "".join(f" {n:>15}" for n in names) + f" {'avg acc':>8}"]
    for label, results in rows.items():
        values = {(r["task"], name): v for r in results for name, v in r["metrics"].items()}
        avg = sum(r["metrics"]["acc"] for r in results) / len(results)
        lines.append(f"{label:<8}" + "".join(f" {values[c]:>15.4g}" for c in columns) + f" {avg:>8.4f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", default=None, help="a compensated artifact: rows FP, W4 (its ECs removed), +SPEAR")
    p.add_argument("--model", default="smollm2", help="without --artifact: FP and W4 RTN per-channel of this model")
    p.add_argument("--spear", action="store_true", help="without --artifact: build one (W4 RTN pc + SPEAR 1%%) first")
    p.add_argument("--quick", action="store_true", help="with --spear: `spear run --quick`'s short calibration (CPU)")
    p.add_argument("--rows", default=None, help="which rows, comma-separated: fp, w4, spear (default: every row "
                   "there is; one process a row runs them side by side)")
    p.add_argument("--tasks", default="all", help="comma-separated task names, or all (default)")
    p.add_argument("--limit", type=int, default=None, help="only the first N items of each task")
    p.add_argument("--batch-size", type=int, default=16, help="log-likelihood requests per forward pass")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--json", default="bench/results/zero_shot.json")
    args = p.parse_args()
    tasks = parse_tasks(args.tasks)
    try:
        args.rows = parse_rows(args.rows or ("fp,w4,spear" if args.spear or args.artifact else "fp,w4"))
    except ValueError as e:
        p.error(str(e))
    if "+SPEAR" in args.rows and not (args.spear or args.artifact):
        p.error("the spear row needs --spear or --artifact")
    device = torch.device(args.device) if args.device else default_device()
    previous = signal.signal(signal.SIGTERM, _exit)  # a `timeout` kill leaves through the with: no artifact left
    try:
        with tempfile.TemporaryDirectory(prefix="spear-zero-shot-") as tmp:
            if args.spear and not args.artifact and "+SPEAR" in args.rows:
                args.artifact = build_spear_artifact(args.model, Path(tmp) / "artifact", device, args.quick)
            run_rows(args, tasks, device)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit(signum, _frame) -> None:
    sys.exit(128 + signum)


def run_rows(args, tasks: list[str], device: torch.device) -> None:
    base, quant, rows = rows_to_run(args, device)
    results: dict[str, list[dict]] = {}
    for label, load in rows:
        if label not in args.rows:
            continue
        start = time.perf_counter()
        lm = load()
        results[label] = [r.to_dict() for r in evaluate_tasks(lm.model, lm.tokenizer, tasks, args.limit,
                                                              args.batch_size)]
        print(f"{label}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
        del lm
        write_json(args.json, {"artifact": None if args.spear else args.artifact, "spear_built": args.spear,
                               "quick": args.quick, "base_model": base, "w4_quant": quant, "limit": args.limit,
                               "tasks": tasks, "dtype": str(default_dtype(device)),
                               "rows": results})
    print(format_table(results))


if __name__ == "__main__":
    main()
