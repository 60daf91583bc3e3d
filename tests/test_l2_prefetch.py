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


def _words_sum(region) -> int:
    """The int32 sum (wrapping) of the words a WeightRows region covers."""
    flat = region.base.reshape(-1)[: region.rows * region.stride].view(region.rows, region.stride)
    words = flat[:, : region.row_bytes].contiguous().view(torch.int32).long().sum().item()
    return (words + (1 << 31)) % (1 << 32) - (1 << 31)


@pytest.mark.skipif(not (torch.cuda.is_available() or l2_prefetch.triton is not None), reason="needs triton")
def test_warm_launch_reads_every_word_of_the_plan():
    """The warm launch (one program an SM; 4 under the interpreter) reads each region's words: the per-program sums
    it stores add up to the region's sum, for a whole weight in 64 KB pieces and for a share of every row."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    o = nn.Linear(256, 256, bias=False).half().to(dev)  # 128 KB: two 64 KB pieces
    gate_up = nn.Linear(512, 96, bias=False).half().to(dev)
    plan = plan_within(o, gate_up, budget=1 << 20, next_fraction=0.3)
    assert (plan[0].rows, plan[0].row_bytes) == (2, 64 << 10) and plan[1].row_bytes == 304
    sink = l2_prefetch.warm_l2(plan, dev)
    l2_prefetch.join(dev)
    programs = sink.numel() // 4
    for i, region in enumerate(plan):
        got = sink[i * programs:(i + 1) * programs].long().sum().item()
        assert (got + (1 << 31)) % (1 << 32) - (1 << 31) == _words_sum(region), i
    assert l2_prefetch.warm_l2((), dev) is None


def test_decode_steps_warm_o_and_gate_up_and_keep_their_logits(monkeypatch):
    """SPEAR_L2_PREFETCH: each one-row step's layers read o's weight and a share of the stacked gate|up's beside
    attention (the interpreter here, a side stream on CUDA); the logits are those of the model without it, and the
    prefill step (several rows) reads nothing ahead."""
    from test_runtime_fuse import DEVICE, logits

    from spear.runtime import model as model_module
    from spear.runtime.model import ModelArgs, fuse_projections, random_model

    args = ModelArgs(dim=128, intermediate=192, n_heads=4, n_kv_heads=2, head_dim=32, n_layers=2, vocab=64)
    model = random_model(args, dtype=torch.float16, device=DEVICE, kernels=False, seed=7)
    assert fuse_projections(model) == 2 * args.n_layers
    ids = torch.randint(0, args.vocab, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = logits(model, ids, prefill=5)
    warmed = []
    real = model_module.warm_l2

    def counting(plan, device):
        warmed.append(tuple(r.base.data_ptr() for r in plan))
        return real(plan, device)

    monkeypatch.setattr(model_module, "warm_l2", counting)
    monkeypatch.setattr(l2_prefetch, "ENABLED", True)
    monkeypatch.setattr(l2_prefetch, "WARM_DEVICES", ("cuda", "cpu"))
    out = logits(model, ids, prefill=5)
    assert torch.equal(out, ref)
    layers = model.layers
    expect = [(b.attention.wo.weight.data_ptr(), b.feed_forward.w_gate_up.weight.data_ptr()) for b in layers]
    assert warmed == [()] * len(layers) + expect * (len(ids) - 5)  # the prefill step: nothing
