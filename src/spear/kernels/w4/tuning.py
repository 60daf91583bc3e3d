"""The W4 tuner: time the candidate configs of a weight shape at each row bucket, keep the fastest (in this
process, config._TUNED, and on disk, kernels.tune_cache)."""

from __future__ import annotations

import functools

import torch
import triton

from spear.kernels import tune_cache
from spear.kernels.pack import PackedEC, PackedW4
from spear.kernels.w4 import config
from spear.kernels.w4.config import (
    DECODE_KERNEL_MAX_M,
    DecodeConfig,
    PrefillConfig,
    _tune_candidates,
    _tune_key,
)
from spear.kernels.w4.decode import w4_decode
from spear.kernels.w4.prefill import w4_prefill_fused


TUNE_BYTES = 128 << 20  # weight bytes per timed graph when tuning: more than the H200's 50 MB L2
TUNE_ROWS = (1, 4, 16, 32, 64, 128)  # tune_w4's row buckets by default


def _read_cached_choices(w: PackedW4, ms: tuple[int, ...], ec: PackedEC | None) -> None:
    """Another process's choices (kernels.tune_cache), for the buckets not tuned in this one."""
    cache = tune_cache.path()
    if cache is None or all(_tune_key(w, m, ec) in config._TUNED for m in ms):
        return
    entries = tune_cache.read(cache)
    for m in ms:
        cfg = tune_cache.config(entries.get(tune_cache.key(w.qweight.device, _tune_key(w, m, ec))),
                                (DecodeConfig, PrefillConfig), _tune_candidates(m))
        if cfg is not None:
            config._TUNED.setdefault(_tune_key(w, m, ec), cfg)


def untuned_buckets(w: PackedW4, ms: tuple[int, ...], ec: PackedEC | None = None) -> tuple[int, ...]:
    """The buckets of `ms` that tune_w4(w, ms, ec=ec) would time: chosen neither in this process nor in the cache."""
    if ec is not None:
        ms = tuple(m for m in ms if m <= DECODE_KERNEL_MAX_M)
    _read_cached_choices(w, ms, ec)
    return tuple(m for m in ms if _tune_key(w, m, ec) not in config._TUNED)


def tune_w4(w: PackedW4, ms: tuple[int, ...] = TUNE_ROWS, timings: dict | None = None,
            ec: PackedEC | None = None) -> dict[int, DecodeConfig | PrefillConfig]:
    """Time the candidate configs of the Triton GEMMs for this weight shape at each M (CUDA only, outside
    graph capture; about 10 ms a candidate): the decode kernel up to DECODE_KERNEL_MAX_M rows (its GEMV loop
    only where M ≤ 4), the fused prefill kernel above. Later calls with the same shape and M bucket use the
    fastest. Returns the choice per M. With `timings`, every bucket is timed again and every candidate's
    median µs goes into `timings[m]`; without, buckets tuned before keep their choice (an engine rebuilt in
    the same process does not tune twice). With `ec`, the decode launch with that EC (rows ≤
    DECODE_KERNEL_MAX_M only); launches with an EC of a rank not tuned use W4's choice. Choices persist in a
    JSON file, per GPU, Triton and torch version and kernel source (kernels.tune_cache; $SPEAR_TUNE_CACHE names
    another file, or 0 for none): without `timings`, a bucket found there is not timed again."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from spear.kernels.timing import time_in_graph

    # Timed in a CUDA graph over enough weight copies to overflow the L2 cache: HBM reads, no launch overhead.
    if ec is not None:
        ms = tuple(m for m in ms if m <= DECODE_KERNEL_MAX_M)
    cache = tune_cache.path()
    if timings is None:
        _read_cached_choices(w, ms, ec)
    tuned = config._TUNED
    chosen = {m: tuned[_tune_key(w, m, ec)] for m in ms if timings is None and _tune_key(w, m, ec) in tuned}
    if len(chosen) == len(ms):
        return chosen
    to_time = [m for m in ms if m not in chosen]
    fastest = {}  # m → the fastest candidates' (µs, config), kept in the cache beside the choice
    copies = [w] + [w.clone() for _ in range(max(1, triton.cdiv(TUNE_BYTES, w.nbytes())) - 1)]
    for m in to_time:
        x = torch.randn(m, w.in_features, dtype=torch.float16, device=w.qweight.device)
        run = w4_decode if m <= DECODE_KERNEL_MAX_M else w4_prefill_fused
        measured = []
        for cfg in _tune_candidates(m):
            try:
                calls = [functools.partial(run, x, copy, ec, cfg=cfg) for copy in copies]
                measured.append((time_in_graph(calls, reps=5), cfg))
            except (OutOfResources, CompilationError):  # e.g. out of shared memory: not a candidate
                pass
        ranked = [(round(us, 2), cfg) for us, cfg in sorted(measured, key=lambda t: t[0])]
        chosen[m] = config._TUNED[_tune_key(w, m, ec)] = ranked[0][1]
        fastest[m] = ranked[:3]
        if timings is not None:
            timings[m] = ranked
    if cache is not None:
        keys = {m: tune_cache.key(w.qweight.device, _tune_key(w, m, ec)) for m in to_time}
        tune_cache.write(cache, {keys[m]: chosen[m] for m in to_time}, {keys[m]: fastest[m] for m in to_time})
    return chosen
