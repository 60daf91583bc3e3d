"""Compile ahead: the Triton kernels a piece of code will launch, compiled in parallel processes before it runs.

A CUDA graph's capture needs its kernels compiled first, and the warm-ups before the captures compile each variant
they meet one after another: on a fresh machine, 55 compiles and 82 s of an 8B model's `spear serve` start on an H100
(bench/serve_startup.py), after the W4 tuner's own candidates were compiled in parallel (w4/precompile.py).

`compile_ahead(fn)` runs `fn` once with every Triton launch recorded instead of compiled and run (record_launches:
the outputs stay as allocated, so `fn` must not branch on what a kernel computes), keeps one launch per Triton
specialization (the kernel, each tensor's dtype and 16-byte alignment, each integer's == 1 and % 16 == 0 and width,
every other argument as is), and has spawned worker processes compile those launches (`run(..., warmup=True)` on
made-up tensors of the same dtypes and alignment) into Triton's on-disk cache (TRITON_CACHE_DIR, which the workers
inherit), each with its launcher. The real warm-ups then find every compile there; a restart that records the same
launches for the same Triton cache skips the workers (done_marker). Fewer than two workers ($SPEAR_COMPILE_WORKERS),
no GPU or Triton's interpreter: nothing is done. A failure is logged, and the warm-ups compile as before. Each
worker holds a CUDA context and a few small tensors of its own, so the runtime calls this before its KV cache takes
the free memory (runtime.runner.compile_graphs): called after, 52 of an 8B model's 78 compiles failed for memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from spear.kernels.w4.precompile import default_workers

log = logging.getLogger(__name__)

INT32 = (-(2**31), 2**31 - 1)


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument as a compile sees it: its dtype and whether its address is 16-byte aligned."""

    dtype: str
    aligned: bool


@dataclass
class Launch:
    """One recorded launch: the kernel by its module and name, its arguments with tensors as TensorArg."""

    module: str
    name: str
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)
    runtime: frozenset = frozenset()  # the positions and names of the kernel's runtime (not constexpr) parameters

    def key(self) -> tuple:
        """What Triton specializes a compile on: a runtime integer by == 1, % 16 == 0 and width, any other value as
        is (over-splitting is harmless: a second compile hits the cache)."""
        def part(at: int | str, value: Any) -> Any:
            return _specialized(value) if at in self.runtime else repr(value)

        return (self.module, self.name, tuple(part(i, v) for i, v in enumerate(self.args)),
                tuple(sorted((k, part(k, v)) for k, v in self.kwargs.items())))


def _specialized(value: Any) -> Any:
    if isinstance(value, float):
        return "float"  # typed, never specialized on its value
    if isinstance(value, bool) or not isinstance(value, int):
        return repr(value)
    return "int", value == 1, value % 16 == 0, INT32[0] <= value <= INT32[1]


def _runtime_parameters(kernel, num_args: int) -> frozenset:
    """Positions (of the first `num_args`) and names of `kernel`'s parameters that are not constexpr, read from
    the Python function's annotations (`tl.constexpr`, or its string under postponed annotations)."""
    import triton.language as tl

    runtime = []
    for i, (name, p) in enumerate(inspect.signature(kernel.fn).parameters.items()):
        if not (p.annotation is tl.constexpr or (isinstance(p.annotation, str) and "constexpr" in p.annotation)):
            runtime += [name] + ([i] if i < num_args else [])
    return frozenset(runtime)


def _recorded(value: Any) -> Any:
    """An argument as a worker can remake it (TensorArg for tensors); ValueError where it cannot."""
    if isinstance(value, torch.Tensor):
        return TensorArg(str(value.dtype).removeprefix("torch."), value.data_ptr() % 16 == 0)
    import triton.language as tl

    if value is None or isinstance(value, (bool, int, float, str, tl.dtype)):
        return value
    raise ValueError(f"an argument of type {type(value).__name__}")


def _kernel_classes() -> list[type]:
    from triton.runtime.jit import JITFunction

    classes: list[type] = [JITFunction]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    return classes


def launch_of(kernel, args: tuple, kwargs: dict) -> Launch:
    """The launch `kernel[grid](*args, **kwargs)` as recorded (ValueError: an argument a worker cannot remake)."""
    fn = kernel.fn
    return Launch(fn.__module__, fn.__name__, tuple(map(_recorded, args)), {k: _recorded(v) for k, v in kwargs.items()},
                  _runtime_parameters(kernel, len(args)))


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Within the block every Triton launch (`kernel[grid](...)`) is appended to the yielded list, not compiled
    nor run; a launch whose arguments a worker could not remake is skipped (its warm-up compiles it)."""
    launches: list[Launch] = []
    originals = {cls: cls.run for cls in _kernel_classes()}

    def recording_run(self, *args, grid, warmup, **kwargs):
        if warmup:
            return originals[type(self)](self, *args, grid=grid, warmup=warmup, **kwargs)
        try:
            launches.append(launch_of(self, args, kwargs))
        except ValueError as e:
            log.debug("not compiled ahead: %s.%s takes %s", self.fn.__module__, self.fn.__name__, e)
        return None

    for cls in originals:
        cls.run = recording_run
    try:
        yield launches
    finally:
        for cls, run in originals.items():
            cls.run = run


def distinct(launches: list[Launch]) -> list[Launch]:
    """One launch per specialization key, in first-seen order."""
    seen: dict[tuple, Launch] = {}
    for launch in launches:
        seen.setdefault(launch.key(), launch)
    return list(seen.values())


def compile_ahead(fn: Callable[[], Any], workers: int | None = None) -> int:
    """Run `fn` with its Triton launches recorded, then compile them over `workers` spawned processes; returns how
    many distinct launches were compiled ahead (0: nothing done)."""
    workers = default_workers() if workers is None else workers
    if workers < 2 or not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    try:
        with record_launches() as launches:
            fn()
        torch.cuda.synchronize()
        jobs = distinct(launches)
        done = done_marker(jobs)
        if not jobs or done.exists():  # a restart: its warm-ups find every compile on disk (9 s of workers saved)
            return 0
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked once initialised
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context) as pool:
            errors = [e for e in pool.map(_compile_one, jobs) if e is not None]
        if errors:
            log.warning("%d of %d kernels did not compile ahead (first: %s); their warm-ups compile them",
                        len(errors), len(jobs), errors[0])
        done.parent.mkdir(parents=True, exist_ok=True)
        done.touch()
        return len(jobs)
    except Exception as e:  # the warm-ups compile what this did not
        log.warning("compiling ahead failed (%s: %s); the warm-ups compile one kernel at a time", type(e).__name__, e)
        return 0


def done_marker(jobs: list[Launch]) -> Path:
    """The file that says these launches were compiled by this Triton for this GPU, kept in the Triton cache they
    went to (so a cache emptied since takes the marker with it)."""
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    triton_cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    what = repr((triton.__version__, device, sorted(repr(job.key()) for job in jobs)))
    return triton_cache / "spear_compile_ahead" / hashlib.sha256(what.encode()).hexdigest()[:32]


def remade(value: Any, device: torch.device) -> Any:
    """A recorded argument made up again: a small tensor of its dtype (offset by one element where the recorded
    one was not 16-byte aligned)."""
    if not isinstance(value, TensorArg):
        return value
    t = torch.zeros(64, dtype=getattr(torch, value.dtype), device=device)
    return t if value.aligned else t[1:]


def kernel_of(module: str, name: str):
    """The JIT function `name` of `module`, through the wrappers (heuristics, autotuners) a module may put on it."""
    kernel = getattr(importlib.import_module(module), name)
    while not isinstance(kernel, tuple(_kernel_classes())):
        kernel = kernel.fn
    return kernel


def _compile_one(launch: Launch) -> str | None:
    """In a worker: compile one launch into Triton's disk cache; why it did not, in a line, where it did not."""
    device = torch.device("cuda")
    try:
        kernel = kernel_of(launch.module, launch.name)
        compiled = kernel.run(*[remade(a, device) for a in launch.args], grid=(1,), warmup=True,
                              **{k: remade(v, device) for k, v in launch.kwargs.items()})
        init = getattr(compiled, "_init_handles", None)
        if init is not None:  # its launcher too: a C stub built by the host compiler (~0.7 s), cached on disk
            init()
        return None
    except Exception as e:  # its warm-up in the server compiles it, and says what is wrong
        return f"{launch.name}: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
