"""The engine in a process of its own: `spear serve --engine-process` on a CPU.

On a CPU, PyTorch's OpenMP threads spin between operators. With the engine in the server's process, they took
the cores from the event loop while it held the GIL, and the engine's Python between operators waited on both:
two threads decoded slower over HTTP than one, so the server runs the engine on one core fewer (BENCHMARKS §4). As
vLLM runs its engine core apart from its API server, this runs the engine in a child process, with its own GIL and
every core, and the server's AsyncEngine drives it through `EngineProcess`: each call of the engine's interface
(add_request, abort, step) is one round trip over a pipe, answered with the engine's counters for /metrics. The
server thus behaves as with the engine in process (the same requests in the same steps, the same errors: an
engine's exception is raised again here). It is not the default: on the 2-core EPYC beside vLLM it gave 11% more
tokens/s at batch 8 and none at batch 1, and OpenMP threads on every core stall whenever another process takes
one of them (each parallel region waits for its slowest thread): with other jobs on the machine the engine decoded
5-7x slower than on one core in process (BENCHMARKS §4). Two threads also sum some of MKL's float32 products in
another order than one, so greedy texts may turn at near ties.

The child ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches the whole process group): the server stops it
after its own shutdown (`close`), and it ends by itself when the pipe closes (the server killed). When the child
is gone, the next call raises SystemExit, which ends the engine thread: requests fail with 503 and the server
stops (launch.EngineServer).
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from spear.errors import SpearError
from spear.runtime.requests import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from spear.server.launch import ServeConfig

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # how long close() waits for the child to end before killing it


@dataclass(frozen=True)
class Counters:
    """The engine's state after a call: what AsyncEngine and /metrics read between calls."""

    has_unfinished: bool
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    num_preemptions: int

    @classmethod
    def of(cls, engine) -> Counters:
        return cls(engine.has_unfinished(), engine.num_running, engine.num_waiting, engine.kv_blocks_used,
                   engine.num_preemptions)


@dataclass(frozen=True)
class Started:
    """What the child reports once its engine is built."""

    tokenizer: Any
    max_model_len: int
    max_num_seqs: int
    kv_blocks_total: int
    kv_cache_summary: str
    startup_s: dict[str, float]  # the child's stages (launch.startup_summary)


class EngineProcess:
    """The engine's interface (async_engine.SyncEngine) over a pipe to a child process that loads `spec` and runs
    its engine with `threads` PyTorch threads. Starting it waits until the engine is built; a SpearError of the
    child's loading (a bad path, a corrupt artifact) is raised here."""

    def __init__(self, spec: str, config: ServeConfig, device: torch.device, threads: int):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no OpenMP pool inherited across fork
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_child_main, args=(child_conn, spec, config, str(device), threads),
                                        name="spear-engine", daemon=True)
        self._process.start()
        child_conn.close()
        self._gone = False
        try:
            started: Started = self._receive()
        except BaseException:
            self.close(timeout=0)
            raise
        self.tokenizer = started.tokenizer
        self.max_model_len = started.max_model_len
        self.max_num_seqs = started.max_num_seqs
        self.kv_blocks_total = started.kv_blocks_total
        self.kv_cache_summary = started.kv_cache_summary
        self.startup_s = started.startup_s

    # Counters AsyncEngine reads (as of the last call).
    @property
    def num_running(self) -> int:
        return self._counters.num_running

    @property
    def num_waiting(self) -> int:
        return self._counters.num_waiting

    @property
    def kv_blocks_used(self) -> int:
        return self._counters.kv_blocks_used

    @property
    def num_preemptions(self) -> int:
        return self._counters.num_preemptions

    def has_unfinished(self) -> bool:
        return not self._gone and self._counters.has_unfinished

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._call("add_request", request_id, prompt_token_ids, params)

    def abort(self, request_id: str) -> None:
        if not self._gone:  # AsyncEngine aborts what the engine held after its thread ends, the child gone or not
            self._call("abort", request_id)

    def step(self) -> list[RequestOutput]:
        return self._call("step")

    def is_alive(self) -> bool:
        return not self._gone and self._process.is_alive()

    def exit_description(self) -> str:
        """How the child ended, for the server's last line."""
        code = self._process.exitcode
        if code is not None and code < 0:
            return f"the engine process was killed by {signal.Signals(-code).name}"
        return f"the engine process exited with code {code}"

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the child (after the last call) and wait for it; kill it if it does not end within `timeout`."""
        if not self._gone and self._process.is_alive():
            try:
                self._conn.send(None)
            except OSError:  # it is gone already
                pass
        self._gone = True
        self._conn.close()
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def _call(self, method: str, *args):
        if self._gone:
            raise SystemExit(self.exit_description())
        try:
            self._conn.send((method, args))
        except OSError:
            self._receive()  # the child is gone: SystemExit
        return self._receive()

    def _receive(self):
        try:
            ok, value, counters = self._conn.recv()
        except (EOFError, OSError):
            self._gone = True
            self._process.join(STOP_TIMEOUT_S)
            raise SystemExit(self.exit_description()) from None
        if counters is not None:
            self._counters = counters
        if not ok:
            raise value
        return value


def _child_main(conn, spec: str, config: ServeConfig, device: str, threads: int) -> None:
    """The child: build the engine as `spear serve` does, report it, then answer calls until told to stop (None)
    or the pipe closes."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    from spear.runtime.engine import kv_cache_summary
    from spear.server.launch import load_engine

    try:
        engine, tokenizer, stages = load_engine(spec, config, torch.device(device), threads)
    except SpearError as e:  # the server prints it in one line
        conn.send((False, e, None))
        return
    conn.send((True, Started(tokenizer, engine.max_model_len, engine.max_num_seqs, engine.kv_blocks_total,
                             kv_cache_summary(engine.runner), stages), Counters.of(engine)))
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):  # the server is gone
            return
        if call is None:
            return
        method, args = call
        try:
            reply = (True, getattr(engine, method)(*args))
        except Exception as e:  # raised again in the server, which decides what it means for the requests
            if not isinstance(e, SpearError):
                log.exception("engine %s failed", method)  # the traceback stays here, in the server's log
            reply = (False, e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}"))
        try:
            conn.send((*reply, Counters.of(engine)))
        except (BrokenPipeError, ConnectionResetError):
            return


def _picklable(e: Exception) -> bool:
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        return False
    return True

