"""The paged KV cache: block accounting, slot layout, and attention over cached blocks."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
import torch.nn.functional as F

from spear.errors import SpearError
from spear.runtime.kv_cache import (
    Batch,
    BlockAllocator,
    Chunk,
    gather_kv,
    paged_attention,
    write_kv,
)

CPU = torch.device("cpu")


def test_allocator_accounting():
    alloc = BlockAllocator(9)  # block 0 is the null block
    assert (alloc.num_total, alloc.num_free, alloc.num_used) == (8, 8, 0)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert 0 not in a + b and len(set(a + b)) == 8 and alloc.num_free == 0
    with pytest.raises(SpearError, match="out of KV cache blocks"):
        alloc.allocate(1)
    alloc.free(a)
    assert alloc.num_free == 3 and sorted(alloc.allocate(3)) == sorted(a)
    with pytest.raises(SpearError):
        BlockAllocator(1)


def test_write_then_gather_round_trips():
    bs, kv, d = 4, 2, 8
    k_pool, v_pool = torch.zeros(10, bs, kv, d), torch.zeros(10, bs, kv, d)
    tables = [[7, 2, 5], [1, 9]]
    lengths = [11, 6]
    batch = Batch.build([Chunk(list(range(n)), 0, t) for n, t in zip(lengths, tables)], bs, CPU)
    k, v = torch.randn(sum(lengths), kv, d), torch.randn(sum(lengths), kv, d)
    write_kv(k_pool, v_pool, batch.slots, k, v)
    got_k, got_v = gather_kv(k_pool, batch.prefill_tables), gather_kv(v_pool, batch.prefill_tables)  # [B, 12, kv, d]
    assert torch.equal(got_k[0, :11], k[:11]) and torch.equal(got_k[1, :6], k[11:])
    assert torch.equal(got_v[0, :11], v[:11]) and torch.equal(got_v[1, :6], v[11:])
    assert k_pool[0].abs().sum() == 0  # padding entries point at the untouched null block


def reference_attention(q, k, v):
    """Causal attention of one sequence: q [L, H, D], k, v [L, KV, D]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)


def test_chunked_prefill_equals_full_prefill_with_a_batched_decode():
    bs, h, kv, d = 4, 4, 2, 8
    lengths, tables = [13, 7], [[3, 8, 1, 6], [2, 5]]
    q = [torch.randn(n, h, d) for n in lengths]
    k = [torch.randn(n, kv, d) for n in lengths]
    v = [torch.randn(n, kv, d) for n in lengths]
    k_pool, v_pool = torch.zeros(10, bs, kv, d), torch.zeros(10, bs, kv, d)

    def run(spans):  # one batched step: (sequence, start, end) per entry
        batch = Batch.build([Chunk([0] * (e - s), s, tables[i]) for i, s, e in spans], bs, CPU)

        def cat(xs):
            return torch.cat([xs[i][s:e] for i, s, e in spans])

        write_kv(k_pool, v_pool, batch.slots, cat(k), cat(v))
        return paged_attention(cat(q), k_pool, v_pool, batch)

    # sequence 0 prefills in chunks of 5, 5, 2 beside sequence 1's prefill, then both decode one token together
    outs = [run([(0, 0, 5), (1, 0, 6)]), run([(0, 5, 10)]), run([(0, 10, 12)]), run([(0, 12, 13), (1, 6, 7)])]
    got0 = torch.cat([outs[0][:5], outs[1], outs[2], outs[3][:1]])
    got1 = torch.cat([outs[0][5:], outs[3][1:]])
    torch.testing.assert_close(got0, reference_attention(q[0], k[0], v[0]))
    torch.testing.assert_close(got1, reference_attention(q[1], k[1], v[1]))


def test_mixed_batch_splits_one_token_chunks_from_longer_ones():
    """Decodes at several context lengths and table widths, a one-token prefill piece and two longer chunks in one
    step: each token's attention equals dense causal attention over its own sequence."""
    bs, h, kv, d = 4, 4, 2, 8
    # (cached tokens before this step, new tokens, block table): the tables run past what is used, as the engine's
    spans = [(9, 1, [3, 8, 1, 6, 11]), (0, 6, [2, 5, 12]), (2, 1, [7, 14]), (0, 1, [4]), (5, 4, [9, 10, 13, 15]),
             (16, 1, [16, 17, 18, 19, 20, 21, 22])]
    k_pool, v_pool = torch.zeros(24, bs, kv, d), torch.zeros(24, bs, kv, d)
    q = [torch.randn(n + new, h, d) for n, new, _ in spans]
    k = [torch.randn(n + new, kv, d) for n, new, _ in spans]
    v = [torch.randn(n + new, kv, d) for n, new, _ in spans]
    cached = Batch.build([Chunk([0] * n, 0, t) for n, _, t in spans if n], bs, CPU)
    write_kv(k_pool, v_pool, cached.slots, torch.cat([x[:n] for x, (n, _, _) in zip(k, spans) if n]),
             torch.cat([x[:n] for x, (n, _, _) in zip(v, spans) if n]))

    batch = Batch.build([Chunk([0] * new, n, t) for n, new, t in spans], bs, CPU)
    assert not batch.decode and batch.decode_index.tolist() == [0, 7, 8, 13]  # the one-token chunks' tokens
    assert batch.block_tables.shape == (4, 5) and batch.seq_lens.tolist() == [10, 3, 1, 17]  # W: the most used blocks
    assert batch.prefill_tables.tolist() == [[2, 5, 0], [9, 10, 13]] and batch.mask.shape == (2, 1, 6, 12)

    def new(xs):
        return torch.cat([x[n:] for x, (n, _, _) in zip(xs, spans)])

    write_kv(k_pool, v_pool, batch.slots, new(k), new(v))
    got = paged_attention(new(q), k_pool, v_pool, batch)
    want = new([reference_attention(*xs) for xs in zip(q, k, v)])
    torch.testing.assert_close(got, want)


def test_decode_batch_keeps_the_graph_table_width():
    batch = Batch.build([Chunk([1], 4, [3, 2]), Chunk([0], 0, [])], 4, CPU, table_width=6)  # a real row and a dummy
    assert batch.decode and batch.mask is None
    assert batch.block_tables.tolist() == [[3, 2, 0, 0, 0, 0], [0] * 6] and batch.slots.tolist() == [8, 0]


def test_copy_takes_the_mask_of_a_batch_of_the_same_shapes():
    static = Batch.build([Chunk([0, 0, 0], 3, [1, 1]), Chunk([0], 4, [1, 1])], 4, CPU)  # the same shapes
    batch = Batch.build([Chunk([5, 6, 7], 2, [3, 2]), Chunk([1], 4, [4, 6])], 4, CPU)
    static.copy_(batch)
    for name in ("tokens", "slots", "prefill_tables", "query_pos", "out_index", "mask"):
        assert torch.equal(getattr(static, name), getattr(batch, name)), name


def test_attention_tiles_group_one_sequence_at_consecutive_positions():
    """Rows of one sequence at consecutive positions share a tile (up to tile_rows, across a block boundary);
    another sequence, a gap in positions, or a full tile starts a new one; padding rows group among themselves;
    the tiles are padded to the slots, and more tiles than slots is an error."""
    from spear.runtime.kv_cache import attention_tiles

    a, b = [3, 1, 7], [2, 5]
    rows = [Chunk([0], p, a) for p in (5, 6, 7, 8, 9)] + [Chunk([0], 4, b), Chunk([0], 6, b)] + [Chunk([0], 0, [])] * 3
    batch = Batch.build(rows, 4, CPU, table_width=3, tile_rows=3, tile_slots=8)
    assert batch.tiles.tolist() == [[0, 3], [3, 2], [5, 1], [6, 1], [7, 3]] + [[0, 0]] * 3
    assert batch.tile_rows == 3 and Batch.build(rows, 4, CPU).tiles is None  # no tiles: a row each
    one_row_tiles = Batch.build(rows, 4, CPU, table_width=3, tile_rows=1, tile_slots=10).tiles  # static shapes: tiles
    assert one_row_tiles.tolist() == [[row, 1] for row in range(10)]
    ones = [(i, [1], p, p + 1) for i, p in enumerate(range(4))]
    with pytest.raises(ValueError, match="2 attention tiles do not fit the 1 slots"):
        attention_tiles(ones, 2, 1)


def test_every_index_field_starts_16_byte_aligned():
    """Triton specializes kernels on 16-byte pointer alignment: fields of a step's one buffer must not change it."""
    chunks = [Chunk([1], 4, [3, 2]), Chunk([5, 6, 7], 2, [4, 6]), Chunk([8], 0, [7])]  # odd counts everywhere
    for tile_rows in (1, 4):
        batch = Batch.build(chunks, 4, CPU, table_width=3, tile_rows=tile_rows, tile_slots=5 if tile_rows > 1 else None)
        views = [getattr(batch, f.name) for f in fields(batch) if f.name not in ("storage", "mask")]
        assert all(v.data_ptr() % 16 == 0 for v in views if isinstance(v, torch.Tensor) and v.numel())
        assert batch.seq_lens.tolist() == [5, 1] and batch.last_index.tolist() == [0, 3, 4]
