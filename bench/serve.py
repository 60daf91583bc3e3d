"""Online serving benchmark through the HTTP API (issue 6, item 3).

    spear serve smollm2 &  python bench/serve.py --rate 4 --num-requests 200 --json bench/results/serve.json
    python bench/serve.py --launch smollm2 --num-requests 32 --rate 2 --json /tmp/serve.json   # starts the server

N requests arrive as a Poisson process at `--rate` requests/s. Prompt and output lengths
are drawn (seeded) from lognormal fits of ShareGPT-like conversations (medians and
log-sigmas below), clipped to fit the server's context. Prompts are random token ids in
[3, 256), so every length is exact on any vocabulary; outputs run to their length
(ignore_eos). Each request streams over SSE (/v1/completions), one chunk per token; the
client records the arrival time of every chunk. TTFT: send → first chunk. ITL: gaps between chunks. TPOT:
(latency − TTFT) / (output tokens − 1). SLO attainment: the share of inter-token gaps,
and of requests by TPOT, within `--itl-slo-ms`. Writes JSON (with provenance) and a PNG
of every inter-token gap over the run's time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import numpy as np
from common import write_json


@dataclass
class RequestRecord:
    sent: float  # seconds since the run's start
    prompt_tokens: int
    output_tokens: int  # asked for
    chunk_times: list[float] = field(default_factory=list)  # seconds since the run's start
    completion_tokens: int = 0  # the server's usage count
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.chunk_times))

    @property
    def tpot(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)


def sample_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int)


async def send(client: httpx.AsyncClient, model: str, record: RequestRecord, prompt: list[int], t0: float) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": record.output_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    record.completion_tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:  # one chunk per token
                    record.chunk_times.append(time.perf_counter() - t0)
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
    if record.error is None and not record.chunk_times:
        record.error = "no tokens streamed"


async def run(url: str, model: str, records: list[RequestRecord], prompts: list[list[int]], timeout: float) -> float:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for record, prompt in zip(records, prompts):
            await asyncio.sleep(max(0.0, record.sent - (time.perf_counter() - t0)))
            tasks.append(asyncio.create_task(send(client, model, record, prompt, t0)))
        await asyncio.gather(*tasks)
        return time.perf_counter() - t0


def percentiles(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99]) * scale
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(values) * scale)}


def summarize(records: list[RequestRecord], makespan: float, slo_s: float) -> dict:
    ok = [r for r in records if r.error is None]
    itls = [g for r in ok for g in r.itls]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    output_tokens = sum(r.completion_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "makespan_s": makespan,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "itl_ms": percentiles(itls),
        "tpot_ms": percentiles(tpots),
        "itl_slo_ms": slo_s * 1000,
        "slo_attainment_itl": float(np.mean([g <= slo_s for g in itls])) if itls else None,
        "slo_attainment_requests_tpot": float(np.mean([t <= slo_s for t in tpots])) if tpots else None,
        "request_throughput": len(ok) / makespan,
        "output_token_throughput": output_tokens / makespan,
        "total_token_throughput": (output_tokens + sum(r.prompt_tokens for r in ok)) / makespan,
    }


def plot(records: list[RequestRecord], slo_s: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [t for r in records if r.error is None for t in r.chunk_times[1:]]
    gaps = [g * 1000 for r in records if r.error is None for g in r.itls]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.scatter(times, gaps, s=2, alpha=0.4, label="inter-token gap")
    ax.axhline(slo_s * 1000, color="red", linestyle="--", label=f"ITL SLO {slo_s * 1000:g} ms")
    ax.set(xlabel="time since start (s)", ylabel="ITL (ms)", yscale="log", title=title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def launch(spec: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """Start `spear serve spec` on a free port; returns the process and its base URL once it answers."""
    proc = subprocess.Popen([sys.executable, "-m", "spear.cli", "serve", spec, "--port", "0", *extra],
                            stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    line = proc.stdout.readline()
    found = re.search(r"(http://\S+)/v1", line)
    if found is None:
        proc.kill()
        sys.exit(f"the server did not start: {line.strip() or 'no output'}")
    url = found.group(1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    sys.exit("the server did not become healthy within 120 s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running server (ignored with --launch)")
    p.add_argument("--launch", default=None, metavar="MODEL", help="start `spear serve MODEL` for the run")
    p.add_argument("--serve-args", default="", help="extra options for the launched server, e.g. '--chunk-tokens 256'")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--rate", type=float, default=4.0, help="requests/s (Poisson); inf: all at once")
    p.add_argument("--input-median", type=float, default=180, help="prompt tokens, lognormal median")
    p.add_argument("--input-sigma", type=float, default=1.0, help="prompt tokens, lognormal log-sigma")
    p.add_argument("--output-median", type=float, default=150, help="output tokens, lognormal median")
    p.add_argument("--output-sigma", type=float, default=0.9, help="output tokens, lognormal log-sigma")
    p.add_argument("--max-input", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=512)
    p.add_argument("--itl-slo-ms", type=float, default=16.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", default="bench/results/serve.json")
    p.add_argument("--plot", default=None, help="PNG of ITL over time (default: next to --json)")
    args = p.parse_args()

    proc, url = launch(args.launch, args.serve_args.split()) if args.launch else (None, args.url.rstrip("/"))
    try:
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        context = card["max_model_len"]
        rng = np.random.default_rng(args.seed)
        n = args.num_requests
        inputs = sample_lengths(rng, n, args.input_median, args.input_sigma, 4, min(args.max_input, context // 2))
        outputs = sample_lengths(rng, n, args.output_median, args.output_sigma, 2, args.max_output)
        outputs = np.minimum(outputs, context - inputs)
        gaps = rng.exponential(1 / args.rate, n) if np.isfinite(args.rate) else np.zeros(n)
        sent = np.cumsum(gaps) - gaps[0]
        prompts = [rng.integers(3, 256, int(k)).tolist() for k in inputs]
        records = [RequestRecord(float(s), int(i), int(o)) for s, i, o in zip(sent, inputs, outputs)]
        makespan = asyncio.run(run(url, card["id"], records, prompts, args.timeout))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)

    summary = summarize(records, makespan, args.itl_slo_ms / 1000)
    config = {k: v for k, v in vars(args).items() if k not in ("json", "plot", "url")}
    write_json(args.json, {"config": {**config, "model": card["id"], "max_model_len": context},
                           "summary": summary, "requests": [asdict(r) for r in records]})
    plot_path = Path(args.plot or Path(args.json).with_suffix(".png"))
    plot(records, args.itl_slo_ms / 1000, plot_path, f"{card['id']}: {n} requests at {args.rate:g} req/s")
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.json} and {plot_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
