"""A model's skeleton without its weights: modules whose parameters live on the meta device, filled later one
tensor at a time from a checkpoint's shards (accelerate's init_empty_weights, transformers' meta-device loading).

Parameters are created where the module's constructor asks (uninitialised memory, never touched) and moved to
meta at once, so building a 70B skeleton costs nothing; buffers (RoPE's inverse frequencies, computed in the
constructors and not stored in checkpoints) stay real.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def _no_init_weights():
    """transformers' own switch that skips its weight initialisation (0.75 s of SmolLM2's load on meta tensors
    alone), wherever this version keeps it."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the block, every parameter a module registers is moved to the meta device."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def causal_lm_skeleton(config, dtype: torch.dtype) -> nn.Module:
    """transformers' causal LM of `config` with its parameters on meta, its tied weights tied (transformers ties them
    in the initialisation that it skips here)."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta(), _no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    return model


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """Parameters reachable under several names (lm_head.weight = embed_tokens.weight): alias -> first name."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied
