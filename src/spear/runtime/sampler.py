"""Choosing each sequence's next token: greedy, or temperature with top-k and top-p, per-request generators."""

from __future__ import annotations

import torch

from spear.nucleus import top_k_top_p
from spear.runtime.requests import SamplingParams

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (as vLLM): logits / 1e-40 overflow to inf


def adjust_logits(logits: torch.Tensor, params: SamplingParams, generated: torch.Tensor) -> None:
    """Apply one row's logit bias and OpenAI presence / frequency penalties, in place: logits [V] (float32),
    generated [n] the ids it has generated so far (on the logits' device)."""
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        logits[torch.tensor(ids, device=logits.device)] += torch.tensor(bias, device=logits.device)
    if (params.presence_penalty or params.frequency_penalty) and generated.numel():
        counts = torch.bincount(generated, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
                  generated: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """One token per row of logits [B, V] (rows with temperature below GREEDY_BELOW greedy), as a [B] int64 tensor
    on the logits' device, without waiting for it (no host sync). Rows whose params adjust their logits (bias,
    penalties) need their generated ids in `generated`; `logits` itself is left as it is."""
    adjusted = [i for i, p in enumerate(params) if p.adjusts_logits]
    if adjusted:
        logits = logits.float().clone()
        for i in adjusted:
            adjust_logits(logits[i], params[i], generated[i])
    rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
    if not rows:  # all greedy: argmax over the logits as they are (no float32 copy)
        return logits.argmax(dim=-1)
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    device = logits.device
    sub = logits[rows] / torch.tensor([params[i].temperature for i in rows], device=device)[:, None]
    vocab = logits.shape[-1]
    sub = top_k_top_p(sub, torch.tensor([min(params[i].top_k, vocab) for i in rows], device=device),
                      torch.tensor([params[i].top_p for i in rows], device=device))
    probs = sub.softmax(dim=-1)
    for j, i in enumerate(rows):
        tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return tokens
