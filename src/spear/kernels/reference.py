"""PyTorch references for the W4A16 kernels: the specification they are tested against.

    y = x · dequant(Q)ᵀ + bias + ec(x),   ec(x) = (alpha·B) (gamma(A x) ⊙ A x),
    gamma(u) = 1 + tanh(W2 silu(W1 u + b1) + b2)
Math in float32 from the fp16 inputs (an int8 EC's factors dequantized as the kernels do: PackedEC.dense_A,
dense_B); the result in x's dtype. And the row-parallel layers' epilogue after tensor
parallelism's reduction (kernels.ec_epilogue), which CPU ranks run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spear.kernels.pack import PackedEC, PackedW4, dequantize_factor, unpack_w4


def dequantize_w4(packed: PackedW4) -> torch.Tensor:
    """W_hat [N, K] in fp16: (q − z) · s per row and group."""
    q = unpack_w4(packed).float()
    g = packed.group_size
    z = packed.zeros.float().repeat_interleave(g, dim=1)
    s = packed.scales.float().repeat_interleave(g, dim=1)
    return ((q - z) * s).half()


def ec_gated_rank_ref(x: torch.Tensor, ec: PackedEC) -> torch.Tensor:
    """g = gamma(A x) ⊙ A x  [M, R], float32."""
    u = x.float() @ ec.dense_A().float().t()
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
        y = y + ec_gated_rank_ref(x, ec) @ ec.dense_B().float().t()
    return y.to(x.dtype)


def ec_epilogue_ref(y: torch.Tensor, u: torch.Tensor | None, B: torch.Tensor | None, W1: torch.Tensor | None = None,
                    b1: torch.Tensor | None = None, W2: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                    b_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The EC epilogue y + bias + (alpha·B)(gamma(u) ⊙ u) on reduced partials: y [M, N], u [M, r] (None: no EC),
    B [N, r] (alpha folded in; int8 codes with `b_scale` [r], alpha folded into it, as the kernel dequantizes them:
    dequantize_factor), gate W1 [h, r], b1 [h], W2 [r, h], b2 [r], bias [N]; the result in `dtype` (default y's)."""
    out = y.float()
    if bias is not None:
        out = out + bias.float()
    if u is not None:
        g = u.float()
        if W1 is not None:
            hidden = F.silu(g @ W1.float().t() + b1.float())
            g = g * (1 + torch.tanh(hidden @ W2.float().t() + b2.float()))
        out = out + g @ (B if b_scale is None else dequantize_factor(B, b_scale, 0)).float().t()
    return out.to(dtype or y.dtype)
