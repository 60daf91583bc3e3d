"""Quantizers (RTN, GPTQ, AWQ) producing one quantized-weight record."""

from spear.quant.record import QuantConfig, QuantizedWeight, rtn_quantize

__all__ = ["QuantConfig", "QuantizedWeight", "rtn_quantize"]
