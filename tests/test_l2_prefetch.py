"""kernels.l2_prefetch: which weight bytes a decode step's RoPE launch asks into L2, within the budget; on CUDA, that
asking changes nothing the launch computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spear.kernels import l2_prefetch
from spear.kernels.l2_prefetch import plan_within, weight_rows
from spear.layer import SpearLinear
from spear.quant.record import QuantConfig, rtn_quantize


def _w4_layer(out_f: int, in_f: int) -> SpearLinear:
    layer = SpearLinear(rtn_quantize(torch.randn(out_f, in_f), QuantConfig(bits=4)))
    layer.use_kernels()
    return layer


def test_w4_layer_gives_its_packed_codes_and_a_float_layer_its_weight():
    w4 = _w4_layer(128, 256)
    rows = weight_rows(w4)
    assert rows.base.data_ptr() == w4.packed.qweight.data_ptr()
    assert (rows.rows, rows.stride, rows.row_bytes) == (128, 256 // 2, 256 // 2)  # 4 bits a weight
    dense = nn.Linear(256, 64, bias=False).half()
    rows = weight_rows(dense, 0.3)
    assert rows.base.data_ptr() == dense.weight.data_ptr()
    assert (rows.rows, rows.stride, rows.row_bytes) == (64, 512, 144)  # 0.3 × 512 = 153.6, down to 16 bytes
    assert weight_rows(dense, 0.01) is None  # under 16 bytes a row: nothing
    assert weight_rows(None) is None


def test_plan_takes_all_of_o_then_a_share_of_every_gate_up_row():
    o, gate_up = _w4_layer(256, 256), _w4_layer(1024, 256)
    first, second = plan_within(o, gate_up, budget=1 << 20, next_fraction=0.25)
    assert first.base.data_ptr() == o.packed.qweight.data_ptr() and first.nbytes == 256 * 128
    assert second.base.data_ptr() == gate_up.packed.qweight.data_ptr()
    assert (second.rows, second.row_bytes) == (1024, 32)


def test_plan_stays_within_its_budget_cutting_o_first():
    o, gate_up = nn.Linear(512, 512, bias=False).half(), nn.Linear(512, 2048, bias=False).half()
    full_o = 512 * 1024
    (o_rows,) = plan_within(o, gate_up, budget=full_o // 2, next_fraction=0.5)  # o alone overfills: cut, no gate|up
    assert o_rows.rows == 512 and o_rows.row_bytes == 512 and o_rows.nbytes <= full_o // 2
    o_rows, next_rows = plan_within(o, gate_up, budget=full_o + 2048 * 160, next_fraction=0.5)
    assert (o_rows.rows, o_rows.stride, o_rows.row_bytes) == (8, 64 << 10, 64 << 10)  # whole: in 64 KB pieces
    assert next_rows.row_bytes == 160 and o_rows.nbytes + next_rows.nbytes <= full_o + 2048 * 160


def test_nothing_is_asked_for_off_cuda_or_when_off(monkeypatch):
    o, gate_up = _w4_layer(64, 128), _w4_layer(128, 128)
    monkeypatch.setattr(l2_prefetch, "ENABLED", True)
    assert l2_prefetch.prefetch_plan(o, gate_up, torch.zeros(1, 8, dtype=torch.float16), rows=1) == ()  # CPU
    monkeypatch.setattr(l2_prefetch, "ENABLED", False)
    assert l2_prefetch.prefetch_plan(o, gate_up, torch.zeros(1, 8, dtype=torch.float16), rows=1) == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the prefetch runs compiled only (inline PTX)")
def test_rope_launch_with_prefetch_computes_the_same():
    from spear.runtime.ops import rope_write_kv

    torch.manual_seed(0)
    dev = torch.device("cuda")
    T, H, KV, D, blocks, block_size = 1, 8, 2, 64, 4, 16
    q, k, v = (torch.randn(T, n, D, dtype=torch.float16, device=dev) for n in (H, KV, KV))
    positions = torch.tensor([5], device=dev)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=dev).float() / D))
    slots = torch.tensor([21], device=dev)
    o, gate_up = nn.Linear(512, 512, bias=False).half().to(dev), nn.Linear(512, 2048, bias=False).half().to(dev)
    plan = plan_within(o, gate_up, budget=1 << 20, next_fraction=0.25)
    assert len(plan) == 2
    results = []
    for prefetch in ((), plan):
        k_pool = torch.zeros(blocks, block_size, KV, D, dtype=torch.float16, device=dev)
        v_pool = torch.zeros_like(k_pool)
        q_out = rope_write_kv(q, k, v, positions, inv_freq, k_pool, v_pool, slots, prefetch=prefetch)
        results.append((q_out, k_pool, v_pool))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
