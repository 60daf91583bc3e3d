"""A causal LM split at its head: the last hidden states of its body, and the logits made from some of them, so
that a caller can score a long sequence a chunk of positions at a time and never hold its [tokens, vocab] logits
whole (2048 × 151,936 float32 logits are 1.2 GB)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def last_hidden(model: nn.Module, ids: torch.Tensor, layers: bool = False) -> tuple[torch.Tensor, tuple]:
    """(last hidden states after the final norm [B·L, H], logits = head(hidden); the outputs of decoder
    layers 1..n−1 when `layers`, else ())."""
    out = model.base_model(input_ids=ids, use_cache=False, output_hidden_states=layers)
    return out.last_hidden_state.flatten(0, 1), tuple(out.hidden_states[1:-1]) if layers else ()


def logits_of(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The model's logits from its last hidden states: the head (in its own dtype: float32 for a bfloat16 student),
    then the final soft-capping of the families that have one (Gemma 2: cap · tanh(logits / cap)), as the model's
    own forward computes them."""
    head = model.get_output_embeddings()
    logits = head(h.to(head.weight.dtype))
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if not cap else cap * torch.tanh(logits / cap)


def position_chunks(n: int, size: int) -> Iterator[slice]:
    """Slices of `size` positions (the last one shorter) covering 0..n−1: the pieces logits are made in."""
    return (slice(i, min(i + size, n)) for i in range(0, n, size))
