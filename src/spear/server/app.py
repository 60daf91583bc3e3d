"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models[/{model}], /health, /metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from spear.errors import SpearError
from spear.runtime.requests import RequestOutput
from spear.server import openapi
from spear.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from spear.server.metrics import RequestTimer, ServerMetrics
from spear.server.prompts import PromptEncoder
from spear.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    ResponseBuilder,
    _SamplingRequest,
    error_body,
)

log = logging.getLogger(__name__)

TOKENIZER_THREADS = 2  # for long prompts, each bounded by the context (spear.server.prompts)


class _ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class _EventStream(StreamingResponse):
    """Closes its event generator however the response ends, so a vanished client's request is aborted now."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class OpenAIServing:
    """Turns validated requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: AsyncEngine, tokenizer, model_names: tuple[str, ...], max_model_len: int,
                 metrics: ServerMetrics):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_names = model_names  # requests may name any; responses name the first (as vLLM documents)
        self.max_model_len = max_model_len
        self.metrics = metrics

        self.prompts = PromptEncoder(tokenizer, max_model_len)
        # long prompts off the event loop; short ones never queue behind them (PromptEncoder.is_long)
        self._tokenizing = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="spear-tokenize")

    async def completion_prompt(self, req: CompletionRequest) -> list[int]:
        return await self._tokenized(self.prompts.completion, req)

    async def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        return await self._tokenized(self.prompts.chat, req)

    async def _tokenized(self, encode, req):
        if not self.prompts.is_long(req):
            return encode(req)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, encode, req)

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    async def serve(self, req: _SamplingRequest, prompt_ids: list[int], request: Request, chat: bool) -> Response:
        params = self._sampling_params(req, prompt_ids)
        builder = ResponseBuilder(chat, self.model_names[0], self.tokenizer)
        echo = self._echo(req, prompt_ids)
        timer = RequestTimer(self.metrics)
        try:
            stream = self.engine.generate(prompt_ids, params, request_id=builder.id)
        except QueueFullError:
            self.metrics.rejected.inc()
            raise
        try:
            if req.stream:
                first = await _unless_disconnected(request, anext(stream))
                events = self._events(stream, first, builder, timer, req.include_usage, echo)
                return _EventStream(events, media_type="text/event-stream")
            text, last, logprobs = await _unless_disconnected(request, self._collect(stream, timer, builder))
        except _ClientGone:
            await stream.aclose()
            self.metrics.aborted.inc()
            return Response(status_code=499)
        except SpearError:
            self.metrics.failed.inc()
            raise
        return JSONResponse(builder.response(echo + text, last, logprobs))

    def _echo(self, req: _SamplingRequest, prompt_ids: list[int]) -> str:
        """The prompt's text when a completion asks for it back (echo), else ''."""
        if not getattr(req, "echo", False):
            return ""
        return req.prompt if isinstance(req.prompt, str) else self.tokenizer.decode(prompt_ids)

    def _sampling_params(self, req: _SamplingRequest, prompt_ids: list[int]):
        if req.model is not None and req.model not in self.model_names:
            raise model_not_found(req.model, self.model_names)
        n, limit = len(prompt_ids), self.max_model_len
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        if n >= limit:  # PromptEncoder refuses these first; kept for callers of serve() with their own ids
            raise RequestError(f"the prompt is {n} tokens but the model's context is {limit} tokens; shorten it",
                               "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                               code="context_length_exceeded")
        max_tokens = req.requested_max_tokens or limit - n
        if n + max_tokens > limit:
            raise RequestError(f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the model's context "
                               f"of {limit} tokens; lower max_tokens", "max_tokens", code="context_length_exceeded")
        vocab = self.prompts.vocab
        if bad := [k for k in req.logit_bias or {} if int(k) >= vocab]:
            raise RequestError(f"logit_bias names token {bad[0]}, outside the vocabulary [0, {vocab})", "logit_bias")
        return req.sampling_params(max_tokens)

    async def _collect(self, stream: RequestStream, timer: RequestTimer,
                       builder: ResponseBuilder) -> tuple[str, RequestOutput, dict | None]:
        """The whole text, the last output and the logprobs object (None unless asked for)."""
        parts, ids, logprobs = [], [], None
        async with aclosing(stream):
            async for out in stream:
                timer.tokens_arrived(len(out.new_token_ids))
                parts.append(out.new_text)
                ids += out.new_token_ids
                if out.logprobs is not None:
                    logprobs = (logprobs or []) + out.logprobs
        self._finished(out)
        return "".join(parts), out, builder.logprobs(ids, logprobs)

    async def _events(self, stream: RequestStream, out: RequestOutput, builder: ResponseBuilder,
                      timer: RequestTimer, include_usage: bool, echo: str) -> AsyncIterator[str]:
        """Server-sent events; starlette cancels this on disconnect, and closing the stream aborts the request."""
        ended = False  # finished or failed; otherwise the client left (closing this generator)
        try:
            async with aclosing(stream):
                if builder.chat:
                    yield _sse(builder.chunk(None, role=True))
                if echo:
                    yield _sse(builder.chunk(echo))
                try:
                    while True:
                        timer.tokens_arrived(len(out.new_token_ids))
                        if out.new_token_ids or out.new_text:  # one chunk per token, even while its text is held back
                            logprobs = builder.logprobs(out.new_token_ids, out.logprobs)
                            yield _sse(builder.chunk(out.new_text, logprobs=logprobs))
                        if out.finished:
                            break
                        out = await anext(stream)
                except SpearError as e:  # the engine failed mid-stream: say so in-band, the status is already sent
                    ended = True
                    self.metrics.failed.inc()
                    yield _sse(error_body(str(e), type="server_error"))
                    return
            ended = True
            self._finished(out)
            yield _sse(builder.chunk(None, out.finish_reason))
            if include_usage:
                yield _sse(builder.usage_chunk(out))
            yield "data: [DONE]\n\n"
        finally:
            if not ended:
                self.metrics.aborted.inc()

    def _finished(self, last: RequestOutput) -> None:
        self.metrics.prompt_tokens.inc(last.prompt_tokens)
        self.metrics.generation_tokens.inc(last.completion_tokens)
        self.metrics.finished.labels(last.finish_reason or "unknown").inc()


# Characters that JSON leaves raw but str.splitlines (httpx's aiter_lines among readers) takes for line ends: a
# generated U+2028 would cut an event in two. Escaped, the event is one line and decodes to the same text.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(payload: dict) -> str:
    """One server-sent event: a single line of JSON, whatever text it carries."""
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS_JSON_KEEPS)}\n\n"


def model_not_found(model: str, served: Sequence[str]) -> RequestError:
    return RequestError(f"the model {model!r} does not exist; this server serves {', '.join(map(repr, served))}",
                        "model", status=404, code="model_not_found")


async def _unless_disconnected(request: Request, work: Awaitable):
    """Await `work`, but give up (raise _ClientGone) as soon as the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise _ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(engine: AsyncEngine, tokenizer, model_names: str | Sequence[str], max_model_len: int) -> FastAPI:
    """The app; its lifespan starts and stops the engine thread. `model_names`: the names requests may give as
    `model` (spear serve --served-model-name); responses name the first."""
    names = (model_names,) if isinstance(model_names, str) else tuple(model_names)
    metrics = ServerMetrics(engine)
    serving = OpenAIServing(engine, tokenizer, names, max_model_len, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()
        serving.close()

    app = openapi.App(title="SPEAR", lifespan=lifespan)
    _install_error_handlers(app)

    @app.post("/v1/completions", response_model=None,
              responses=openapi.generate_responses(openapi.Completion, openapi.CompletionChunk))
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await serving.serve(req, await serving.completion_prompt(req), request, chat=False)

    @app.post("/v1/chat/completions", response_model=None,
              responses=openapi.generate_responses(openapi.ChatCompletion, openapi.ChatCompletionChunk))
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await serving.serve(req, await serving.chat_prompt(req), request, chat=True)

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "spear", "max_model_len": max_model_len}

    @app.get("/v1/models", response_model=None, responses=openapi.MODELS_RESPONSES)
    async def models() -> dict:
        return {"object": "list", "data": [card(name) for name in names]}

    @app.get("/v1/models/{model:path}", response_model=None, responses=openapi.MODEL_RESPONSES)  # names hold "/"
    async def retrieve_model(model: str) -> dict:
        if model not in names:
            raise model_not_found(model, names)
        return card(model)

    @app.get("/health", response_model=None, responses=openapi.HEALTH_RESPONSES)
    async def health() -> Response:
        alive = engine.is_running()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics", response_class=Response, responses=openapi.METRICS_RESPONSES)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _param_path(error: dict, errors: list[dict]) -> list[str]:
    """The field `error` is about: a union's alternatives all fail under one field, so take the common prefix of the
    errors under its top-level field."""
    def path(e: dict) -> list[str]:
        return [str(part) for part in e.get("loc", ()) if part != "body"]

    top = path(error)[:1]
    return os.path.commonprefix([path(e) for e in errors if path(e)[:1] == top])


def _install_error_handlers(app: FastAPI) -> None:
    """Every error is an OpenAI-style JSON body; 400 (not FastAPI's 422) for invalid requests; no tracebacks."""

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # of a union's alternatives, the error about the value, not the one that says it has another type
        first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
        loc = _param_path(first, errors)  # message and parameter from the same error
        if first.get("type") == "json_invalid":
            message, param = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
        else:
            param = ".".join(loc) or None
            msg = first["msg"].removeprefix("Value error, ")
            message = f"{param}: {msg}" if param else msg
        return JSONResponse(error_body(message, param), status_code=400)

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), type="requests", code="rate_limit_exceeded"), status_code=429,
                            headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), type="server_error"), status_code=503)

    @app.exception_handler(RequestFailedError)
    async def request_failed(request: Request, exc: RequestFailedError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), type="server_error"), status_code=500)

    @app.exception_handler(SpearError)
    async def spear_error(request: Request, exc: SpearError) -> JSONResponse:
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    app.add_middleware(_InternalErrors)


class _InternalErrors:
    """ASGI middleware: an unexpected exception becomes a 500 with an error body, logged once, on a connection that
    stays open. (Starlette's handler for Exception answers too, but re-raises: uvicorn logs it again and closes.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            if started:  # the status is sent: only closing the connection tells the client
                raise
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            body = error_body("internal server error", type="server_error")
            await JSONResponse(body, status_code=500)(scope, receive, send)
