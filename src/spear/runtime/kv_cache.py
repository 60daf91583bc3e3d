"""The paged KV cache: fixed-size blocks of K/V per layer, handed out to sequences by a block allocator.

A sequence's token at position p lives in block `table[p // block_size]` at offset
`p % block_size` (its cache slot: block * block_size + offset). Block 0 is the null
block: never allocated, it is where padding rows (CUDA-graph buckets) write and what
padded block-table entries point at, so padding never touches a live sequence.

The new K/V reach their slots through spear.kernels.ops.rope_write_kv (with RoPE). Attention
splits a step's chunks once, when the Batch is built: every one-token chunk (a decode, or a
one-token prefill piece: the same query) takes ops.paged_decode_attention (a Triton
flash-decoding kernel on CUDA) over its own block table, with no gather; the longer chunks
gather their blocks (the tables cut to the blocks they use) and run
scaled_dot_product_attention with an explicit mask (key position <= query position), which is
causal within a chunk and attends to every cached earlier token. A pure decode batch (what the
CUDA graphs capture) is the first kind alone. A sliding-window layer (Mistral, Phi-3, Gemma 3) sees only the keys
of its last `window` positions: the decode kernel skips the others, the prefill mask drops them (Batch.window_mask).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from spear.errors import SpearError
from spear.kernels.ops import decode_key_mask, paged_decode_attention, rope_cos_sin

NULL_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockAllocator:
    """Hands out block ids 1 .. num_blocks - 1 (block 0 is the null block)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise SpearError(f"the KV cache needs at least 2 blocks (one is reserved), got {num_blocks}")
        self.num_total = num_blocks - 1
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise SpearError(f"out of KV cache blocks: asked for {n}, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class KVCache:
    """K and V block pools, one [num_blocks, block_size, n_kv_heads, head_dim] tensor per layer."""

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]


@dataclass
class Chunk:
    """New tokens of one sequence at consecutive positions from `start`, with the sequence's block table."""

    tokens: list[int]
    start: int
    block_table: list[int]


@dataclass
class Batch:
    """One forward over the paged cache: B sequences, T new tokens in all.

    Attention rows: the Bd one-token chunks (decode kernel) and the Bp longer ones, padded to S (the
    longest of them) for SDPA. A decode batch (every chunk one token) is Bd = B rows in chunk order."""

    tokens: torch.Tensor  # [T] the chunks' tokens, concatenated
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache slot each token's K/V goes to
    last_index: torch.Tensor  # [B] index into T of each sequence's last token
    block_tables: torch.Tensor  # [Bd, W] the one-token chunks' tables, padded with the null block
    seq_lens: torch.Tensor  # [Bd] their lengths with this step's token (its position + 1)
    decode_index: torch.Tensor  # [Bd] index into T of their tokens
    prefill_tables: torch.Tensor  # [Bp, M] the longer chunks' tables, cut to the blocks they use, padded
    query_pos: torch.Tensor  # [Bp, S] position of each query; padding queries get 0 and are discarded
    padded_index: torch.Tensor  # [Bp, S] index into T of each query (padding: 0)
    out_index: torch.Tensor  # [T] index into the Bd decode outputs then the Bp * S padded ones, per token
    # [NT, 2] (first row, row count) of the one-token chunks grouped into tiles of up to `tile_rows` rows of one
    # sequence at consecutive positions (a prefill chunk's tokens as rows, runner.token_rows), which the
    # attention kernel serves with one pass over their keys; padding tiles have count 0. None: a row a tile.
    tiles: torch.Tensor | None = None
    tile_rows: int = 1
    mask: torch.Tensor | None = None  # [Bp, 1, S, M * block_size] key position <= query position (None: decode)
    decode: bool = False  # every chunk is one token (T == B): attention is the decode kernel alone
    storage: torch.Tensor | None = None  # the one int64 buffer every index field above is a view of
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window_mask's, built once a step
    # On a CPU, what every layer's reference ops would build again, built once a step: rope_cos_sin's angles by
    # (inv_freq, gain), decode_mask's masks by window
    angles: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    decode_masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, chunks: list[Chunk], block_size: int, device: torch.device, table_width: int | None = None,
              tile_rows: int = 1, tile_slots: int | None = None) -> Batch:
        """`table_width`: W, the one-token chunks' table width (CUDA graphs' static shape); default the most
        blocks one of them uses. The longer chunks' tables are cut to the blocks they use. `tile_rows` > 1 or
        `tile_slots` given: group the one-token chunks into attention tiles (`tiles`), padded to `tile_slots` (a
        static shape). A CUDA graph's batch gives `tile_slots`, so it carries tiles, one row each where
        `tile_rows` is 1 (16-way GQA and wider): every graph has the same fields, whatever the model."""
        tokens, positions, slots, last_index = [], [], [], []
        ones, longs = [], []  # (first token's index into T, table, start, end) per chunk
        for c in chunks:
            end, used = c.start + len(c.tokens), cdiv(c.start + len(c.tokens), block_size)
            table = c.block_table[:used] + [NULL_BLOCK] * (used - len(c.block_table))  # dummy chunks have no blocks
            (ones if len(c.tokens) == 1 else longs).append((len(tokens), table, c.start, end))
            tokens += c.tokens
            positions += range(c.start, end)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(c.start, end)]
            last_index.append(len(tokens) - 1)
        W = table_width or max((len(table) for _, table, _, _ in ones), default=0)
        M = max((len(table) for _, table, _, _ in longs), default=0)
        S = max((end - start for _, _, start, end in longs), default=0)
        # each [·, ·] field as a flat list, row after row; the block tables as their rows (padded in the buffer)
        seq_lens, decode_index, query_pos, padded_index = ([] for _ in range(4))
        tables = [table for _, table, _, _ in ones]
        prefill_tables = [table for _, table, _, _ in longs]
        out_index = [0] * len(tokens)
        for j, (first, table, start, end) in enumerate(ones):
            seq_lens.append(end)
            decode_index.append(first)
            out_index[first] = j
        for i, (first, table, start, end) in enumerate(longs):
            pad = S - (end - start)
            query_pos += list(range(start, end)) + [0] * pad
            padded_index += list(range(first, first + end - start)) + [0] * pad
            out_index[first : first + end - start] = range(len(ones) + i * S, len(ones) + i * S + end - start)
        tiles = attention_tiles(ones, tile_rows, tile_slots) if tile_rows > 1 or tile_slots is not None else []
        # One host → device copy for the whole batch (a copy per field cost ~10 µs each per step), from one NumPy
        # buffer (torch.tensor of a Python list cost ~1 ms for 32 decodes' full-width tables on a 2-core CPU).
        B, T, Bd, Bp = len(chunks), len(tokens), len(ones), len(longs)
        parts = (tokens, positions, slots, last_index, tables, seq_lens, decode_index, prefill_tables, query_pos,
                 padded_index, out_index, tiles)
        shapes = ((T,), (T,), (T,), (B,), (Bd, W), (Bd,), (Bd,), (Bp, M), (Bp, S), (Bp, S), (T,), (len(tiles) // 2, 2))
        sizes = [math.prod(shape) for shape in shapes]
        # Each field starts 16-byte aligned (an even number of int64s before it): Triton specializes a kernel on
        # whether its pointers are, so a field whose alignment changed from step to step compiled a second
        # variant mid-serving (a 736 ms step on the H200, slo_experiment_h200_d98406d, static 512).
        starts = [0, *itertools.accumulate(n + n % 2 for n in sizes)]
        host = np.zeros(starts[-1], dtype=np.int64)  # zero: also the null block that pads the tables
        for part, start, n, shape in zip(parts, starts, sizes, shapes):
            if part is tables or part is prefill_tables:
                rows = host[start:start + n].reshape(shape)
                for row, table in zip(rows, part):
                    row[: len(table)] = table
            elif n:
                host[start:start + n] = part
        storage = torch.from_numpy(host)
        if device.type == "cuda":  # from pinned memory, asynchronously: a pageable copy would wait for the GPU's
            storage = storage.pin_memory().to(device, non_blocking=True)  # previous step (EngineConfig.overlap)
        else:
            storage = storage.to(device)
        pieces = storage.split([m for n in sizes for m in (n, n % 2)])  # each field, then its alignment pad
        views = [piece.view(shape) for piece, shape in zip(pieces[::2], shapes)]
        if not tiles:
            views[-1] = None
        batch = cls(*views, tile_rows=tile_rows if tiles else 1, decode=not longs, storage=storage)
        if longs:  # once per step, for every layer
            key_pos = torch.arange(M * block_size, device=device)
            batch.mask = (key_pos <= batch.query_pos[..., None])[:, None]
        return batch

    def window_mask(self, window: int) -> torch.Tensor:
        """`mask` within a sliding window: key position > query position - window (built once a step)."""
        if window not in self.window_masks:
            key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self.window_masks[window] = self.mask & (key_pos > self.query_pos[..., None] - window)[:, None]
        return self.window_masks[window]

    def rope_cos_sin(self, inv_freq: torch.Tensor, gain: float) -> tuple[torch.Tensor, torch.Tensor]:
        """kernels.ops.rope_cos_sin of the step's positions, built once a step for every layer that rotates by
        `inv_freq` and `gain`."""
        key = (inv_freq.data_ptr(), gain)
        if key not in self.angles:
            self.angles[key] = rope_cos_sin(self.positions, inv_freq, gain)
        return self.angles[key]

    def decode_mask(self, keys: int, window: int | None) -> torch.Tensor:
        """kernels.ops.decode_key_mask of the one-token chunks over `keys` positions (their tables' width times the
        block size), built once a step."""
        if (keys, window) not in self.decode_masks:
            self.decode_masks[keys, window] = decode_key_mask(self.seq_lens, keys, window)
        return self.decode_masks[keys, window]

    def copy_(self, other: Batch) -> None:
        """Copy another batch of the same shapes into this one's tensors (static CUDA-graph inputs)."""
        if self.storage is not None and other.storage is not None and self.storage.shape == other.storage.shape:
            self.storage.copy_(other.storage)  # the same layout: one copy
            if self.mask is not None:  # built from query_pos, not a view of the storage
                self.mask.copy_(other.mask)
            return
        for f in fields(self):
            if f.name != "storage" and isinstance(getattr(self, f.name), torch.Tensor):
                getattr(self, f.name).copy_(getattr(other, f.name))


def attention_tiles(ones: list[tuple[int, list[int], int, int]], tile_rows: int, tile_slots: int | None) -> list[int]:
    """The one-token chunks (first, table, start, end), in order, as flat (first row, row count) tiles: a row
    joins the tile before it while that holds fewer than `tile_rows` rows of the same table at the position
    before (padding rows, all at position 0 of the null block, group among themselves); then (0, 0) up to
    `tile_slots` tiles. The attention kernel reads a tile's table from its last row (the longest)."""
    tiles: list[list[int]] = []
    for row, (_, table, start, _) in enumerate(ones):
        _, before, before_start, _ = ones[row - 1] if row else (0, None, 0, 0)
        # the same sequence: the next position, and the table before it a prefix of this one's (which may
        # have a block more); tables of distinct live sequences share no block
        same_sequence = row > 0 and start == before_start + 1 and table[:len(before)] == before
        if tiles and tiles[-1][1] < tile_rows and (same_sequence or table == before == [NULL_BLOCK]):
            tiles[-1][1] += 1
        else:
            tiles.append([row, 1])
    if tile_slots is not None:
        if len(tiles) > tile_slots:
            raise ValueError(f"{len(tiles)} attention tiles do not fit the {tile_slots} slots of the batch")
        tiles += [[0, 0]] * (tile_slots - len(tiles))
    return [x for tile in tiles for x in tile]


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v [T, KV, D] at their slots in the pools [N, block_size, KV, D]."""
    k_pool.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_pool.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


def gather_kv(pool: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, M * block_size, KV, D]: each sequence's cached tokens in position order."""
    return pool[block_tables].flatten(1, 2)


# Not cuDNN: torch 2.11 sends masked SDPA to cuDNN first on sm_90, and cuDNN builds an execution plan for
# every new (batch, query, key) shape, 40–60 ms each; a mixed step's shapes change every step (measured on
# the H200: bimodal mixed steps of ~10 and ~55 ms).
PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: Batch,
                    scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """q [T, H, D] over the cached keys and values of each query's sequence -> [T, H, D]; softmax scale `scale`
    (None: D^-½), each query over the keys of its last `window` positions only (None: all)."""
    # the reference path's key mask (a CPU's), built once a step; the kernel has its own
    decode_mask = None if q.is_cuda else batch.decode_mask(batch.block_tables.shape[1] * k_pool.shape[1], window)
    if batch.decode:  # T == B: token b is sequence b's query at position seq_len - 1, over keys 0 .. seq_len - 1
        return paged_decode_attention(q, k_pool, v_pool, batch.block_tables, batch.seq_lens, scale, tiles=batch.tiles,
                                      tile_rows=batch.tile_rows, window=window, mask=decode_mask)
    k = gather_kv(k_pool, batch.prefill_tables).transpose(1, 2).to(q.dtype)  # [Bp, KV, M * block_size, D]
    v = gather_kv(v_pool, batch.prefill_tables).transpose(1, 2).to(q.dtype)
    qp = q[batch.padded_index].transpose(1, 2)  # [Bp, H, S, D]
    with sdpa_kernel(PREFILL_SDPA_BACKENDS):
        mask = batch.mask if window is None else batch.window_mask(window)
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale, enable_gqa=True)  # [Bp, H, S, D]
    out = out.transpose(1, 2).flatten(0, 1)  # [Bp * S, H, D]
    if batch.decode_index.numel():  # the one-token chunks (a shape: no sync)
        decoded = paged_decode_attention(q[batch.decode_index], k_pool, v_pool, batch.block_tables, batch.seq_lens,
                                         scale, window=window, mask=decode_mask)
        out = torch.cat([decoded, out])  # [Bd + Bp * S, H, D]
    return out[batch.out_index]
