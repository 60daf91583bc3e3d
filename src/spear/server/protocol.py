"""The OpenAI-compatible request bodies (validated by pydantic) and the response objects."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from spear.errors import SpearError
from spear.runtime.requests import MAX_LOGPROBS, RequestOutput, SamplingParams, TokenLogprobs


MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
SEED_RANGE = (-(2**63), 2**64 - 1)  # what a torch.Generator takes
MAX_LOGIT_BIAS = 300  # entries
MAX_TOKEN_ID_DIGITS = 10  # a logit_bias key; int() of a 5,000-digit one raises


def _valid_unicode(text: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"), which no tokenizer can encode: refuse them here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {e.start}") from None
    return text


def _nonempty_stop(text: str) -> str:
    if not 0 < len(text) <= MAX_STOP_CHARS:
        raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
StopString = Annotated[Text, AfterValidator(_nonempty_stop)]

# OpenAI parameters this server does not implement, with the values that leave them off: those are accepted (a
# client may send its defaults), anything else is a 400 naming the parameter.
NEUTRAL_VALUES: dict[str, tuple] = {
    "repetition_penalty": (1,),  # vLLM's extension
    "best_of": (1,),
    "suffix": ("",),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "store": (False,),
    "service_tier": ("auto", "default"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """The fields completions and chat share. Unknown fields are an error, not silently ignored; values are not
    coerced ("temperature": false, "max_tokens": "5" are 400s, as the schema says)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extension; 0 or -1: off (any k ≥ the vocabulary is off too)
    n: Literal[1] = 1  # one choice per request
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # not implemented: NEUTRAL_VALUES
    repetition_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator(*[k for k in NEUTRAL_VALUES if k not in ("best_of", "suffix")])
    @classmethod
    def _only_neutral(cls, value: Any, info: ValidationInfo) -> Any:
        return _neutral(value, info)

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            # the vocabulary's size is checked with the tokenizer (OpenAIServing._sampling_params)
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
                raise ValueError(f"its keys are token ids (at most {MAX_TOKEN_ID_DIGITS} digits), got {key[:20]!r}"
                                 f"{'…' if len(key) > 20 else ''}")
        return value

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
            seed=self.seed, stop=stop, stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            logprobs=self.requested_logprobs,
        )

    @property
    def requested_logprobs(self) -> int | None:
        """Top tokens to report at each position (0: the sampled token's alone); None: no log-probabilities."""
        raise NotImplementedError

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _neutral(value: Any, info: ValidationInfo) -> Any:
    neutral = NEUTRAL_VALUES[info.field_name]
    if value is not None and value not in neutral:
        shown = " or ".join(repr(n) for n in neutral)
        raise ValueError(f"is not supported by this server (send null or {shown})")
    return value


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[int]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None  # the prompt's text before the completion's
    best_of: int | None = None
    suffix: Text | None = None

    @field_validator("echo")
    @classmethod
    def _no_prompt_logprobs(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("logprobs") is not None:
            raise ValueError("with logprobs it would need the prompt's log-probabilities, which this server does "
                             "not compute; send one or the other")
        return value

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        """OpenAI also takes a list of prompts (a batch); a list of one is that prompt."""
        if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
            if len(value) > 1:
                raise ValueError(f"batch prompts (a list of {len(value)}) are not supported; send one request a prompt")
            return value[0]
        return value

    @field_validator("best_of", "suffix")
    @classmethod
    def _only_neutral_here(cls, value: Any, info: ValidationInfo) -> Any:
        return _neutral(value, info)


class TextPart(BaseModel):
    """One part of a message's content in OpenAI's list form."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[TextPart]  # a list of text parts is joined with newlines, as vLLM does
    name: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            kinds = sorted({str(part.get("type")) for part in value if isinstance(part, dict)} - {"text"})
            if kinds:
                raise ValueError(f"content parts of type {', '.join(kinds)} are not supported: this server takes "
                                 "text parts only")
        return value

    @field_validator("content")
    @classmethod
    def _joined(cls, value: str | list[TextPart]) -> str:
        return value if isinstance(value, str) else "\n".join(part.text for part in value)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class RequestError(SpearError):
    """A request the server refuses (HTTP 400 unless `status` says otherwise), naming the bad parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


def error_body(message: str, param: str | None = None, code: str | None = None,
               type: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(out: RequestOutput) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


class ResponseBuilder:
    """The response objects and stream chunks of one request, in OpenAI's shapes."""

    def __init__(self, chat: bool, model: str, tokenizer):
        self.chat = chat
        self.model = model
        self.tokenizer = tokenizer
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._offset = 0  # completions' text_offset: characters of the tokens reported so far

    def _envelope(self, object: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices}

    def response(self, text: str, last: RequestOutput, logprobs: dict | None = None) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": last.finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": last.finish_reason}
            body = self._envelope("text_completion", [choice])
        return {**body, "usage": usage(last)}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False,
              logprobs: dict | None = None) -> dict:
        """One stream chunk; `role`: chat's opening chunk, which names the assistant."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, last: RequestOutput) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage(last)}

    def logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None) -> dict | None:
        """OpenAI's logprobs object of these tokens: chat's `content` list, or completions' tokens, token_logprobs,
        top_logprobs (the sampled token's entry included, as vLLM) and text_offset. None when none were asked for."""
        if logprobs is None:
            return None
        texts = [self._text(i) for i in token_ids]
        if self.chat:
            return {"content": [{**_entry(text, lp.logprob), "top_logprobs": [_entry(self._text(i), v) for i, v in lp.top]}
                                for text, lp in zip(texts, logprobs)]}
        offsets = []
        for text in texts:
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": texts, "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
                "top_logprobs": [{**{self._text(i): _finite(v) for i, v in lp.top}, text: _finite(lp.logprob)}
                                 for text, lp in zip(texts, logprobs)],
                "text_offset": offsets}

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # as OpenAI and vLLM: JSON has no -Infinity


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
