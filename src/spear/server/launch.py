"""`spear serve`: load a model, build its engine, and serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, get_args

import torch
import uvicorn

from spear.errors import SpearError
from spear.util import release_freed_memory
from spear.server.guard import GuardConfig, raise_open_file_limit, uvicorn_config

if TYPE_CHECKING:
    from spear.server.async_engine import AsyncEngine
    from spear.server.engine_process import EngineProcess
    from spear.runtime.engine import Engine, EngineConfig
    from spear.runtime.latency import LatencyTable
    from spear.runtime.tp_serve import StepChannel


# The default prefill chunk. On a CPU a step of 512 prompt tokens stalls every running stream for seconds (3–8 s
# for SmolLM2-135M on 2 cores, beside 0.07 s a decode step); 128 bounds it near 1 s (bench/server_reliability.py)
CHUNK_TOKENS = {"cuda": 512, "cpu": 128}
KV_CACHE_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")  # --kv-cache-dtype (EngineConfig.kv_cache_dtype)


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_waiting: int = 256  # requests waiting for the engine beyond which the server answers 429
    # prompt tokens prefilled per engine step (the most, with an ITL SLO); None: CHUNK_TOKENS of the device
    chunk_tokens: int | None = None
    itl_slo_ms: float | None = None  # SLO-aware chunks from the latency table (spear.runtime.slo)
    max_model_len: int | None = None  # context per sequence (None: the model's, at most 4096)
    max_num_seqs: int = 256  # sequences decoded together at most (as many as the KV cache holds)
    tp: int = 1  # tensor-parallel ranks (spear.runtime.tp_serve)
    tp_reduction: str = "p2p"  # how row-parallel layers reduce on GPUs (spear.runtime.tp.set_reduction)
    # the engine's host work overlapped with the GPU step (EngineConfig.overlap; single rank only): 2-6% less
    # per decode step on the H200 (BENCHMARKS §5). Never on a CPU, whose forward is the host's work: there it only
    # handed each token out one step late (a streamed first token at 92-116 ms instead of 52)
    overlap: bool = True
    http: GuardConfig = field(default_factory=GuardConfig)  # body size, read timeout, connections, Host names
    # The KV cache's size (EngineConfig): bytes, or None for gpu_memory_utilization of a GPU's memory less what the
    # weights and a warm-up step hold (on a CPU: spear.runtime.engine.CPU_KV_CACHE_MEMORY)
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    # the names requests may give as `model`, responses giving the first (none: served_model_names' default)
    served_model_name: tuple[str, ...] = ()
    kv_cache_dtype: str = "auto"  # "auto" (the model's), or on a CPU "bfloat16" / "float16" (EngineConfig)
    # on a CPU (one rank): the engine in a process of its own, on every core (spear.server.engine_process), rather
    # than in the server's on one core fewer (cpu_serving_threads)
    engine_process: bool = False

    def __post_init__(self) -> None:
        if self.max_waiting < 1:
            raise SpearError(f"--max-waiting must be at least 1, got {self.max_waiting}")
        if self.itl_slo_ms is not None and self.itl_slo_ms <= 0:
            raise SpearError(f"--itl-slo-ms must be positive, got {self.itl_slo_ms}")
        if self.max_num_seqs < 1 or (self.max_model_len is not None and self.max_model_len < 2):
            raise SpearError("--max-num-seqs must be at least 1 and --max-model-len at least 2")
        if self.tp < 1:
            raise SpearError(f"--tp must be at least 1, got {self.tp}")
        if not all(name.strip() for name in self.served_model_name):
            raise SpearError("--served-model-name has an empty name")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise SpearError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory} bytes")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise SpearError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, got {self.kv_cache_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise SpearError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        from spear.runtime.tp import Reduction

        if self.tp_reduction not in get_args(Reduction):
            raise SpearError(f"--tp-reduction must be one of {', '.join(get_args(Reduction))}, got {self.tp_reduction!r}")


def served_model_names(spec: str, config: ServeConfig) -> tuple[str, ...]:
    """The names the API serves the model as: --served-model-name's, else the spec as given and its base name
    ('/models/q4' → '/models/q4' and 'q4')."""
    base = os.path.basename(os.path.abspath(spec))
    return config.served_model_name or tuple(dict.fromkeys(name for name in (spec, base) if name))


def serve(spec: str, config: ServeConfig, device: torch.device | None = None) -> None:
    """Serve `spec` (artifact dir, HF dir, GGUF or 'smollm2') until interrupted; with `config.tp` > 1 on
    that many ranks (one GPU each, or CPU processes over gloo), rank 0 serving HTTP."""
    if config.tp == 1:
        _serve(spec, config, device)
        return
    from torch.multiprocessing import ProcessExitedException

    from spear.runtime.tp import launch

    cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    try:
        launch(_serve_rank, config.tp, spec, config, cuda, cuda=cuda)
    except ProcessExitedException as e:  # a rank killed or crashed: rank 0 answered 503 and stopped
        raise SpearError(f"the server stopped: tensor-parallel {e}") from None


class EngineServer(uvicorn.Server):
    """uvicorn's server bound to the engine's life: a signal stops the engine first, so that requests in flight end
    at once with an error (an error event in a stream) rather than holding the exit; and the server exits by itself
    when the engine has stopped (a failed tensor-parallel step, its process gone)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, process: EngineProcess | None = None):
        super().__init__(config)
        self.engine = engine
        self.process = process  # the engine's own process, if it has one: its death stops the server too

    async def on_tick(self, counter: int) -> bool:
        engine_gone = not self.engine.is_running() or (self.process is not None and not self.process.is_alive())
        return await super().on_tick(counter) or engine_gone

    async def shutdown(self, sockets=None) -> None:
        await asyncio.to_thread(self.engine.shutdown)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn re-raises the signal it shut down for; a SIGTERM is a stop asked for, and a clean shutdown after
        it exits 0 (not 143). Ctrl-C still ends as an interrupt (exit 130)."""
        with super().capture_signals():
            yield
            self._captured_signals = [sig for sig in self._captured_signals if sig != signal.SIGTERM]


def _serve(spec: str, config: ServeConfig, device: torch.device | None, channel: StepChannel | None = None) -> None:
    """Serve on this process; with a `channel`, as rank 0 of a tensor-parallel group. On a CPU with one rank (and
    ServeConfig.engine_process) the engine runs in a child process (spear.server.engine_process)."""
    from spear.models.loading import default_device
    from spear.runtime.engine import kv_cache_summary
    from spear.server.app import build_app
    from spear.server.async_engine import AsyncEngine
    from spear.server.engine_process import EngineProcess

    sock = _listen(config.host, config.port)  # before the slow load, so a taken port fails at once
    threads = torch.get_num_threads()
    start = time.perf_counter()
    process = None
    try:
        own_process = channel is None and config.engine_process and (device or default_device()).type == "cpu"
        if own_process:
            engine = process = EngineProcess(spec, config, torch.device("cpu"), cpu_serving_threads(own_process))
            tokenizer, kv_summary, stages = process.tokenizer, process.kv_cache_summary, process.startup_s
        else:
            engine, tokenizer, stages = load_engine(spec, config, device, cpu_serving_threads(own_process), channel)
            kv_summary = kv_cache_summary(engine.runner)
        async_engine = AsyncEngine(engine, config.max_waiting, fatal_step_errors=channel is not None)
        app = build_app(async_engine, tokenizer, served_model_names(spec, config), engine.max_model_len)
        host, port = sock.getsockname()[:2]
        tp = "" if channel is None else f", tensor parallel over {config.tp} ranks"
        print(f"serving {spec} on http://{host}:{port}/v1 (context {engine.max_model_len} tokens{tp})", flush=True)
        print(kv_summary, flush=True)
        print(startup_summary(time.perf_counter() - start, stages), flush=True)
        raise_open_file_limit()
        EngineServer(uvicorn_config(app, config.host, config.http, log_level="info"), async_engine, process).run(
            sockets=[sock])
        if process is not None and not process.is_alive():
            raise SpearError(f"the server stopped: {process.exit_description()}")
    finally:
        sock.close()
        if process is not None:
            process.close()
        torch.set_num_threads(threads)  # the process's own again (serve() called from Python)


def load_engine(spec: str, config: ServeConfig, device: torch.device | None, threads: int,
                channel: StepChannel | None = None) -> tuple[Engine, object, dict[str, float]]:
    """The engine `spear serve` runs (on a CPU with `threads` PyTorch threads), its tokenizer, and the seconds its
    stages took (startup_summary)."""
    from spear import api
    from spear.runtime.engine import build_engine
    from spear.runtime.slo import SLOPolicy
    from spear.runtime.tp_serve import leader_engine

    start = time.perf_counter()
    lm = api.load(spec, device, serving=True)
    loaded = time.perf_counter() - start
    if lm.model.device.type == "cpu":
        torch.set_num_threads(threads)
    engine_config = _engine_config(config, lm.model.device)
    if channel is None:
        engine = build_engine(lm.model, lm.tokenizer, engine_config)
    else:
        engine = leader_engine(lm.model, lm.tokenizer, engine_config, channel, config.tp_reduction)
    tokenizer = lm.tokenizer
    del lm  # under TP the full weights go; the engine holds this rank's shard
    release_freed_memory()  # what loading freed (records, dense copies) leaves the process
    if config.itl_slo_ms is not None:
        table = serving_table(spec, engine)
        if (warning := slo_warning(table, config.itl_slo_ms, config.max_num_seqs)) is not None:
            print(warning, file=sys.stderr, flush=True)
        engine.policy = SLOPolicy(table, config.itl_slo_ms, max_chunk=engine_config.policy.chunk_tokens)
    return engine, tokenizer, {"load": loaded, **engine.startup_s}


def startup_summary(total_s: float, stages: dict[str, float]) -> str:
    """One line: the seconds from the command to the first request it can take, and the stages that took them."""
    parts = ", ".join(f"{name.replace('_', ' ')} {seconds:.1f} s" for name, seconds in stages.items())
    return f"ready in {total_s:.1f} s ({parts})"


def _serve_rank(spec: str, config: ServeConfig, cuda: bool) -> None:
    """One rank of `serve --tp`: rank 0 serves, the others follow its steps until it stops them.

    Signals (the launcher passes SIGTERM on to every rank) end rank 0's server gracefully, after
    which it stops the followers; the followers ignore them and end with rank 0 (its stop, or its
    connection gone)."""
    import torch.distributed as dist

    from spear import api
    from spear.runtime.engine import make_runner
    from spear.runtime.tp_serve import (
        StepChannel,
        agree_kv_blocks,
        follow,
        reduction_rows,
        shard_runtime_model,
    )

    rank = dist.get_rank()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    channel = StepChannel()
    for sig in (signal.SIGINT, signal.SIGTERM):
        # rank 0: uvicorn takes them over while it serves and re-raises them after its shutdown; ignored
        # then, so that the followers are stopped
        signal.signal(sig, signal.SIG_IGN)
    if rank > 0:
        engine_config = _engine_config(config, device)
        model = shard_runtime_model(api.load(spec, device, serving=True).model, config.tp_reduction, reduction_rows(engine_config))
        follow(make_runner(model, agree_kv_blocks(model, engine_config, channel)), channel)
        return
    try:
        _serve(spec, config, device, channel)
    finally:
        channel.send(None)


def cpu_serving_threads(engine_process: bool) -> int:
    """PyTorch's threads when serving on a CPU: with the engine in its own process, every core the process may use;
    in the server's process, one fewer (as vLLM's CPU backend reserves one), for the HTTP server and tokenization:
    OpenMP threads that share their cores with the event loop spin against it (on 2 cores, 2 threads decoded 8.3
    tokens/s over HTTP and 1 thread 13.2, bench/cpu_serve_compare.py). OMP_NUM_THREADS, when set, decides instead."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores if engine_process else max(1, cores - 1)


def _engine_config(config: ServeConfig, device: torch.device) -> EngineConfig:
    from spear.runtime.engine import EngineConfig
    from spear.runtime.scheduler import StaticChunkPolicy

    chunk_tokens = config.chunk_tokens or CHUNK_TOKENS["cuda" if device.type == "cuda" else "cpu"]
    return EngineConfig(max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                        kv_cache_memory=config.kv_cache_memory, gpu_memory_utilization=config.gpu_memory_utilization,
                        kv_cache_dtype=None if config.kv_cache_dtype == "auto" else getattr(torch, config.kv_cache_dtype),
                        policy=StaticChunkPolicy(chunk_tokens),
                        overlap=config.overlap and config.tp == 1 and device.type == "cuda")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int:
    """Bytes of a memory size: a number of bytes, or a number and a unit, as 1073741824, "2GiB", "512MiB", "1.5GB"."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match[2].lower() not in _UNITS:
        raise SpearError(f"cannot read {text!r} as a memory size; give bytes or a number with a unit, as 2GiB, "
                         f"512MiB or 1.5GB")
    return int(float(match[1]) * _UNITS[match[2].lower()])


def serving_table(spec: str, engine: Engine) -> LatencyTable:
    """The step-latency table for --itl-slo-ms: the one stored for this model, device, EC density and engine shape
    (in the artifact directory, or the cache for other models), else a fresh profile, stored for the next start.
    Warns when the SLO cannot be met even by a step with no prefill."""
    from spear.api import model_key
    from spear.artifact import is_artifact
    from spear.runtime import latency
    from spear.runtime.kv_cache import cdiv
    from spear.util import cache_dir

    runner = engine.runner
    device, density = latency.device_name(runner.cache.device), latency.ec_density(runner.model)
    if is_artifact(spec):
        path = Path(spec) / latency.TABLE_FILE
    else:
        key = f"{model_key(spec)}:{device}:{density:.6f}:{engine.config.max_num_seqs}:{engine.max_model_len}"
        path = cache_dir("latency") / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"
    table = latency.LatencyTable.load(path) if path.is_file() else None
    if table is not None and table.device == device and math.isclose(table.ec_density, density):
        return table
    why = (f"{path} was profiled on {table.device} at EC density {table.ec_density:.2f}" if table is not None
           else f"no stored latency table for {spec} on {device}")
    print(f"{why}: profiling step latency on this device for --itl-slo-ms (a minute or two)", file=sys.stderr, flush=True)
    context = min(256, engine.max_model_len // 4)  # the profile's decoding sequences' context
    _, prefill = latency.default_grid(1, engine.max_model_len)
    # decode batches up to max_num_seqs, or as many as the KV cache holds beside the largest prefill chunk
    fit = (engine.kv_blocks_total - cdiv(prefill[-1], engine.block_size)) // cdiv(context + 1, engine.block_size)
    batches, _ = latency.default_grid(max(1, min(engine.config.max_num_seqs, fit)), engine.max_model_len)
    table = latency.profile(runner, batches, prefill, decode_context=context)
    print(f"wrote {table.save(path)}", file=sys.stderr, flush=True)
    return table


def slo_warning(table: LatencyTable, itl_slo_ms: float, max_num_seqs: int) -> str | None:
    """Why the SLO cannot hold on this device (a decode step of a full batch alone takes longer), or None."""
    batch = min(max_num_seqs, table.batch_sizes[-1])
    seconds = table.predict(batch, table.prefill_tokens[0])
    if seconds is None or seconds * 1e3 <= itl_slo_ms:
        return None
    return (f"warning: --itl-slo-ms {itl_slo_ms:g} cannot be met here: one decode step of {batch} sequences "
            f"takes {seconds * 1e3:.0f} ms on this device; lower --max-num-seqs or raise the SLO")


def _listen(host: str, port: int) -> socket.socket:
    if not 0 <= port < 65536:
        raise SpearError(f"--port must be between 0 and 65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise SpearError(f"cannot resolve host {host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    # proto: IPPROTO_TCP, not 0. asyncio turns Nagle off (TCP_NODELAY) only on sockets that name TCP, and an accepted
    # socket names what the listening one does; with Nagle on, a keep-alive response's second write waited for the
    # client's delayed ACK: 40 ms on every request after a connection's first (a /health took 43 ms, not 1)
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise SpearError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock
