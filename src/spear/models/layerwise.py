"""Walk a transformers causal LM one decoder layer at a time.

Quantizers (GPTQ, AWQ, OmniQuant) and the sensitivity measure keep only one decoder layer's
activations in memory: capture the inputs of layer 0, then for each layer collect
statistics, change the layer, and run it again to produce the next layer's inputs.
Each layer is replayed with its own keyword arguments: models that mix layer kinds
(Gemma-2/3, Cohere-2, Qwen-2 with sliding windows) give sliding-window and global
attention layers different masks and rotary embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
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


def module_name(model: nn.Module, module: nn.Module) -> str:
    """`module`'s name inside `model` (as named_modules gives it): "model.layers" for a Llama's decoder layers."""
    return next(name for name, m in model.named_modules() if m is module)


def layer_linears(layer: nn.Module) -> dict[str, nn.Module]:
    """Linear layers inside one decoder layer, by their name relative to it, in forward order."""
    from spear.layer import SpearLinear

    return {name: m for name, m in layer.named_modules() if isinstance(m, (nn.Linear, SpearLinear))}


def quantizable_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Every linear layer inside the decoder layers, by its full name (embeddings and lm_head excluded)."""
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    return {
        f"{prefix}.{i}.{name}": m for i, layer in enumerate(layers) for name, m in layer_linears(layer).items()
    }


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def final_norm(model: nn.Module) -> nn.Module:
    """The norm applied after the last decoder layer (its output is `last_hidden_state`)."""
    for attr in ("norm", "final_layernorm", "ln_f"):
        module = getattr(model.base_model, attr, None)
        if isinstance(module, nn.Module):
            return module
    raise SpearError(f"cannot find the final norm of {type(model).__name__}: unsupported architecture")


class _StopForward(Exception):
    pass


@dataclass
class LayerInputs:
    """Hidden states entering decoder layer `index`, one tensor per calibration batch, plus the keyword
    arguments (attention mask, position embeddings, ...) the model calls each of its layers with.

    Layers of one kind (sliding-window or global attention, local or global rotary) get the same tensors
    from the model, so `layer_kwargs` holds each distinct mask / embedding once, however many layers use it."""

    hidden: list[torch.Tensor]
    layer_kwargs: list[list[dict]]  # [layer][batch]
    index: int = 0

    @property
    def kwargs(self) -> list[dict]:
        """Layer `index`'s keyword arguments, one dict per batch."""
        return self.layer_kwargs[self.index]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, dict]]:
        return iter(zip(self.hidden, self.kwargs))


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, batches: list[torch.Tensor]) -> LayerInputs:
    """Run the model on each batch of token ids, keeping layer 0's hidden states and every layer's keyword
    arguments (stopping before the last layer runs): the inputs of a walk from layer 0."""
    layers = decoder_layers(model)
    hidden, layer_kwargs = [], [[] for _ in layers]

    def grab(i, _module, args, kw):
        kw = dict(kw)
        h = args[0] if args else kw.pop("hidden_states")
        if i == 0:
            hidden.append(h)
        layer_kwargs[i].append(kw)
        if i == len(layers) - 1:
            raise _StopForward

    handles = [layer.register_forward_pre_hook(partial(grab, i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for ids in batches:
            try:
                model(input_ids=ids.to(model.device), use_cache=False)
            except _StopForward:
                pass
    finally:
        for handle in handles:
            handle.remove()
    if any(len(kw) != len(batches) for kw in layer_kwargs):
        raise SpearError(f"{type(model).__name__} does not call each decoder layer once: unsupported architecture")
    return LayerInputs(hidden, layer_kwargs)


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs) -> LayerInputs:
    """The outputs of `layer` (decoder layer `inputs.index`, or a copy of it) on every batch: the next layer's
    inputs."""
    out = []
    for h, kw in inputs:
        y = layer(h, **kw)
        out.append(y[0] if isinstance(y, tuple) else y)
    return LayerInputs(out, inputs.layer_kwargs, inputs.index + 1)


@torch.no_grad()
def check_replay(model: nn.Module, batches: list[torch.Tensor], last: LayerInputs | None = None) -> None:
    """Raise unless walking the decoder layers one at a time reproduces the model's own final hidden states on
    `batches`; `last`: that walk's outputs of the last layer, when the caller has them already."""
    if last is None:
        last = capture_layer_inputs(model, batches)
        for layer in decoder_layers(model):
            last = run_layer(layer, last)
    norm = final_norm(model)
    for ids, h in zip(batches, last.hidden):
        full = model.base_model(input_ids=ids.to(model.device), use_cache=False).last_hidden_state.float()
        if torch.linalg.norm(full - norm(h).float()) > 1e-2 * torch.linalg.norm(full):  # O(1) if the replay is wrong
            raise SpearError(f"layer-by-layer replay does not reproduce {type(model).__name__}: unsupported "
                             "architecture for GPTQ, AWQ, OmniQuant and the ECs (RTN alone does not walk the layers)")


def check_walkable(model: nn.Module, seq_len: int) -> None:
    """Fail fast, before any work, on a model the walk cannot replay; checked on one random sequence of `seq_len`
    tokens (the calibration's length, so that sliding windows shorter than it are crossed)."""
    vocab = model.get_input_embeddings().num_embeddings
    check_replay(model, [torch.randint(vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))])


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
