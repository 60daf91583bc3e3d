"""The one shared abstraction: a linear layer with a quantized weight and an optional EC.

    y = dequant(Q) x + bias + alpha * B (gamma(A x) ⊙ A x)

The PyTorch backend (the specification) keeps the dequantized weight as a non-persistent
buffer in the compute dtype, so forward is one matmul plus the EC branch; the codes, scales
and zeros stay the source of truth. For inference on CUDA, `use_kernels()` packs the weight
(and a snapshot of the EC) for the Triton W4A16 kernels (spear.kernels.w4): fp16 inputs
then take the kernels, with the decode or prefill path picked by the number of rows.
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
        self.register_buffer("g_idx", qweight.g_idx)  # None (not in the state dict) unless imported
        self.register_buffer("offsets", qweight.offsets)
        self.register_buffer("weight_hat", qweight.dequantize(dtype), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.ec: ErrorCompensator | None = None
        self.packed = None  # PackedW4 once use_kernels() ran
        self.packed_ec = None  # PackedEC snapshot of self.ec, likewise

    @property
    def qweight(self) -> QuantizedWeight:
        return QuantizedWeight(self.codes, self.scales, self.zeros, self.bits, self.group_size, self.g_idx,
                               self.offsets)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, so code that reads `.weight` (dtype, device, shape) keeps working."""
        return self.weight_hat

    def use_kernels(self, drop_dense: bool = False) -> bool:
        """Pack for the Triton kernels (inference: the EC is snapshotted, so call it after calibration).

        Returns False, changing nothing, where the kernels do not apply (not 4-bit, sizes not
        multiples of 64, an unsupported group size). With `drop_dense` the dequantized weight
        is freed; forward then needs CUDA fp16 inputs.
        """
        from spear.errors import SpearError
        from spear.kernels.pack import pack_ec, pack_w4

        try:
            self.packed = pack_w4(self.qweight)
        except SpearError:
            return False
        self.packed_ec = None if self.ec is None else pack_ec(self.ec)
        if drop_dense:
            self.weight_hat = torch.empty(0, dtype=self.weight_hat.dtype, device=self.weight_hat.device)
        return True

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.packed is not None:  # follow .to(device); the packed dtypes are fixed
            device = self.codes.device
            self.packed = self.packed.to(device)
            self.packed_ec = None if self.packed_ec is None else self.packed_ec.to(device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.is_cuda and x.dtype == torch.float16:
            from spear.kernels.w4 import w4_linear

            return w4_linear(x, self.packed, self.packed_ec, None if self.bias is None else self.bias.half())
        y = F.linear(x, self.weight_hat.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if self.ec is not None:
            y = y + self.ec(x)
        return y

    def extra_repr(self) -> str:
        ec = "none" if self.ec is None else f"rank={self.ec.rank}, gate_hidden={self.ec.gate_hidden}"
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group={self.group_size}, ec={ec}"
