"""Joint fitting of the codes and the EC (issue 51, item 4): where SPEAR rounds the weights itself (RTN), the codes
are re-rounded with the EC's low-rank part in place, and the EC refitted to what is left, as LoftQ alternates, in
QERA's whitened norm:

    Ŵ_0 = RTN(W),  (A_t, B_t) = QERA_r(W − Ŵ_t),  Ŵ_{t+1} = RTN(W − B_t A_t)
    residual_t = min_{rank r} E_x ‖(W − Ŵ_t − BA) x‖² = Σ_{i>r} σ²_i(W − Ŵ_t)  (σ_i of (W − Ŵ_t) R_xx^{1/2})

B A takes the error's largest directions; the codes then round W with them removed, whose rows span a smaller range
on a per-channel grid, so the next error is smaller. The round with the least residual is kept (SmolLM2, rank 8-32:
each round lowered it, by 5-18% in all after three). The adaptive EC then trains from that init as before
(its gate starts at gamma ≡ 1, where its correction is B A). RTN's rounds also choose each row's clipping
(`clipped_rtn`, on by default: CompensateConfig.refit_clip): the grid is fitted to c·(W − B A) for the c of least
whitened error, which on a per-channel absmax grid matters more than the alternation itself (BENCHMARKS §2).
GPTQ's codes are re-rounded the same way, by GPTQ on the layer's input Hessian (Σ x xᵀ, the statistics the EC is
fitted in): Ŵ_{t+1} = GPTQ(W − B_t A_t), each row's clipping chosen as well (`clipped_gptq`). Imported, AWQ and
OmniQuant codes keep theirs: their rounding is not ours to redo.

After calibration (`joint_rounds`, opt-in) the alternation goes on with the trained EC: the codes are re-rounded
against its mean linear part, α B diag(E_x γ(A x)) A, and the EC is trained again (compensate.pipeline.train_jointly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spear.compensate.init import WhitenedError
from spear.compensate.stats import InputStats
from spear.errors import SpearError
from spear.quant.pipeline import QuantSettings
from spear.record import QuantConfig, QuantizedWeight, fit_grid, quantize_to_codes, rtn_quantize

REFITTABLE = ("rtn", "gptq")  # the methods whose rounding joint fitting redoes


@dataclass(frozen=True)
class Rounding:
    """How SPEAR rounded a model's codes, to round them again: RTN under `settings.quant`, or GPTQ with the settings'
    dampening, block size and column order on the inputs' Hessian."""

    settings: QuantSettings  # its method is one of REFITTABLE
    clip: bool = False  # each row's range shrunk by the factor of least whitened error (clipped_rtn, clipped_gptq)

    @classmethod
    def of(cls, settings: QuantSettings | None) -> "Rounding | None":
        """The rounding of codes quantized under `settings`; None where it is not SPEAR's to redo."""
        return cls(settings) if settings is not None and settings.method in REFITTABLE else None

    @property
    def method(self) -> str:
        return self.settings.method

    def round(self, W: torch.Tensor, stats: InputStats | None) -> QuantizedWeight:
        s = self.settings
        if s.method == "rtn":  # clipping needs the inputs' statistics: without them (joint rounds), plain RTN
            return clipped_rtn(W, s.quant, stats) if self.clip and stats is not None else rtn_quantize(W, s.quant)
        if self.clip:
            return clipped_gptq(W, stats.sum_xx, s)
        from spear.quant.gptq import gptq_quantize

        return gptq_quantize(W, stats.sum_xx, s.quant, s.gptq_damp, s.gptq_block_size, act_order=s.gptq_act_order)


def keep_better_rows(best: list[torch.Tensor] | None, candidate: list[torch.Tensor]) -> list[torch.Tensor]:
    """[row error, row tensors...]: each row of `best` replaced by the candidate's where its error is lower."""
    if best is None:
        return candidate
    take = candidate[0] < best[0]
    for kept, new in zip(best, candidate):
        kept[take] = new[take]
    return best


CLIP_RATIOS = tuple(1 - 0.025 * i for i in range(21))  # 1.0, 0.975, ..., 0.5: the range shrinks clipped_rtn tries


@torch.no_grad()
def clipped_rtn(W: torch.Tensor, cfg: QuantConfig, stats: InputStats) -> QuantizedWeight:
    """RTN with each row's grid fitted to its weights scaled by c in CLIP_RATIOS (so its range shrinks to c of it, the
    largest weights clipped), c chosen per row for the least whitened error ‖(w − ŵ) R_xx^{1/2}‖² (AWQ's clip search, in
    QERA's norm). The record is RTN's: same bits, grid, group layout and zero points; c = 1 is plain RTN, so no row's
    error grows. On SmolLM2 at W4 per-channel (absmax) it cuts the whitened error 2.9× (BENCHMARKS §2)."""
    out_f, in_f = W.shape
    g = cfg.group_size_for(in_f)
    W = W.detach().float()
    w = W.reshape(out_f * (in_f // g), g)
    S = stats.r_xx_sqrt().to(device=w.device, dtype=torch.float32)
    best = None  # [row error, codes, scales, zeros] of each row's best c so far
    for c in CLIP_RATIOS:
        scale, zero = fit_grid(w * c, cfg)
        codes = quantize_to_codes(w, scale[:, None], zero[:, None], cfg)
        w_hat = ((codes - zero[:, None]) * scale[:, None]).reshape(out_f, in_f)
        candidate = [((W - w_hat) @ S).pow(2).sum(1)] + [t.reshape(out_f, -1) for t in (codes, scale, zero)]
        best = keep_better_rows(best, candidate)
    _, codes, scale, zero = best
    return QuantizedWeight.from_float_codes(codes.reshape(out_f, in_f), scale, zero, cfg)


GPTQ_CLIP_RATIOS = tuple(1 - 0.05 * i for i in range(9))  # 1.0, 0.95, ..., 0.6: one GPTQ sweep per ratio
STACKED_WEIGHTS = 1 << 28  # at most this many weights in one stacked sweep (1 GiB in float32; an 8B down_proj: 4 c's)


def ratios_per_sweep(weights: int) -> int:
    """How many clip ratios one stacked sweep of a `weights`-weight matrix takes (at least one)."""
    return min(len(GPTQ_CLIP_RATIOS), max(1, STACKED_WEIGHTS // weights))


@torch.no_grad()
def clipped_gptq(W: torch.Tensor, H: torch.Tensor, settings: QuantSettings) -> QuantizedWeight:
    """GPTQ with each row's grid fitted to c·w, c in GPTQ_CLIP_RATIOS of least error (w − ŵ) H (w − ŵ)ᵀ (the
    reference GPTQ's `mse` grid search, judged on the layer's Hessian instead of ‖w − RTN(w)‖). GPTQ treats the rows
    independently (one H for all), so one sweep over W stacked once per c gives each row's outcome at every c. c = 1
    is plain GPTQ: no row's error grows. The record is GPTQ's: same bits, grid layout and zero points."""
    from spear.quant.gptq import gptq_quantize

    W = W.detach().float()
    H = H.to(W.device, torch.float32)
    out_f = W.shape[0]
    per_sweep = ratios_per_sweep(W.numel())
    best = None  # [row error, codes, scales, zeros] of each row's best c so far
    for i in range(0, len(GPTQ_CLIP_RATIOS), per_sweep):
        ratios = torch.tensor(GPTQ_CLIP_RATIOS[i:i + per_sweep], device=W.device)
        stacked = gptq_quantize(W.repeat(len(ratios), 1), H, settings.quant, settings.gptq_damp,
                                settings.gptq_block_size, act_order=settings.gptq_act_order,
                                clip=ratios.repeat_interleave(out_f))
        error = W - stacked.dequantize(torch.float32).view(len(ratios), out_f, -1)  # [c's, out, in]
        loss = ((error @ H) * error).sum(-1)
        rows = loss.argmin(0) * out_f + torch.arange(out_f, device=W.device)  # each row's best c in this sweep
        candidate = [loss.min(0).values, stacked.codes[rows], stacked.scales[rows], stacked.zeros[rows]]
        best = keep_better_rows(best, candidate)
    _, codes, scales, zeros = best
    return QuantizedWeight(codes, scales, zeros, settings.quant.bits, stacked.group_size)


def check_refit(rerounds: bool, method: str | None) -> None:
    """Refuse joint fitting of codes that SPEAR did not round (RTN, GPTQ), in one line, before any work (`spear run`
    before quantizing, `spear compensate` before loading); compensate() itself refuses them too, later."""
    if rerounds and method not in REFITTABLE:
        raise SpearError(f"--refit-rounds and --joint-rounds re-round RTN or GPTQ codes; {method} codes keep their own "
                         f"rounding: drop them or quantize with --method rtn or gptq")


@dataclass
class Refit:
    """One module's outcome: the kept round's record (None: round 0, the codes as they were), its QERA factors,
    and the whitened residual of every round."""

    record: QuantizedWeight | None
    A: torch.Tensor
    B: torch.Tensor
    residuals: list[float]

    @property
    def kept(self) -> int:
        return min(range(len(self.residuals)), key=self.residuals.__getitem__)


def refit_module(W: torch.Tensor, w_hat: torch.Tensor, stats: InputStats, rank: int, rounding: Rounding,
                 rounds: int, first: WhitenedError | None = None) -> Refit:
    """`rounds` alternations from the codes `w_hat` (W's rounding by `rounding`); the round of least residual.
    `first`: w_hat's whitened error where the planner has it already (at least `rank` vectors), round 0's."""
    W = W.detach().float()
    best = None
    residuals = []
    record, current = None, w_hat.detach().float()
    for t in range(rounds + 1):
        if t:
            record = rounding.round(W - (B.double() @ A.double()).float(), stats)
            current = record.dequantize(torch.float32).to(W.device)
        reuse = t == 0 and first is not None and first.U.shape[1] >= rank
        error = first if reuse else WhitenedError.of(W, current, stats, rank)
        A, B = error.factors(W, current, rank)
        residuals.append(error.spectrum[rank:].sum().item())
        if best is None or residuals[-1] < best[0]:
            best = (residuals[-1], record, A, B)
    _, record, A, B = best
    return Refit(record, A, B, residuals)


def refit_summary(refits: dict[str, Refit]) -> dict:
    """The modules' whitened residuals summed by round, relative to round 0's, and how many modules kept each round."""
    rounds = len(next(iter(refits.values())).residuals)
    total = [sum(r.residuals[t] for r in refits.values()) for t in range(rounds)]
    kept = [sum(r.kept == t for r in refits.values()) for t in range(rounds)]
    best = sum(r.residuals[r.kept] for r in refits.values())
    return {"rounds": rounds - 1, "residual_by_round": [x / total[0] for x in total], "residual_kept": best / total[0],
            "modules_by_kept_round": kept}


# --- after calibration: the codes re-rounded against the trained EC, then the EC trained again ------------------
#     Ŵ' = round(W − α B diag(E_x γ(A x)) A)   (the trained EC's mean linear part; γ ≡ 1 without a gate)


@torch.no_grad()
def mean_gates(model: torch.nn.Module, ids: torch.Tensor, batch_size: int = 8) -> dict[str, torch.Tensor]:
    """E_x γ(A x) per rank direction [r] of every gated EC of `model` (by its SpearLinear's name), over the tokens of
    `ids`; an EC without a gate is absent (its γ is 1)."""
    from spear.compensate.calibrate import ec_modules

    gated = {n.removesuffix(".ec"): ec for n, ec in ec_modules(model).items() if ec.gate is not None}
    sums = {n: torch.zeros(ec.rank, dtype=torch.float64) for n, ec in gated.items()}
    tokens = 0

    def hook(name: str):
        def accumulate(ec, inputs, _output) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            A, _ = ec.factors()
            sums[name] += ec.gamma(x @ A.to(x.dtype).t()).double().sum(0).cpu()
        return accumulate

    handles = [ec.register_forward_hook(hook(n)) for n, ec in gated.items()]
    device = next(model.parameters()).device
    try:
        for i in range(0, len(ids), batch_size):
            chunk = ids[i:i + batch_size].to(device)
            model(input_ids=chunk)
            tokens += chunk.numel()
    finally:
        for h in handles:
            h.remove()
    return {n: (s / max(tokens, 1)).float() for n, s in sums.items()}


@torch.no_grad()
def reround_under_ecs(layers: dict, weights: dict[str, torch.Tensor], rounding: Rounding,
                      gates: dict[str, torch.Tensor], stats: dict[str, InputStats] | None = None) -> int:
    """Re-round the codes of every layer of `layers` that has an EC to W − α B diag(ḡ) A, its trained EC's mean
    linear part removed (`gates`: ḡ by name, absent = 1); `weights`: the float W by name; `stats`: the layers'
    input statistics, which GPTQ's rounding needs (RTN's does not). The ECs stay as they are. Returns the count."""
    count = 0
    for name, layer in layers.items():
        if layer.ec is None:
            continue
        A, B = (f.detach().float() for f in layer.ec.factors())
        gate = gates.get(name)
        if gate is not None:
            A = gate.to(A.device)[:, None] * A
        W = weights[name].detach().float().to(A.device)
        correction = layer.ec.alpha.detach().float() * (B.double() @ A.double()).float()
        layer.set_record(rounding.round(W - correction, None if stats is None else stats[name]))
        count += 1
    return count
