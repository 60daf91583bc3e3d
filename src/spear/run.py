"""The main job (`spear run`): quantize a model, evaluate float vs quantized, report.

Writes the artifact and `report.json` under the run directory and prints a table.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from spear.api import model_key
from spear.artifact import ArtifactInfo, save_artifact
from spear.data.calibration import CalibConfig, calibration_ids
from spear.eval import perplexity
from spear.models.loading import load_float_model
from spear.quant.pipeline import QuantSettings, check_shapes, quantize_model
from spear.util import versions

QUICK_CALIB = CalibConfig(num_sequences=16, seq_len=128)
QUICK_WINDOWS = 2


@dataclass
class RunConfig:
    model: str
    settings: QuantSettings
    calib: CalibConfig
    out: Path
    datasets: tuple[str, ...] = ("wikitext2", "ptb")
    seqlen: int = 2048
    max_windows: int | None = None
    batch_size: int = 1
    quick: bool = False

    @classmethod
    def build(cls, model: str, settings: QuantSettings, calib: CalibConfig, quick: bool = False,
              out: str | None = None, seqlen: int = 2048, max_windows: int | None = None, batch_size: int = 1) -> "RunConfig":
        if quick:
            calib = CalibConfig(QUICK_CALIB.num_sequences, QUICK_CALIB.seq_len, calib.seed, calib.text_file)
            max_windows = max_windows or QUICK_WINDOWS
        q = settings.quant
        name = f"{Path(model).stem}-{settings.method}-w{q.bits}{'g' + str(q.group_size) if q.group_size > 0 else 'pc'}"
        name += "-asym" if not q.sym else ""
        return cls(model, settings, calib, Path(out or Path("runs") / name), seqlen=seqlen,
                   max_windows=max_windows, batch_size=batch_size, quick=quick)


@dataclass
class RunReport:
    model: str
    setting: dict
    device: str
    fp: dict = field(default_factory=dict)  # dataset -> ppl
    quantized: dict = field(default_factory=dict)
    windows: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self) | {
            "fp_ppl": self.fp.get("wikitext2"),
            "w4_ppl": self.quantized.get("wikitext2"),
            "versions": versions(),
        }


def run(config: RunConfig, device: torch.device | None = None) -> dict:
    t0 = time.perf_counter()
    lm = load_float_model(config.model, device)
    check_shapes(lm.model, config.settings.quant)
    report = RunReport(config.model, {"method": config.settings.method, **config.settings.quant.to_dict()},
                       str(next(lm.model.parameters()).device))
    report.seconds["load"] = time.perf_counter() - t0

    _evaluate(lm, config, report.fp, report)
    float_model = copy.deepcopy(lm.model) if _needs_float_copy() else None
    t = time.perf_counter()
    ids = None
    if config.settings.method != "rtn":
        ids = calibration_ids(lm.model, lm.tokenizer, config.calib, model_key(config.model))
    quantize_model(lm.model, config.settings, ids)
    report.seconds["quantize"] = time.perf_counter() - t
    _evaluate(lm, config, report.quantized, report)
    del float_model

    info = ArtifactInfo(config.model, report.setting, None if ids is None else asdict(config.calib))
    save_artifact(lm.model, lm.tokenizer, config.out / "artifact", info)
    result = report.to_dict()
    (config.out / "report.json").write_text(json.dumps(result, indent=2))
    _print_table(report, config)
    return result


def _needs_float_copy() -> bool:
    return False


def _evaluate(lm, config: RunConfig, into: dict, report: RunReport) -> None:
    for ds in config.datasets:
        r = perplexity(lm.model, lm.tokenizer, ds, config.seqlen, config.max_windows, config.batch_size)
        into[ds] = r.ppl
        report.windows[ds] = r.windows


def _print_table(report: RunReport, config: RunConfig) -> None:
    s = report.setting
    label = f"W{s['bits']} {s['method'].upper()} {'per-channel' if s['group_size'] == -1 else 'g' + str(s['group_size'])} {s['grid']}"
    lines = [f"{'model':<28} {'dataset':<10} {'windows':>7} {'FP':>9} {label:>28}"]
    for ds in config.datasets:
        lines.append(f"{config.model:<28} {ds:<10} {report.windows[ds]:>7} {report.fp[ds]:>9.3f} {report.quantized[ds]:>28.3f}")
    lines.append(f"run directory: {config.out}")
    print("\n".join(lines), file=sys.stderr)
