"""RTN grids, the quantized-weight record, and its exact round trip through safetensors."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from spear.errors import SpearError
from spear.record import QuantConfig, QuantizedWeight, rtn_quantize

CONFIGS = [
    QuantConfig(bits=b, group_size=g, sym=sym, sym_grid=grid)
    for b in (2, 3, 4, 8)
    for g in (-1, 32, 64)
    for sym, grid in ((True, "absmax"), (True, "gptq"), (False, "absmax"))
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"w{c.bits}g{c.group_size}{c.grid}")
def test_rtn_error_bound_and_code_range(cfg):
    w = torch.randn(48, 192) * torch.rand(48, 1) * 3
    q = rtn_quantize(w, cfg)
    assert q.codes.dtype == torch.uint8 and q.scales.dtype == torch.float16
    assert int(q.codes.max()) <= 2**cfg.bits - 1
    assert q.group_size == (192 if cfg.group_size == -1 else cfg.group_size)
    err = (q.dequantize() - w).abs()
    step = q.scales.float().repeat_interleave(q.group_size, dim=1)
    if cfg.sym and cfg.sym_grid == "absmax":
        # absmax: every weight lies inside the grid, so rounding error is at most half a step
        assert (err <= step / 2 + 1e-6).all()
    else:
        # gptq / min-max grids clip at most one extreme value by half a step more
        assert (err <= step + 1e-6).all()


def test_rtn_is_nearest_grid_point():
    cfg = QuantConfig(bits=4, group_size=32)
    w = torch.randn(8, 64)
    q = rtn_quantize(w, cfg)
    deq = q.dequantize()
    for delta in (-1, 1):
        other = QuantizedWeight((q.codes.int() + delta).clamp(0, 15).to(torch.uint8), q.scales, q.zeros, 4, 32)
        assert ((other.dequantize() - w).abs() >= (deq - w).abs() - 1e-6).all()


def test_record_roundtrip_safetensors_is_exact(tmp_path):
    q = rtn_quantize(torch.randn(32, 128), QuantConfig(bits=3, group_size=64, sym=False))
    save_file(q.tensors("layer"), str(tmp_path / "q.safetensors"))
    back = QuantizedWeight.from_tensors(load_file(str(tmp_path / "q.safetensors")), "layer", bits=3)
    assert torch.equal(back.dequantize(), q.dequantize())
    assert back.group_size == 64


def test_zero_rows_and_packed_bytes():
    w = torch.zeros(4, 64)
    q = rtn_quantize(w, QuantConfig())
    assert torch.equal(q.dequantize(), w)
    # 4 rows x 64 weights at 4 bits + 4 fp16 scales + 4 zeros at 4 bits
    assert q.nbytes_packed() == 128 + 8 + 2


@pytest.mark.parametrize("bits", [1, 9, 0])
def test_bits_out_of_range(bits):
    with pytest.raises(SpearError, match="bits"):
        QuantConfig(bits=bits)


def test_group_size_must_divide():
    with pytest.raises(SpearError, match="does not divide"):
        rtn_quantize(torch.randn(8, 576), QuantConfig(group_size=128))
    with pytest.raises(SpearError, match="group size"):
        QuantConfig(group_size=4)


@pytest.mark.parametrize("group_size", [-1, 16])
@pytest.mark.parametrize("extra", [None, "offsets", "g_idx"])
def test_dequantize_is_the_per_column_formula_bit_for_bit(group_size, extra):
    """The broadcast dequantization equals (q − z)·s (+ m) with s, z, m repeated over each group's columns."""
    g = torch.Generator().manual_seed(0)
    q = rtn_quantize(torch.randn(24, 64, generator=g), QuantConfig(4, group_size))
    if extra == "offsets":
        q.offsets = torch.randn(q.scales.shape, generator=g)
    if extra == "g_idx":
        q.g_idx = torch.randperm(64, generator=g).to(torch.int32) % q.scales.shape[1]
    cols = q.g_idx.long() if q.g_idx is not None else torch.arange(64) // q.group_size
    expected = (q.codes.float() - q.zeros.float()[:, cols]) * q.scales.float()[:, cols]
    if q.offsets is not None:
        expected = expected + q.offsets[:, cols]
    for dtype in (torch.float32, torch.float16):
        assert torch.equal(q.dequantize(dtype), expected.to(dtype))
