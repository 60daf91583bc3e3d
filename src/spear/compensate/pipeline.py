"""Add error compensators to a quantized model: sensitivity → plan → closed-form init → KL calibration.

    damage_m  = 1 − CKA(final hidden states of the float model, same with only m quantized)
    σ²_m      = whitened error spectrum of E_m R_xx^{1/2} (what each rank step of m captures)
    plan      = planner(damages, spectra, shapes, budget = fraction × bytes of the W4 model)
    A_m, B_m  = closed form of W_m − Ŵ_m (LoRC / LQER / QERA-exact); the adaptive EC starts from QERA
    calibrate = min KL(float ‖ W4 + EC) on self-sampled sequences (adaptive: gate, alpha, A, B)

A quantizer that rescales channels (AWQ) is read back into the float model's basis first (compensate.basis).

`kind` picks the EC: "adaptive" (SPEAR: gated, KL-trained) or a static baseline ("lorc",
"lqer", "qera": gate off, closed form only). "adaptive" with `gate=False` is KL-trained without the gate: a static
EC, y = Q(W)x + alpha·B A x, that stock vLLM's LoRA path serves exactly (BENCHMARKS §2: −0.5 to +0.6 points of gap
closed against the gate, at equal bytes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.compensate.basis import weights_in_float_basis
from spear.compensate.calibrate import (CalibrateConfig, CalibrationResult, calibrate_ecs, ec_state_dict,
                                         load_ec_state_dict)
from spear.compensate.cka import SensitivityConfig, SensitivityTable, module_sensitivity
from spear.compensate.init import WhitenedError, attach_ec, init_ec
from spear.compensate.cost import BytesCost, CostModel
from spear.compensate.planner import Plan, PlannerConfig, plan_ecs, quantized_model_bytes
from spear.compensate.refit import Rounding, mean_gates, refit_module, refit_summary, reround_under_ecs
from spear.compensate.stats import InputStats, collect_input_stats, walk_input_stats
from spear.errors import SpearError
from spear.layer import SpearLinear
from spear.memory import return_freed_memory
from spear.util import stage_done

KINDS = ("adaptive", "lorc", "lqer", "qera")
# joint fitting's rounds where SPEAR rounded the codes by RTN and the EC starts from QERA: +1.6 / +1.5 points of the
# hard case's gap at the defaults, every round lowering the whitened residual (BENCHMARKS §2)
REFIT_ROUNDS = 3
# What a budget is a share of: the whole 4-bit model (the paper's 1%), or only its quantized linears. A model whose
# embeddings dominate (a 262k vocabulary: ~87% of a 1B model's 4-bit bytes) gets several times the EC bytes a linear
# from the first; the second is the same share everywhere.
BUDGET_BASES = ("model", "linears")


@dataclass(frozen=True)
class CompensateConfig:
    kind: str = "adaptive"
    budget: float = 0.01  # EC bytes as a fraction of `budget_base`'s bytes
    budget_base: str = "model"  # "model": the whole 4-bit model, as the paper counts; "linears": its quantized linears
    planner: PlannerConfig = PlannerConfig()
    cost: CostModel = BytesCost()  # what a rank step costs the planner (compensate/cost.py): bytes, or bytes + µs
    sensitivity: SensitivityConfig = SensitivityConfig()
    calibrate: CalibrateConfig = CalibrateConfig()
    gate: bool = True  # adaptive only: False trains a gate-less EC with the same KL loss (its bytes go to rank)
    stats_sequences: int = 1024  # input statistics (R_xx, E|x|) from at most the first this many calibration sequences
    # joint fitting: re-round RTN or GPTQ codes with the EC in place, this many times (compensate.refit); None:
    # REFIT_ROUNDS where SPEAR rounded the codes (RTN, GPTQ) and QERA initialises the EC (adaptive, qera), else 0
    refit_rounds: int | None = None
    # each re-rounding also picks every row's clipping by whitened error (compensate.refit.clipped_rtn, clipped_gptq)
    refit_clip: bool = True
    # after calibration: re-round the codes against the trained EC's mean linear part and train again, this many
    # times (compensate.refit.reround_under_ecs); the steps are split evenly over the trainings, the round of least
    # KL is kept. Opt-in: BENCHMARKS §2 has what it measured
    joint_rounds: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SpearError(f"unknown EC kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if not 0 < self.budget < 1:
            raise SpearError(f"budget must be a fraction in (0, 1), e.g. 0.01 for 1%, got {self.budget}")
        if self.budget_base not in BUDGET_BASES:
            raise SpearError(f"unknown budget base {self.budget_base!r}; choose one of {', '.join(BUDGET_BASES)}")
        if not self.gate and self.kind != "adaptive":
            raise SpearError(f"only the adaptive EC has a gate to turn off; {self.kind} has none")
        if self.stats_sequences < 1:
            raise SpearError(f"stats_sequences must be positive, got {self.stats_sequences}")
        if self.refit_rounds is not None and self.refit_rounds < 0:
            raise SpearError(f"refit rounds must be 0 or more, got {self.refit_rounds}")
        if self.joint_rounds < 0 or (self.joint_rounds and self.kind != "adaptive"):
            raise SpearError(f"joint rounds re-train the EC after re-rounding: 0 or more, with the adaptive EC only "
                             f"(got {self.joint_rounds} with {self.kind})")
        if self.refit_rounds and self.kind in ("lorc", "lqer"):
            raise SpearError(f"joint fitting refits QERA's factors; the {self.kind} EC has its own: use qera or adaptive")
        if self.joint_rounds and self.calibrate.checkpoint_dir is not None:
            raise SpearError("a calibration checkpoint resumes one training; joint rounds run several: drop one")

    @property
    def rerounds_codes(self) -> bool:
        """Whether this config re-rounds the codes (refit rounds asked for, or joint rounds): RTN or GPTQ codes only."""
        return bool(self.refit_rounds or self.joint_rounds)

    def refit_rounds_for(self, ours: bool) -> int:
        """The joint-fitting rounds this config runs on codes that SPEAR rounded (`ours`: RTN, GPTQ) or not."""
        if self.refit_rounds is not None:
            return self.refit_rounds
        return REFIT_ROUNDS if ours and self.kind in ("adaptive", "qera") else 0

    @property
    def gated(self) -> bool:
        return self.kind == "adaptive" and self.gate

    @property
    def trained(self) -> bool:
        return self.kind == "adaptive"


@dataclass
class CompensateReport:
    kind: str
    plan: Plan
    sensitivity: SensitivityTable
    calibration: CalibrationResult | None
    w4_bytes: int
    ec_bytes: int
    seconds: dict = field(default_factory=dict)
    linear_bytes: int = 0  # the quantized linears' share of w4_bytes
    refit: dict | None = None  # joint fitting's whitened residual by round (refit_summary), where it ran
    joint_kl: list[float] | None = None  # after calibration: the KL of each training, round 0 first (joint_rounds)

    @property
    def ec_memory_pct(self) -> float:
        """EC bytes as a percentage of the whole 4-bit model."""
        return 100.0 * self.ec_bytes / self.w4_bytes

    @property
    def ec_linears_pct(self) -> float:
        """EC bytes as a percentage of the 4-bit linears alone."""
        return 100.0 * self.ec_bytes / max(self.linear_bytes, 1)

    def save_diagnostics(self, directory) -> None:
        """sensitivity.json / .png (damage heat map), plan.json and plan_ranks.png (rank per module) in `directory`."""
        from pathlib import Path

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "sensitivity.json").write_text(self.sensitivity.to_json())
        self.sensitivity.save_heatmap(directory / "sensitivity.png")
        (directory / "plan.json").write_text(self.plan.to_json())
        if self.plan.entries:
            self.plan.save_rank_plot(directory / "plan_ranks.png")

    def summary(self) -> dict:
        return {
            "kind": self.kind, "mode": self.plan.mode, "why": self.plan.why, "entropy": self.plan.entropy,
            "modules": len(self.plan.entries),
            "ranks": sorted({e.rank for e in self.plan.entries}), "w4_bytes": self.w4_bytes, "ec_bytes": self.ec_bytes,
            "ec_memory_pct": self.ec_memory_pct, "linear_bytes": self.linear_bytes,
            "ec_linears_pct": self.ec_linears_pct, "seconds": self.seconds, "refit": self.refit,
            "joint_kl": self.joint_kl,
            "calibration": None if self.calibration is None else self.calibration.to_dict() | {"history": None},
        }


def quantized_layers(model: nn.Module) -> dict[str, SpearLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, SpearLinear)}


def compensate(
    student: nn.Module,
    teacher: nn.Module,
    calib_ids: torch.Tensor,
    cfg: CompensateConfig = CompensateConfig(),
    sensitivity: SensitivityTable | None = None,
    rescaled: bool = False,
    rounding: Rounding | None = None,
) -> CompensateReport:
    """Attach ECs to `student` (quantized, in place) and, for trained kinds, calibrate them against
    the float `teacher`. A sensitivity table computed earlier (same model and quantization) can be reused.
    `rescaled`: the student is AWQ's, with per-channel scales folded in (compensate.basis reads them back).
    `rounding`: how SPEAR rounded the student's codes (RTN, GPTQ), which joint fitting (cfg.refit_rounds) redoes."""
    layers = quantized_layers(student)
    if not layers:
        raise SpearError("the model has no quantized layers: quantize it first")
    if cfg.rerounds_codes and rounding is None:
        raise SpearError("joint fitting re-rounds the codes: this model was not quantized by SPEAR's RTN or GPTQ "
                         "(AWQ, OmniQuant and imported codes keep their own rounding); drop --refit-rounds")
    if rounding is not None and cfg.refit_clip:
        rounding = replace(rounding, clip=True)
    teacher_linears = dict(teacher.named_modules())
    records = {n: m.qweight for n, m in layers.items()}
    w4_bytes = quantized_model_bytes(student, records)
    linear_bytes = sum(r.nbytes_packed() for r in records.values())
    del records
    seconds = {}

    t = time.perf_counter()
    rescalings, w_hat = weights_in_float_basis(teacher, student, layers, rescaled)  # Ŵ comparable with W
    if sensitivity is None:
        sensitivity = module_sensitivity(teacher, w_hat, calib_ids, cfg.sensitivity)
    seconds["sensitivity"] = time.perf_counter() - t
    stage_done("sensitivity", seconds["sensitivity"], cfg.calibrate.progress)

    t = time.perf_counter()
    planner = replace(cfg.planner, gate_hidden=cfg.planner.gate_hidden if cfg.gated else 0)
    shapes = {n: (m.out_features, m.in_features) for n, m in layers.items()}
    init_kind = "qera" if cfg.kind == "adaptive" else cfg.kind
    marginal = planner.allocation == "marginal"
    # 1,024 sequences (524k tokens) for a 1,536² R_xx; all 4,096 took ~30 s on an H200, 4× the time
    stats_ids = calib_ids[: cfg.stats_sequences]
    errors: dict[str, WhitenedError] = {}

    def spectra_of(layer_stats: dict[str, InputStats]) -> None:
        for n, st in layer_stats.items():
            W = teacher_linears[n].weight.to(layers[n].weight_hat.device)
            errors[n] = WhitenedError.of(W, w_hat[n], st, planner.rank_cap)

    if marginal and init_kind == "qera":
        # the spectra are all the statistics serve (the inits read them back): a decoder layer at a time, so that
        # one layer's R_xx are held, not the model's (65 GB in float64 at 8B); the same sums as collect_input_stats
        stats = {}
        for layer_stats in walk_input_stats(teacher, stats_ids, list(layers)):
            spectra_of(layer_stats)
    else:
        stats = collect_input_stats(teacher, stats_ids, list(layers)) if marginal or init_kind != "lorc" else {}
        if marginal:  # every kind is allocated from the same whitened spectra: equal modules and ranks
            spectra_of(stats)
    errors = {n: errors[n] for n in layers if n in errors}  # model order, whichever way they came
    seconds["spectra"] = time.perf_counter() - t
    stage_done("spectra", seconds["spectra"], cfg.calibrate.progress)
    spectra = {n: e.spectrum for n, e in errors.items()} if marginal else None
    base_bytes = w4_bytes if cfg.budget_base == "model" else linear_bytes
    plan = plan_ecs(sensitivity, shapes, int(cfg.budget * base_bytes), cfg.cost, cfg.seed, planner, spectra)

    from spear.artifact import round_as_stored

    t = time.perf_counter()
    names = [e.name for e in plan.entries]
    refits = {}
    refit_rounds = cfg.refit_rounds_for(rounding is not None)
    if refit_rounds:
        ranks = {e.name: e.rank for e in plan.entries}
        walked = walk_input_stats(teacher, stats_ids, names) if not stats else [stats]
        for layer_stats in walked:
            for n, st in layer_stats.items():
                if n in ranks:
                    W = teacher_linears[n].weight.to(layers[n].weight_hat.device)
                    refits[n] = refit_module(W, w_hat[n], st, ranks[n], rounding, refit_rounds, errors.pop(n, None))
                    if refits[n].record is not None:  # the layer takes the codes (packed) and its new dense copy;
                        layers[n].set_record(refits[n].record)  # the old copy and the unpacked codes go
                        w_hat[n], refits[n].record = layers[n].weight_hat, None
        return_freed_memory()
        seconds["refit"] = time.perf_counter() - t
        stage_done("refit", seconds["refit"], cfg.calibrate.progress)
        t = time.perf_counter()
    for entry in plan.entries:
        layer = layers[entry.name]
        W = teacher_linears[entry.name].weight.to(layer.weight_hat.device)
        if entry.name in refits:
            A, B = refits[entry.name].A, refits[entry.name].B
        elif init_kind == "qera" and entry.name in errors:  # the SVD the plan already computed
            A, B = errors[entry.name].factors(W, w_hat[entry.name], entry.rank)
        else:
            A, B = init_ec(init_kind, W, w_hat[entry.name], entry.rank, stats.get(entry.name))
        if entry.name in rescalings:
            A, B = rescalings[entry.name].to_student(A, B)
        attach_ec(layer, A, B, entry.gate_hidden, planner.factor_bits)
    seconds["init"] = time.perf_counter() - t
    stage_done("init", seconds["init"], cfg.calibrate.progress)
    # the statistics (at 8B: ~65 GB of float64 R_xx), spectra and dense views go before training needs the memory
    del stats, errors, w_hat, spectra
    return_freed_memory()

    calibration, joint_kl = None, None
    if cfg.trained and plan.entries:
        steps = max(1, cfg.calibrate.steps // (cfg.joint_rounds + 1))
        calib_cfg = replace(cfg.calibrate, train_gate=cfg.gated, seed=cfg.seed, steps=steps)
        calibration = calibrate_ecs(student, teacher, calib_ids, calib_cfg)
        seconds["calibrate"] = calibration.seconds
        stage_done("calibration", calibration.seconds, cfg.calibrate.progress)
        if cfg.joint_rounds:
            t = time.perf_counter()
            calibration, joint_kl = train_jointly(student, teacher, calib_ids, stats_ids, calib_cfg, rounding,
                                                  cfg.joint_rounds, calibration)
            seconds["joint"] = time.perf_counter() - t
    round_as_stored(student)  # the ECs as the artifact stores them (fp16): what is evaluated is what is served
    ec_bytes = sum(layers[n].ec.nbytes() for n in names)
    kind = "adaptive, no gate" if cfg.trained and not cfg.gated else cfg.kind
    refit = None if not refits else refit_summary(refits) | {"clip": rounding.clip}
    return CompensateReport(kind, plan, sensitivity, calibration, w4_bytes, ec_bytes, seconds, linear_bytes, refit,
                            joint_kl)


def train_jointly(student: nn.Module, teacher: nn.Module, calib_ids: torch.Tensor, stats_ids: torch.Tensor,
                  calib_cfg: CalibrateConfig, rounding: Rounding, rounds: int, first: CalibrationResult
                  ) -> tuple[CalibrationResult, list[float]]:
    """`rounds` alternations after the calibration `first`: re-round the codes under the trained ECs
    (compensate.refit), train the ECs again. The round of least KL (held-out where there is a held-out set) is kept:
    its codes, ECs and calibration result. Returns that result and every round's KL, round 0 first."""
    def kl(result: CalibrationResult) -> float:
        return result.final_heldout_kl if result.final_heldout_kl is not None else result.final_train_kl

    layers = {n: m for n, m in quantized_layers(student).items() if m.ec is not None}
    teacher_linears = dict(teacher.named_modules())

    # set_record replaces a layer's tensors (never writes into them): a record taken here stays valid
    def snapshot() -> tuple[dict, dict]:
        return {n: m.qweight for n, m in layers.items()}, ec_state_dict(student)

    history, calibration = [kl(first)], first
    best = (history[0], snapshot(), first)
    for _ in tqdm(range(rounds), desc="joint rounds", unit="round", disable=not calib_cfg.progress):
        gates = mean_gates(student, stats_ids[:64])
        weights = {n: teacher_linears[n].weight for n in layers}
        if rounding.method == "gptq":  # GPTQ rounds on each layer's input Hessian: a decoder layer's at a time
            for layer_stats in walk_input_stats(teacher, stats_ids, list(layers)):
                part = {n: layers[n] for n in layer_stats}
                reround_under_ecs(part, weights, rounding, gates, layer_stats)
        else:
            reround_under_ecs(layers, weights, rounding, gates)
        calibration = calibrate_ecs(student, teacher, calib_ids, calib_cfg)
        history.append(kl(calibration))
        if history[-1] < best[0]:
            best = (history[-1], snapshot(), calibration)
    _, (records, ec_state), calibration = best
    for n, record in records.items():
        layers[n].set_record(record)
    load_ec_state_dict(student, ec_state)
    return calibration, history
