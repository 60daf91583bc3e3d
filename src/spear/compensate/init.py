"""Closed-form low-rank initialisations of the quantization error E = W − Ŵ (out×in).

Each method minimises a weighted Frobenius error over rank-r products BA:

    min_{rank(BA) ≤ r} ‖(E − BA) M‖_F
    LoRC       M = I                       plain truncated SVD of E
    LQER       M = diag(s),  s = E|x|      normalised s / sqrt(min s · max s)   (LQER, Zhang et al. 2024)
    QERA/EoRA  M = R_xx^{1/2}, R_xx = E[x xᵀ]: ‖(E − BA) R^{1/2}‖_F² = E_x ‖(E − BA) x‖²   (QERA, eq. 9)

With E M = U Σ Vᵀ, Eckart–Young gives BA = U_r Σ_r V_rᵀ M⁻¹ = U_r U_rᵀ E (since Vᵀ = Σ⁻¹ Uᵀ E M).
The second form needs no inverse of M, so near-singular R_xx is harmless. The split is
balanced in the weighted space: B = U_r Σ_r^{1/2}, A = Σ_r^{-1/2} U_rᵀ E, so A M = Σ_r^{1/2} V_rᵀ
and the rank-space activations A x have second moment Σ_r under QERA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spear.compensate.stats import InputStats
from spear.errors import SpearError
from spear.layer import ErrorCompensator, SpearLinear

KINDS = ("lorc", "lqer", "qera")
LQER_SCALE_MIN = 1e-4  # clamp of E|x| before normalising, as in the LQER reference code


def lorc_init(E: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD of E."""
    return _weighted_lowrank(E, None, rank)


def lqer_init(E: torch.Tensor, rank: int, mean_abs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SVD of E diag(s), s = E|x| normalised to s / sqrt(min s · max s); A = Σ^{1/2} V_rᵀ diag(s)⁻¹."""
    s = mean_abs.double().clamp(min=LQER_SCALE_MIN)
    s = s / torch.sqrt(s.min() * s.max())
    return _weighted_lowrank(E, torch.diag(s), rank)


def qera_init(E: torch.Tensor, rank: int, r_xx_sqrt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SVD of E R_xx^{1/2}: the minimiser of E_x ‖(E − BA) x‖² over rank r."""
    return _weighted_lowrank(E, r_xx_sqrt, rank)


# A tall whitened error above this many elements takes its SVD through its Gram matrix (_tall_svd): an 8B model's
# gate/up projections (14,336 × 4,096) would otherwise spend minutes in the GPU solver's SVD, 64 times over
GRAM_ABOVE_ELEMENTS = 1 << 24


def _tall_svd(M: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(U_r [out, ≤ rank], Σ [in]) of a tall M [out, in] from the eigh of Mᵀ M = V Σ² Vᵀ: U_r = M V_r Σ_r⁻¹, the
    same as the SVD's up to the signs of its columns (float64; directions with no error left get a zero column)."""
    G = M.t() @ M
    lam, V = torch.linalg.eigh((G + G.t()) / 2)
    S = lam.flip(0).clamp(min=0).sqrt()
    V_r, S_r = V.flip(1)[:, :rank], S[:rank]
    inv = torch.where(S_r > S[0] * 1e-10, 1 / S_r.clamp(min=1e-300), torch.zeros_like(S_r))
    return (M @ V_r) * inv, S


@dataclass
class WhitenedError:
    """The SVD of one module's whitened error E R_xx^{1/2} = U Σ Vᵀ, kept to `max_rank` left vectors.

    Rank r of the QERA form removes Σ_{i≤r} σ²_i of E_x ‖E x‖² = Σ_i σ²_i (the planner's gain per rank
    step), and its factors need only U_r and Σ_r (module docstring), so one SVD serves both."""

    U: torch.Tensor  # [out, ≤ max_rank] float64
    S: torch.Tensor  # [min(out, in)] float64, descending

    @classmethod
    def of(cls, W: torch.Tensor, W_hat: torch.Tensor, stats: InputStats, max_rank: int) -> "WhitenedError":
        E = W.detach().double() - W_hat.detach().double()
        if E.shape[0] <= E.shape[1]:
            # U Σ² Uᵀ = (E R^{1/2})(E R^{1/2})ᵀ = E R_xx Eᵀ, [out×out]: no square root of the (larger) R_xx, and an
            # eigh of the smaller side (down_proj: 576² instead of a 1536² square root, ~10× less on a CPU)
            G = E @ stats.r_xx.to(E.device) @ E.t()
            lam, Q = torch.linalg.eigh((G + G.t()) / 2)
            S, U = lam.flip(0).clamp(min=0).sqrt(), Q.flip(1)
        else:
            M = E @ stats.r_xx_sqrt().to(E.device)  # [out, in], out > in
            if M.numel() <= GRAM_ABOVE_ELEMENTS:
                U, S, _ = torch.linalg.svd(M, full_matrices=False)
            else:
                U, S = _tall_svd(M, max_rank)
        return cls(U[:, :max_rank].contiguous(), S)

    @property
    def spectrum(self) -> torch.Tensor:
        """σ²_i, descending."""
        return self.S.square()

    def factors(self, W: torch.Tensor, W_hat: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """QERA's (A, B) at `rank` ≤ the kept vectors, equal to qera_init's."""
        if rank > self.U.shape[1]:
            raise SpearError(f"rank {rank} needs more than the {self.U.shape[1]} singular vectors kept")
        E = W.detach().double() - W_hat.detach().double()
        return _factors(E, self.U[:, :rank], self.S[:rank])


def _weighted_lowrank(E: torch.Tensor, M: torch.Tensor | None, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r×in], B [out×r]) float32 with BA = U_r U_rᵀ E, E M = U Σ Vᵀ (module docstring)."""
    out_f, in_f = E.shape
    if not 1 <= rank <= min(out_f, in_f):
        raise SpearError(f"EC rank {rank} is impossible for a {out_f}×{in_f} layer; use 1..{min(out_f, in_f)}")
    E = E.double()
    EM = E if M is None else E @ M.to(E.device)
    U, S, _ = torch.linalg.svd(EM, full_matrices=False)
    return _factors(E, U[:, :rank], S[:rank])


def _factors(E: torch.Tensor, U: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """B = U_r Σ_r^{1/2}, A = Σ_r^{-1/2} U_rᵀ E (float32), from the weighted SVD's leading U_r, Σ_r."""
    keep = S > S[0] * 1e-10  # directions with no error left get zero A row and B column
    inv_sqrt = torch.where(keep, S.clamp(min=1e-300).rsqrt(), torch.zeros_like(S))
    B = U * torch.where(keep, S.sqrt(), torch.zeros_like(S))  # U_r Σ_r^{1/2}
    A = inv_sqrt[:, None] * (U.t() @ E)  # Σ_r^{-1/2} U_rᵀ E
    return A.float(), B.float()


def init_ec(
    kind: str, W: torch.Tensor, W_hat: torch.Tensor, rank: int, stats: InputStats | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r×in], B [out×r]) float32 with BA ≈ W − Ŵ; `lqer` and `qera` need the layer's input stats."""
    E = W.detach().double() - W_hat.detach().double()
    if kind == "lorc":
        return lorc_init(E, rank)
    if kind not in KINDS:
        raise SpearError(f"unknown EC init {kind!r}; choose one of {', '.join(KINDS)}")
    if stats is None:
        raise SpearError(f"EC init {kind!r} needs input statistics of the layer (collect_input_stats)")
    if kind == "lqer":
        return lqer_init(E, rank, stats.mean_abs.to(E.device))
    return qera_init(E, rank, stats.r_xx_sqrt().to(E.device))


def attach_ec(layer: SpearLinear, A: torch.Tensor, B: torch.Tensor, gate_hidden: int = 0,
              factor_bits: int = 16) -> ErrorCompensator:
    """Give `layer` an EC with these factors (gate, if any, starts at gamma ≡ 1), stored in `factor_bits`; returns
    the EC."""
    rank = A.shape[0]
    if A.shape != (rank, layer.in_features) or B.shape != (layer.out_features, rank):
        raise SpearError(
            f"EC factors A {tuple(A.shape)}, B {tuple(B.shape)} do not fit a "
            f"{layer.out_features}×{layer.in_features} layer (need r×in and out×r)"
        )
    w = layer.weight_hat
    ec = ErrorCompensator(layer.in_features, layer.out_features, rank, gate_hidden, factor_bits=factor_bits)
    ec = ec.to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        ec.A.copy_(A)
        ec.B.copy_(B)
    layer.ec = ec
    return ec
