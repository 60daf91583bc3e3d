"""Walk a transformers causal LM one decoder layer at a time.

Quantizers (GPTQ, AWQ) and layer-by-layer calibration keep only one decoder layer's
activations in memory: capture the inputs of layer 0, then for each layer collect
statistics, change the layer, and run it again to produce the next layer's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from spear.errors import SpearError


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers (the ModuleList with num_hidden_layers entries)."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise SpearError(f"cannot find the decoder layers of {type(model).__name__}: unsupported architecture")


def layer_linears(layer: nn.Module) -> dict[str, nn.Module]:
    """Linear layers inside one decoder layer, by their name relative to it, in forward order."""
    from spear.layer import SpearLinear

    return {name: m for name, m in layer.named_modules() if isinstance(m, (nn.Linear, SpearLinear))}


def quantizable_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Every linear layer inside the decoder layers, by its full name (embeddings and lm_head excluded)."""
    layers = decoder_layers(model)
    prefix = next(name for name, m in model.named_modules() if m is layers)
    return {
        f"{prefix}.{i}.{name}": m for i, layer in enumerate(layers) for name, m in layer_linears(layer).items()
    }


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


class _StopForward(Exception):
    pass


@dataclass
class LayerInputs:
    """Hidden states entering a decoder layer, one tensor per calibration batch, plus the
    keyword arguments (attention mask, position embeddings, ...) the layer was called with."""

    hidden: list[torch.Tensor]
    kwargs: list[dict]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, dict]]:
        return iter(zip(self.hidden, self.kwargs))


@torch.no_grad()
def capture_first_layer_inputs(model: nn.Module, batches: list[torch.Tensor]) -> LayerInputs:
    """Run the embedding part of the model on each batch of token ids and stop at layer 0."""
    first = decoder_layers(model)[0]
    hidden, kwargs = [], []

    def grab(_module, args, kw):
        hidden.append(args[0] if args else kw.pop("hidden_states"))
        kwargs.append({k: v for k, v in kw.items() if k != "hidden_states"})
        raise _StopForward

    handle = first.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for ids in batches:
            try:
                model(input_ids=ids.to(model.device), use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
    return LayerInputs(hidden, kwargs)


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs) -> LayerInputs:
    """The layer's outputs on every batch: the next layer's inputs."""
    out = []
    for h, kw in inputs:
        y = layer(h, **kw)
        out.append(y[0] if isinstance(y, tuple) else y)
    return LayerInputs(out, inputs.kwargs)


@torch.no_grad()
def observe_inputs(
    layer: nn.Module, inputs: LayerInputs, observers: list[tuple[nn.Module, Callable[[torch.Tensor], None]]]
) -> None:
    """Run `layer` on every batch; each (module, callback) pair sees the module's input tensor."""
    hooks = [m.register_forward_pre_hook(lambda _m, args, fn=fn: fn(args[0])) for m, fn in observers]
    try:
        for h, kw in inputs:
            layer(h, **kw)
    finally:
        for hook in hooks:
            hook.remove()
