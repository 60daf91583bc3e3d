"""The CPU 4-bit paths (kernels.cpu_w4) against their specification, x @ record.dequantize()ᵀ: PyTorch's int4 CPU
matmul (skipped where this PyTorch lacks it) and the nibble-packed scratch dequantization."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spear.errors import SpearError
from spear.kernels.cpu_w4 import (
    CPU_W4_MAX_ROWS,
    Int4OpLayout,
    PackedNibbles,
    Scratch,
    cpu_w4_linear,
    dequantize_into,
    has_int4_op,
    int4_op_layout,
    nibbles_of,
    pack_cpu_w4,
    pack_nibbles,
    scratch_for,
    scratch_linear,
    scratch_rows,
)
from spear.record import QuantizedWeight

needs_int4_op = pytest.mark.skipif(not has_int4_op(), reason=f"no CPU int4 matmul in torch {torch.__version__}")

# (N, K, group size or -1 for per-channel): SmolLM2's k/v (192×576, per-channel as g' = 64), groups of 64 and 128,
# a group of 512 (run as 256), and a per-channel K of 1536 (run as 256)
SHAPES = [(192, 576, -1), (64, 256, 64), (48, 512, 128), (32, 1024, 512), (16, 1536, -1)]


def random_record(n: int, k: int, group: int, gen: torch.Generator, bits: int = 4) -> QuantizedWeight:
    """Codes, fp16 scales and asymmetric zeros drawn over their whole range."""
    g = k if group == -1 else group
    top = 2**bits
    codes = torch.randint(0, top, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, top, (n, k // g), generator=gen, dtype=torch.uint8)
    return QuantizedWeight(codes, scales, zeros, bits, g)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


@needs_int4_op
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_int4_fp32_is_the_dequantized_weight(n, k, group, gen):
    """In float32 the op's weight is W_hat exactly: the identity as x reads it back bit for bit."""
    record = random_record(n, k, group, gen)
    packed = pack_cpu_w4(record, torch.float32)
    assert torch.equal(cpu_w4_linear(torch.eye(k), packed).t(), record.dequantize())


@needs_int4_op
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_int4_linear_matches_reference(n, k, group, dtype, tol, gen):
    record = random_record(n, k, group, gen)
    bias = torch.randn(n, generator=gen) * 0.1
    x = torch.randn(2, 3, k, generator=gen)
    ref = x.double() @ record.dequantize().double().t() + bias.double()
    y = cpu_w4_linear(x, pack_cpu_w4(record, dtype), bias)
    assert y.shape == (2, 3, n) and y.dtype == torch.float32
    assert rel_err(y, ref) < tol
    yb = cpu_w4_linear(x.bfloat16(), pack_cpu_w4(record, dtype), bias)  # the result comes back in x's dtype
    assert yb.dtype == torch.bfloat16 and rel_err(yb, ref) < 2e-2


@needs_int4_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_is_deterministic_and_batch_invariant(dtype, gen):
    """Each output is one tile's sum over K: the same bits at any thread count and for a row alone or in a batch."""
    packed = pack_cpu_w4(random_record(64, 512, 128, gen), dtype)
    x = torch.randn(9, 512, generator=gen)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(cpu_w4_linear(x, packed))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(cpu_w4_linear(x[4:5], packed), outs[0][4:5])


@needs_int4_op
@pytest.mark.parametrize("n,k,group,bits,dtype,match", [
    (40, 256, 64, 4, torch.float32, "multiple of 16"),  # N
    (64, 256, 16, 4, torch.float32, "multiple of 32"),  # group
    (64, 576, -1, 4, torch.float32, None),  # per-channel K = 576 runs as 9 groups of 64
    (64, 200, -1, 4, torch.float32, "multiple of 32"),  # per-channel K not a multiple of 32
    (64, 256, 64, 8, torch.float32, "at most 4 bits"),
    (64, 256, 64, 4, torch.float16, "float32 or bfloat16"),
])
def test_int4_shapes_it_refuses(n, k, group, bits, dtype, match, gen):
    record = random_record(n, k, group, gen, bits)
    if match is None:
        assert pack_cpu_w4(record, dtype).group_size == 64
        return
    with pytest.raises(SpearError, match=match) as info:
        pack_cpu_w4(record, dtype)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("pack", [pack_nibbles, pytest.param(pack_cpu_w4, marks=needs_int4_op)])
def test_imported_formats_are_refused(pack, gen):
    record = random_record(64, 256, 64, gen)
    record.offsets = torch.zeros(64, 4)
    with pytest.raises(SpearError, match="imported format"):
        pack(record)


@pytest.mark.parametrize("n,k,group", SHAPES + [(40, 200, 8)])  # the scratch takes any N, any group, even K
def test_scratch_dequantizes_bit_for_bit(n, k, group, gen):
    record = random_record(n, k, group, gen)
    packed = pack_nibbles(record)
    scratch = Scratch(n * k + 7)  # larger than the layer, as the shared scratch is
    assert torch.equal(dequantize_into(packed, scratch), record.dequantize())
    bias = torch.randn(n, generator=gen)
    x = torch.randn(5, k, generator=gen)
    ref = x.double() @ record.dequantize().double().t() + bias.double()
    assert rel_err(scratch_linear(x, packed, scratch, bias), ref) < 1e-5


@needs_int4_op
@pytest.mark.parametrize("n,k,group", SHAPES + [(80, 128, -1), (2048, 64, 32)])  # full blocks and a shorter last one
def test_the_scratch_reads_the_int4_kernels_codes_bit_for_bit(n, k, group, gen):
    """A layer served both ways holds its codes once: the scratch path unpacks the int4 op's own packing."""
    record = random_record(n, k, group, gen)
    packed = pack_cpu_w4(record)
    nibbles = nibbles_of(packed, record)
    assert nibbles.layout == int4_op_layout(n) is not None  # this CPU's layout is one of the known ones
    assert nibbles.codes.data_ptr() == packed.weight.data_ptr()
    assert torch.equal(dequantize_into(nibbles, Scratch(n * k)), record.dequantize())


@needs_int4_op
@pytest.mark.parametrize("n", [256, 272, 608, 1040])  # one piece; a piece and a short block; several, a short one
def test_packing_a_piece_of_rows_at_a_time_is_the_whole_packing(n, gen):
    from spear.kernels import cpu_w4

    codes = random_record(n, 64, -1, gen).codes
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    assert torch.equal(cpu_w4._int4pack(codes), whole)


def _pack_as(codes: torch.Tensor, layout: Int4OpLayout) -> torch.Tensor:
    """The int4 op's packing of codes [N, K] as `layout` describes it, written out one byte at a time."""
    n, k = codes.shape
    out, b, full = [], layout.block, n - n % layout.block
    for start in range(0, full, b):
        for kk in range(k):
            for j in range(b // 2):
                lo, hi = (start + j, start + j + b // 2) if layout.halves else (start + 2 * j, start + 2 * j + 1)
                out.append(int(codes[lo, kk]) | int(codes[hi, kk]) << 4)
    for kk in range(k):
        for j in range((n - full) // 2):
            out.append(int(codes[full + 2 * j, kk]) | int(codes[full + 2 * j + 1, kk]) << 4)
    return torch.tensor(out, dtype=torch.uint8).view(n, k // 2)


@pytest.mark.parametrize("layout", [Int4OpLayout(32, True), Int4OpLayout(64, True), Int4OpLayout(32, False),
                                    Int4OpLayout(64, False)])
def test_every_known_int4_op_layout_unpacks(layout, gen):
    """The layouts of other CPUs (AVX-512's blocks of 64, the scalar loop's pairs), as PyTorch's packing writes them."""
    record = random_record(144, 8, -1, gen)  # two blocks of 64 and a last one of 16
    s = record.scales.float()
    nibbles = PackedNibbles(_pack_as(record.codes, layout), s[..., None], (-record.zeros.float() * s)[..., None], 8,
                            layout)
    assert torch.equal(dequantize_into(nibbles, Scratch(144 * 8)), record.dequantize())


@pytest.mark.parametrize("shared", [False, pytest.param(True, marks=needs_int4_op)])
def test_a_layer_larger_than_the_scratch_runs_a_block_of_rows_at_a_time(shared, gen):
    """208 rows through a scratch of 64 rows: blocks of 64, 64, 64 and 16 rows (the int4 packing's last, shorter
    block among them), the same output as the whole layer's dequantized weight, bias included."""
    n, k = 208, 96
    record = random_record(n, k, 32, gen)
    packed = nibbles_of(pack_cpu_w4(record), record) if shared else pack_nibbles(record)
    scratch = Scratch(64 * k + 5)
    assert scratch_rows(packed, scratch) == 64
    bias, x = torch.randn(n, generator=gen), torch.randn(40, k, generator=gen)
    want = torch.nn.functional.linear(x, record.dequantize(), bias)
    assert torch.allclose(scratch_linear(x, packed, scratch, bias), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(dequantize_into(packed, scratch, 192, 208), record.dequantize()[192:])
    assert scratch_for([(n, k), (64, 40000)]).weight.numel() == 64 * 40000  # 64 rows of the widest layer at least


def test_scratch_refusals(gen):
    with pytest.raises(SpearError, match="even in size"):
        pack_nibbles(random_record(16, 65, -1, gen))
    packed = pack_nibbles(random_record(16, 64, -1, gen))
    with pytest.raises(SpearError, match="largest block"):
        dequantize_into(packed, Scratch(16 * 64 - 1))


@pytest.mark.parametrize("gate_hidden", [0, 8])
def test_a_layer_served_on_the_cpu_is_its_pytorch_forward(gate_hidden, gen):
    """SpearLinear after use_cpu_kernels (the int4 kernel and the scratch path, its EC snapshot: ServedEC) against
    its own PyTorch forward (the dequantized weight, the EC module)."""
    from spear.layer import ErrorCompensator, SpearLinear

    layer = SpearLinear(random_record(64, 256, 64, gen))
    layer.ec = ErrorCompensator(256, 64, rank=4, gate_hidden=gate_hidden)
    with torch.no_grad():
        for p in layer.ec.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    x = torch.randn(CPU_W4_MAX_ROWS + 8, 256, generator=gen)
    want, ec = layer(x), layer.ec(x)
    assert layer.use_cpu_kernels(Scratch(64 * 256))
    layer.release_for_serving()
    assert layer.ec is None and layer.has_ec  # the snapshot alone serves
    assert torch.allclose(layer.cpu_ec(x), ec, atol=1e-6)  # the snapshot is the same function
    served = layer.cpu_ec  # through mm / addmm on transposed views: F.linear's own products, bit for bit
    u = F.linear(x, served.At.t())
    if served.gate is not None:
        w1t, b1, w2t, b2 = served.gate
        u = u * (1 + torch.tanh(F.linear(F.silu(F.linear(u, w1t.t(), b1)), w2t.t(), b2)))
    assert torch.equal(served(x), F.linear(u, served.alpha_Bt.t()))
    for rows in (1, CPU_W4_MAX_ROWS + 8):  # the int4 kernel (bfloat16), the scratch path (float32)
        tol = 2e-2 if rows == 1 else 1e-5
        assert torch.allclose(layer(x[:rows]), want[:rows], atol=tol, rtol=tol), rows


@needs_int4_op
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_layers_give_each_layers_output_bit_for_bit(bias, gen):
    """q/k/v-like layers served as one int4 matmul (runtime.linear.FusedCPULinear): the stack is the packing of the
    stacked codes, the parts' codes become views of it, and every output (decode rows through the stack, each part's
    EC added into its columns; prefill rows through each part) is the part's own bit for bit."""
    from spear.layer import ErrorCompensator, SpearLinear
    from spear.runtime.linear import FusedCPULinear

    records = [random_record(n, 256, 64, gen) for n in (128, 64, 64)]
    layers, scratch = [], Scratch(128 * 256)
    for record, ec in zip(records, [(4, 8), None, (2, 0)]):  # (rank, gate_hidden): gated, none, ungated
        layer = SpearLinear(record, torch.randn(record.shape[0], generator=gen) if bias else None, dense=False)
        if ec is not None:
            layer.ec = ErrorCompensator(256, record.shape[0], rank=ec[0], gate_hidden=ec[1])
            with torch.no_grad():
                for p in layer.ec.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        assert layer.use_cpu_kernels(scratch)
        layer.release_for_serving()
        assert layer.stack_key() == ("cpu_w4", 256, 64, torch.bfloat16)
        layers.append(layer)
    x = torch.randn(CPU_W4_MAX_ROWS + 8, 256, generator=gen)
    rows = (1, 5, CPU_W4_MAX_ROWS + 8)  # the int4 kernel, twice; the scratch path
    want = [[layer(x[:m]) for layer in layers] for m in rows]
    fused = FusedCPULinear(layers)
    whole = torch.cat([r.codes for r in records])
    assert torch.equal(fused.cpu_w4.weight, pack_cpu_w4(QuantizedWeight(whole, *(torch.cat([getattr(r, f) for r in records])
                                                         for f in ("scales", "zeros")), 4, 64)).weight)
    for layer in layers:  # one copy of the codes
        assert layer.cpu_w4.weight.untyped_storage().data_ptr() == fused.cpu_w4.weight.untyped_storage().data_ptr()
        assert layer.cpu_nibbles.codes.data_ptr() == layer.cpu_w4.weight.data_ptr()
    for m, parts in zip(rows, want):
        assert all(torch.equal(y, part) for y, part in zip(fused(x[:m]), parts)), m
        assert all(torch.equal(layer(x[:m]), part) for layer, part in zip(layers, parts)), m  # the views serve too
    small = SpearLinear(random_record(32, 256, 64, gen), dense=False)  # 32 rows: not whole blocks of every packing
    assert small.use_cpu_kernels(scratch) and small.stack_key() is None
