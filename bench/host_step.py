"""The engine's host time per decode step, without the model (issue 5: what the GPU waits for between steps).

    python bench/host_step.py --json bench/results/host_step_cpu.json            # batch 1, 8, 32

A decode step replays a CUDA graph, and the sampler's `.tolist()` waits for it; the next step's
host work (scheduling, the step's index buffer, sampling bookkeeping, detokenizing) then runs while
the GPU is idle, so it adds to ms/token one for one. This script times that host work alone: the
engine runs as it serves, with the runner's decode forward replaced by what a graph replay costs
the host (building the padded batch, `ModelRunner.padded_batch`) and [B, 256] logits (greedy: on a
GPU the argmax over the vocabulary is a kernel of the step, here it would be CPU time that is not
the host's). A 4,096-token context (Llama-2-7B's table width: 256 blocks of 16), no model weights.
The median over `--steps` steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import write_json
from fixtures import random_model
from decode import NoText

from spear.runtime.engine import Engine, EngineConfig, make_runner
from spear.runtime.model import ModelArgs
from spear.runtime.requests import SamplingParams

VOCAB = 256  # the logits' width: argmax cost stays out of the host time
CONTEXT = 4096


def host_us_per_step(batch: int, steps: int) -> dict:
    args = ModelArgs(dim=64, intermediate=128, n_heads=4, n_kv_heads=4, head_dim=16, n_layers=1, vocab=VOCAB,
                     max_seq_len=CONTEXT)
    config = EngineConfig(max_num_seqs=32, max_model_len=CONTEXT, num_kv_blocks=32 * CONTEXT // 16 + 1)
    runner = make_runner(random_model(args, dtype=torch.float32, seed=0), config)
    engine = Engine(runner, NoText(), config)
    logits = torch.zeros(batch, VOCAB)
    logits[:, 7] = 1  # greedy picks token 7
    size = 1 << (batch - 1).bit_length()
    eager_forward = runner.forward

    def replay_host_side(chunks, patch=None):
        if all(len(c.tokens) == 1 for c in chunks):  # a decode step: the host side of a graph replay
            runner.padded_batch(chunks, size)
            return logits[: len(chunks)]
        return eager_forward(chunks, patch)  # the prompts' prefill, before timing

    runner.forward = replay_host_side
    for i in range(batch):
        engine.add_request(f"r{i}", list(range(1, 128)), SamplingParams(max_tokens=steps + 10, temperature=0,
                                                                        ignore_eos=True))
    while any(not s.prefilled for s in engine.running) or engine.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return {"batch": batch, "host_us": 1e6 * statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json", help="write the figures here")
    opts = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for batch in opts.batches:
        rows.append(host_us_per_step(batch, opts.steps))
        print(f"batch {batch:>3}: {rows[-1]['host_us']:7.0f} µs host per decode step", flush=True)
    if opts.json:
        write_json(opts.json, {"vocab": VOCAB, "context": CONTEXT, "steps": opts.steps, "rows": rows})


if __name__ == "__main__":
    main()
