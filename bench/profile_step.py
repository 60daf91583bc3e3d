"""Where a decode step's time goes (issue 5's gap to the bandwidth floor, BENCHMARKS.md §5).

    python bench/profile_step.py --model llama2-7b --setting w4 --batch 1 --json bench/results/profile_w4.json
    python bench/profile_step.py --tiny --json /tmp/profile.json                 # CPU: end-to-end check
    python bench/profile_step.py --setting w4+ec15 --batch 8 --chunk 64 --json ...   # mixed steps: a 64-token
                                                                                     # prefill beside 8 decodes
    ... --chunk 64 --mixed-graph-tokens 128     # the same, the mixed steps replayed as CUDA-graph pieces
                                                # (compare the wall time; kernels inside graphs may not be listed)
    ... --chunk 64 --mixed-graph-tokens 128 --row-graph-tokens 128   # ... as one whole-step graph each

Builds the engine on random weights like bench/decode.py, prefills, then runs `--steps` decode
steps eagerly (no CUDA graph, so every kernel is seen) under torch.profiler and prints the
operators and kernels that take the most device time (CPU time on a CPU) per step; an
operator's row includes its kernels' time, as in torch.profiler's own table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import write_json
from decode import EC_FRACTIONS, MODELS, NoText
from fixtures import random_model

from spear.record import QuantConfig
from spear.runtime.engine import Engine, EngineConfig, make_runner
from spear.runtime.requests import SamplingParams
from spear.runtime.scheduler import StaticChunkPolicy


def op_time_us(event, cuda: bool) -> float:
    """Total time of one profiler row in µs: device time on CUDA (the attribute's name moved across torch versions)."""
    if not cuda:
        return event.cpu_time_total
    return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="llama2-7b")
    p.add_argument("--setting", choices=["fp16", *EC_FRACTIONS], default="w4")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--chunk", type=int, default=0,
                   help="profile mixed steps: each step also prefills a new request of this many tokens")
    p.add_argument("--mixed-graph-tokens", type=int, nargs="*", default=[],
                   help="run mixed steps as CUDA-graph pieces with these token buckets (EngineConfig.mixed_graph_tokens), "
                        "decode steps as CUDA graphs; default (none, or 0): every step eager")
    p.add_argument("--row-graph-tokens", type=int, default=0,
                   help="with --mixed-graph-tokens: steps of up to this many tokens replay one whole-step CUDA graph "
                        "instead of the pieces (EngineConfig.row_graph_tokens); default 0: decode steps only")
    p.add_argument("--tiny", action="store_true", help="the tiny model, on whatever device there is")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    name = "tiny" if args.tiny else args.model
    prompt_tokens = 16 if args.tiny else args.prompt_tokens

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    dtype = torch.float16 if cuda else torch.float32
    fraction = EC_FRACTIONS.get(args.setting)
    model = random_model(MODELS[name], None if fraction is None else QuantConfig(4, -1), fraction or 0.0, 32, dtype, device)
    graph_tokens = tuple(t for t in args.mixed_graph_tokens if t > 0)
    config = EngineConfig(max_num_seqs=args.batch + args.steps + 1, max_model_len=max(args.chunk, prompt_tokens) + args.steps + 8,
                          policy=StaticChunkPolicy(max(args.batch * prompt_tokens, args.chunk + args.batch)),
                          cuda_graphs=bool(graph_tokens), mixed_graph_tokens=graph_tokens,
                          row_graph_tokens=args.row_graph_tokens)
    engine = Engine(make_runner(model, config), NoText(), config)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.steps + 4, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), torch.randint(model.args.vocab, (prompt_tokens,), generator=gen).tolist(), params)
    engine.step()  # the prefill
    engine.step()  # one decode step to warm up
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    wall = []
    with torch.profiler.profile(activities=activities) as prof:
        for step in range(args.steps):
            if args.chunk:  # a new request whose whole prompt is prefilled in this step, beside the decodes
                engine.add_request(f"new{step}", torch.randint(model.args.vocab, (args.chunk,), generator=gen).tolist(),
                                   SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            engine.step()
            if cuda:
                torch.cuda.synchronize()
            wall.append((time.perf_counter() - start) * 1e3)
    rows = sorted(prof.key_averages(), key=lambda e: op_time_us(e, cuda), reverse=True)
    top = [{"name": e.key, "calls_per_step": e.count / args.steps, "us_per_step": op_time_us(e, cuda) / args.steps}
           for e in rows[: args.top]]
    kernels_us = sum(op_time_us(e, cuda) for e in prof.key_averages() if cuda and e.device_type.name == "CUDA") / args.steps
    write_json(args.json, {"model": name, "setting": args.setting, "batch": args.batch, "chunk": args.chunk,
                           "steps": args.steps, "device": str(device), "wall_ms_per_step": wall,
                           "kernel_ms_per_step": kernels_us / 1e3, "top": top})
    what = f"decode step + a {args.chunk}-token prefill" if args.chunk else "decode step"
    how = f"mixed steps as graph pieces {list(graph_tokens)}" if graph_tokens else "eager"
    if graph_tokens and args.row_graph_tokens:
        how += f", whole-step graphs up to {args.row_graph_tokens} tokens"
    print(f"{name} {args.setting} batch {args.batch}: {'device' if cuda else 'CPU'} time per {what}, {how}; "
          f"wall {sorted(wall)[len(wall) // 2]:.2f} ms (profiled), kernels {kernels_us / 1e3:.2f} ms")
    for row in top:
        print(f"{row['us_per_step']:10.1f} µs  {row['calls_per_step']:6.1f}×  {row['name'][:90]}")


if __name__ == "__main__":
    main()
