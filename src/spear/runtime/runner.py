"""Executes one engine step on the model: eagerly, or decode-only steps replayed from CUDA graphs.

On CUDA (and `EngineConfig.cuda_graphs`), one graph per batch-size bucket (1, 2, 4, ...,
up to max_num_seqs) is captured at start-up over static input tensors: decode batches are
padded to their bucket with dummy sequences that write to the null block, and block
tables are padded to the longest a sequence can have. Everything else runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spear.runtime.kv_cache import Batch, Chunk, KVCache, cdiv
from spear.runtime.model import Transformer


class DecodeGraph:
    """A captured decode step over `size` sequences with static inputs and output."""

    def __init__(self, model: Transformer, cache: KVCache, size: int, table_width: int, pool):
        self.inputs = Batch.build([Chunk([0], 0, [])] * size, cache.block_size, cache.device, table_width)  # all dummies
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (lazy inits, autotuning) outside the capture
            for _ in range(2):
                model(self.inputs, cache)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = model(self.inputs, cache)  # [size, vocab]

    def run(self, batch: Batch) -> torch.Tensor:
        self.inputs.copy_(batch)
        self.graph.replay()
        return self.logits


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache, max_model_len: int, max_num_seqs: int, cuda_graphs: bool):
        self.model = model
        self.cache = cache
        self.max_model_len = max_model_len
        self.table_width = cdiv(max_model_len, cache.block_size)
        self.graphs: dict[int, DecodeGraph] = {}
        self.on_step: Callable[[list[Chunk]], None] | None = None  # sees each step's chunks first (TP: sends them)
        if cuda_graphs and cache.device.type == "cuda":
            with torch.inference_mode():
                pool = torch.cuda.graph_pool_handle()
                for size in sorted(graph_buckets(max_num_seqs), reverse=True):  # largest first: the pool fits all
                    self.graphs[size] = DecodeGraph(model, cache, size, self.table_width, pool)

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Logits [B, vocab] at the last token of each chunk; their K/V land in the cache."""
        if self.on_step is not None:
            self.on_step(chunks)
        size = next((s for s in sorted(self.graphs) if s >= len(chunks)), None)
        if size is not None and all(len(c.tokens) == 1 for c in chunks):
            return self.graphs[size].run(self.padded_batch(chunks, size))[: len(chunks)]
        return self.model(Batch.build(chunks, self.cache.block_size, self.cache.device), self.cache)

    def padded_batch(self, chunks: list[Chunk], size: int) -> Batch:
        """The batch in a graph's static shapes: `size` rows (dummies write to the null block), full-width tables."""
        padded = chunks + [Chunk([0], 0, [])] * (size - len(chunks))
        return Batch.build(padded, self.cache.block_size, self.cache.device, self.table_width)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two >= max_num_seqs."""
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    return sizes
