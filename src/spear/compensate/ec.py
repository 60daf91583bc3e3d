"""The error compensator (EC): a low-rank correction with a per-token gate in rank space.

    ec(x) = alpha * B (gamma(A x) ⊙ A x),     gamma(u) = 1 + tanh(MLP(u))

A: r×in, B: out×r, MLP: r → h → r with its last layer zero-initialised, so gamma ≡ 1 at
the start and the EC begins as the static correction alpha * B A x. With `gated=False`
the gate is absent and the EC *is* a static low-rank correction (LoRC / LQER / QERA).
"""

from __future__ import annotations

import torch
from torch import nn


class ErrorCompensator(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, gate_hidden: int = 0, alpha: float = 1.0):
        super().__init__()
        self.rank = rank
        self.A = nn.Parameter(torch.zeros(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        self.alpha = nn.Parameter(torch.tensor(float(alpha)))
        self.gate: nn.Sequential | None = None
        if gate_hidden > 0:
            self.gate = nn.Sequential(nn.Linear(rank, gate_hidden), nn.SiLU(), nn.Linear(gate_hidden, rank))
            nn.init.zeros_(self.gate[2].weight)
            nn.init.zeros_(self.gate[2].bias)

    @property
    def gate_hidden(self) -> int:
        return 0 if self.gate is None else self.gate[0].out_features

    def gamma(self, u: torch.Tensor) -> torch.Tensor:
        """The gate gamma(u) = 1 + tanh(MLP(u)) for rank-space activations u [..., r] (ones without a gate)."""
        if self.gate is None:
            return torch.ones_like(u)
        return 1 + torch.tanh(self.gate.to(u.dtype)(u))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x @ self.A.to(x.dtype).t()  # [..., r]
        if self.gate is not None:
            u = u * self.gamma(u)  # gamma(u) ⊙ u
        return self.alpha.to(x.dtype) * (u @ self.B.to(x.dtype).t())

    def nbytes(self, bytes_per_param: int = 2) -> int:
        """Bytes as served in fp16: A, B, the gate MLP and alpha."""
        return sum(p.numel() for p in self.parameters()) * bytes_per_param
