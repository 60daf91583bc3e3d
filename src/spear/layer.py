"""The one shared abstraction: a linear layer with a quantized weight and an optional EC.

    y = dequant(Q) x + bias + alpha * B (gamma(A x) ⊙ A x)

This module is the PyTorch reference backend (the specification). It keeps the
dequantized weight as a non-persistent buffer in the compute dtype, so forward is one
matmul plus the EC branch; the codes, scales and zeros stay the source of truth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spear.compensate.ec import ErrorCompensator
from spear.quant.record import QuantizedWeight


class SpearLinear(nn.Module):
    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.bits = qweight.bits
        self.group_size = qweight.group_size
        self.register_buffer("codes", qweight.codes)
        self.register_buffer("scales", qweight.scales)
        self.register_buffer("zeros", qweight.zeros)
        self.register_buffer("weight_hat", qweight.dequantize(dtype), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.ec: ErrorCompensator | None = None

    @property
    def qweight(self) -> QuantizedWeight:
        return QuantizedWeight(self.codes, self.scales, self.zeros, self.bits, self.group_size)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, so code that reads `.weight` (dtype, device, shape) keeps working."""
        return self.weight_hat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight_hat.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if self.ec is not None:
            y = y + self.ec(x)
        return y

    def extra_repr(self) -> str:
        ec = "none" if self.ec is None else f"rank={self.ec.rank}, gate_hidden={self.ec.gate_hidden}"
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group={self.group_size}, ec={ec}"
