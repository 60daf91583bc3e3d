"""`spear serve` against vLLM-CPU on one artifact, over HTTP, side by side (issue 53): tokens/s and TTFT.

    python bench/cpu_serve_compare.py --artifact runs/smollm2-w4/artifact --vllm-python V/bin/python \
        --json bench/results/ecosystem/cpu_serve_compare.json                     # 2-core CPU, ~10 min

V is vLLM's own environment as the README's vLLM section builds it (vllm-cpu and the spear-vllm plugin). The
artifact is exported (`spear export-vllm`) to --export (default <artifact>-vllm); `spear serve ARTIFACT` and
`spear-vllm serve EXPORT` (the plugin: W4 + adaptive ECs; vLLM compiles its model unless --vllm-eager) both run
for the whole measurement, and the rounds alternate between them, so that both meet the same machine.

Each round, per server: `batch 1`, each prompt alone, streamed; `batch 8`, eight requests at once. Every request
asks for --max-tokens greedy tokens (EOS ignored). tokens/s: generated tokens over the wall time from the first
request sent to the last one done; TTFT: send to the first streamed token; decode tokens/s: a request's tokens after
its first over the time after its first. Greedy texts are compared server against server, prompt by prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from common import write_json  # noqa: E402

PROMPTS = ("The history of the French language", "def fibonacci(n):\n", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are")


class ServerFailed(Exception):
    """A server answered with an error event instead of tokens."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, name: str, timeout: float = 900) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            sys.exit(f"{name} exited with {proc.returncode} before answering")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    sys.exit(f"{name} did not answer in {timeout:.0f} s")


def served_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


async def stream_one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    sent, stamps, parts = time.perf_counter(), [], []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise ServerFailed(event["error"]["message"])
            choices = event.get("choices") or []
            if choices:  # one chunk a token (its text may be held back: empty)
                stamps.append(time.perf_counter())
                parts.append(choices[0].get("text") or "")
    done = time.perf_counter()
    decode = (max_tokens - 1) / (done - stamps[0]) if len(stamps) > 1 and done > stamps[0] else None
    return {"ttft_s": stamps[0] - sent, "seconds": done - sent, "decode_tokens_per_s": decode, "text": "".join(parts)}


async def measure(url: str, model: str, batch: int, max_tokens: int) -> dict:
    """batch 1: the prompts one after another; batch > 1: that many requests at once, the prompts cycled."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        if batch == 1:
            results = [await stream_one(client, model, p, max_tokens) for p in PROMPTS]
        else:
            results = await asyncio.gather(*[stream_one(client, model, PROMPTS[i % len(PROMPTS)], max_tokens)
                                             for i in range(batch)])
        wall = time.perf_counter() - t0
    decode = [r["decode_tokens_per_s"] for r in results if r["decode_tokens_per_s"]]
    return {"tokens_per_s": len(results) * max_tokens / wall, "ttft_mean_s": statistics.mean(r["ttft_s"] for r in results),
            "decode_tokens_per_s_mean": statistics.mean(decode) if decode else None,
            "texts": [r["text"] for r in results[: len(PROMPTS)]]}


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--artifact", required=True)
    p.add_argument("--vllm-python", required=True, help="python of vLLM's environment (spear-vllm installed there)")
    p.add_argument("--export", default=None, help="the export-vllm directory (default <artifact>-vllm; made if absent)")
    p.add_argument("--vllm-model", default=None,
                   help="vLLM serves this model directory instead of the export (`spear-vllm serve DIR`: vLLM's own CLI; "
                        "the plugin only takes SPEAR's exports): e.g. the float model, where vLLM-CPU's build has no "
                        "W4A16 GEMM (AVX2)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile")
    p.add_argument("--vllm-dtype", default="float16")
    p.add_argument("--spear-args", default="", help="more `spear serve` options")
    p.add_argument("--json", default="bench/results/ecosystem/cpu_serve_compare.json")
    args = p.parse_args()

    export = Path(args.vllm_model or args.export or f"{args.artifact.rstrip('/')}-vllm")
    if not args.vllm_model and not export.is_dir():
        subprocess.run([sys.executable, "-m", "spear.cli", "export-vllm", args.artifact, "--out", str(export)], check=True)
    spear_port, vllm_port = free_port(), free_port()
    vllm_log = tempfile.NamedTemporaryFile("w", prefix="vllm-", suffix=".log", delete=False)  # its cause, if it fails
    servers = {
        "spear": subprocess.Popen([sys.executable, "-m", "spear.cli", "serve", args.artifact, "--device", "cpu",
                                   "--port", str(spear_port), *args.spear_args.split()],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        "vllm": subprocess.Popen([str(Path(args.vllm_python).parent / "spear-vllm"), "serve", str(export), "--port",
                                  str(vllm_port), "--dtype", args.vllm_dtype, "--max-model-len", "2048",
                                  *(["--enforce-eager"] if args.vllm_eager else [])],
                                 stdout=vllm_log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}),
    }
    urls = {"spear": f"http://127.0.0.1:{spear_port}", "vllm": f"http://127.0.0.1:{vllm_port}"}
    results: dict = {"artifact": args.artifact, "export": None if args.vllm_model else str(export),
                     "vllm_model": args.vllm_model, "max_tokens": args.max_tokens,
                     "vllm": {"eager": args.vllm_eager, "dtype": args.vllm_dtype,
                              "version": subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                                                        capture_output=True, text=True).stdout.strip()},
                     "loadavg_start": os.getloadavg(), "startup_s": {}, "rounds": []}
    try:
        for name, proc in servers.items():
            results["startup_s"][name] = wait_ready(proc, urls[name], name)
        models = {name: served_name(url) for name, url in urls.items()}
        for name in list(servers):  # warm-up: vLLM compiles its first shapes, both fill their caches
            try:
                for batch in args.batches:
                    asyncio.run(measure(urls[name], models[name], batch, 4))
            except ServerFailed as e:  # e.g. vllm-cpu's AVX2 build has no W4A16 GEMM (cpu_gemm_wna16)
                time.sleep(5)  # the worker's traceback reaches the log after the error event
                cause = [line for line in Path(vllm_log.name).read_text().splitlines() if "Error:" in line]
                results["failed"] = {name: f"{e}: {cause[-1].split('] ')[-1] if cause else ''}"}
                print(f"{name} failed: {results['failed'][name]}", flush=True)
                servers.pop(name).terminate()
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            row = {name: {f"batch{b}": asyncio.run(measure(urls[name], models[name], b, args.max_tokens))
                          for b in args.batches} for name in order}
            results["rounds"].append(row)
            print(f"round {r}: " + "; ".join(f"{n} " + ", ".join(
                f"b{b} {row[n][f'batch{b}']['tokens_per_s']:.1f} tok/s ttft {row[n][f'batch{b}']['ttft_mean_s']:.2f} s"
                for b in args.batches) for n in order), flush=True)
    finally:
        for proc in servers.values():
            proc.terminate()
        for proc in servers.values():
            proc.wait(timeout=60)
    results["loadavg_end"] = os.getloadavg()
    summary = {}
    for b in args.batches:
        key = f"batch{b}"
        med = {n: statistics.median(row[n][key]["tokens_per_s"] for row in results["rounds"]) for n in servers}
        ttft = {n: statistics.median(row[n][key]["ttft_mean_s"] for row in results["rounds"]) for n in servers}
        summary[key] = {"tokens_per_s": med, "ttft_s": ttft}
        if len(servers) == 2:
            last = results["rounds"][-1]
            texts = last["spear"][key]["texts"], last["vllm"][key]["texts"]
            summary[key] |= {"spear_over_vllm": med["spear"] / med["vllm"], "same_text": [a == b for a, b in zip(*texts)],
                             "common_prefix_chars": [common_prefix(a, b) for a, b in zip(*texts)]}
    results["summary"] = summary
    print(json.dumps(summary, indent=1))
    write_json(args.json, results)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
