"""An RMSNorm folded into the W4 decode launches on either side of it (FoldedNorm; kernels.w4: w4_decode_add_norm
makes one, w4_decode's `rms` takes one; runtime.model folds the norms between o and gate/up and between down and the
next layer's q/k/v on decode steps). Kept apart from the kernels so that the runtime model can name it without
Triton."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FoldedNorm:
    """An RMSNorm folded into the W4 decode launches on either side of it (w4_decode_add_norm makes one, w4_decode's
    `rms` takes one): the producer's epilogue forms the residual stream h = y + residual, hw = h ⊙ w_norm and each
    output tile's Σ h² per row; the consumer multiplies hw and scales its rows by rstd = 1 / sqrt(mean(h²) + eps),
    since norm(h) Wᵀ = rstd ⊙ (hw Wᵀ) (and u = A norm(h) = rstd ⊙ A hw before the EC's gate). One launch of
    add + RMSNorm fewer, at the cost of the rounding of hw instead of norm(h)."""

    h: torch.Tensor  # [M, K] fp16: the residual stream after the add
    hw: torch.Tensor  # [M, K] fp16: h ⊙ w_norm, the consumer's x
    ssq: torch.Tensor  # [M, P] float32: Σ h² over the producer's P output tiles
    eps: float
