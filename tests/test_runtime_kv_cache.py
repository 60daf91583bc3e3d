"""The paged KV cache: block accounting, slot layout, and attention over cached blocks."""

from __future__ import annotations

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
    got_k, got_v = gather_kv(k_pool, batch.block_tables), gather_kv(v_pool, batch.block_tables)  # [B, 12, kv, d]
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
        return paged_attention(cat(q), k_pool, v_pool, batch, batch.attention_mask(bs))

    # sequence 0 prefills in chunks of 5, 5, 2 beside sequence 1's prefill, then both decode one token together
    outs = [run([(0, 0, 5), (1, 0, 6)]), run([(0, 5, 10)]), run([(0, 10, 12)]), run([(0, 12, 13), (1, 6, 7)])]
    got0 = torch.cat([outs[0][:5], outs[1], outs[2], outs[3][:1]])
    got1 = torch.cat([outs[0][5:], outs[3][1:]])
    torch.testing.assert_close(got0, reference_attention(q[0], k[0], v[0]))
    torch.testing.assert_close(got1, reference_attention(q[1], k[1], v[1]))
