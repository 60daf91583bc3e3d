"""Scheduling policy: how many prompt tokens each engine step may prefill beside its decodes.

The engine decodes one token for every running sequence each step (decodes never wait)
and asks the policy for the prefill budget of the step; any object with this method
plugs in, e.g. the SLO-aware policy (spear.runtime.slo) that reads profiled latency tables.
A policy that also has `observe(stats)` gets each finished step's StepStats (measured time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from spear.errors import SpearError


class SchedulerPolicy(Protocol):
    def prefill_budget(self, num_decodes: int, decode_context_tokens: int, waiting_prompt_tokens: int) -> int:
        """Prompt tokens to prefill this step.

        num_decodes: sequences decoding one token this step; decode_context_tokens: their
        context lengths summed (attention cost); waiting_prompt_tokens: prompt tokens not yet prefilled.
        """


@dataclass(frozen=True)
class StaticChunkPolicy:
    """A fixed prefill chunk per step, whatever the decode load."""

    chunk_tokens: int = 512

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise SpearError(f"the prefill chunk must be at least 1 token, got {self.chunk_tokens}")

    def prefill_budget(self, num_decodes: int, decode_context_tokens: int, waiting_prompt_tokens: int) -> int:
        return self.chunk_tokens
