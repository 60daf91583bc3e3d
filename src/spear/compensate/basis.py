"""A quantized linear read in its float model's basis, for quantizers that rescale channels (AWQ).

AWQ folds per-channel scales into the op before a linear (eq. 4 of AWQ: y = Q(W diag(s)) (x / s)), and, where that
op is a linear itself (AWQ's v→o and up→down pairs), into that linear's output rows. So the student's weight is

    Ŵ' ≈ diag(1/t) W diag(s)        x' = x / s (its input),  y' = y / t (its output)

and comparing Ŵ' with the float W directly measures the rescaling, not the rounding. Sensitivity and the
closed-form EC inits therefore use Ŵ = diag(t) Ŵ' diag(1/s), and the factors they give in the float basis map
back to the student as

    A' = A diag(s)   (A' x' = A x: the gate sees the same u)      B' = diag(1/t) B.

Checkpoints do not store AWQ's scales; they are read back along AWQ's own scale groups (quant.awq.scale_groups):
- after a norm (q, k, v; gate, up): s = the float norm's weight / the student's (fold_scale divided it by s): exact;
- the op before a rescaled linear (v under multi-head attention, up): t = its consumer's s, by least squares over
  each of its rows given its own s (a row has ~in nonzero entries: its largest sets its scale);
- after a linear (o, down): s by least squares over each column given t = 1; a column rounded to zero in every
  row takes its s from the rows of the op before.
Both fits regress Ŵ' on W over Ŵ''s nonzero entries (an entry rounded to zero says only that it is small; noise in
Ŵ' leaves the slope unbiased, where regressing W on Ŵ' would shrink it by the rounding noise). Each column or row
is fitted on its own: on a massive-activation channel a joint fit's error of even 1% would dominate the module.
A generic fit of (s, t) to the weights alone (alternating least squares) was tried first: on SmolLM2 W4 AWQ it put
one down_proj column 18× off and made that module's damage 100× every other's, and SPEAR then hurt (−25% of the gap).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spear.errors import SpearError
from spear.models.layerwise import decoder_layers, quantizable_linears

MISMATCH_ERROR = 1.2  # ‖Ŵ − W‖ / ‖W‖ of no quantization (even Ŵ = 0 gives 1; unrelated weights ≈ √2)
MIN_NONZERO = 2  # nonzero entries a column needs for its s to come from its own weights


@dataclass(frozen=True)
class Rescaling:
    """Ŵ' ≈ diag(1/t) W diag(s) (module docstring); float64."""

    s: torch.Tensor  # [in]
    t: torch.Tensor  # [out]

    def to_float_basis(self, w_hat: torch.Tensor) -> torch.Tensor:
        """Ŵ = diag(t) Ŵ' diag(1/s), in w_hat's dtype."""
        t, s = self.t.to(w_hat.device), self.s.to(w_hat.device)
        return (t[:, None] * w_hat.double() / s[None, :]).to(w_hat.dtype)

    def to_student(self, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(A diag(s), diag(1/t) B): factors fitted in the float basis, for the rescaled linear."""
        t, s = self.t.to(A.device), self.s.to(A.device)
        return (A.double() * s[None, :]).to(A.dtype), (B.double() / t[:, None]).to(B.dtype)


def row_scales(W: torch.Tensor, w_hat: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """t [out] of Ŵ' ≈ diag(1/t) W diag(s) given s: least squares of each row over Ŵ''s nonzero entries."""
    Q = w_hat.detach().double().to(W.device)
    Ws = torch.where(Q != 0, W.detach().double() * s.double().to(W.device), torch.zeros_like(Q))
    u = (Q * Ws).sum(1) / Ws.square().sum(1).clamp(min=1e-300)
    return 1 / torch.where(u > 1e-12, u, torch.ones_like(u))  # an all-zero row says nothing of its scale


def column_scales(W: torch.Tensor, w_hat: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """s [in] of Ŵ' ≈ W diag(s) (t = 1): least squares of each column over Ŵ''s nonzero entries; `fallback` for
    columns with fewer than MIN_NONZERO of them."""
    Q = w_hat.detach().double().to(W.device)
    Wn = torch.where(Q != 0, W.detach().double(), torch.zeros_like(Q))
    s = (Q * Wn).sum(0) / Wn.square().sum(0).clamp(min=1e-300)
    seen = ((Q != 0).sum(0) >= MIN_NONZERO) & (s > 1e-12)
    return torch.where(seen, s, fallback.double().to(W.device))


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
def read_awq_rescalings(teacher: nn.Module, student: nn.Module) -> dict[str, Rescaling]:
    """Full name → Rescaling of every decoder linear of an AWQ `student` of the float `teacher` (module docstring)."""
    from spear.quant.awq import scale_groups

    full_names = {id(m): n for n, m in quantizable_linears(teacher).items()}
    out = {}
    for layer_f, layer_q in zip(decoder_layers(teacher), decoder_layers(student)):
        names = {id(m): n for n, m in layer_f.named_modules()}
        s, t = {}, {}  # by name within the layer
        for group in scale_groups(layer_f):  # norms' groups before the linears they feed: s of `prev` is known
            prev = names[id(group.prev)]
            float_prev, student_prev = layer_f.get_submodule(prev), layer_q.get_submodule(prev)
            if isinstance(float_prev, nn.Linear):  # its rows were divided by the group's s
                t[prev] = row_scales(float_prev.weight, student_prev.weight_hat, s[prev])
                for linear in group.linears:
                    n = names[id(linear)]
                    s[n] = column_scales(linear.weight, layer_q.get_submodule(n).weight_hat, fallback=t[prev])
            else:
                folded = student_prev.weight.double()
                ratio = torch.where(folded != 0, float_prev.weight.double() / folded, torch.ones_like(folded))
                s.update({names[id(linear)]: ratio for linear in group.linears})
        for n, scale in s.items():
            linear = layer_f.get_submodule(n)
            out[full_names[id(linear)]] = Rescaling(scale, t.get(n, torch.ones(linear.out_features, dtype=torch.float64,
                                                                                device=scale.device)))
    return out


def weights_in_float_basis(teacher: nn.Module, student: nn.Module, layers: dict[str, nn.Module],
                           rescaled: bool) -> tuple[dict[str, Rescaling], dict[str, torch.Tensor]]:
    """(name → Rescaling of the rescaled ones, name → Ŵ in the float basis) of the student's quantized `layers`
    (name → SpearLinear); `rescaled`: the student is AWQ's. SpearError where a Ŵ is no quantization of its W."""
    rescalings = read_awq_rescalings(teacher, student) if rescaled else {}
    w_hat = {n: rescalings[n].to_float_basis(m.weight_hat) if n in rescalings else m.weight_hat
             for n, m in layers.items()}
    for n, w in w_hat.items():
        check_quantization_of(n, teacher.get_submodule(n).weight, w)
    return rescalings, w_hat
