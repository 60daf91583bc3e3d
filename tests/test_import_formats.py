"""Each imported format dequantizes to the format's own weights bit for bit.

Where the library that writes or reads the format runs here, it writes the tensors and its reader is the
reference: compressed-tensors (installed), gguf (installed), AutoAWQ and AutoGPTQ (optional: AutoAWQ's and
AutoGPTQ's packers and readers, skipped when absent; they install with `pip install --no-deps`, see
test_gptq_against_autogptq). Without them, GPTQ tensors are packed here from the format's documentation and
compared with AutoGPTQ's dequantization formula.
"""

import importlib.util

import numpy as np
import pytest
import torch
from torch import nn

from spear.errors import SpearError
from spear.kernels.pack import pack_w4
from spear.quant.formats import (
    AWQ_SHIFT_OF_COLUMN, GGUF_BITS, GGUF_BLOCK_BYTES, GGUF_BLOCK_WEIGHTS, awq_record, compressed_tensors_record,
    gguf_record, gptq_record, unpack_int32,
)
from spear.record import QuantizedWeight

OUT, IN = 64, 128


def random_grid(groups: int, asym: bool, seed: int = 0):
    """Codes [OUT, IN], zeros and fp16 scales [OUT, groups]; asymmetric zeros in 1..15 (v1 GPTQ cannot store 0)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (OUT, IN), generator=g)
    zeros = torch.randint(1, 16, (OUT, groups), generator=g) if asym else torch.full((OUT, groups), 8)
    scales = (torch.rand(OUT, groups, generator=g) * 0.02 + 1e-3).half()
    return codes, zeros, scales


def act_order_g_idx(in_features: int, group_size: int, seed: int = 0) -> torch.Tensor:
    """GPTQ's act-order: columns quantized in a permuted order, group = position in that order // group size."""
    perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[perm] = (torch.arange(in_features) // group_size).to(torch.int32)
    return g_idx


def pack_words(codes: torch.Tensor, shifts=tuple(range(8))) -> torch.Tensor:
    """[rows, 8 n] codes → [rows, n] int32, code 8k + j at bits 4 * shifts[j] (the writers' loops, vectorised)."""
    c = codes.to(torch.int64).reshape(codes.shape[0], -1, 8)
    words = (c << (4 * torch.tensor(shifts))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_gptq(codes, zeros, scales, g_idx, v1=True) -> dict:
    """GPTQ tensors as AutoGPTQ / GPTQModel lay them out (layer name 'm')."""
    return {"m.qweight": pack_words(codes).t().contiguous(), "m.qzeros": pack_words((zeros - int(v1)).t()),
            "m.scales": scales.t().contiguous(), "m.g_idx": g_idx}


def test_unpack_inverts_packing():
    codes = torch.randint(0, 16, (3, 16), dtype=torch.uint8)
    assert torch.equal(unpack_int32(pack_words(codes)), codes)
    assert torch.equal(unpack_int32(pack_words(codes, AWQ_SHIFT_OF_COLUMN), AWQ_SHIFT_OF_COLUMN), codes)


@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("v1", [True, False])
def test_gptq_matches_its_dequantization_formula(asym, act_order, v1):
    gs = 32
    codes, zeros, scales = random_grid(IN // gs, asym)
    g_idx = act_order_g_idx(IN, gs) if act_order else torch.arange(IN, dtype=torch.int32) // gs
    record = gptq_record("m", pack_gptq(codes, zeros, scales, g_idx, v1), OUT, IN, gs, v1)
    # AutoGPTQ's reader (qlinear_cuda.py, torch path): scales[g_idx] * (weight - zeros[g_idx]), in fp16
    g = g_idx.long()
    reference = (scales.t()[g] * (codes.t() - zeros.t()[g])).t()
    assert reference.dtype == torch.float16
    assert torch.equal(record.dequantize(torch.float16), reference)
    assert (record.g_idx is not None) == act_order and record.standard_form == (not act_order)


def test_gptq_v1_nibble_15_is_zero_point_16():
    codes, zeros, scales = random_grid(1, asym=False)
    tensors = pack_gptq(codes, torch.full_like(zeros, 16), scales, torch.zeros(IN, dtype=torch.int32))
    record = gptq_record("m", tensors, OUT, IN, -1)
    assert int(record.zeros.max()) == 16 and record.group_size == IN


def _load_file_module(package: str, relative: str):
    """A module file of an installed package, without running the package's __init__ (AutoGPTQ's imports
    a transformers API that transformers 5 removed; its QuantLinear files need only torch)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed")
    path = f"{next(iter(spec.submodule_search_locations))}/{relative}"
    module_spec = importlib.util.spec_from_file_location(f"_{package}_{relative.replace('/', '_')}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_against_autogptq(asym, act_order):
    """AutoGPTQ packs (QuantLinear.pack) and reads (its CPU forward): pip install --no-deps auto-gptq==0.7.1."""
    qlinear = _load_file_module("auto_gptq", "nn_modules/qlinear/qlinear_cuda.py")
    gs = 32
    codes, zeros, scales = random_grid(IN // gs, asym, seed=1)
    g_idx = act_order_g_idx(IN, gs, seed=1) if act_order else torch.arange(IN, dtype=torch.int32) // gs
    g = g_idx.long()
    linear = nn.Linear(IN, OUT, bias=False)
    linear.weight.data = (codes - zeros[:, g]).float() * scales[:, g].float()
    layer = qlinear.QuantLinear(4, gs, IN, OUT, bias=False, weight_dtype=torch.float16)
    layer.pack(linear, scales.float(), zeros.float(), g_idx)
    layer.scales = layer.scales.half()
    tensors = {f"m.{k}": getattr(layer, k) for k in ("qweight", "qzeros", "scales", "g_idx")}
    record = gptq_record("m", tensors, OUT, IN, gs)
    assert torch.equal(record.codes.long(), codes)
    reference = layer(torch.eye(IN, dtype=torch.float16)).t()  # its dequantized weight, row by row
    assert torch.equal(record.dequantize(torch.float16), reference)


@pytest.mark.parametrize("gs", [32, IN])
def test_awq_against_autoawq(gs):
    """AutoAWQ packs (WQLinear_GEMM.from_linear) and reads (dequantize_gemm): pip install --no-deps autoawq."""
    pytest.importorskip("awq")
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    codes, zeros, scales = random_grid(IN // gs, asym=True, seed=2)
    linear = nn.Linear(IN, OUT, bias=False)
    g = torch.arange(IN) // gs
    linear.weight.data = (codes - zeros[:, g]).float() * scales[:, g].float()
    layer = WQLinear_GEMM.from_linear(linear, 4, gs, scales=scales.t().float(), zeros=zeros.t().float())
    tensors = {f"m.{k}": getattr(layer, k) for k in ("qweight", "qzeros", "scales")}
    record = awq_record("m", tensors, OUT, IN)
    assert torch.equal(record.codes.long(), codes) and torch.equal(record.zeros.long(), zeros)
    reference = dequantize_gemm(layer.qweight, layer.qzeros, layer.scales, 4, gs).t()
    assert torch.equal(record.dequantize(torch.float16), reference)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("strategy", ["group", "channel"])
def test_compressed_tensors_against_the_library(dtype, asym, strategy):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    gs = 32 if strategy == "group" else None
    groups = IN // 32 if strategy == "group" else 1
    args = QuantizationArgs(num_bits=4, type="int", symmetric=not asym, strategy=strategy, group_size=gs)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(OUT, IN, generator=g).to(dtype)
    scale = (torch.rand(OUT, groups, generator=g) * 0.5 + 0.05).to(dtype)
    zero_point = torch.randint(-8, 8, (OUT, groups), generator=g, dtype=torch.int8) if asym else None
    state = {"weight": weight, "weight_scale": scale} | ({"weight_zero_point": zero_point} if asym else {})
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    reference = PackedQuantizationCompressor.decompress(compressed, scheme)["weight"]
    record = compressed_tensors_record("m", {f"m.{k}": v for k, v in compressed.items()}, OUT, IN)
    assert reference.dtype == dtype
    assert torch.equal(record.dequantize(dtype), reference)


def test_compressed_tensors_scales_outside_fp16_stay_float32():
    codes, zeros, _ = random_grid(1, asym=False)
    value = 2.0**-20 * (1 + 2.0**-7)  # a bf16 value whose last bit is below fp16's subnormal step (2^-24)
    scales = torch.full((OUT, 1), value, dtype=torch.bfloat16)
    tensors = {"m.weight_packed": pack_words(codes), "m.weight_scale": scales,
               "m.weight_shape": torch.tensor([OUT, IN])}
    record = compressed_tensors_record("m", tensors, OUT, IN)
    assert record.scales.dtype == torch.float32 and not record.standard_form
    assert torch.equal(record.dequantize(), (codes - 8).float() * value)


GGUF_FP16_BYTES = {"Q6_K": slice(208, 210), "Q4_1": slice(0, 4), "Q5_1": slice(0, 4), "Q4_K": slice(0, 4),
                   "Q5_K": slice(0, 4)}  # where d (and m or dmin) sit; d alone at bytes 0:2 otherwise


def random_gguf_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Raw bytes [rows, row bytes] of a `kind` tensor: random codes, sub-scales and high bits, small finite fp16
    d (m, dmin): any such bytes are valid blocks of the layout gguf.quants dequantizes."""
    n, size = GGUF_BLOCK_WEIGHTS[kind], GGUF_BLOCK_BYTES[kind]
    blocks = rng.integers(0, 256, (rows, cols // n, size), dtype=np.uint8)
    fp16 = GGUF_FP16_BYTES.get(kind, slice(0, 2))
    halves = (fp16.stop - fp16.start) // 2
    blocks[..., fp16] = (rng.standard_normal((rows, cols // n, halves)) * 0.01).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """The same float32 bits, the sign of zero included."""
    assert a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("kind", list(GGUF_BITS))
def test_gguf_random_blocks_against_gguf_quants(kind):
    """Every type from random blocks (gguf writes no K-quants): the record dequantizes to gguf.quants' float32 bit
    for bit, at the type's bits, and keeps it through the artifact's packing at those bits."""
    from gguf import GGMLQuantizationType, quants

    n_in = 512
    data = random_gguf_blocks(kind, OUT, n_in, np.random.default_rng(5))
    record = gguf_record("t", kind, data, OUT, n_in)
    reference = torch.from_numpy(quants.dequantize(data, GGMLQuantizationType[kind]))
    assert_bitwise_equal(record.dequantize(), reference)
    assert record.bits == GGUF_BITS[kind] and int(record.codes.max()) < 2 ** record.bits
    assert record.group_size == (16 if kind == "Q6_K" else 32)
    assert (record.offsets is not None) == (kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"))
    stored = QuantizedWeight.from_tensors(record.tensors("m"), "m", record.bits, n_in)
    assert_bitwise_equal(stored.dequantize(), reference)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_gguf_quantized_weights_against_gguf_quants(kind):
    """The types gguf.quants also quantizes, from real weights."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    weight = np.random.default_rng(4).standard_normal((OUT, IN)).astype(np.float32)
    data = quants.quantize(weight, qtype)
    record = gguf_record("t", kind, data, OUT, IN)
    assert_bitwise_equal(record.dequantize(), torch.from_numpy(quants.dequantize(data, qtype)))
    assert record.group_size == 32 and (record.offsets is not None) == kind.endswith("_1")


def test_gguf_scales_are_fp16_or_exact_float32():
    """Q6_K's d · sc (11 × 8 significant bits, sc signed) stay float32, exact; one-level types keep fp16 d."""
    rng = np.random.default_rng(6)
    assert gguf_record("t", "Q6_K", random_gguf_blocks("Q6_K", OUT, 256, rng), OUT, 256).scales.dtype == torch.float32
    assert gguf_record("t", "Q8_0", random_gguf_blocks("Q8_0", OUT, 256, rng), OUT, 256).scales.dtype == torch.float16


def test_gguf_refuses_other_types_and_bad_sizes():
    with pytest.raises(SpearError, match="Q3_K"):
        gguf_record("blk.0.ffn_down.weight", "Q3_K", np.zeros((OUT, 110), np.uint8), OUT, 256)
    with pytest.raises(SpearError, match="malformed GGUF"):
        gguf_record("t", "Q4_0", np.zeros((OUT, 17), np.uint8), OUT, 32)
    with pytest.raises(SpearError, match="malformed GGUF"):
        gguf_record("t", "Q6_K", np.zeros((OUT, 210), np.uint8), OUT, 128)


def test_malformed_tensors_are_one_clear_error():
    codes, zeros, scales = random_grid(IN // 32, asym=False)
    tensors = pack_gptq(codes, zeros, scales, torch.arange(IN, dtype=torch.int32) // 32)
    with pytest.raises(SpearError, match="m.qweight has shape"):
        gptq_record("m", tensors, OUT, 2 * IN, 32)
    tensors["m.g_idx"] = torch.full((IN,), 99, dtype=torch.int32)
    with pytest.raises(SpearError, match="g_idx names groups outside"):
        gptq_record("m", tensors, OUT, IN, 32)


def test_record_with_g_idx_and_offsets_round_trips_and_refuses_the_kernels():
    codes, zeros, scales = random_grid(IN // 32, asym=True)
    offsets = torch.randn(OUT, IN // 32)
    record = QuantizedWeight(codes.to(torch.uint8), scales, zeros.to(torch.uint8), 4, 32, act_order_g_idx(IN, 32),
                             offsets)
    again = QuantizedWeight.from_tensors(record.tensors("m"), "m", 4)
    assert torch.equal(again.dequantize(), record.dequantize())
    g = record.g_idx.long()
    expected = (codes - zeros[:, g]).float() * scales[:, g].float() + offsets[:, g]
    assert torch.equal(record.dequantize(), expected)
    with pytest.raises(SpearError, match="g_idx, offsets or float32 scales"):
        pack_w4(record)


def test_tensor_parallelism_refuses_to_split_an_imported_record():
    from spear.layer import SpearLinear
    from spear.runtime.tp import RowParallelLinear

    codes, zeros, scales = random_grid(IN // 32, asym=True)
    record = QuantizedWeight(codes.to(torch.uint8), scales, zeros.to(torch.uint8), 4, 32, act_order_g_idx(IN, 32))
    with pytest.raises(SpearError, match="cannot be split yet"):
        RowParallelLinear(SpearLinear(record), rank=0, world=2)
