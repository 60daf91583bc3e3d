"""Executes one engine step on the model: eagerly, or replayed from CUDA graphs.

On CUDA (and `EngineConfig.cuda_graphs`), one graph of a whole step per row-count bucket (1, 2, 4, ...,
up to the first power of two ≥ max(max_num_seqs, row_graph_tokens)) is captured at start-up over
static input tensors, every row a one-token query of the decode-attention kernel: a decode step is
one row per sequence, and a mixed step of up to `row_graph_tokens` tokens one row per token
(`token_rows`), a prompt chunk's rows grouped into attention tiles that read its keys once. Steps
are padded to their bucket with dummy rows that write to the null block, and block tables are
padded to the longest a sequence can have.

Larger mixed steps (prefill chunks beside decodes) would run eagerly, which is host-bound (about
1,000 kernel launches from Python for a 7B model); with `mixed_graph_tokens` (token-count buckets;
the engine's default on CUDA) `MixedStepGraphs` replays the model in pieces between attentions from
CUDA graphs (the pieces are token-parallel, so padding tokens are harmless: they write to the
null block) and runs only the varlen attention eagerly, as vLLM's piecewise graphs do.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spear.errors import SpearError
from spear.runtime.kv_cache import Batch, Chunk, KVCache, cdiv
from spear.runtime.model import Transformer
from spear.kernels.ops import attention_tile_rows


class DecodeGraph:
    """A captured step of `size` one-token rows (a decode step, or a small mixed step as `token_rows`) with
    static inputs and output."""

    def __init__(self, model: Transformer, cache: KVCache, size: int, table_width: int, tile_rows: int, tile_slots: int,
                 pool):
        self.inputs = Batch.build([Chunk([0], 0, [])] * size, cache.block_size, cache.device, table_width,
                                  tile_rows, tile_slots)  # all dummies
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


class MixedStepGraphs:
    """A step of up to `tokens` tokens (any mix of prefill chunks and decodes, at most `max_seqs` sequences)
    as L + 1 pieces over static buffers: piece 0 is the embedding and block 0 up to its attention, piece i
    is block i − 1 after its attention and block i up to its own, piece L the last block after attention,
    the final norm and the head. Attention runs eagerly between pieces on the real (unpadded) batch.

    With `capture` (CUDA) each piece is a CUDA graph; without, the pieces run eagerly on the same static
    buffers (how CPU tests check the padding and the buffer plumbing)."""

    def __init__(self, model: Transformer, cache: KVCache, tokens: int, max_seqs: int, capture: bool):
        self.model, self.cache, self.tokens, self.max_seqs = model, cache, tokens, max_seqs
        n = len(model.layers)
        self.inputs = torch.zeros(3 * tokens + max_seqs, dtype=torch.long, device=cache.device)  # one copy per step
        self.token_ids, self.positions, self.slots, self.last_index = self.inputs.split([tokens] * 3 + [max_seqs])
        self.q: list[torch.Tensor | None] = [None] * n  # each block's rotated queries (a piece's output)
        self.residual: list[torch.Tensor | None] = [None] * n
        self.attn: list[torch.Tensor | None] = [None] * n  # each block's attention output (the next piece's input)
        self.logits: torch.Tensor | None = None
        self.graphs: list[torch.cuda.CUDAGraph] = []
        for i in range(n + 1):  # eager first: allocates the attention buffers, warms up kernels and scratch
            self._piece(i)
            if i < n:
                self.attn[i] = torch.zeros(tokens, self.q[i].shape[1] * self.q[i].shape[2], dtype=self.q[i].dtype,
                                           device=cache.device)
        if capture:
            pool = torch.cuda.graph_pool_handle()
            for i in range(n + 1):  # replayed in capture order, so the pieces may share one pool
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(i)
                self.graphs.append(graph)

    def _piece(self, i: int) -> None:
        model, n = self.model, len(self.model.layers)
        if i == 0:
            x, residual = model.embed(self.token_ids), None
        else:
            x, residual = model.layers[i - 1].after_attention(self.attn[i - 1], self.residual[i - 1])
        if i < n:
            self.q[i], self.residual[i] = model.layers[i].before_attention(
                x, residual, model.rope.inv_freq, self.positions, self.slots, self.cache.layer(i))
        else:
            self.logits = model.logits(x, residual, self.last_index)

    def run(self, batch: Batch, num_seqs: int) -> torch.Tensor:
        """Logits [num_seqs, vocab] for the real batch (T ≤ tokens tokens, num_seqs ≤ max_seqs sequences)."""
        T = batch.tokens.shape[0]
        pad_tokens, pad_seqs = self.tokens - T, self.max_seqs - num_seqs
        zeros = batch.tokens.new_zeros
        # padding tokens: token 0 at position 0 in slot 0 (the null block); padding heads read row 0
        self.inputs.copy_(torch.cat([batch.tokens, zeros(pad_tokens), batch.positions, zeros(pad_tokens),
                                     batch.slots, zeros(pad_tokens), batch.last_index, zeros(pad_seqs)]))
        for i in range(len(self.model.layers) + 1):
            if self.graphs:
                self.graphs[i].replay()
            else:
                self._piece(i)
            if i < len(self.model.layers):
                out = self.model.layers[i].attention.attend(self.q[i][:T], self.cache.layer(i), batch)  # [T, H * D]
                self.attn[i][:T].copy_(out)
        return self.logits[:num_seqs]


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache, max_model_len: int, max_num_seqs: int, cuda_graphs: bool,
                 mixed_graph_tokens: tuple[int, ...] = (), row_graph_tokens: int = 0):
        """With `cuda_graphs` on a CUDA cache, captures the decode and mixed-step graphs; their kernels are compiled
        ahead by compile_graphs, which make_runner calls before the KV cache takes the free memory."""
        self.model = model
        self.cache = cache
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.row_graph_tokens = row_graph_tokens
        self.table_width = cdiv(max_model_len, cache.block_size)
        # attention tiles: a prefill chunk's rows share one pass over their keys (kv_cache.attention_tiles)
        self.tile_rows = attention_tile_rows(model.args.n_heads // model.args.n_kv_heads)
        self.graphs: dict[int, DecodeGraph] = {}
        self.mixed: dict[int, MixedStepGraphs] = {}
        self.on_step: Callable[[list[Chunk]], None] | None = None  # sees each step's chunks first (TP: sends them)
        capture = cuda_graphs and cache.device.type == "cuda"
        with torch.inference_mode():
            if capture:
                pool = torch.cuda.graph_pool_handle()
                for size in self.graph_sizes():
                    self.graphs[size] = DecodeGraph(model, cache, size, self.table_width, self.tile_rows,
                                                    self.tile_slots(size), pool)
            for tokens in sorted(mixed_graph_tokens, reverse=True):
                self.mixed[tokens] = MixedStepGraphs(model, cache, tokens, max_num_seqs, capture)

    def graph_sizes(self) -> list[int]:
        """The whole-step graphs' row counts, largest first."""
        return sorted(graph_buckets(max(self.max_num_seqs, self.row_graph_tokens)), reverse=True)

    def _dry_steps(self, sizes: list[int], mixed_graph_tokens: tuple[int, ...]) -> None:
        """The steps the graphs capture, run once eagerly (kernels.compile_ahead records their launches)."""
        for size in sizes:
            self.model(Batch.build([Chunk([0], 0, [])] * size, self.cache.block_size, self.cache.device,
                                   self.table_width, self.tile_rows, self.tile_slots(size)), self.cache)
        for tokens in mixed_graph_tokens:
            MixedStepGraphs(self.model, self.cache, tokens, self.max_num_seqs, capture=False)

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], patch: TokenPatch | None = None) -> torch.Tensor:
        """Logits [B, vocab] at the last token of each chunk; their K/V land in the cache. `patch`: tokens not on
        the host yet (the engine's overlapped steps), written into the step's tokens on the device."""
        if self.on_step is not None:
            if patch is not None:
                raise SpearError("overlapped steps need every token on the host under tensor parallelism")
            self.on_step(chunks)
        num_tokens = sum(len(c.tokens) for c in chunks)
        whole = num_tokens == len(chunks) or num_tokens <= self.row_graph_tokens  # a decode step, or a small one
        size = next((s for s in sorted(self.graphs) if s >= num_tokens), None) if whole else None
        if size is not None:  # only then split the step into rows (a long prompt's chunk need not be)
            rows, last = token_rows(chunks)  # rows keep the step's token order: the patch's indices hold
            logits = self.graphs[size].run(_patched(self.padded_batch(rows, size), patch))
            return logits[: len(rows)] if len(rows) == len(chunks) else logits[torch.tensor(last, device=logits.device)]
        batch = _patched(Batch.build(chunks, self.cache.block_size, self.cache.device), patch)
        tokens = next((t for t in sorted(self.mixed) if t >= batch.tokens.shape[0]), None)
        if tokens is not None and not batch.decode and len(chunks) <= self.max_num_seqs:
            return self.mixed[tokens].run(batch, len(chunks))
        return self.model(batch, self.cache)

    def padded_batch(self, chunks: list[Chunk], size: int) -> Batch:
        """The batch in a graph's static shapes: `size` rows (dummies write to the null block), full-width tables,
        `tile_slots(size)` attention tiles."""
        padded = chunks + [Chunk([0], 0, [])] * (size - len(chunks))
        return Batch.build(padded, self.cache.block_size, self.cache.device, self.table_width, self.tile_rows,
                           self.tile_slots(size))

    def tile_slots(self, size: int) -> int:
        """The most attention tiles `size` rows can need: each of at most max_num_seqs sequences starts a tile,
        every tile_rows rows of a sequence another, and the padding rows need cdiv(pad, tile_rows)."""
        return min(size, self.max_num_seqs + cdiv(size, self.tile_rows) + 1)


@dataclass(frozen=True)
class TokenPatch:
    """Tokens of a step that are still on the device: token `index[i]` of the step (in its chunks' order) is
    `source[rows[i]]` (the engine's overlapped steps: the previous step's samples)."""

    index: list[int]
    rows: list[int]
    source: torch.Tensor


def _patched(batch: Batch, patch: TokenPatch | None) -> Batch:
    if patch is not None and patch.index:
        where = torch.tensor([patch.index, patch.rows], device=batch.tokens.device)  # one host → device copy
        batch.tokens[where[0]] = patch.source[where[1]].to(batch.tokens.dtype)
    return batch


def token_rows(chunks: list[Chunk]) -> tuple[list[Chunk], list[int]]:
    """Every token of the step as its own one-token chunk, and the row of each chunk's last token.

    A token at position p of a prefill chunk is then a decode query over keys 0 .. p: its chunk's earlier
    tokens write their K/V in the same layer before attention reads, so this is causal attention within the
    chunk, by the decode kernel. A mixed step of a few dozen tokens thus replays a decode step's CUDA graph
    whole, instead of running attention eagerly between graph pieces (host-bound)."""
    rows = [Chunk([token], c.start + i, c.block_table) for c in chunks for i, token in enumerate(c.tokens)]
    return rows, [n - 1 for n in itertools.accumulate(len(c.tokens) for c in chunks)]


def compile_graphs(model: Transformer, block_size: int, kv_dtype: torch.dtype, max_model_len: int, max_num_seqs: int,
                   mixed_graph_tokens: tuple[int, ...], row_graph_tokens: int) -> int:
    """The kernels of the graphs ModelRunner(..., cuda_graphs=True) captures, compiled in parallel processes
    (kernels.compile_ahead) over a KV cache of the null block alone, so that it runs before the real cache takes the
    free memory: each compiling worker needs a CUDA context of its own. Measured on an 8B model on an H100: with the
    cache allocated first, 52 of 78 compiles failed for memory and the warm-ups compiled them one by one (63 s).
    The graphs' kernels take the pools' strides, never their block counts, so the compiles are the same. Returns
    how many were compiled (0: none, or the Triton cache had them)."""
    from spear.kernels import compile_ahead  # Triton's: a plain install has none (nor CUDA graphs)

    args = model.args
    scratch = KVCache(args.n_layers, 1, block_size, args.n_kv_heads, args.head_dim, kv_dtype, model.device)
    runner = ModelRunner(model, scratch, max_model_len, max_num_seqs, False, (), row_graph_tokens)
    with torch.inference_mode():
        compiled = compile_ahead.compile_ahead(lambda: runner._dry_steps(runner.graph_sizes(), mixed_graph_tokens))
    del runner, scratch
    torch.cuda.empty_cache()  # the dry steps' outputs: the KV budget measures free memory next
    return compiled


def graph_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two >= max_rows."""
    sizes = [1]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] * 2)
    return sizes
