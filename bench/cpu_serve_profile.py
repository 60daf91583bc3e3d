"""Where a CPU decode step of `spear serve` goes, in process (issue 53): the engine built as `spear serve` builds it.

    python bench/cpu_serve_profile.py --artifact runs/smollm2-w4/artifact --json bench/results/cpu_serve_profile.json
    python bench/cpu_serve_profile.py --artifact ... --no-profile          # step times only (a minute)

Loads the artifact for serving, sets PyTorch's threads as `spear serve` does (launch.cpu_serving_threads;
OMP_NUM_THREADS, when set, decides) and builds the engine from launch's EngineConfig; then, per batch, admits that
many requests of the bench's prompts (greedy, EOS ignored), prefills them and times `--steps` decode steps through
Engine.step (scheduler, forward, sampling, detokenizer): the median step's wall time and the engine thread's CPU time
(which other processes on the cores move less), against which a server's tokens/s over HTTP
(bench/cpu_serve_compare.py) sizes its own overhead. Unless --no-profile, one run of the same steps under cProfile
(Python functions, cumulative) and one under torch.profiler (operators, self CPU time a step) print where a step
goes; the JSON keeps the top rows of both.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import write_json
from cpu_serve_compare import PROMPTS

from spear import api
from spear.runtime.engine import Engine, build_engine
from spear.runtime.requests import SamplingParams
from spear.server.launch import ServeConfig, _engine_config, cpu_serving_threads


def start(engine: Engine, tokenizer, batch: int, max_tokens: int, tag: str) -> None:
    """Admit `batch` requests and step until every one is decoding (prefilled, first token out)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}{i}", tokenizer.encode(PROMPTS[i % len(PROMPTS)]), params)
    while engine.waiting or any(not s.prefilled for s in engine.running):
        engine.step()
    engine.step()


def drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def timed_steps(engine: Engine, steps: int) -> tuple[list[float], list[float]]:
    """Each step's wall time and this thread's CPU time (the latter less moved by other processes on the cores)."""
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return wall, cpu


def profile(engine: Engine, steps: int, top: int) -> dict:
    """The same steps under cProfile (Python functions, cumulative) and torch.profiler (operators by self CPU time,
    per step); both printed."""
    profiler = cProfile.Profile()
    profiler.enable()
    timed_steps(engine, steps)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        timed_steps(engine, steps)
    print(text.getvalue())
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return {"ops_self_ms_per_step": {e.key: e.self_cpu_time_total / 1e3 / steps for e in ops},
            "ops_calls_per_step": {e.key: e.count / steps for e in ops}, "cprofile": text.getvalue().splitlines()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-profile", action="store_true", help="time the steps only")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    lm = api.load(args.artifact, torch.device("cpu"), serving=True)
    torch.set_num_threads(cpu_serving_threads(ServeConfig().engine_process))
    config = _engine_config(ServeConfig(), torch.device("cpu"))
    engine = build_engine(lm.model, lm.tokenizer, config)
    tokenizer = lm.tokenizer
    del lm
    results = {"artifact": args.artifact, "threads": torch.get_num_threads(), "torch": torch.__version__,
               "steps": args.steps, "loadavg_start": os.getloadavg(), "batches": {}}
    max_tokens = 3 * args.steps + 8
    for batch in args.batches:
        start(engine, tokenizer, batch, max_tokens, f"warm{batch}-")
        timed_steps(engine, 3)
        times, cpu = timed_steps(engine, args.steps)
        ms, cpu_ms = statistics.median(times) * 1e3, statistics.median(cpu) * 1e3
        print(f"batch {batch}: median decode step {ms:.1f} ms, {cpu_ms:.1f} ms of CPU time "
              f"({batch / ms * 1e3:.1f} tokens/s in process)", flush=True)
        results["batches"][str(batch)] = {"step_ms_median": ms, "step_cpu_ms_median": cpu_ms,
                                          "step_ms": [t * 1e3 for t in times], "tokens_per_s": batch / ms * 1e3}
        if not args.no_profile:
            results["batches"][str(batch)] |= profile(engine, args.steps, args.top)
        drain(engine)
    if args.json:
        write_json(args.json, results)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
