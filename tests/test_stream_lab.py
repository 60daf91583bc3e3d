"""bench/stream_lab.py's stand-in kernels (the W4 GEMV's grid and loads with a dial for the arithmetic): with no
arithmetic (WORK = 0) every way of fetching, the split-K grid and stream-K alike, must read each code word exactly
once, so each gives the matrix's row sums (mod 2^32) against PyTorch's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import stream_lab  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter (conftest)


@pytest.mark.parametrize("mode", stream_lab.MODES)
def test_every_mode_reads_each_word_once(mode):
    gen = torch.Generator().manual_seed(0)
    n, kw = 80, 96  # 80 rows: a partial last tile of 32; 96 words: 3 steps of 32, partial splits
    codes = torch.randint(-2**31, 2**31 - 1, (n, kw), generator=gen, dtype=torch.int32).to(DEVICE)
    ref = (codes.long().sum(1) + 2**31) % 2**32 - 2**31  # int32 wrap-around
    out = torch.zeros(64, n, dtype=torch.int32, device=DEVICE)
    stream_lab.launch(codes, out, 32, 32, 4, mode, 0, 3)  # 3 "SMs": 6 or 12 stream-K programs
    assert torch.equal(out.long().sum(0).add(2**31).remainder(2**32).sub(2**31), ref), mode


@pytest.mark.parametrize("mode", stream_lab.LAYER_MODES)
def test_layer_modes_read_each_weight_once(mode):
    """--layer: the persistent programs stream each of a layer's four weights whole, as four launches or one, each
    weight's row sums landing at its offset; the barrier's arrival count is back at zero after each launch. The
    barrier mode spins until every program has arrived and PDL is compiled code, so on CPU (the interpreter runs
    programs one after another) only the others run; the offline compile covers the barrier there."""
    if DEVICE.type == "cpu" and mode in ("persistent", "launches_pdl"):
        pytest.skip("the grid barrier and PDL run on the GPU only")
    gen = torch.Generator().manual_seed(1)
    shapes = [(48, 64), (16, 96), (80, 64), (16, 160)]  # partial tiles of 32 rows; K / 8 words not a step multiple
    weights = [torch.randint(-2**31, 2**31 - 1, s, generator=gen, dtype=torch.int32).to(DEVICE) for s in shapes]
    out = torch.zeros(sum(n for n, _ in shapes), dtype=torch.int32, device=DEVICE)
    barrier = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # twice: the barrier must work again from the state it left
        stream_lab.launch_layer(weights, out, barrier, 32, 32, 4, mode, 0, 3)
    assert barrier[0].item() == 0
    ref = torch.cat([(w.long().sum(1) + 2**31) % 2**32 - 2**31 for w in weights])
    assert torch.equal(out.long(), ref), mode


def test_w4_layer_yardstick_makes_the_engines_four_launches():
    """--layer's yardstick: the W4 kernel's own launches of a layer (here in the interpreter, untuned), q|k|v, o,
    gate|up with SiLU·up, down, against the dequantized weights."""
    from spear.kernels.reference import w4_linear_ref

    torch.manual_seed(0)
    shapes = [(192, 128), (128, 128), (256, 128), (128, 128)]
    calls, weights, xs = stream_lab.w4_layer_calls(shapes, DEVICE, tune=False)
    outs = calls[0]()
    assert [tuple(o.shape) for o in outs] == [(1, 192), (1, 128), (1, 128), (1, 128)]  # gate|up: SiLU·up, N / 2
    refs = [w4_linear_ref(x, w).float() for x, w in zip(xs, weights, strict=True)]
    refs[2] = torch.nn.functional.silu(refs[2][:, :128]) * refs[2][:, 128:]
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2, i
