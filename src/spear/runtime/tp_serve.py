"""Serving under tensor parallelism: rank 0 runs the engine, the other ranks follow its steps (gpt-fast style).

Every forward pass is a collective step. Rank 0's runner hands each step's chunks (token ids,
start positions, block tables: all that Batch.build needs) to ranks 1..N-1 through a
`StepChannel` (a ring of shared-memory slots) before running it; each follower runs the same forward on its shard of the
model and its own KV cache (its local KV heads, the same block ids since rank 0's allocator
chose them) and discards the logits. Rank 0's logits, after the row-parallel all-reduces
inside the model, are the full logits. Sending None ends the followers.

CUDA graphs stay as configured: every rank captures the same decode buckets in the same order
when its runner is built (the NCCL all-reduces are captured with the rest, as in
bench/tp_decode.py), and a step takes the graph path on every rank alike.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from spear.runtime.engine import Engine, EngineConfig, eos_token_ids, kv_cache_blocks, make_runner
from spear.runtime.kv_cache import Chunk
from spear.runtime.model import Transformer, build_runtime_model, use_kernels
from spear.runtime.runner import ModelRunner
from spear.runtime.tp import Reduction, apply_tp, set_reduction

IDLE_TIMEOUT = timedelta(days=365)  # followers wait for the next step as long as the server idles


class StepChannel:
    """Rank 0 to the other ranks: each step's chunks (None: stop), through a ring of slots in shared memory.

    The ranks share one host, so a step goes as a few hundred int32 in a shared-memory slot and a
    sequence number, as vLLM's shm_broadcast does: rank 0 writes the slot and then the number, a
    follower polls the number and reads. `broadcast_object_list` over gloo, before, cost 1.2-1.5 ms a
    step on a 2-core CPU (pickling and two collectives; `bench/step_channel.py`, BENCHMARKS §7), about as
    long as the engine's overhead per decode step measured at TP 2 on an H200 pair. A step too large for a slot goes pickled over a CPU (gloo) group of its own, which also
    carries the set-up. A follower polls without pausing for SPIN_S (as vLLM's workers do), then with a
    growing sleep, so that it may wait idle for as long as the server does. A wait ends if another rank's process
    is gone.

    Collective: every rank builds it, in the same order as its other groups.
    """

    SLOTS = 8  # steps rank 0 may run ahead of the slowest follower
    SLOT_INTS = 1 << 16  # int32 a slot holds (256 KiB): the chunk header, tokens and block tables of a step
    SPIN_S = 0.05  # how long a rank polls without pausing (one core), longer than an engine step
    WAIT_MAX_S = 2e-3  # the longest sleep between two polls after that

    def __init__(self):
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # a file in /dev/shm (memory), mapped by every rank: header int64 [0] steps written, [1 + r] steps rank r
        # has read; then the slots
        header_bytes = 8 * (1 + self.world)
        nbytes = header_bytes + 4 * self.SLOTS * self.SLOT_INTS
        path = [None]
        if self.rank == 0:
            fd, path[0] = tempfile.mkstemp(prefix="spear-steps-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            os.ftruncate(fd, nbytes)
            os.close(fd)
        dist.broadcast_object_list(path, src=0, group=self.group)
        mapped = np.memmap(path[0], dtype=np.uint8, mode="r+", shape=(nbytes,)).view(np.ndarray)  # (memmap's
        # own methods cost tens of µs a call; a plain view of its memory does not)
        self.header = mapped[:header_bytes].view(np.int64)
        self.slots = mapped[header_bytes:].view(np.int32).reshape(self.SLOTS, self.SLOT_INTS)
        if self.rank == 0:
            self.header[:] = 0
        pids = [None] * self.world
        dist.all_gather_object(pids, os.getpid(), group=self.group)  # also: every rank has it mapped
        self.peers = [pid for rank, pid in enumerate(pids) if rank != self.rank]  # a wait ends if one is gone
        if self.rank == 0:
            os.unlink(path[0])  # the name goes now; the memory stays while a rank maps it, and never leaks
        self.step = 0  # steps this rank has written (rank 0) or read

    def send(self, chunks: list[Chunk] | None) -> None:
        readers = self.header[2 : 1 + self.world]  # ranks 1..N-1
        self._wait(lambda: self.step - int(readers.min()) < self.SLOTS)  # a free slot
        slot = self.slots[self.step % self.SLOTS]
        packed = _pack(chunks)
        large = packed.size > self.SLOT_INTS
        if large:
            slot[0] = -2
        else:
            slot[: packed.size] = packed
        _fence()
        self.header[0] = self.step = self.step + 1
        if large:
            dist.broadcast_object_list([chunks], src=0, group=self.group)

    def receive(self) -> list[Chunk] | None:
        self._wait(lambda: int(self.header[0]) > self.step)
        _fence()
        slot = self.slots[self.step % self.SLOTS]
        if slot[0] == -2:  # too large for a slot: pickled over gloo
            message = [None]
            dist.broadcast_object_list(message, src=0, group=self.group)
            chunks = message[0]
        else:
            chunks = _unpack(slot)
        _fence()
        self.step += 1
        self.header[1 + self.rank] = self.step
        return chunks

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Poll until ready: without a pause for SPIN_S (a follower waits about a step for the next one), then with
        sleeps growing to WAIT_MAX_S (an idle server); end when another rank's process is gone (no hang)."""
        if ready():
            return
        spin_until, pause, polls = time.perf_counter() + self.SPIN_S, 0.0, 0
        while not ready():
            polls += 1
            if polls % 64 or time.perf_counter() < spin_until:
                os.sched_yield()  # a core shared with rank 0 (a VM's, or an oversubscribed host's) lets it run
                continue
            pause = min(self.WAIT_MAX_S, max(pause * 2, 1e-5))
            time.sleep(pause)
            if polls % 4096 == 0 and not all(_alive(pid) for pid in self.peers):
                raise SystemExit(f"rank {self.rank}: another tensor-parallel rank is gone")


def _pack(chunks: list[Chunk] | None) -> np.ndarray:
    """[n, (len(tokens), start, len(block_table)) × n, tokens…, block tables…] as int32; [-1] for None."""
    if chunks is None:
        return np.array([-1], dtype=np.int32)
    sizes = [(len(c.tokens), c.start, len(c.block_table)) for c in chunks]
    parts = [[len(chunks)], *sizes, *(c.tokens for c in chunks), *(c.block_table for c in chunks)]
    return np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int32)


def _unpack(slot: np.ndarray) -> list[Chunk] | None:
    n = int(slot[0])
    if n < 0:
        return None
    sizes = slot[1 : 1 + 3 * n].reshape(n, 3).tolist()
    at = 1 + 3 * n
    tokens, tables = [], []
    for length, _, _ in sizes:
        tokens.append(slot[at : at + length].tolist())
        at += length
    for _, _, width in sizes:
        tables.append(slot[at : at + width].tolist())
        at += width
    return [Chunk(t, start, b) for t, (_, start, _), b in zip(tokens, sizes, tables, strict=True)]


_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier between the slot's data and its sequence number (a lock's acquire and release)."""
    with _FENCE:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shard_runtime_model(hf_model: nn.Module, reduction: Reduction = "p2p", max_rows: int = 32) -> Transformer:
    """This rank's shard of the runtime model built from `hf_model` (see shard_for_serving)."""
    return shard_for_serving(build_runtime_model(hf_model, kernels=False), reduction, max_rows)


def shard_for_serving(model: Transformer, reduction: Reduction = "p2p", max_rows: int = 32) -> Transformer:
    """Shard the unpacked runtime `model` in place for this rank, then pack its 4-bit linears for the kernels
    (use_kernels: only what they read stays).

    Where they are packed (CUDA, fp16), the row-parallel layers reduce steps of up to `max_rows` token
    rows by `reduction` (spear.runtime.tp: "p2p", the W4 kernel's epilogue writing to the peers, is the
    fastest measured, BENCHMARKS §7); larger steps, float models and CPU ranks reduce collectively.
    Collective: every rank calls it in the same order."""
    apply_tp(model)
    if use_kernels(model) and reduction != "collective":
        set_reduction(model, reduction, max_rows)
    return model


def leader_engine(hf_model: nn.Module, tokenizer, config: EngineConfig, channel: StepChannel,
                  reduction: Reduction = "p2p") -> Engine:
    """Rank 0's engine: its runner sends every step to the followers before running it."""
    model = shard_runtime_model(hf_model, reduction, reduction_rows(config))
    config = agree_kv_blocks(model, config, channel)
    runner = make_runner(model, config)
    runner.on_step = channel.send
    return Engine(runner, tokenizer, config, eos_token_ids(hf_model))


def agree_kv_blocks(model: Transformer, config: EngineConfig, channel: StepChannel) -> EngineConfig:
    """`config` with the KV-cache blocks of the rank whose budget gives the fewest: rank 0's allocator hands out the
    block ids of every rank's cache. Collective: every rank calls it before make_runner."""
    blocks = torch.tensor([kv_cache_blocks(model, config)])
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=channel.group)
    return replace(config, num_kv_blocks=int(blocks))


def reduction_rows(config: EngineConfig) -> int:
    """The token rows a decode step of this engine reduces at most: its batch, up to the decode kernel's rows where
    that kernel can run (without a GPU ranks reduce collectively, and triton may not be installed)."""
    if not torch.cuda.is_available():
        return config.max_num_seqs
    from spear.kernels.w4 import DECODE_KERNEL_MAX_M

    return min(config.max_num_seqs, DECODE_KERNEL_MAX_M)


def follow(runner: ModelRunner, channel: StepChannel) -> None:
    """Ranks 1..N-1: run rank 0's steps on this rank's shard and KV cache until it sends None."""
    while (chunks := channel.receive()) is not None:
        runner.forward(chunks)
