"""What a request asks of the engine and what the engine hands back each step.

These two types are the contract between the engine (spear.runtime.engine) and its
callers (the HTTP server, the benchmarks, tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spear.errors import SpearError

MAX_LOGPROBS = 20  # most likely tokens a request may ask for at each position (vLLM's default cap)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # per-request generator; None: the engine's
    stop: tuple[str, ...] = ()  # stop strings; the text returned ends before the first match
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
    # OpenAI's penalties over the tokens generated so far: logit -= presence · [count > 0] + frequency · count
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # each token's log-probability and this many of the most likely; None: none

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SpearError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise SpearError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpearError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpearError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise SpearError(f"seed must fit in 64 bits, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SpearError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability under the model (before temperature, penalties and bias, as vLLM's
    default), and the most likely tokens' at its position, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """One request's progress in one engine step."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)  # tokens sampled this step (0 or 1 in practice)
    new_text: str = ""  # their text, held back while it could still be the start of a stop string
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (this request failed alone)
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for them
