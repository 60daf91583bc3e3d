"""Prometheus metrics of one server: latency histograms and the engine's gauges."""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

from spear.server.async_engine import AsyncEngine

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.016, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """One registry per app, so that several servers (tests) never share counters."""

    def __init__(self, engine: AsyncEngine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("spear_time_to_first_token_seconds", "Time from request arrival to its first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("spear_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             buckets=_ITL_BUCKETS, registry=r)
        self.prompt_tokens = Counter("spear_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("spear_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.finished = Counter("spear_requests_finished", "Finished requests by reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("spear_requests_rejected", "Requests answered 429 because the queue was full",
                                registry=r)
        self.aborted = Counter("spear_requests_aborted", "Requests whose client left before the end", registry=r)
        self.failed = Counter("spear_requests_failed", "Requests the engine failed (a step or their own sampling)",
                              registry=r)
        gauges = {
            "spear_queue_depth": ("Requests waiting for the engine (accepted, not yet running)", "queue_depth"),
            "spear_num_requests_running": ("Requests the engine is running", "num_running"),
            "spear_num_requests_waiting": ("Requests the engine holds but is not running yet", "num_waiting"),
            "spear_kv_blocks_used": ("KV-cache blocks in use", "kv_blocks_used"),
            "spear_kv_blocks_total": ("KV-cache blocks in all", "kv_blocks_total"),
        }
        for name, (doc, field) in gauges.items():
            Gauge(name, doc, registry=r).set_function(lambda field=field: getattr(engine.stats, field))
        r.register(EngineCounters(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCounters:
    """Counters the engine keeps itself (a collector: they are read from its stats, not incremented here)."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        yield CounterMetricFamily("spear_num_preemptions", "Running requests preempted because the KV cache was full "
                                  "(their blocks freed, to be recomputed)", value=self.engine.stats.num_preemptions)


class RequestTimer:
    """Feeds one request's token arrival times to the TTFT and ITL histograms."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = self.last = time.perf_counter()
        self.tokens = 0

    def tokens_arrived(self, count: int) -> None:
        if count == 0:
            return
        now = time.perf_counter()
        if self.tokens == 0:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.tokens += count
