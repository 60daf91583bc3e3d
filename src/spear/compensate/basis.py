"""A quantized linear read in its float model's basis, for quantizers that rescale channels (AWQ).

AWQ folds per-channel scales into the op before a linear (eq. 4 of AWQ: y = Q(W diag(s)) (x / s)), and, where that
op is a linear itself (AWQ's v→o and up→down pairs), into that linear's output rows. So the student's weight is

    Ŵ' ≈ diag(1/t) W diag(s)        x' = x / s (its input),  y' = y / t (its output)

and comparing Ŵ' with the float W directly measures the rescaling, not the rounding. Sensitivity and the
closed-form EC inits therefore use Ŵ = diag(t) Ŵ' diag(1/s), and the factors they give in the float basis map
back to the student as

    A' = A diag(s)   (A' x' = A x: the gate sees the same u)      B' = diag(1/t) B.

Checkpoints do not store AWQ's scales, so (s, t) are fitted to (W, Ŵ') by alternating least squares: t over each
row, s over each column's nonzero entries (an entry rounded to zero says only that it is small). The pair is
determined up to one common factor, which cancels in both maps above. A channel that AWQ scaled down far enough
rounds to zero in every row and says nothing of its s in the weights: there s comes from the inputs, the float
model's E|x| over the student's E|x'| (which also moves with the rounding upstream, so it is used only there).
The fit is kept where it at least brings the error ‖Ŵ − W‖ below RESCALED_GAIN of ‖Ŵ' − W‖: linears AWQ left alone
(o_proj under grouped-query attention) stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.errors import SpearError

MISMATCH_ERROR = 1.2  # ‖Ŵ − W‖ / ‖W‖ of no quantization (even Ŵ = 0 gives 1; unrelated weights ≈ √2)
RESCALED_GAIN = 0.9  # a fit that leaves more than this share of the plain error is rounding noise, not a rescaling
FIT_ITERATIONS = 20
MIN_NONZERO = 2  # nonzero entries a column needs for its s to come from the weights
INPUT_SEQUENCES = 32  # calibration sequences whose inputs give the s of all-zero columns


@dataclass(frozen=True)
class Rescaling:
    """Ŵ' ≈ diag(1/t) W diag(s) (module docstring); float64."""

    s: torch.Tensor  # [in]
    t: torch.Tensor  # [out]

    @classmethod
    def with_input_scale(cls, W: torch.Tensor, w_hat: torch.Tensor, s: torch.Tensor) -> "Rescaling":
        """s given; t by least squares of each row of Ŵ' against the row of W diag(s), over Ŵ''s nonzero entries."""
        Q = w_hat.detach().double().to(W.device)
        Ws = torch.where(Q != 0, W.detach().double() * s.double().to(W.device), torch.zeros_like(Q))
        u = (Q * Ws).sum(1) / Ws.square().sum(1).clamp(min=1e-300)
        u = torch.where(u.abs() > 1e-12, u, torch.ones_like(u))  # an all-zero row says nothing of its scale
        return cls(s.double().to(W.device), 1 / u)

    def to_float_basis(self, w_hat: torch.Tensor) -> torch.Tensor:
        """Ŵ = diag(t) Ŵ' diag(1/s), in w_hat's dtype."""
        t, s = self.t.to(w_hat.device), self.s.to(w_hat.device)
        return (t[:, None] * w_hat.double() / s[None, :]).to(w_hat.dtype)

    def to_student(self, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(A diag(s), diag(1/t) B): factors fitted in the float basis, for the rescaled linear."""
        t, s = self.t.to(A.device), self.s.to(A.device)
        return (A.double() * s[None, :]).to(A.dtype), (B.double() / t[:, None]).to(B.dtype)


def relative_error(W: torch.Tensor, w_hat: torch.Tensor) -> float:
    W = W.detach().double()
    return (torch.linalg.norm(w_hat.detach().double().to(W.device) - W) / torch.linalg.norm(W).clamp(min=1e-300)).item()


def check_quantization_of(name: str, W: torch.Tensor, w_hat: torch.Tensor) -> None:
    """SpearError where Ŵ (in the float basis) is no quantization of W: the float model is not the one it came from."""
    error = relative_error(W, w_hat)
    if error >= MISMATCH_ERROR:
        raise SpearError(f"the quantized weight of {name} is no quantization of the float model's (relative error "
                         f"{error:.2f}): is the base model the one it was quantized from?")


def fit_rescaling(W: torch.Tensor, w_hat: torch.Tensor, iterations: int = FIT_ITERATIONS) -> tuple[Rescaling, torch.Tensor]:
    """The least-squares (s, t) of diag(1/t) W diag(s) ≈ Ŵ' (module docstring), and which columns the weights
    identify (their s; the others keep s = 1)."""
    W, Q = W.detach().double(), w_hat.detach().double().to(W.device)
    nonzero = Q != 0
    identified = nonzero.sum(0) >= MIN_NONZERO
    s = torch.ones(W.shape[1], dtype=torch.float64, device=W.device)
    for _ in range(iterations):
        t = Rescaling.with_input_scale(W, Q, s).t
        uW = torch.where(nonzero, W / t[:, None], torch.zeros_like(W))
        fitted = (Q * uW).sum(0) / uW.square().sum(0).clamp(min=1e-300)
        s = torch.where(identified & (fitted.abs() > 1e-12), fitted, s)
    return Rescaling.with_input_scale(W, Q, s), identified


@torch.no_grad()
def input_mean_abs(model: nn.Module, calib_ids: torch.Tensor, names: list[str], batch_size: int = 8) -> dict:
    """E|x| per input channel [in] float64 of each named linear of `model`, on the first INPUT_SEQUENCES."""
    sums = {n: 0.0 for n in names}
    tokens = 0

    def hook(name: str):
        def fn(_module, args):
            x = args[0].detach()
            sums[name] = sums[name] + x.reshape(-1, x.shape[-1]).abs().double().sum(0)

        return fn

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    try:
        for ids in calib_ids[:INPUT_SEQUENCES].split(batch_size):
            model.base_model(input_ids=ids.to(model.device), use_cache=False)
            tokens += ids.numel()
    finally:
        for h in handles:
            h.remove()
    return {n: v / tokens for n, v in sums.items()}


def read_rescalings(teacher: nn.Module, student: nn.Module, calib_ids: torch.Tensor, names: list[str]) -> dict:
    """name → Rescaling of each named linear of `student` that its quantizer rescaled (AWQ); the others are left out."""
    fits = {}
    for n in tqdm(names, desc="rescaled linears", unit="module"):
        W, w_hat = teacher.get_submodule(n).weight, student.get_submodule(n).weight_hat
        fit, identified = fit_rescaling(W, w_hat)
        if relative_error(W, fit.to_float_basis(w_hat.double())) < RESCALED_GAIN * relative_error(W, w_hat):
            fits[n] = (fit, identified)
    blind = [n for n, (_, identified) in fits.items() if not identified.all()]
    if blind:  # all-zero columns: s from the inputs, brought to the fit's common factor on the identified columns
        x_float, x_student = input_mean_abs(teacher, calib_ids, blind), input_mean_abs(student, calib_ids, blind)
        for n in blind:
            (fit, identified), live = fits[n], x_student[n] > 1e-12 * x_student[n].max()
            from_inputs = x_float[n] / x_student[n].clamp(min=1e-300)
            ok = identified & live
            c = (from_inputs[ok] / fit.s[ok]).median() if ok.any() else 1.0
            s = torch.where(identified | ~live, fit.s, from_inputs / c)
            fits[n] = (Rescaling(s, fit.t), identified)  # t is unchanged: all-zero columns do not enter its fit
    return {n: fit for n, (fit, _) in fits.items()}
