"""Soak: concurrent clients with random lengths, mid-stream disconnects and clients that give up, against the real
engine behind the real HTTP stack. Afterwards no KV block is held, the process's RSS is flat (within 10%) and greedy
answers are what they were at the start.

A bounded run on the tiny model is part of CI; the long one is marked `soak`:
    SPEAR_SOAK_SECONDS=600 SPEAR_SOAK_CLIENTS=32 python -m pytest -m soak tests/test_soak.py -s
(SmolLM2 on CPU; it prints its report as one JSON line)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field

import httpx
import pytest
import torch
from server_harness import CHAT_TEMPLATE, running_server, wait_until

from spear.runtime.engine import EngineConfig, build_engine
from spear.server.app import build_app
from spear.server.async_engine import AsyncEngine

WORDS = "the a river stone light over under quick slow red green city forest night morning said and went".split()
GREEDY_PROMPTS = ("Once upon a time", "The capital of France is", "1, 2, 3, 4,")


@dataclass
class SoakReport:
    seconds: float
    clients: int
    served: int = 0  # requests answered whole (non-streamed, or streamed to [DONE])
    disconnected: int = 0  # streams the client left mid-way
    gave_up: int = 0  # non-streamed requests the client stopped waiting for
    rejected: int = 0  # 429
    server_errors: int = 0  # 5xx or a stream's error event
    aborted: int = 0  # requests the server saw their client leave before the end (a client may leave after it)
    tokens: int = 0  # streamed tokens received
    p50_itl_ms: float = 0.0  # gaps between a stream's consecutive tokens, as the client saw them
    p99_itl_ms: float = 0.0
    kv_blocks_used_end: int = -1
    rss_start_mb: float = 0.0  # after the warm-up (the first tenth of the run, at least 5 s)
    rss_end_mb: float = 0.0
    greedy_unchanged: bool = False
    gaps: list[float] = field(default_factory=list, repr=False)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def one_request(http: httpx.AsyncClient, rng: random.Random, report: SoakReport, max_tokens: int) -> None:
    words = " ".join(rng.choices(WORDS, k=rng.randint(1, 60)))
    body = {"max_tokens": rng.randint(1, max_tokens), "temperature": rng.choice([0, 0.8]), "ignore_eos": True}
    if rng.random() < 0.25:
        path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": words}]}
    else:
        path, body = "/v1/completions", {**body, "prompt": words}
    kind = rng.choices(["whole", "stream", "disconnect", "give_up"], weights=[3, 4, 2, 1])[0]
    if kind in ("whole", "give_up"):
        try:
            r = await asyncio.wait_for(http.post(path, json=body), timeout=rng.uniform(0.05, 1.0) if kind == "give_up" else None)
        except TimeoutError:
            report.gave_up += 1
            return
        report.served += r.status_code == 200
        report.rejected += r.status_code == 429
        report.server_errors += r.status_code >= 500
        return
    leave_after = rng.randint(1, body["max_tokens"] - 1) if kind == "disconnect" and body["max_tokens"] > 1 else None
    async with http.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            report.rejected += r.status_code == 429
            report.server_errors += r.status_code >= 500
            return
        last, seen = None, 0
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                report.served += 1
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    report.server_errors += 1
                    return
                if not event["choices"] or event["choices"][0].get("finish_reason") or "role" in event["choices"][0].get("delta", {}):
                    continue
                now = time.perf_counter()
                if last is not None:
                    report.gaps.append(now - last)
                last, seen = now, seen + 1
                report.tokens += 1
                if seen == leave_after:
                    report.disconnected += 1
                    return


async def clients(url: str, n: int, seconds: float, max_tokens: int, report: SoakReport, rss: list) -> None:
    deadline = time.monotonic() + seconds
    warm = time.monotonic() + max(5.0, seconds / 10)

    async def client(seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            while time.monotonic() < deadline:
                await one_request(http, rng, report, max_tokens)

    async def sample_rss() -> None:
        while time.monotonic() < warm:
            await asyncio.sleep(0.5)
        rss.append(rss_mb())

    await asyncio.gather(sample_rss(), *(client(i) for i in range(n)))


def greedy(url: str) -> list[str]:
    body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    return [httpx.post(f"{url}/v1/completions", json={**body, "prompt": p}, timeout=120).json()["choices"][0]["text"]
            for p in GREEDY_PROMPTS]


def soak(lm, name: str, seconds: float, n_clients: int, max_tokens: int, max_model_len: int) -> SoakReport:
    engine = build_engine(lm.model, lm.tokenizer, EngineConfig(max_model_len=max_model_len, overlap=True))
    async_engine = AsyncEngine(engine)
    report = SoakReport(seconds, n_clients)
    with running_server(build_app(async_engine, lm.tokenizer, name, engine.max_model_len)) as url:
        before = greedy(url)
        rss: list[float] = []
        asyncio.run(clients(url, n_clients, seconds, max_tokens, report, rss))
        wait_until(lambda: async_engine.stats.num_running == 0 and async_engine.stats.queue_depth == 0, timeout=60)
        metrics = httpx.get(f"{url}/metrics").text
        report.kv_blocks_used_end = int(float(next(line.split()[1] for line in metrics.splitlines()
                                                   if line.startswith("spear_kv_blocks_used "))))
        report.greedy_unchanged = greedy(url) == before
        report.rss_start_mb, report.rss_end_mb = rss[0], rss_mb()
        report.aborted = int(float(next(line.split()[1] for line in metrics.splitlines()
                                        if line.startswith("spear_requests_aborted_total"))))
    gaps = sorted(report.gaps)
    report.p50_itl_ms, report.p99_itl_ms = (1e3 * gaps[int(q * (len(gaps) - 1))] for q in (0.5, 0.99))
    assert engine.kv_blocks_used == 0
    return report


def check(report: SoakReport) -> None:
    assert report.server_errors == 0 and report.rejected == 0, report
    assert report.served > 0 and report.disconnected > 0 and report.gave_up > 0 and report.aborted > 0, report
    assert report.kv_blocks_used_end == 0, report
    assert abs(report.rss_end_mb - report.rss_start_mb) <= 0.1 * report.rss_start_mb, report
    assert report.greedy_unchanged, report


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from spear.models import load_float_model

    lm = load_float_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)
    lm.tokenizer.chat_template = CHAT_TEMPLATE
    return lm


def test_short_soak_tiny(tiny):
    check(soak(tiny, "tiny", seconds=10, n_clients=8, max_tokens=48, max_model_len=256))


@pytest.mark.soak
def test_long_soak(smollm2):
    seconds = float(os.environ.get("SPEAR_SOAK_SECONDS", 600))
    report = soak(smollm2, "smollm2", seconds, int(os.environ.get("SPEAR_SOAK_CLIENTS", 32)), max_tokens=64,
                  max_model_len=512)
    print(json.dumps({k: v for k, v in asdict(report).items() if k != "gaps"}))
    check(report)
