"""A quantized linear read in its float model's basis, for quantizers that rescale channels (AWQ).

AWQ folds per-channel scales into the op before a linear (eq. 4 of AWQ: y = Q(W diag(s)) (x / s)), and, where that
op is a linear itself (AWQ's v→o and up→down pairs), into that linear's output rows. So the student's weight is

    Ŵ' ≈ diag(1/t) W diag(s)        x' = x / s (its input),  y' = y / t (its output)

and comparing Ŵ' with the float W directly measures the rescaling, not the rounding. Sensitivity and the
closed-form EC inits therefore use Ŵ = diag(t) Ŵ' diag(1/s), and the factors they give in the float basis map
back to the student as

    A' = A diag(s)   (A' x' = A x: the gate sees the same u)      B' = diag(1/t) B.

Checkpoints do not store AWQ's scales, and the weights alone cannot give them: a channel that AWQ scaled down
far enough rounds to zero in every row, and then says nothing of its s; a mild rescaling is hard to tell from
rounding. So s is read from the inputs, the float model's E|x| over the student's E|x'| per channel (upstream
rounding moves these by a few percent), and t from the weights given s, by least squares over each row (no row
rounds to zero: its largest entry sets its scale). Linears AWQ left alone come out with s ≈ 1 and t ≈ 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spear.errors import SpearError

MISMATCH_ERROR = 1.2  # ‖Ŵ − W‖ / ‖W‖ of no quantization (even Ŵ = 0 gives 1; unrelated weights ≈ √2)
INPUT_SEQUENCES = 32  # calibration sequences whose inputs give s


@dataclass(frozen=True)
class Rescaling:
    """Ŵ' ≈ diag(1/t) W diag(s) (module docstring); float64."""

    s: torch.Tensor  # [in]
    t: torch.Tensor  # [out]

    @classmethod
    def with_input_scale(cls, W: torch.Tensor, w_hat: torch.Tensor, s: torch.Tensor) -> "Rescaling":
        """s given; t by least squares of each row of Ŵ' against the row of W diag(s)."""
        Ws = W.detach().double() * s.double().to(W.device)
        Q = w_hat.detach().double().to(W.device)
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
    """name → Rescaling of each named linear of `student`, whose quantizer rescaled channels (AWQ)."""
    x_float, x_student = input_mean_abs(teacher, calib_ids, names), input_mean_abs(student, calib_ids, names)
    out = {}
    for n in names:
        dead = x_student[n] <= 1e-12 * x_student[n].max()  # a channel that is zero in the student: its s is moot
        s = torch.where(dead, torch.ones_like(x_student[n]), x_float[n] / x_student[n].clamp(min=1e-300))
        W, w_hat = teacher.get_submodule(n).weight, student.get_submodule(n).weight_hat
        out[n] = Rescaling.with_input_scale(W, w_hat, s)
    return out
