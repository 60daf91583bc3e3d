"""Latency of one engine step's hand-off from rank 0 to the other tensor-parallel ranks (issue 7; serving, issue 5).

    python bench/step_channel.py --json bench/results/step_channel_cpu.json     # any machine, about 20 s

Two processes on this host (spear.runtime.tp.launch, gloo). Rank 0 hands a decode step of `batch`
sequences (one token each, block tables of a `--context`-token sequence) to rank 1 `--steps` times,
2 ms apart (about an engine step: rank 1 is waiting, as a follower does); the figure is the median
time from rank 0 beginning to send to rank 1 holding the chunks (time.perf_counter: one clock for
the processes of a host). "shared_memory" is spear.runtime.tp_serve.StepChannel; "pickled_gloo" is the
hand-off it replaced (torch.distributed.broadcast_object_list over a gloo group).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist
from common import write_json

from spear.runtime.kv_cache import Chunk
from spear.runtime.tp import launch
from spear.runtime.tp_serve import StepChannel

BLOCK = 16
GAP_S = 2e-3  # between two steps: about an engine decode step


class PickledGloo:
    def __init__(self, group):
        self.group = group

    def send(self, chunks):
        dist.broadcast_object_list([chunks], src=0, group=self.group)

    def receive(self):
        message = [None]
        dist.broadcast_object_list(message, src=0, group=self.group)
        return message[0]


def measure(batch: int, context: int, steps: int, out: list) -> None:
    channel = StepChannel()
    ways = {"shared_memory": channel, "pickled_gloo": PickledGloo(channel.group)}
    chunks = [Chunk([1000 + i], context - 1, list(range(i * 1000, i * 1000 + context // BLOCK + 1))) for i in range(batch)]
    for name, way in ways.items():
        stamps = []  # rank 0: when it began to send; rank 1: when it held the chunks (one host: the same clock)
        dist.barrier(group=channel.group)
        for _ in range(steps):
            if dist.get_rank() == 0:
                time.sleep(GAP_S)  # the follower is waiting, as it does between engine steps
                stamps.append(time.perf_counter())
                way.send(chunks)
            else:
                got = way.receive()
                stamps.append(time.perf_counter())
                assert got == chunks
        sent = [stamps]
        dist.broadcast_object_list(sent, src=0, group=channel.group)
        if dist.get_rank() == 1:
            times = [held - began for held, began in zip(stamps, sent[0], strict=True)]
            out.append({"way": name, "batch": batch, "context": context, "median_us": 1e6 * statistics.median(times),
                        "p90_us": 1e6 * statistics.quantiles(times, n=10)[-1]})
    if dist.get_rank() == 0:
        channel.send(None)
    else:
        assert channel.receive() is None


def run(args: argparse.Namespace) -> None:
    rows: list = []
    for batch in args.batches:
        measure(batch, args.context, args.steps, rows)
    if dist.get_rank() == 1:
        write_json(args.json, {"steps": args.steps, "rows": rows})
        for r in rows:
            print(f"{r['way']:<14} batch {r['batch']:>3}  median {r['median_us']:8.1f} µs  p90 {r['p90_us']:8.1f} µs",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    launch(run, 2, args, cuda=False)


if __name__ == "__main__":
    main()
