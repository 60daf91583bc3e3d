"""The top-k / top-p nucleus, shared by the calibration sampler (spear.data) and the serving sampler
(spear.runtime), which may not import each other."""

from __future__ import annotations

import torch


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with every token outside each row's top-k and top-p nucleus set to -inf (k = 0: no top-k)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    k = torch.where(top_k > 0, top_k, logits.shape[-1])
    sorted_logits = sorted_logits.masked_fill(rank[None] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    outside = probs.cumsum(dim=-1) - probs >= top_p[:, None]  # mass before this token already reaches top_p
    outside[:, 0] = False  # the most likely token always stays (top_p 1e-50 rounds to 0 in float32)
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
