"""The OpenAPI description of what the server answers: OpenAI's response objects, streams as server-sent events, every
error status the server and its guard send with OpenAI's error body, and none of FastAPI's 422 (an invalid request is
a 400 here). The fuzz test (tests/test_server_fuzz.py) checks the server's answers against it."""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/"


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorObject


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]  # none in the usage chunk (stream_options.include_usage)
    usage: Usage | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok", "engine stopped"]


ERRORS = {
    400: "The request is invalid; `param` names the parameter",
    401: "No valid API key: the server was started with --api-key and needs Authorization: Bearer KEY",
    404: "The model named is not one this server serves",
    413: "The body is over the limit (spear serve --max-body-mb)",
    415: "The body is not sent as application/json",
    421: "The Host header is not one this server answers to (spear serve --allowed-hosts)",
    429: "Too many requests are waiting (spear serve --max-waiting); retry after Retry-After seconds",
    500: "The request failed (in the engine, or a bug); the server log has the cause",
    503: "The engine has stopped",
}
HEADERS = {
    401: {"headers": {"WWW-Authenticate": {"schema": {"const": "Bearer"}, "required": True}}},
    429: {"headers": {"Retry-After": {"schema": {"type": "integer"}, "required": True}}},
}


def errors(*statuses: int) -> dict:
    """FastAPI `responses` for these error statuses, each with OpenAI's error body."""
    return {status: {"model": ErrorResponse, "description": ERRORS[status], **HEADERS.get(status, {})}
            for status in statuses}


def generate_responses(body: type[BaseModel], chunk: type[BaseModel]) -> dict:
    """A generating route's responses: `body`, or with stream: true server-sent events, each a `chunk` (or an error
    body, when the engine fails mid-stream), the last `data: [DONE]`."""
    payload = {"anyOf": [{"$ref": REF + chunk.__name__}, {"$ref": REF + "ErrorResponse"}]}
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}  # Open API 3.1: one event
    ok = {"model": body, "content": {"text/event-stream": {"schema": event}},
          "description": f"The {body.__name__}; with stream: true, server-sent events `data: {{{chunk.__name__}}}`, "
                         "the last `data: [DONE]`"}
    return {200: ok, **errors(400, 401, 404, 413, 415, 421, 429, 500, 503)}


# the guard's 401 (with --api-key; on /health and /metrics with --api-key-probes) and 421 apply to every route
MODELS_RESPONSES = {200: {"model": ModelList}, **errors(401, 421)}
MODEL_RESPONSES = {200: {"model": Model}, **errors(401, 404, 421)}
HEALTH_RESPONSES = {200: {"model": Health}, 503: {"model": Health, "description": "The engine has stopped"},
                    **errors(401, 421)}
METRICS_RESPONSES = {200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                           "description": "The metrics in Prometheus' text format"}, **errors(401, 421)}


class App(FastAPI):
    """FastAPI whose OpenAPI schema lacks the 422 responses FastAPI adds to every route with parameters, and has
    the stream chunks' schemas."""

    def openapi(self) -> dict:
        spec = super().openapi()  # cached until the routes change; removing what is gone already does nothing
        for operations in spec["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            spec["components"]["schemas"].pop(name, None)
        _, chunks = models_json_schema([(CompletionChunk, "serialization"), (ChatCompletionChunk, "serialization")],
                                       ref_template=REF + "{model}")
        spec["components"]["schemas"].update(chunks["$defs"])  # the streams' events name them
        return spec
