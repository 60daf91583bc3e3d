"""Quantizers (RTN, GPTQ, AWQ) producing one quantized-weight record (spear.record)."""
