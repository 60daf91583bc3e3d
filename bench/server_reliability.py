"""The server under hostile input: what one client's abuse costs the others, on a real `spear serve` (CPU or GPU).

    python bench/server_reliability.py --json bench/results/server/reliability_cpu.json     # 2-core CPU, ~4 min

Three measurements, each on its own `spear serve MODEL` (started here on a free port):
- `tokenization`: a small request's latency (2 tokens) alone, and while three 3.9 MB CJK prompts (1.3M characters,
  under the 4 MB body cap) are in flight. Target: ≤ 2× alone.
- `connections`: with `--max-connections CAP`, 1.5 × CAP idle sockets held open (renewed as the server drops them),
  then 20 probe requests, each on a new connection. Target: ≥ 19 of 20 answered.
- `chunks`: one stream decoding while a long prompt arrives; the stream's longest inter-token gap (the stall the
  prefill causes) and the long prompt's time to first token, at each `--chunk-tokens` given (`default`: the
  server's own choice on this device).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from common import write_json
from serve import launch


def hostile_cjk_prompt(chars: int = 1_300_000) -> str:
    return "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(chars))


def small_latency(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello there", "max_tokens": 2, "temperature": 0},
                   timeout=120)
    r.raise_for_status()
    return time.perf_counter() - t0


def tokenization(url: str, trials: int) -> dict:
    """The small request alone (median of 5), then behind three hostile prompts, `trials` times."""
    for _ in range(2):  # warm-up
        small_latency(url)
    alone = statistics.median(small_latency(url) for _ in range(5))
    body = json.dumps({"prompt": hostile_cjk_prompt(), "max_tokens": 1}, ensure_ascii=False).encode()
    behind, statuses = [], []
    for _ in range(trials):
        threads = [threading.Thread(target=lambda: statuses.append(httpx.post(
            f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=300
        ).status_code)) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # the three bodies sent, their tokenization under way
        behind.append(small_latency(url))
        for t in threads:
            t.join()
    worst = max(behind)
    return {"alone_s": alone, "behind_three_hostile_s": behind, "worst_ratio": worst / alone,
            "hostile_statuses": sorted(set(statuses)), "hostile_body_bytes": len(body), "target_ratio": 2.0,
            "met": worst <= 2 * alone}


def connections(url: str, cap: int, probes: int = 20) -> dict:
    port = int(url.rsplit(":", 1)[1])
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(cap * 3 // 2)]
    answered = 0
    try:
        time.sleep(0.5)
        for _ in range(probes):
            try:
                with httpx.Client(timeout=30) as client:  # a new connection each
                    answered += client.get(f"{url}/v1/models").status_code == 200
            except httpx.TransportError:
                pass
            held.append(socket.create_connection(("127.0.0.1", port)))  # the holder renews what it lost
    finally:
        for s in held:
            s.close()
    return {"cap": cap, "idle_sockets_held": cap * 3 // 2, "probes": probes, "answered": answered, "target": 19,
            "met": answered >= 19}


def stream_stall(url: str, long_prompt_tokens: int) -> dict:
    """A stream of 64 tokens; after its 8th token a prompt of `long_prompt_tokens` arrives."""
    gaps, stamps, long_ttft = [], [], {}
    body = {"prompt": list(range(10, 30)), "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}

    def long_request() -> None:
        prompt = [3 + (i * 31) % 250 for i in range(long_prompt_tokens)]
        t0 = time.perf_counter()
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "stream": True},
                          timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    long_ttft["s"] = time.perf_counter() - t0
                    break

    arrival = threading.Thread(target=long_request)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            stamps.append(time.perf_counter())
            if len(stamps) == 8:
                arrival.start()
    arrival.join()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"max_gap_s": max(gaps), "median_gap_s": statistics.median(gaps), "long_prompt_ttft_s": long_ttft.get("s")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--only", nargs="+", choices=("tokenization", "connections", "chunks"),
                   default=["tokenization", "connections", "chunks"])
    p.add_argument("--trials", type=int, default=3, help="tokenization: rounds of three hostile prompts")
    p.add_argument("--cap", type=int, default=100, help="connections: the server's --max-connections")
    p.add_argument("--chunks", nargs="+", default=["512", "default"], help="chunks: --chunk-tokens values")
    p.add_argument("--long-prompt", type=int, default=2000, help="chunks: the arriving prompt's tokens")
    p.add_argument("--json", default="bench/results/server/reliability_cpu.json")
    args = p.parse_args()

    base = ["--device", args.device]
    results: dict = {"model": args.model, "device": args.device}
    runs = {"tokenization": ([], lambda url: tokenization(url, args.trials)),
            "connections": (["--max-connections", str(args.cap)], lambda url: connections(url, args.cap))}
    for name in [n for n in args.only if n in runs]:
        extra, measure = runs[name]
        proc, url = launch(args.model, base + extra)
        try:
            results[name] = measure(url)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        print(name, json.dumps(results[name]), flush=True)
    if "chunks" in args.only:
        results["chunks"] = {}
        for chunk in args.chunks:
            proc, url = launch(args.model, base + ([] if chunk == "default" else ["--chunk-tokens", chunk]))
            try:
                stream_stall(url, 64)  # warm-up
                results["chunks"][chunk] = stream_stall(url, args.long_prompt)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            print(f"chunk {chunk}", json.dumps(results["chunks"][chunk]), flush=True)
    write_json(args.json, results)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
