"""Timing GPU calls as a CUDA graph replays them: no Python launch overhead in the figure, which at
M = 1 (a few µs of kernel) would otherwise be most of it. Used by the tuner and the benchmarks."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def time_in_graph(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Median µs per call over `reps` replays of one CUDA graph that makes every call in order.

    Pass calls over several copies of the data (more bytes than the L2 cache holds) to time reads
    from HBM rather than from cache."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture: compile, autotune, allocate
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)
