"""The main job (`spear run`): quantize → plan → calibrate → evaluate → report.

Float model, its W4 version, and W4 + SPEAR's adaptive ECs, each evaluated with the
same protocol. Writes under the run directory: the compensated artifact, the damage
table and heat map, and `report.json`; prints a table.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from spear.api import model_key
from spear.artifact import ArtifactInfo, save_artifact
from spear.compensate.calibrate import CalibrateConfig
from spear.compensate.cka import SensitivityConfig
from spear.compensate.pipeline import CompensateConfig, compensate
from spear.compensate.refit import REFITTABLE, Rounding, check_refit
from spear.data.calibration import CalibConfig, calibration_ids, calibration_record
from spear.eval.perplexity import eval_batch, perplexity
from spear.models.layerwise import check_walkable
from spear.models.loading import load_float_model
from spear.quant.pipeline import QuantSettings, check_shapes, quantize_model
from spear.util import versions

QUICK_CALIB = CalibConfig(num_sequences=16, seq_len=128)
QUICK_WINDOWS = 1
# No held-out early stopping in --quick: 2 held-out sequences of 128 tokens are too few to judge 16 steps by. With
# them (patience 3) a run kept the untrained init once in three (held-out KL 0.3876 not beaten by step 12: 63.1 / 55.8%
# of the gap, against 74.4 / 67.5% and 75.1 / 67.6% for the runs that went on; the same calibration, same code)
QUICK_CALIBRATE = CalibrateConfig(steps=16, batch_size=2, eval_every=4, holdout=0)
QUICK_SENSITIVITY = SensitivityConfig(num_sequences=2, seq_len=128)
# one joint-fitting round in --quick: 73.2 / 65.2% of the gap, three rounds 72.9 / 64.1%, none (int8 factors) 61.8 /
# 55.2% (one draw each, 2-core CPU; BENCHMARKS §3): a round is one more whitened SVD a module
QUICK_REFIT_ROUNDS = 1


def quick_calibration(calib: CalibConfig, compensate: CompensateConfig | None, ours: bool = True
                      ) -> tuple[CalibConfig, CompensateConfig | None]:
    """`--quick`'s short self-sampling, sensitivity and KL calibration in place of these configs' (CPU minutes),
    and at most QUICK_REFIT_ROUNDS of joint fitting where the default would run more (on codes SPEAR rounded:
    `ours`)."""
    calib = replace(calib, num_sequences=QUICK_CALIB.num_sequences, seq_len=QUICK_CALIB.seq_len)
    if compensate is not None:
        rounds = compensate.refit_rounds
        if rounds is None:
            rounds = min(QUICK_REFIT_ROUNDS, compensate.refit_rounds_for(ours))
        compensate = replace(compensate, sensitivity=QUICK_SENSITIVITY, calibrate=QUICK_CALIBRATE, refit_rounds=rounds)
    return calib, compensate


@dataclass
class RunConfig:
    model: str
    settings: QuantSettings
    calib: CalibConfig
    out: Path
    datasets: tuple[str, ...] = ("wikitext2", "ptb")
    seqlen: int = 2048
    max_windows: int | None = None
    batch_size: int | None = None  # windows per forward pass; None: eval.perplexity.eval_batch
    quick: bool = False
    compensate: CompensateConfig | None = CompensateConfig()  # None: quantize and evaluate only

    @classmethod
    def build(cls, model: str, settings: QuantSettings, calib: CalibConfig, quick: bool = False,
              out: str | None = None, seqlen: int = 2048, max_windows: int | None = None,
              batch_size: int | None = None,
              compensate: CompensateConfig | None = CompensateConfig()) -> "RunConfig":
        if compensate is not None:
            check_refit(compensate.rerounds_codes, settings.method)
        if quick:
            calib, compensate = quick_calibration(calib, compensate, ours=settings.method in REFITTABLE)
            max_windows = max_windows or QUICK_WINDOWS
        q = settings.quant
        name = f"{Path(model).stem}-{settings.method}-w{q.bits}{'g' + str(q.group_size) if q.group_size > 0 else 'pc'}"
        name += "-asym" if not q.sym else ""
        return cls(model, settings, calib, Path(out or Path("runs") / name), seqlen=seqlen,
                   max_windows=max_windows, batch_size=batch_size, quick=quick, compensate=compensate)


@dataclass
class RunReport:
    model: str
    setting: dict
    device: str
    fp: dict = field(default_factory=dict)  # dataset -> ppl
    quantized: dict = field(default_factory=dict)
    compensated: dict = field(default_factory=dict)
    ec: dict = field(default_factory=dict)  # the compensation summary (plan, bytes, calibration)
    windows: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        fp, w4, spear = (self.fp.get("wikitext2"), self.quantized.get("wikitext2"), self.compensated.get("wikitext2"))
        return asdict(self) | {
            "fp_ppl": fp,
            "w4_ppl": w4,
            "spear_ppl": spear,
            "gap_closed": None if spear is None else gap_closed(fp, w4, spear),
            "ec_memory_pct": self.ec.get("ec_memory_pct"),
            "ec_linears_pct": self.ec.get("ec_linears_pct"),
            "versions": versions(),
        }


def gap_closed(fp: float, w4: float, compensated: float) -> float:
    """Share of the FP↔W4 perplexity gap closed: (W4 − W4+EC) / (W4 − FP)."""
    return (w4 - compensated) / (w4 - fp) if w4 != fp else 0.0


def run(config: RunConfig, device: torch.device | None = None) -> dict:
    t0 = time.perf_counter()
    lm = load_float_model(config.model, device)
    check_shapes(lm.model, config.settings.quant)
    if config.settings.method != "rtn" or config.compensate is not None:  # they walk the decoder layers
        check_walkable(lm.model, config.calib.seq_len)
    report = RunReport(config.model, {"method": config.settings.method, **config.settings.quant.to_dict()},
                       str(next(lm.model.parameters()).device))
    report.seconds["load"] = time.perf_counter() - t0

    _evaluate(lm, config, report.fp, report)
    float_model = copy.deepcopy(lm.model) if config.compensate is not None else None
    t = time.perf_counter()
    ids = calibration_ids(lm.model, lm.tokenizer, config.calib, model_key(config.model))
    report.seconds["calibration_ids"] = time.perf_counter() - t  # self-sampling, unless cached
    t = time.perf_counter()
    quantize_model(lm.model, config.settings, ids)
    report.seconds["quantize"] = time.perf_counter() - t
    _evaluate(lm, config, report.quantized, report)

    plan = None
    if config.compensate is not None:
        q = config.settings
        rounding = Rounding.of(q)
        result = compensate(lm.model, float_model, ids, config.compensate, rescaled=q.method == "awq",
                            rounding=rounding)
        del float_model
        plan = json.loads(result.plan.to_json())
        report.ec = result.summary()
        result.save_diagnostics(config.out)
        _evaluate(lm, config, report.compensated, report)

    info = ArtifactInfo(config.model, report.setting, calibration_record(config.calib, ids), plan=plan)
    save_artifact(lm.model, lm.tokenizer, config.out / "artifact", info)
    report.seconds["total"] = time.perf_counter() - t0
    result = report.to_dict()
    (config.out / "report.json").write_text(json.dumps(result, indent=2))
    _print_table(report, config)
    return result


def _evaluate(lm, config: RunConfig, into: dict, report: RunReport) -> None:
    batch = config.batch_size or eval_batch(lm.model)
    for ds in config.datasets:
        r = perplexity(lm.model, lm.tokenizer, ds, config.seqlen, config.max_windows, batch)
        into[ds] = r.ppl
        report.windows[ds] = r.windows
        report.seconds["evaluate"] = report.seconds.get("evaluate", 0.0) + r.seconds


def _print_table(report: RunReport, config: RunConfig) -> None:
    s = report.setting
    label = f"W{s['bits']} {s['method'].upper()} {'per-channel' if s['group_size'] == -1 else 'g' + str(s['group_size'])} {s['grid']}"
    spear = f"+SPEAR {report.ec['ec_memory_pct']:.2f}% mem" if report.ec else ""
    lines = [f"{'model':<20} {'dataset':<10} {'windows':>7} {'FP':>9} {label:>28} {spear:>20} {'gap closed':>11}"]
    for ds in config.datasets:
        row = f"{Path(config.model).name:<20} {ds:<10} {report.windows[ds]:>7} {report.fp[ds]:>9.3f} {report.quantized[ds]:>28.3f}"
        if report.compensated:
            closed = gap_closed(report.fp[ds], report.quantized[ds], report.compensated[ds])
            row += f" {report.compensated[ds]:>20.3f} {100 * closed:>10.1f}%"
        lines.append(row)
    lines.append(f"run directory: {config.out}")
    print("\n".join(lines), file=sys.stderr)
