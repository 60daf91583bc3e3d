"""Why zero-shot accuracy recovers less than perplexity (issue 51, item 5): the same FP / W4 / +SPEAR rows scored
item by item, so that each task's recovery can be read on three scales.

    python bench/zero_shot_gap.py --levers self text random --calib-samples 128 --calib-len 128 --steps 100 \
        --limit 500 --max-windows 8 --json bench/results/quality/zero_shot_gap_cpu.json

For every task item (lm-eval's requests, `spear.eval.tasks`) each row records the gold answer's log-likelihood and
whether the row picks it. Per task and SPEAR row:
- acc recovered: (acc − acc_W4) / (acc_FP − acc_W4), the headline zero-shot figure;
- gold NLL recovered: the same on the mean negative log-likelihood of the gold answer, the quantity the
  calibration's KL and the perplexity gap speak of, on the tasks' own text;
- choice KL recovered: the mean KL(FP's choice distribution ‖ the row's), a softmax over each item's choices, from
  W4's to the row's: how close the row's decisions are to FP's, continuous where accuracy counts flips;
- flips: the items W4 got wrong that FP got right (broken), those it got right that FP got wrong (fixed), and how
  many of each the row still has.
If the gold NLL and choice KL recover as much as perplexity while accuracy does not, the calibration transfers to
the tasks and the accuracy shortfall is the metric's (few flips, near chance); if they recover less, the
objective or the data does not reach the tasks' text.

Levers (each a +SPEAR row at the same protocol, --calib-samples × --calib-len, --steps):
- self: the default, sequences the float model samples from BOS;
- random: each sample starts from one random vocabulary token after BOS (more topics and registers);
- chat: each sample starts from the model's chat template opened for a user turn (questions and their answers);
- text: WikiText-2's validation text instead of self-samples (real text: not data-free, a diagnostic of the data);
- topk: the objective instead of the data: self-samples, the KL on the teacher's top 128 tokens and the rest's mass
  (CalibrateConfig.teacher_mode "topk"), which weighs the tokens an answer is picked among over the tail;
- confident: self-samples, each position's KL weighted by the teacher's top-1 probability (CalibrateConfig.
  position_weight "confident"): the positions the context settles, as a LAMBADA passage's last word, over open ones;
- refit: self-samples, and the codes re-rounded under the ECs before calibration as `spear run` does by default
  (three rounds, each row's clipping picked by whitened error: compensate.refit); the other levers keep W4's codes.
The float and W4 models, the sensitivity table and each lever's calibration ids are computed once; the JSON is
written after every row, the table printed last.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import write_json  # noqa: E402

from spear.api import model_key  # noqa: E402
from spear.compensate.basis import weights_in_float_basis  # noqa: E402
from spear.compensate.calibrate import CalibrateConfig  # noqa: E402
from spear.compensate.cka import SensitivityConfig, module_sensitivity  # noqa: E402
from spear.compensate.pipeline import CompensateConfig, compensate, quantized_layers  # noqa: E402
from spear.compensate.refit import Rounding  # noqa: E402
from spear.data.calibration import CalibConfig, calibration_ids, calibration_record  # noqa: E402
from spear.eval import perplexity  # noqa: E402
from spear.eval.perplexity import data_dir  # noqa: E402
from spear.eval.tasks import load_docs, loglikelihoods, parse_tasks  # noqa: E402
from spear.models import load_float_model  # noqa: E402
from spear.quant.pipeline import QuantSettings, quantize_model  # noqa: E402
from spear.record import QuantConfig  # noqa: E402
from spear.run import gap_closed  # noqa: E402

W4_RTN_PC = QuantSettings("rtn", QuantConfig(bits=4, group_size=-1, sym=True, sym_grid="absmax"))
LEVERS = {"self": {}, "random": {"first_token": "random"}, "chat": {"first_token": "chat"},
          "text": {"text_file": "wikitext-2-raw/wiki.valid.tokens.txt"},  # under the evaluation data (data_dir)
          "topk": {}, "confident": {}, "refit": {}}
# the levers that change CalibrateConfig (the objective), not the data
OBJECTIVES = {"topk": {"teacher_mode": "topk"}, "confident": {"position_weight": "confident"}}
DATASETS = ("wikitext2", "ptb")
DEFAULT_TASKS = "lambada_openai,hellaswag,piqa,arc_easy"


def score_items(model, tokenizer, tasks: list[str], limit: int | None, batch_size: int) -> dict[str, dict]:
    """Per task: each item's gold log-likelihood, whether the row picks the gold answer (LAMBADA: greedy), and the
    log-likelihood of every choice."""
    out = {}
    for task in tasks:
        docs = load_docs(task, limit)
        results = loglikelihoods(model, tokenizer, [r for d in docs for r in d.requests], batch_size, False, task)
        gold_ll, correct, choices, at = [], [], [], 0
        for doc in docs:
            scored = results[at : at + len(doc.requests)]
            at += len(doc.requests)
            lls = [ll for ll, _ in scored]
            gold_ll.append(round(lls[doc.gold], 4))
            choices.append([round(ll, 4) for ll in lls])
            if task == "lambada_openai":
                correct.append(scored[0][1])
            else:
                correct.append(max(range(len(lls)), key=lambda i: (lls[i], -i)) == doc.gold)
        out[task] = {"gold_ll": gold_ll, "correct": correct, "choice_ll": choices}
    return out


def choice_kl(reference: list[list[float]], row: list[list[float]]) -> float | None:
    """Mean over items of KL(softmax(reference's choice lls) ‖ softmax(row's)); None for one-choice tasks."""
    if len(reference[0]) < 2:
        return None
    total = 0.0
    for ref, got in zip(reference, row):
        p = torch.tensor(ref, dtype=torch.float64).log_softmax(0)
        q = torch.tensor(got, dtype=torch.float64).log_softmax(0)
        total += float((p.exp() * (p - q)).sum())
    return total / len(reference)


def recovered(fp: float, w4: float, row: float) -> float | None:
    """(row − W4) / (FP − W4): the share of W4's loss the row wins back, on any scale."""
    return None if math.isclose(fp, w4) else (row - w4) / (fp - w4)


def task_summary(items: dict, fp: dict, w4: dict) -> dict:
    """One row's figures on one task, against FP's and W4's items."""
    n = len(items["correct"])
    acc = sum(items["correct"]) / n
    nll = -sum(items["gold_ll"]) / n
    broken = [i for i in range(n) if fp["correct"][i] and not w4["correct"][i]]
    fixed = [i for i in range(n) if w4["correct"][i] and not fp["correct"][i]]
    summary = {"items": n, "acc": acc, "gold_nll": nll,
               "broken_by_w4_still_wrong": sum(not items["correct"][i] for i in broken), "broken_by_w4": len(broken),
               "fixed_by_w4_still_right": sum(items["correct"][i] for i in fixed), "fixed_by_w4": len(fixed),
               "flips_vs_fp": sum(a != b for a, b in zip(items["correct"], fp["correct"]))}
    kl = choice_kl(fp["choice_ll"], items["choice_ll"])
    if kl is not None:
        summary["choice_kl_vs_fp"] = kl
    return summary


def recovery(row: dict, fp: dict, w4: dict) -> dict:
    """Per task: acc, gold NLL and choice KL recovered by the row (its summary against FP's and W4's)."""
    out = {}
    for task, s in row.items():
        out[task] = {"acc": recovered(fp[task]["acc"], w4[task]["acc"], s["acc"]),
                     "gold_nll": recovered(fp[task]["gold_nll"], w4[task]["gold_nll"], s["gold_nll"])}
        if "choice_kl_vs_fp" in s:
            out[task]["choice_kl"] = recovered(0.0, w4[task]["choice_kl_vs_fp"], s["choice_kl_vs_fp"])
    return out


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def format_table(rows: list[dict], tasks: list[str]) -> str:
    lines = [f"{'row':<16} {'wiki/ptb gap':>14} " + " ".join(f"{t[:9]:>27}" for t in tasks),
             f"{'':<16} {'':>14} " + " ".join(f"{'acc (rec) | NLL rec | KL rec':>27}" for _ in tasks)]
    for row in rows:
        gap = row.get("gap_closed")
        gap_text = f"{_pct(gap['wikitext2'])} / {_pct(gap['ptb'])}" if gap else ""
        cells = []
        for t in tasks:
            s, r = row["tasks"][t], row.get("recovered", {}).get(t, {})
            cells.append(f"{s['acc']:.3f} ({_pct(r.get('acc'))}) | {_pct(r.get('gold_nll'))} | "
                         f"{_pct(r.get('choice_kl'))}")
        lines.append(f"{row['row']:<16} {gap_text:>14} " + " ".join(f"{c:>27}" for c in cells))
    return "\n".join(lines)


def plot(rows: list[dict], tasks: list[str], path: Path) -> None:
    """Three panels (accuracy, gold NLL, choice KL recovered), a group of bars per task and one bar per +SPEAR
    row; the perplexity gap each row closed on WikiText-2 as a dashed line of its colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levers = [r for r in rows if "recovered" in r]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
    width = 0.8 / max(1, len(levers))
    for ax, (key, title) in zip(axes, [("acc", "accuracy recovered"), ("gold_nll", "gold-answer NLL recovered"),
                                       ("choice_kl", "choice KL to FP recovered")]):
        for j, row in enumerate(levers):
            values = [100 * (row["recovered"][t].get(key) or 0) for t in tasks]
            bars = ax.bar([i + j * width for i in range(len(tasks))], values, width, label=row["row"])
            ax.axhline(100 * row["gap_closed"]["wikitext2"], color=bars.patches[0].get_facecolor(), ls="--", lw=1)
        ax.set_xticks([i + width * (len(levers) - 1) / 2 for i in range(len(tasks))], [t[:10] for t in tasks])
        ax.set_title(title)
        ax.axhline(0, color="black", lw=0.5)
    axes[0].set_ylabel("% of W4's loss won back")
    fig.suptitle("zero-shot recovery by task (dashed: the row's WikiText-2 perplexity gap closed)", fontsize=10)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def reused_rows(args, tasks: list[str]) -> dict[str, dict]:
    """The FP and W4 rows of an earlier run (--reuse), refused unless it scored the same model, tasks, items and
    windows (the rows are deterministic: they do not depend on the levers)."""
    import json

    earlier = json.loads(Path(args.reuse).read_text())
    same = (earlier["model"], earlier["tasks"], earlier["limit"], earlier["max_windows"]) == \
        (args.model, tasks, args.limit, args.max_windows)
    if not same:
        sys.exit(f"--reuse {args.reuse}: another model, task list, limit or window count")
    return {row["row"]: row for row in earlier["rows"] if row["row"] in ("FP", "W4")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--levers", nargs="+", default=["self", "text", "random", "chat"], choices=list(LEVERS))
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--calib-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=100, help="KL calibration steps of each +SPEAR row")
    p.add_argument("--calib-batch", type=int, default=8, help="calibration sequences per KL step")
    p.add_argument("--budget", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated task names, or all")
    p.add_argument("--limit", type=int, default=500, help="the first N items of each task")
    p.add_argument("--task-batch", type=int, default=32, help="log-likelihood requests per forward pass")
    p.add_argument("--max-windows", type=int, default=8, help="perplexity windows of each dataset")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None, help="the figure (default: the JSON's path with .png)")
    p.add_argument("--reuse", default=None,
                   help="take the FP and W4 rows from this earlier JSON of the same model, tasks, limit and windows")
    args = p.parse_args()
    tasks = parse_tasks(args.tasks)

    lm = load_float_model(args.model)
    rows: list[dict] = []
    levers: dict[str, dict] = {}

    def save() -> None:
        write_json(args.json, {"model": args.model, "setting": {"method": "rtn", **W4_RTN_PC.quant.to_dict()},
                               "budget": args.budget, "steps": args.steps, "calib_batch": args.calib_batch,
                               "seed": args.seed, "tasks": tasks, "limit": args.limit, "max_windows": args.max_windows,
                               "levers": levers, "rows": rows})

    def measure(label: str, model, extra: dict | None = None) -> dict:
        start = time.perf_counter()
        ppl = {ds: perplexity(model, lm.tokenizer, ds, 2048, args.max_windows, 1, progress=False).ppl
               for ds in DATASETS}
        items = score_items(model, lm.tokenizer, tasks, args.limit, args.task_batch)
        row = {"row": label, **ppl, **(extra or {}), "items": items, "eval_seconds": time.perf_counter() - start}
        print(f"{label}: wiki {ppl['wikitext2']:.3f} ptb {ppl['ptb']:.3f} ({row['eval_seconds']:.0f} s)",
              file=sys.stderr, flush=True)
        return row

    earlier = reused_rows(args, tasks) if args.reuse else {}
    fp = earlier.get("FP") or measure("FP", lm.model)
    self_ids = calibration_ids(lm.model, lm.tokenizer, CalibConfig(args.calib_samples, args.calib_len),
                               model_key(args.model))
    quantized = copy.deepcopy(lm.model)
    quantize_model(quantized, W4_RTN_PC, self_ids)
    w4 = earlier.get("W4") or measure("W4", quantized)
    for row in (fp, w4):
        row["tasks"] = {t: task_summary(row["items"][t], fp["items"][t], w4["items"][t]) for t in tasks}
    rows += [fp, w4]
    save()
    _, w_hat = weights_in_float_basis(lm.model, quantized, quantized_layers(quantized), False)
    sensitivity = module_sensitivity(lm.model, w_hat, self_ids, SensitivityConfig())
    cfg = CompensateConfig(seed=args.seed)
    cfg = replace(cfg, budget=args.budget, calibrate=replace(cfg.calibrate, steps=args.steps,
                                                              batch_size=args.calib_batch, progress=False))
    for lever in args.levers:
        settings = dict(LEVERS[lever])
        if "text_file" in settings:
            settings["text_file"] = str(data_dir() / settings["text_file"])
        calib = CalibConfig(args.calib_samples, args.calib_len, **settings)
        ids = calibration_ids(lm.model, lm.tokenizer, calib, model_key(args.model))
        objective = OBJECTIVES.get(lever, {})
        refit = lever == "refit"  # the other rows keep W4's codes (no `rounding`: nothing to re-round)
        levers[lever] = {**calibration_record(calib, ids), **settings, **objective,
                         "refit_rounds": cfg.refit_rounds_for(refit)}
        student = copy.deepcopy(quantized)
        start = time.perf_counter()
        report = compensate(student, lm.model, ids, replace(cfg, calibrate=replace(cfg.calibrate, **objective)),
                            sensitivity=sensitivity, rounding=Rounding.of(W4_RTN_PC) if refit else None)
        row = measure(f"+SPEAR {lever}", student, {"ec_memory_pct": report.ec_memory_pct,
                                                   "heldout_kl": report.calibration.final_heldout_kl,
                                                   "compensate_seconds": time.perf_counter() - start})
        row["gap_closed"] = {ds: gap_closed(fp[ds], w4[ds], row[ds]) for ds in DATASETS}
        row["tasks"] = {t: task_summary(row["items"][t], fp["items"][t], w4["items"][t]) for t in tasks}
        row["recovered"] = recovery(row["tasks"], fp["tasks"], w4["tasks"])
        rows.append(row)
        save()
        del student
    print(format_table(rows, tasks))
    figure = Path(args.plot or Path(args.json).with_suffix(".png"))
    plot(rows, tasks, figure)
    print(f"wrote {args.json} and {figure}")


if __name__ == "__main__":
    main()
