"""Quantize every linear layer of a model's decoder stack, in place, with RTN, GPTQ, AWQ or OmniQuant (LWC).

The float nn.Linear modules are replaced by SpearLinear (spear.layer) holding the
quantized-weight record. GPTQ, AWQ and OmniQuant go layer by layer so memory stays one layer deep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.errors import SpearError
from spear.layer import SpearLinear
from spear.models.layerwise import quantizable_linears, set_module
from spear.models.plain_skeleton import FAMILIES
from spear.record import QuantConfig, QuantizedWeight, rtn_quantize

METHODS = ("rtn", "gptq", "awq", "omniquant")


@dataclass(frozen=True)
class QuantSettings:
    method: str = "rtn"
    quant: QuantConfig = QuantConfig()
    gptq_damp: float = 0.01  # dampening, fraction of mean diag(H)
    gptq_block_size: int = 128
    # sweep columns by decreasing diag(H) (static groups); on SmolLM2-135M W4 with self-sampled
    # calibration it turns GPTQ from about-RTN into a clear win (docstring of spear.quant.gptq)
    gptq_act_order: bool = True
    awq_grid: int = 20  # number of alpha values in [0, 1) searched per scaled group
    omniquant_epochs: int = 20  # passes over the calibration set per decoder layer (the reference's 20)
    omniquant_lr: float = 1e-2  # AdamW on the clipping logits (the reference's lwc_lr)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpearError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")


def replace_with_quantized(model: nn.Module, name: str, qweight: QuantizedWeight) -> SpearLinear:
    old = model.get_submodule(name)
    new = SpearLinear(qweight, old.bias, dtype=old.weight.dtype).to(old.weight.device)
    set_module(model, name, new)
    return new


def check_shapes(model: nn.Module, cfg: QuantConfig) -> None:
    """Fail fast, before any work, on a model with nothing to quantize or a group size that does not divide some
    input size."""
    linears = quantizable_linears(model)
    if not linears:
        conv = any(type(m).__name__ == "Conv1D" for m in model.modules())
        why = " (its projections are transformers' Conv1D, GPT-2's layout)" if conv else ""
        raise SpearError(f"{type(model).__name__} has no linear layers in its decoder layers{why}: nothing to "
                         "quantize. SPEAR quantizes decoder layers of nn.Linear (Llama, Mistral, Qwen, Phi-3, Gemma "
                         f"and most current families) and serves {', '.join(FAMILIES)}")
    for m in linears.values():
        cfg.group_size_for(m.in_features)


@torch.no_grad()
def quantize_model(model: nn.Module, settings: QuantSettings, calib_ids: torch.Tensor | None = None) -> dict[str, QuantizedWeight]:
    """Quantize `model` in place; return the records by module name. GPTQ, AWQ and OmniQuant need calib_ids.
    The model's other floating tensors end rounded to the artifact's 16 bits (artifact.round_as_stored)."""
    from spear.artifact import round_as_stored

    check_shapes(model, settings.quant)
    if settings.method == "rtn":
        records = {}
        for name, linear in tqdm(quantizable_linears(model).items(), desc="RTN", unit="layer"):
            records[name] = rtn_quantize(linear.weight, settings.quant)
            replace_with_quantized(model, name, records[name])
    elif calib_ids is None:
        raise SpearError(f"{settings.method} needs calibration data")
    elif settings.method == "gptq":
        from spear.quant.gptq import gptq_quantize_model

        records = gptq_quantize_model(model, settings, calib_ids)
    elif settings.method == "omniquant":
        from spear.quant.omniquant import omniquant_quantize_model

        records = omniquant_quantize_model(model, settings, calib_ids)
    else:
        from spear.quant.awq import awq_quantize_model

        records = awq_quantize_model(model, settings, calib_ids)
    round_as_stored(model)
    return records
