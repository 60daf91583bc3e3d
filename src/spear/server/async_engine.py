"""The synchronous engine behind an asyncio interface.

One background thread owns the engine: it alone calls add_request, abort and step. The
event loop hands it commands (add, abort) through a lock-protected inbox and gets each
RequestOutput back on the asyncio queue of its request (loop.call_soon_threadsafe). The
thread sleeps on a condition variable whenever the engine has nothing to do.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Protocol

from spear.errors import SpearError
from spear.runtime.requests import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(SpearError):
    """More requests are waiting than the server accepts; the client should retry later (HTTP 429)."""


class EngineDeadError(SpearError):
    """The engine thread has stopped or a step failed; the request cannot complete (HTTP 503)."""


class RequestFailedError(SpearError):
    """This request alone failed inside the engine (its sampling raised, say); the others go on (HTTP 500).
    Its message never carries the internal error, which goes to the log."""


REQUEST_FAILED = "the server failed while generating this request; the server log has the cause"


class SyncEngine(Protocol):
    """What AsyncEngine needs of spear.runtime.engine.Engine."""

    num_running: int
    num_waiting: int
    max_num_seqs: int  # sequences it runs at once
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int  # running sequences preempted so far (their blocks freed, to be recomputed)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished(self) -> bool: ...


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every iteration (read by /metrics)."""

    queue_depth: int = 0  # waiting in the engine + submitted but not yet handed to it
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput | Exception

    def put(self, item: RequestOutput | Exception) -> None:
        if not self.loop.is_closed():  # a client's loop may be gone (tests, shutdown)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class RequestStream:
    """The outputs of one request, as an async iterator; closing it early aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue):
        self.request_id = request_id
        self._engine = engine
        self._queue = queue
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:  # the client is gone: free the request's KV blocks
            await self.aclose()
            raise
        if isinstance(item, Exception):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """`fatal_step_errors`: a failed step stops the engine (under tensor parallelism the ranks are then out of step:
    a rank died, say); every request fails and later ones get 503. Otherwise only the step's requests fail."""

    def __init__(self, engine: SyncEngine, max_waiting: int = 256, fatal_step_errors: bool = False):
        if max_waiting < 1:
            raise SpearError(f"max_waiting must be at least 1, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.fatal_step_errors = fatal_step_errors
        self._cond = threading.Condition()
        self._adds: list[_Add] = []  # inbox, guarded by _cond
        self._aborts: list[str] = []
        self._sinks: dict[str, _Sink] = {}  # live requests, guarded by _cond
        self._in_engine: set[str] = set()  # ids the engine holds; engine thread only
        self._stats = EngineStats(kv_blocks_total=engine.kv_blocks_total)
        self._stopping = False
        self._stop_reason = "the server is shutting down"
        self._thread = threading.Thread(target=self._run, name="spear-engine", daemon=True)

    @property
    def stats(self) -> EngineStats:
        return self._stats

    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Submit a request now (raises QueueFullError at once when the queue is full); iterate its outputs."""
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise EngineDeadError(self._stop_reason if self._stopping else "the engine is not running")
            if self._really_waiting() >= self.max_waiting:
                raise QueueFullError(f"{self.max_waiting} requests are already waiting; retry later")
            if request_id in self._sinks:
                raise SpearError(f"request id {request_id!r} is already in use")
            self._sinks[request_id] = _Sink(asyncio.get_running_loop(), queue)
            self._adds.append(_Add(request_id, list(prompt_ids), params))
            self._cond.notify()
        return RequestStream(self, request_id, queue)

    def _really_waiting(self) -> int:
        """Live requests beyond the engine's sequence slots: those that could not run now (caller holds _cond)."""
        return max(0, len(self._sinks) - self.engine.max_num_seqs)

    def abort(self, request_id: str) -> None:
        with self._cond:
            if self._sinks.pop(request_id, None) is None:
                return
            pending = [a for a in self._adds if a.request_id != request_id]
            if len(pending) == len(self._adds):
                self._aborts.append(request_id)
            self._adds = pending
            self._cond.notify()

    # --- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except SystemExit as e:  # the engine is gone: a tensor-parallel rank, or the engine's process
            self._stop_reason = f"the engine stopped ({e}); the server is stopping"
        finally:  # however the thread ends (shutdown, a fatal step, SystemExit: a rank gone), no request waits on
            self._stopping = True
            self._fail_all(EngineDeadError(self._stop_reason))

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._adds or self._aborts or self.engine.has_unfinished()):
                    self._cond.wait()
                if self._stopping:
                    break
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            try:
                self._apply(adds, aborts)
                outputs = self.engine.step() if self.engine.has_unfinished() else []
                self._publish_stats()  # before the outputs: a client never sees stats older than its tokens
                self._deliver(outputs)
            except Exception:  # a bug in a step: fail every live request, keep serving (unless fatal)
                log.exception("engine step failed")
                if self.fatal_step_errors:
                    self._stop_reason = "the engine stopped after a failed step; the server is stopping"
                    return
                self._fail_all(EngineDeadError(REQUEST_FAILED))
                self._publish_stats()

    def _apply(self, adds: list[_Add], aborts: list[str]) -> None:
        for request_id in aborts:
            if request_id in self._in_engine:
                self._in_engine.discard(request_id)
                self.engine.abort(request_id)
        for add in adds:
            try:
                self.engine.add_request(add.request_id, add.prompt_ids, add.params)
            except Exception as e:  # this request's fault (SpearError says why) or a bug: it alone fails
                if not isinstance(e, SpearError):
                    log.exception("adding request %s failed", add.request_id)
                    e = RequestFailedError(REQUEST_FAILED)
                with self._cond:
                    sink = self._sinks.pop(add.request_id, None)
                if sink is not None:
                    sink.put(e)
            else:
                self._in_engine.add(add.request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self._in_engine.discard(out.request_id)
            with self._cond:
                sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if sink is not None:
                sink.put(RequestFailedError(REQUEST_FAILED) if out.finish_reason == "error" else out)

    def _fail_all(self, error: Exception) -> None:
        with self._cond:
            sinks, self._sinks = self._sinks, {}
            self._adds, self._aborts = [], []
        for request_id in self._in_engine:
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine is already in trouble; free what it lets us free
                log.exception("abort of %s failed", request_id)
        self._in_engine.clear()
        for sink in sinks.values():
            sink.put(error)

    def _publish_stats(self) -> None:
        e = self.engine
        with self._cond:
            pending = len(self._adds)
        self._stats = EngineStats(pending + e.num_waiting, e.num_running, e.num_waiting, e.kv_blocks_used, e.kv_blocks_total,
                                  e.num_preemptions)
