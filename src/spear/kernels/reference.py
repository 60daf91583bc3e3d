"""PyTorch references for the W4A16 kernels: the specification they are tested against.

    y = x · dequant(Q)ᵀ + bias + ec(x),   ec(x) = (alpha·B) (gamma(A x) ⊙ A x),
    gamma(u) = 1 + tanh(W2 silu(W1 u + b1) + b2)
Math in float32 from the fp16 inputs; the result in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spear.kernels.pack import PackedEC, PackedW4, unpack_w4


def dequantize_w4(packed: PackedW4) -> torch.Tensor:
    """W_hat [N, K] in fp16: (q − z) · s per row and group."""
    q = unpack_w4(packed).float()
    g = packed.group_size
    z = packed.zeros.float().repeat_interleave(g, dim=1)
    s = packed.scales.float().repeat_interleave(g, dim=1)
    return ((q - z) * s).half()


def ec_gated_rank_ref(x: torch.Tensor, ec: PackedEC) -> torch.Tensor:
    """g = gamma(A x) ⊙ A x  [M, R], float32."""
    u = x.float() @ ec.A.float().t()
    if not ec.gated:
        return u
    hidden = F.silu(u @ ec.W1.float().t() + ec.b1.float())
    return u * (1 + torch.tanh(hidden @ ec.W2.float().t() + ec.b2.float()))


def w4_linear_ref(
    x: torch.Tensor, packed: PackedW4, ec: PackedEC | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    y = x.float() @ dequantize_w4(packed).float().t()
    if bias is not None:
        y = y + bias.float()
    if ec is not None:
        y = y + ec_gated_rank_ref(x, ec) @ ec.B.float().t()
    return y.to(x.dtype)
