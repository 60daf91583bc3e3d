"""Serving under tensor parallelism: rank 0 runs the engine, the other ranks follow its steps (gpt-fast style).

Every forward pass is a collective step. Rank 0's runner hands each step's chunks (token ids,
start positions, block tables: all that Batch.build needs) to ranks 1..N-1 through a
`StepChannel` before running it; each follower runs the same forward on its shard of the
model and its own KV cache (its local KV heads, the same block ids since rank 0's allocator
chose them) and discards the logits. Rank 0's logits, after the row-parallel all-reduces
inside the model, are the full logits. Sending None ends the followers.

CUDA graphs stay as configured: every rank captures the same decode buckets in the same order
when its runner is built (the NCCL all-reduces are captured with the rest, as in
bench/tp_decode.py), and a step takes the graph path on every rank alike.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch import nn

from spear.runtime.engine import Engine, EngineConfig, eos_token_ids, make_runner
from spear.runtime.kv_cache import Chunk
from spear.runtime.model import Transformer, build_runtime_model, use_kernels
from spear.runtime.runner import ModelRunner
from spear.runtime.tp import Reduction, apply_tp, set_reduction

IDLE_TIMEOUT = timedelta(days=365)  # followers wait for the next step as long as the server idles


class StepChannel:
    """Rank 0 to the other ranks: each step's chunks (None: stop), pickled over a CPU (gloo) group.

    A group of its own, so that the followers may wait idle for as long as the server does (the
    model's group keeps its collective timeout), and so that no GPU takes part in the hand-off.
    Collective: every rank builds it, in the same order as its other groups.
    """

    def __init__(self):
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def send(self, chunks: list[Chunk] | None) -> None:
        dist.broadcast_object_list([chunks], src=0, group=self.group)

    def receive(self) -> list[Chunk] | None:
        message = [None]
        dist.broadcast_object_list(message, src=0, group=self.group)
        return message[0]


def shard_runtime_model(hf_model: nn.Module, reduction: Reduction = "p2p", max_rows: int = 32) -> Transformer:
    """This rank's shard of the runtime model; 4-bit linears are packed for the kernels after sharding.

    Where they are packed (CUDA, fp16), the row-parallel layers reduce steps of up to `max_rows` token
    rows by `reduction` (spear.runtime.tp: "p2p", the W4 kernel's epilogue writing to the peers, is the
    fastest measured, BENCHMARKS §7); larger steps, float models and CPU ranks reduce collectively.
    Collective: every rank calls it in the same order."""
    model = apply_tp(build_runtime_model(hf_model, kernels=False))
    if use_kernels(model) and reduction != "collective":
        set_reduction(model, reduction, max_rows)
    return model


def leader_engine(hf_model: nn.Module, tokenizer, config: EngineConfig, channel: StepChannel,
                  reduction: Reduction = "p2p") -> Engine:
    """Rank 0's engine: its runner sends every step to the followers before running it."""
    runner = make_runner(shard_runtime_model(hf_model, reduction, reduction_rows(config)), config)
    runner.on_step = channel.send
    return Engine(runner, tokenizer, config, eos_token_ids(hf_model))


def reduction_rows(config: EngineConfig) -> int:
    """The token rows a decode step of this engine reduces at most: its batch, up to the decode kernel's rows."""
    from spear.kernels.w4 import DECODE_KERNEL_MAX_M

    return min(config.max_num_seqs, DECODE_KERNEL_MAX_M)


def follow(runner: ModelRunner, channel: StepChannel) -> None:
    """Ranks 1..N-1: run rank 0's steps on this rank's shard and KV cache until it sends None."""
    while (chunks := channel.receive()) is not None:
        runner.forward(chunks)
