"""Compensation table (issue 3): W4 vs static baselines vs SPEAR, with ablations, on one setting.

    python bench/compensate_table.py --model smollm2 --method rtn --bits 4 --group-size -1 \
        --json bench/results/compensate_rtn_w4pc.json

Rows: FP, W4, +LoRC / +LQER / +QERA at each budget, +SPEAR at 1%, and the ablations
(gate off: static EC trained with KL; uniform placement; fixed concentrate; fixed spread).
The float model, its quantized version, the calibration ids and the sensitivity table are
computed once; each row deep-copies the quantized model. JSON is written after every row.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import write_json  # noqa: E402
from torch import nn  # noqa: E402

import spear.compensate.init as ec_init  # noqa: E402

from spear.api import model_key  # noqa: E402
from spear.compensate.calibrate import CalibrateConfig, gate_spread  # noqa: E402
from spear.compensate.cost import LatencyCost  # noqa: E402
from spear.layer import ErrorCompensator  # noqa: E402
from spear.compensate.basis import weights_in_float_basis  # noqa: E402
from spear.compensate.cka import SensitivityConfig, module_sensitivity  # noqa: E402
from spear.compensate.pipeline import CompensateConfig, compensate, quantized_layers  # noqa: E402
from spear.compensate.refit import Rounding  # noqa: E402
from spear.data.calibration import FIRST_TOKENS, CalibConfig, calibration_ids, calibration_record  # noqa: E402
from spear.eval import perplexity  # noqa: E402
from spear.models import load_float_model  # noqa: E402
from spear.quant.pipeline import QuantSettings, quantize_model  # noqa: E402
from spear.record import QuantConfig  # noqa: E402
from spear.run import gap_closed  # noqa: E402


class TokenScalarGateEC(ErrorCompensator):
    """The gate as one scalar per token, gamma(u) = 1 + tanh(MLP(u)) with MLP: r → h → 1, scaling all r
    channels alike (the ablation of where the gate acts). Fewer bytes than the channel gate the planner counts."""

    def __init__(self, in_features: int, out_features: int, rank: int, gate_hidden: int = 0, alpha: float = 1.0):
        super().__init__(in_features, out_features, rank, gate_hidden, alpha)
        if self.gate is not None:
            self.gate[2] = nn.Linear(gate_hidden, 1)
            nn.init.zeros_(self.gate[2].weight)
            nn.init.zeros_(self.gate[2].bias)

    def gamma(self, u: torch.Tensor) -> torch.Tensor:
        return super().gamma(u).expand_as(u)


TOKEN_GATE_ROW = "ablation: per-token scalar gate"


def rows_to_run(budgets: list[float], spear_budget: float) -> list[tuple[str, CompensateConfig]]:
    """Every row: the static baselines (same allocator as SPEAR), SPEAR, and its ablations."""
    base = CompensateConfig()
    rows = []
    for budget in budgets:
        for kind in ("lorc", "lqer", "qera"):
            rows.append((f"+{kind.upper()} {100 * budget:g}%", replace(base, kind=kind, budget=budget)))
    spear = replace(base, budget=spear_budget)
    planner, calibrate = spear.planner, spear.calibrate
    rows.append((f"+SPEAR {100 * spear_budget:g}%", spear))
    rows.append(("ablation: gate off (static EC, KL-trained)", replace(spear, gate=False)))
    rows.append(("ablation: closed form rank 1 on every linear (QERA)",
                 replace(spear, kind="qera", budget=0.99, planner=replace(planner, max_rank=1))))
    rows.append((TOKEN_GATE_ROW, spear))
    for h in (2, 32):
        rows.append((f"ablation: gate hidden {h}", replace(spear, planner=replace(planner, gate_hidden=h))))
    for lam in (0.1, 1.0):
        rows.append((f"ablation: hidden-state term {lam:g}", replace(spear, calibrate=replace(calibrate, hidden_weight=lam))))
    rows.append(("ablation: hidden-state term 1, gate off", replace(spear, gate=False,
                                                               calibrate=replace(calibrate, hidden_weight=1.0))))
    rows.append(("ablation: A, B learning rate 3e-3", replace(spear, calibrate=replace(calibrate, lr_ab=3e-3))))
    for mode in ("uniform", "concentrate", "spread"):
        rows.append((f"ablation: placement {mode}", replace(spear, planner=replace(planner, mode=mode))))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--method", default="rtn", choices=["rtn", "gptq", "awq", "omniquant"])
    p.add_argument("--omniquant-epochs", type=int, default=QuantSettings.omniquant_epochs)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=-1)
    p.add_argument("--budgets", type=float, nargs="+", default=[0.01, 0.03])
    p.add_argument("--spear-budget", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=CalibrateConfig.steps, help="KL calibration steps")
    p.add_argument("--norm-lr", type=float, default=CalibrateConfig.norm_lr,
                   help="> 0: train the norm gains beside the ECs at this LR (norm tweaking)")
    p.add_argument("--cost", default="bytes", choices=["bytes", "latency"], help="the planner's cost model")
    p.add_argument("--calib-batch", type=int, default=8, help="calibration sequences per KL step")
    p.add_argument("--calib-samples", type=int, default=CalibConfig.num_sequences)
    p.add_argument("--calib-len", type=int, default=512)
    p.add_argument("--calib-first-token", default="bos", choices=list(FIRST_TOKENS))
    p.add_argument("--calib-start", default="bos", choices=["bos", "mid"])
    p.add_argument("--calib-temperature", type=float, default=CalibConfig.temperature)
    p.add_argument("--calib-surprise", type=float, default=CalibConfig.surprise,
                   help="share of positions sampled at full width and temperature 2 (data.calibration)")
    p.add_argument("--calib-pack", type=int, default=CalibConfig.pack, help="self-samples end to end per sequence")
    p.add_argument("--calib-sample-batch", type=int, default=CalibConfig.batch_size, help="sequences sampled at once")
    p.add_argument("--calib-top-p", type=float, default=CalibConfig.top_p)
    p.add_argument("--calib-file", default=None, help="real text instead of self-samples (an upper-bound row, not SPEAR)")
    p.add_argument("--sensitivity-samples", type=int, default=128, help="calibration sequences the CKA damage uses")
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--only", nargs="*", default=None, help="run only rows whose label contains one of these")
    p.add_argument("--seed", type=int, default=0, help="the compensators' seed (batch order, gate init): a draw")
    p.add_argument("--ec-bits", type=int, default=16, choices=[16, 8, 4],
                   help="EC factors of every row in fp16, int8 or int4")
    p.add_argument("--refit-rounds", type=int, default=0,
                   help="joint fitting of RTN or GPTQ codes and the ECs before calibration, this many rounds (every row)")
    p.add_argument("--no-refit-clip", action="store_true",
                   help="the refit's RTN or GPTQ rounds on the plain grid (no per-row clipping by whitened error)")
    p.add_argument("--joint-rounds", type=int, default=0,
                   help="after calibration: codes re-rounded against the trained ECs, then trained again (SPEAR rows)")
    p.add_argument("--json", required=True)
    args = p.parse_args()

    lm = load_float_model(args.model)
    calib = CalibConfig(args.calib_samples, args.calib_len, text_file=args.calib_file,
                        temperature=args.calib_temperature, top_p=args.calib_top_p, first_token=args.calib_first_token,
                        start=args.calib_start, surprise=args.calib_surprise, pack=args.calib_pack,
                        batch_size=args.calib_sample_batch)
    ids = calibration_ids(lm.model, lm.tokenizer, calib, model_key(args.model))
    settings = QuantSettings(args.method, QuantConfig(args.bits, args.group_size), omniquant_epochs=args.omniquant_epochs)
    datasets = ("wikitext2", "ptb")
    rows: list[dict] = []

    def evaluate(model) -> dict:
        return {ds: perplexity(model, lm.tokenizer, ds, 2048, args.max_windows, args.batch_size, progress=False).ppl
                for ds in datasets}

    def save() -> None:
        write_json(args.json, {"model": args.model, "setting": {"method": args.method, **settings.quant.to_dict()},
                               "calibration": {**calibration_record(calib, ids),
                                               "source": "text file" if calib.text_file else "self-sampled"},
                               "max_windows": args.max_windows, "steps": args.steps, "calib_batch": args.calib_batch, "cost": args.cost,
                               "norm_lr": args.norm_lr, "seed": args.seed, "ec_bits": args.ec_bits,
                               "refit_rounds": args.refit_rounds, "refit_clip": not args.no_refit_clip,
                               "joint_rounds": args.joint_rounds,
                               "rows": rows})

    fp = evaluate(lm.model)
    rows.append({"row": "FP", **fp})
    quantized = copy.deepcopy(lm.model)
    quantize_model(quantized, settings, ids)
    w4 = evaluate(quantized)
    rows.append({"row": f"W{args.bits}", **w4})
    print(f"{'FP':<44} wiki {fp['wikitext2']:8.3f}  ptb {fp['ptb']:8.3f}", flush=True)
    print(f"{'W' + str(args.bits):<44} wiki {w4['wikitext2']:8.3f}  ptb {w4['ptb']:8.3f}", flush=True)
    rescaled = args.method == "awq"  # AWQ folds scales into the weights: Ŵ read back into the float basis
    _, w_hat = weights_in_float_basis(lm.model, quantized, quantized_layers(quantized), rescaled)
    sensitivity = module_sensitivity(lm.model, w_hat, ids[: args.sensitivity_samples], SensitivityConfig())
    for label, cfg in rows_to_run(args.budgets, args.spear_budget):
        if args.only and not any(key in label for key in args.only):
            continue
        cfg = replace(cfg, seed=args.seed, refit_rounds=args.refit_rounds if cfg.kind in ("adaptive", "qera") else 0,
                      refit_clip=not args.no_refit_clip,
                      joint_rounds=args.joint_rounds if cfg.kind == "adaptive" else 0,
                      planner=replace(cfg.planner, factor_bits=args.ec_bits), calibrate=replace(cfg.calibrate, steps=args.steps, batch_size=args.calib_batch,
                                                             norm_lr=args.norm_lr, progress=False),
                      cost=LatencyCost() if args.cost == "latency" else cfg.cost)
        student = copy.deepcopy(quantized)
        t = time.perf_counter()
        ec_init.ErrorCompensator = TokenScalarGateEC if label == TOKEN_GATE_ROW else ErrorCompensator
        report = compensate(student, lm.model, ids, cfg, sensitivity=sensitivity, rescaled=rescaled,
                            rounding=Rounding.of(settings))
        ppl = evaluate(student)
        gates = gate_spread(student, ids[:8])
        row = {"row": label, **ppl, "ec_memory_pct": report.ec_memory_pct, "mode": report.plan.mode, "why": report.plan.why,
               "heldout_kl": None if report.calibration is None else report.calibration.final_heldout_kl,
               "calibration": None if report.calibration is None else report.calibration.to_dict(),
               "gate": gates,
               "modules": len(report.plan.entries), "ranks": sorted({e.rank for e in report.plan.entries}),
               "refit": report.refit, "joint_kl": report.joint_kl,
               "gap_closed": {ds: gap_closed(fp[ds], w4[ds], ppl[ds]) for ds in datasets},
               "seconds": time.perf_counter() - t}
        rows.append(row)
        save()
        print(f"{label:<44} wiki {ppl['wikitext2']:8.3f}  ptb {ppl['ptb']:8.3f}  mem {row['ec_memory_pct']:.2f}%  "
              f"gap closed {100 * row['gap_closed']['wikitext2']:5.1f}% / {100 * row['gap_closed']['ptb']:5.1f}%", flush=True)
        del student
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
