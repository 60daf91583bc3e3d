"""Where `spear serve`'s start-up time goes, stage by stage, on a random W4 artifact in a real shape.

    python bench/serve_startup.py --model llama3-8b --json bench/results/memory/serve_startup.json   # a GPU
    python bench/serve_startup.py --model tiny --json /tmp/startup.json                               # CPU check

The artifact is written straight at 4 bits (fixtures.write_random_artifact, gated rank-32 ECs on --ec-fraction of
the linears), then loaded and built in this process exactly as `spear serve` with default flags does it
(api.load(serving=True), server.launch's EngineConfig, runtime.engine.build_engine), twice: the first build meets
empty kernel caches (a fresh machine: Triton compiles every config it tries), the second finds them warm (a restart).
Each build's seconds are split by timers wrapped around the functions that can take long:
    precompile            the tuner's candidates compiled in parallel processes first (kernels.w4.precompile)
    tune_w4 / tune_gemv   the decode kernels' configs timed per weight shape and row bucket (use_kernels)
    kv_budget             the warm-up step that sizes the KV cache from free memory (engine._cuda_kv_budget)
    compile_ahead         the graphs' kernels compiled in parallel processes first (kernels.compile_ahead)
    decode_graphs         one CUDA graph of a whole step per row bucket (runner.DecodeGraph), with their warm-ups
    mixed_graphs          the piecewise graphs of mixed steps per token bucket (runner.MixedStepGraphs)
and the counts of each (shapes tuned, graphs captured), and Triton's compiles in this process by the stage that
made them ("triton_compile in decode_graphs"). What is left of a stage is the rest (packing, allocation). Each
compile in the graphs' stages that takes longer than a disk-cache load (SLOW_COMPILE_S) is listed with its kernel and
Triton's specialization of it ("slow_graph_compiles"): what compile_ahead did not compile for them. Each launch the
graphs' stages make whose specialization compile_ahead's dry steps did not record is listed with the arguments by
which it differs from the nearest recorded launch of its kernel ("graph_launches_not_ahead"), and compile_ahead's
warnings (kernels its workers failed to compile) are kept ("compile_ahead_log").
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import write_json
from fixtures import write_random_artifact
from shapes import MODELS

from spear import api
from spear.kernels import compile_ahead as compile_ahead_module
from spear.runtime import engine as engine_module
from spear.runtime import runner as runner_module
from spear.server.launch import ServeConfig, _engine_config
from spear.shards import safetensors_bytes

EC_RANK = 32
SLOW_COMPILE_S = 0.1  # a compile found in Triton's disk cache loads in milliseconds
GRAPH_STAGES = ("decode_graphs", "mixed_graphs")


class StageTimers:
    """Seconds and calls of each wrapped function, summed; `wrap` replaces module.attr while the timers are on. A
    call made inside another timed call is also counted as "NAME in OUTER" (Triton's compiles by stage)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[object, str, object]] = []
        self._active: list[str] = []

    def wrap(self, owner: object, attr: str, name: str, sync: bool = True, observe=None) -> None:
        """Time owner.attr as `name`; `observe(outer, seconds, args)`, if given, also sees each call."""
        original = getattr(owner, attr)
        sync = sync and torch.cuda.is_available()

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if sync:
                torch.cuda.synchronize()
            start = time.perf_counter()
            outer = self._active[-1] if self._active else None
            self._active.append(name)
            try:
                return original(*args, **kwargs)
            finally:
                self._active.pop()
                if sync:
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                for key in (name, f"{name} in {outer}") if outer else (name,):
                    self.seconds[key] += seconds
                    self.calls[key] += 1
                if observe is not None:
                    observe(outer, seconds, args)

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    @property
    def stage(self) -> str | None:
        """The innermost timed call running now."""
        return self._active[-1] if self._active else None

    def patch(self, owner: object, attr: str, replacement) -> None:
        """Replace owner.attr until undo()."""
        self._undo.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, replacement)

    def undo(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()


def timed_functions() -> list[tuple[object, str, str]]:
    """(owner, attribute, stage) of each function timed; the kernels' tuners are imported where use_kernels calls them."""
    import spear.kernels.compile_ahead as compile_ahead
    import spear.kernels.f16_gemv as f16_gemv
    import spear.kernels.w4 as w4
    import spear.kernels.w4.precompile as precompile

    return [(precompile, "precompile_w4", "precompile"), (w4, "tune_w4", "tune_w4"),
            (f16_gemv, "tune_gemv", "tune_gemv"),
            (engine_module, "_cuda_kv_budget", "kv_budget"),
            (compile_ahead, "compile_ahead", "compile_ahead"),
            (runner_module.DecodeGraph, "__init__", "decode_graphs"),  # a class's capture: its __init__
            (runner_module.MixedStepGraphs, "__init__", "mixed_graphs")]


def slow_compile_logger(log: list[dict]):
    """An observer of Triton's compile (StageTimers.wrap): each call made in a graph stage that takes longer than
    SLOW_COMPILE_S goes to `log` with its kernel's name and specialization (signature, attributes, constexprs)."""
    def observe(stage: str | None, seconds: float, args: tuple) -> None:
        if stage in GRAPH_STAGES and seconds > SLOW_COMPILE_S:
            src = args[0]
            fn = getattr(src, "fn", None)
            log.append({"stage": stage, "kernel": getattr(fn, "__name__", str(fn)), "seconds": round(seconds, 3),
                        **{k: str(getattr(src, k)) for k in ("signature", "attrs", "constexprs", "constants")
                           if hasattr(src, k)}})

    return observe


class AheadCheck:
    """The specializations compile_ahead's dry steps recorded against those the graphs' warm-ups and captures launch:
    each launch of a graph stage whose key (compile_ahead.Launch.key) was not recorded, with the parameters by which
    it differs from the nearest recorded launch of the same kernel."""

    def __init__(self, timers: StageTimers):
        from triton.runtime.jit import JITFunction

        self.ahead: dict[tuple, object] = {}
        self.graphs: dict[tuple, object] = {}
        distinct, run = compile_ahead_module.distinct, JITFunction.run

        def recorded_distinct(launches):
            jobs = distinct(launches)
            self.ahead.update((job.key(), job) for job in jobs)
            return jobs

        def observed_run(kernel, *args, grid, warmup, **kwargs):
            if not warmup and timers.stage in GRAPH_STAGES:
                try:
                    launch = compile_ahead_module.launch_of(kernel, args, kwargs)
                    self.graphs.setdefault(launch.key(), launch)
                except ValueError:
                    pass
            return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        timers.patch(compile_ahead_module, "distinct", recorded_distinct)
        timers.patch(JITFunction, "run", observed_run)

    def not_ahead(self) -> list[dict]:
        import inspect

        missed = []
        for key, launch in self.graphs.items():
            if key in self.ahead:
                continue
            names = list(inspect.signature(compile_ahead_module.kernel_of(launch.module, launch.name).fn).parameters)
            parts = key[2] + key[3]

            def differing(other: tuple) -> list[str]:
                return [f"{names[i] if i < len(key[2]) else parts[i][0]}: {b!r} ahead, {a!r} here"
                        for i, (a, b) in enumerate(zip(parts, other[2] + other[3])) if a != b]

            same_kernel = [differing(k) for k in self.ahead if k[:2] == key[:2] and len(k[2]) == len(key[2])]
            missed.append({"kernel": launch.name, "recorded_for_kernel": len(same_kernel),
                           "differs_by": min(same_kernel, key=len) if same_kernel else None})
        return missed


class LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def start_once(path: Path, device: torch.device, serve: ServeConfig | None = None) -> dict:
    """One start as `spear serve PATH` makes it (default flags, or `serve`'s), without the HTTP server: seconds by
    stage."""
    timers = StageTimers()
    for owner, attr, name in timed_functions():
        timers.wrap(owner, attr, name)
    import triton.compiler

    slow_compiles: list[dict] = []
    timers.wrap(triton.compiler, "compile", "triton_compile", sync=False,  # where the JIT looks it up
                observe=slow_compile_logger(slow_compiles))
    check = AheadCheck(timers) if device.type == "cuda" else None
    ahead_log = LogRecords()
    logging.getLogger(compile_ahead_module.__name__).addHandler(ahead_log)
    try:
        start = time.perf_counter()
        lm = api.load(str(path), device, serving=True)
        loaded = time.perf_counter() - start
        config = _engine_config(serve or ServeConfig(), lm.model.device)
        engine = engine_module.build_engine(lm.model, lm.tokenizer, config)
        total = time.perf_counter() - start
        runner = engine.runner
        row = {"total_s": total, "load_s": loaded, **{f"{k}_s": v for k, v in engine.startup_s.items()},
               "timed_s": dict(timers.seconds), "timed_calls": dict(timers.calls),
               "decode_graph_buckets": sorted(runner.graphs), "mixed_graph_buckets": sorted(runner.mixed),
               "kv_blocks": runner.cache.num_blocks, "kv_bytes": runner.cache.nbytes,
               "max_num_seqs": config.max_num_seqs, "max_model_len": runner.max_model_len,
               "slow_graph_compiles": slow_compiles, "compile_ahead_log": ahead_log.lines,
               "graph_launches_not_ahead": check.not_ahead() if check else [],
               "launches_recorded_ahead": len(check.ahead) if check else 0,
               "graph_launches": len(check.graphs) if check else 0}
        if device.type == "cuda":
            row["device_memory_peak"] = torch.cuda.max_memory_allocated(device)
    finally:
        timers.undo()
        logging.getLogger(compile_ahead_module.__name__).removeHandler(ahead_log)
    del engine, runner, lm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return row


def brief(label: str, row: dict) -> str:
    timed = ", ".join(f"{k} {v:.1f} s ({row['timed_calls'][k]})" for k, v in row["timed_s"].items())
    return (f"{label}: ready in {row['total_s']:.1f} s = load {row['load_s']:.1f} + kernels {row['kernels_s']:.1f} "
            f"+ kv cache and graphs {row['kv_cache_and_graphs_s']:.1f}; timed: {timed}; "
            f"{len(row['graph_launches_not_ahead'])} of {row['graph_launches']} graph launch specializations not among "
            f"the {row['launches_recorded_ahead']} compiled ahead, e.g. "
            f"{[m['differs_by'] for m in row['graph_launches_not_ahead'][:3]]}; "
            f"compile_ahead said {row['compile_ahead_log']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    p.add_argument("--ec-fraction", type=float, default=0.15, help="share of the linears with an EC (default 0.15)")
    p.add_argument("--starts", type=int, default=2, help="starts in this process: the first cold, then warm")
    p.add_argument("--workdir", default=None, help="where the artifact is written (default: a temp dir, removed)")
    p.add_argument("--gpu-memory-utilization", type=float, default=ServeConfig.gpu_memory_utilization,
                   help="as spear serve's: the KV cache's share of the card (default %(default)s)")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="spear-startup-"))
    path = workdir / f"{args.model}-ec{args.ec_fraction:g}"
    started = time.perf_counter()
    if not path.is_dir():
        write_random_artifact(MODELS[args.model], path, args.ec_fraction, EC_RANK, device=device)
    record = {"model": args.model, "ec_fraction": args.ec_fraction, "ec_rank": EC_RANK, "device": str(device),
              "gpu_memory_utilization": args.gpu_memory_utilization,
              "artifact_bytes": safetensors_bytes(path), "write_s": time.perf_counter() - started, "starts": []}
    for i in range(args.starts):
        row = start_once(path, device, ServeConfig(gpu_memory_utilization=args.gpu_memory_utilization))
        record["starts"].append(row)
        print(brief("cold" if i == 0 else "warm", row), flush=True)
        write_json(args.json, record)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
