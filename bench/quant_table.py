"""Perplexity table of the quantizers on one model (issue 2's BENCHMARKS.md table).

    python bench/quant_table.py --model smollm2 --json bench/results/quant_table.json

Loads the float model once; for each setting deep-copies it, quantizes, evaluates
WikiText-2 and PTB with the full protocol, and prints a table last.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json  # noqa: E402

from spear.api import model_key  # noqa: E402
from spear.data.calibration import CalibConfig, calibration_ids  # noqa: E402
from spear.eval import perplexity  # noqa: E402
from spear.models import load_float_model  # noqa: E402
from spear.quant.pipeline import QuantSettings, quantize_model  # noqa: E402
from spear.record import QuantConfig  # noqa: E402


def settings_grid(bits_list: list[int]) -> list[QuantSettings]:
    grid = []
    for bits in bits_list:
        for g in (-1, 64):
            grid.append(QuantSettings("rtn", QuantConfig(bits, g, sym=True, sym_grid="absmax")))
            grid.append(QuantSettings("rtn", QuantConfig(bits, g, sym=True, sym_grid="gptq")))
            grid.append(QuantSettings("rtn", QuantConfig(bits, g, sym=False)))
            for act_order in (False, True):
                grid.append(QuantSettings("gptq", QuantConfig(bits, g, sym=True, sym_grid="absmax"), gptq_act_order=act_order))
                grid.append(QuantSettings("gptq", QuantConfig(bits, g, sym=False), gptq_act_order=act_order))
            grid.append(QuantSettings("awq", QuantConfig(bits, g, sym=True, sym_grid="absmax")))
            grid.append(QuantSettings("awq", QuantConfig(bits, g, sym=False)))
    return grid


def label(s: QuantSettings) -> str:
    q = s.quant
    act_order = " act-order" if s.method == "gptq" and s.gptq_act_order else ""
    return f"W{q.bits} {s.method.upper()}{act_order} {'pc' if q.group_size == -1 else 'g' + str(q.group_size)} {q.grid}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--calib-len", type=int, default=512)
    p.add_argument("--json", default="bench/results/quant_table.json")
    p.add_argument("--only", nargs="*", default=None, help="run only settings whose label contains one of these")
    args = p.parse_args()

    lm = load_float_model(args.model)
    calib = CalibConfig(args.calib_samples, args.calib_len)
    ids = calibration_ids(lm.model, lm.tokenizer, calib, model_key(args.model))
    datasets = ("wikitext2", "ptb")
    rows = []

    def evaluate(model, name, settings, seconds):
        quant = None if settings is None else {"method": settings.method, "act_order": settings.gptq_act_order,
                                               **settings.quant.to_dict()}
        row = {"setting": name, "quant": quant,
               "quantize_seconds": seconds}
        for ds in datasets:
            r = perplexity(model, lm.tokenizer, ds, 2048, args.max_windows, args.batch_size, progress=False)
            row[ds] = r.ppl
            row[f"{ds}_windows"] = r.windows
        rows.append(row)
        print(f"{name:<28} wikitext2 {row['wikitext2']:>10.3f}  ptb {row['ptb']:>10.3f}  ({seconds:.0f} s)", flush=True)

    def save():
        write_json(args.json, {"model": args.model, "dtype": str(next(lm.model.parameters()).dtype),
                               "calibration": {"num_sequences": calib.num_sequences, "seq_len": calib.seq_len,
                                               "source": "self-sampled"},
                               "protocol": "raw file tokenized once, 2048-token non-overlapping windows", "rows": rows})

    evaluate(lm.model, "FP", None, 0.0)
    for settings in settings_grid(args.bits):
        if args.only and not any(key in label(settings) for key in args.only):
            continue
        model = copy.deepcopy(lm.model)
        t = time.perf_counter()
        quantize_model(model, settings, ids)
        evaluate(model, label(settings), settings, time.perf_counter() - t)
        del model
        save()  # after every row, so a cut-short run keeps what it measured
    save()
    print(f"\n{'setting':<28} {'wikitext2':>10} {'ptb':>10}")
    for row in rows:
        print(f"{row['setting']:<28} {row['wikitext2']:>10.2f} {row['ptb']:>10.2f}")


if __name__ == "__main__":
    main()
