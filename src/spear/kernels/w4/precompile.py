"""Compile the W4 tuner's candidates in parallel processes before tune_w4 times them one by one.

On a machine whose Triton cache is empty, tuning an 8B model's shapes compiles some hundred kernel variants, one
after another, each taking seconds of one CPU core: 163 s of a 259 s `spear serve` start on an H100
(bench/serve_startup.py). Here worker processes (spawned, one CUDA context each) launch every candidate once on
random tensors of the same shapes and dtypes, so each variant is compiled once, by one worker, into Triton's on-disk
cache (TRITON_CACHE_DIR, which the workers inherit); tune_w4 then finds every compile there. Candidate j of a
bucket goes to worker j mod W for every shape, as the shapes share most compiled variants. Only buckets that
tune_w4 would time (not in its cache) are compiled; fewer than two workers, no GPU or Triton's interpreter: nothing
is done.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from spear.kernels.pack import PackedEC, PackedW4

MAX_WORKERS = 16

TensorSpec = tuple[tuple[int, ...], str]  # shape, dtype name: a tensor to make up in a worker


@dataclass(frozen=True)
class CompileJob:
    """A weight shape (and EC) and the row buckets whose candidates tune_w4 will time."""

    weight: dict[str, TensorSpec]  # PackedW4's tensors
    group_size: int
    in_features: int
    ms: tuple[int, ...]
    ec: dict[str, TensorSpec] | None = None  # PackedEC's tensors (an int8 EC's: int8 A and B, their scales)
    ec_rank: int = 0
    ec_gated: bool = False


def _spec(t: torch.Tensor) -> TensorSpec:
    return tuple(t.shape), str(t.dtype).removeprefix("torch.")


def compile_job(w: PackedW4, ms: tuple[int, ...], ec: PackedEC | None = None) -> CompileJob:
    weight = {k: _spec(getattr(w, k)) for k in ("qweight", "scales", "zeros")}
    ec_specs = None if ec is None else {k: _spec(t) for k, t in ec.tensors().items()}
    return CompileJob(weight, w.group_size, w.in_features, tuple(ms), ec_specs,
                      ec.rank if ec is not None else 0, ec.gated if ec is not None else False)


def default_workers() -> int:
    """One fewer than the cores this process may use, at most MAX_WORKERS ($SPEAR_COMPILE_WORKERS overrides)."""
    if (env := os.environ.get("SPEAR_COMPILE_WORKERS")) is not None:
        return int(env)
    return max(0, min(MAX_WORKERS, len(os.sched_getaffinity(0)) - 1))


def precompile_w4(jobs: list[CompileJob], workers: int | None = None) -> int:
    """Compile every candidate of `jobs` into Triton's disk cache over `workers` processes; returns the workers
    used (0: not worth it, nothing done)."""
    jobs = [j for j in jobs if j.ms]
    if not jobs or not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    workers = default_workers() if workers is None else workers
    if workers < 2:
        return 0
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked once initialised
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        list(pool.map(_compile_share, [(jobs, share, workers) for share in range(workers)]))
    return workers


def _made_up(specs: dict[str, TensorSpec], device: torch.device) -> dict[str, torch.Tensor]:
    """Tensors of the given shapes and dtypes (values do not matter to a compile: small, finite)."""
    out = {}
    for name, (shape, dtype) in specs.items():
        dt = getattr(torch, dtype)
        out[name] = (torch.randint(0, min(1 << 16, torch.iinfo(dt).max), shape, dtype=dt, device=device)
                     if not dt.is_floating_point else torch.rand(shape, device=device).to(dt) * 0.01)
    return out


def _compile_share(args: tuple[list[CompileJob], int, int]) -> int:
    """Worker `share` of `workers`: launch candidate j of each job's buckets where j % workers == share."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from spear.kernels.w4.config import DECODE_KERNEL_MAX_M, _tune_candidates
    from spear.kernels.w4.decode import w4_decode
    from spear.kernels.w4.prefill import w4_prefill_fused

    jobs, share, workers = args
    device = torch.device("cuda")
    launched = 0
    for job in jobs:
        w = PackedW4(**_made_up(job.weight, device), group_size=job.group_size, in_features=job.in_features)
        ec = None if job.ec is None else PackedEC(**_made_up(job.ec, device), rank=job.ec_rank, gated=job.ec_gated)
        for m in job.ms:
            x = torch.randn(m, job.in_features, dtype=torch.float16, device=device)
            run = w4_decode if m <= DECODE_KERNEL_MAX_M else w4_prefill_fused
            for j, cfg in enumerate(_tune_candidates(m)):
                if j % workers != share:
                    continue
                try:
                    run(x, w, ec, cfg=cfg)
                    launched += 1
                except (OutOfResources, CompilationError):  # not a candidate here: tune_w4 skips it too
                    pass
    torch.cuda.synchronize()
    return launched
