"""The paged KV cache: fixed-size blocks of K/V per layer, handed out to sequences by a block allocator.

A sequence's token at position p lives in block `table[p // block_size]` at offset
`p % block_size` (its cache slot: block * block_size + offset). Block 0 is the null
block: never allocated, it is where padding rows (CUDA-graph buckets) write and what
padded block-table entries point at, so padding never touches a live sequence.

The new K/V reach their slots through spear.runtime.ops.rope_write_kv (with RoPE). A pure
decode batch (one new token per sequence: what the CUDA graphs capture) attends with
ops.paged_decode_attention (a Triton flash-decoding kernel on CUDA). Other batches (prefill,
mixed chunks) gather each sequence's blocks by its block table and run
scaled_dot_product_attention with an explicit mask (key position <= query position), which
is causal within a prefill chunk and attends to every cached earlier token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from spear.errors import SpearError
from spear.runtime.ops import paged_decode_attention

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
    """One forward over the paged cache: B sequences, T new tokens in all, S the longest chunk."""

    tokens: torch.Tensor  # [T] the chunks' tokens, concatenated
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache slot each token's K/V goes to
    block_tables: torch.Tensor  # [B, M] padded with the null block
    query_pos: torch.Tensor  # [B, S] position of each query; padding queries get 0 and are discarded
    padded_index: torch.Tensor  # [B, S] index into T of each query (padding: 0)
    flat_index: torch.Tensor  # [T] index into B*S of each token
    last_index: torch.Tensor  # [B] index into T of each sequence's last token
    seq_lens: torch.Tensor  # [B] each sequence's length with this step's tokens (last position + 1)
    decode: bool = False  # every chunk is one token (T == B): attention takes the decode kernel
    storage: torch.Tensor | None = None  # the one int64 buffer every field above is a view of

    @classmethod
    def build(cls, chunks: list[Chunk], block_size: int, device: torch.device, table_width: int | None = None) -> Batch:
        width = table_width or max(len(c.block_table) for c in chunks)
        S = max(len(c.tokens) for c in chunks)
        # each field as a flat list (the [B, ·] ones row after row)
        tokens, positions, slots, tables, query_pos, padded_index, flat_index, last_index = ([] for _ in range(8))
        seq_lens = []
        for b, c in enumerate(chunks):
            table = c.block_table + [NULL_BLOCK] * (width - len(c.block_table))
            pos = list(range(c.start, c.start + len(c.tokens)))
            first = len(tokens)
            tokens += c.tokens
            positions += pos
            slots += [table[p // block_size] * block_size + p % block_size for p in pos]
            tables += table
            pad = S - len(pos)
            query_pos += pos + [0] * pad
            padded_index += list(range(first, first + len(pos))) + [0] * pad
            flat_index += range(b * S, b * S + len(pos))
            last_index.append(len(tokens) - 1)
            seq_lens.append(pos[-1] + 1)
        # One host → device copy for the whole batch (a copy per field cost ~10 µs each per step).
        parts = (tokens, positions, slots, tables, query_pos, padded_index, flat_index, last_index, seq_lens)
        storage = torch.tensor(list(itertools.chain(*parts)), dtype=torch.long, device=device)
        B, T = len(chunks), len(tokens)
        views = storage.split([len(part) for part in parts])
        shapes = ((T,), (T,), (T,), (B, width), (B, S), (B, S), (T,), (B,), (B,))
        return cls(*(view.view(shape) for view, shape in zip(views, shapes)), decode=S == 1, storage=storage)

    def copy_(self, other: Batch) -> None:
        """Copy another batch of the same shapes into this one's tensors (static CUDA-graph inputs)."""
        if self.storage is not None and other.storage is not None and self.storage.shape == other.storage.shape:
            self.storage.copy_(other.storage)  # the same layout: one copy
            return
        for f in fields(self):
            if f.name != "storage" and isinstance(getattr(self, f.name), torch.Tensor):
                getattr(self, f.name).copy_(getattr(other, f.name))

    def attention_mask(self, block_size: int) -> torch.Tensor:
        """[B, 1, S, M * block_size]: key position <= query position."""
        key_pos = torch.arange(self.block_tables.shape[1] * block_size, device=self.query_pos.device)
        return (key_pos <= self.query_pos[..., None])[:, None]


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v [T, KV, D] at their slots in the pools [N, block_size, KV, D]."""
    k_pool.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_pool.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


def gather_kv(pool: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, M * block_size, KV, D]: each sequence's cached tokens in position order."""
    return pool[block_tables].flatten(1, 2)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: Batch,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """q [T, H, D] over the cached keys and values of each query's sequence -> [T, H, D].

    `mask` is batch.attention_mask (unused, and may be None, for a decode batch)."""
    if batch.decode:  # T == B: token b is sequence b's query at position seq_len - 1, over keys 0 .. seq_len - 1
        return paged_decode_attention(q, k_pool, v_pool, batch.block_tables, batch.seq_lens)
    k = gather_kv(k_pool, batch.block_tables).transpose(1, 2)  # [B, KV, K, D]
    v = gather_kv(v_pool, batch.block_tables).transpose(1, 2)
    qp = q[batch.padded_index].transpose(1, 2)  # [B, H, S, D]
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, enable_gqa=True)  # [B, H, S, D]
    return out.transpose(1, 2).flatten(0, 1)[batch.flat_index]
