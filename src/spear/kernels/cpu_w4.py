"""4-bit weights served on a CPU without a float32 copy of the weight (issues 50 and 53).

Two ways, both from a standard-form record (W_hat = (q - z) s, fp16 scales, codes 0..15), both tested against
`QuantizedWeight.dequantize()`:

int4 kernel: PyTorch's CPU int4 matmul (`_weight_int4pack_mm_for_cpu`). It walks blocks of 4 activation rows by 32
    (AVX2) or 64 (AVX-512) output columns and dequantizes the block's weight tile in registers as it multiplies,
    so its cost grows with ceil(M / 4): the decode path. Its dequant is  W = (q - 8) s' + m'  with s', m' per
    (group, row); we pass s' = s and m' = (8 - z) s, so that W = (q - z) s.
      weight             uint8 [N, K / 2]: the op's own layout, which follows the CPU's vector width (AVX2 and
                         AVX-512 differ): pack on the machine that serves, never store it
      scales_and_zeros   [K / g', N, 2] in the compute dtype (float32 or bfloat16): (s', m')
    The op takes N a multiple of 16 and groups g' of 32, 64, 128 or 256 columns; a record group g (per-channel:
    g = K) that is a multiple of 32 runs as g' = the largest of those dividing g, its scale repeated g / g'
    times. Activations, scales and output share one dtype (the op refuses a mix); it multiplies and accumulates
    in float32 either way. Its AVX2 and AVX-512 loops exist for bfloat16 only: float32 runs a scalar loop, 7-13×
    slower than dense F.linear (bench/cpu_w4.py), so bfloat16 is the default. In float32 the weight is W_hat
    exactly ((q - 8) s, (8 - z) s and their sum are exact). In bfloat16, s' and m' are rounded to bfloat16
    (8 significant bits against fp16's 11), x and y too: the output's error is that of a bfloat16 dense linear.
    Each output element is one block's sum over all of K: the same bits at any thread count and for a row alone
    or in a batch.

scratch: the codes stay nibble-packed, uint8 [N, K / 2] (column j in the low nibble of byte j, column j + K / 2
    in the high one, so unpacking writes two contiguous halves), and each call dequantizes the layer, a block of
    rows at a time, into one float32 scratch shared by every layer, then runs F.linear on each block: the prefill
    path, where the dequantization is spread over many rows. The dequantized weight is W_hat bit for bit ((q - z) s has at most 16 significant bits).

    A layer served both ways holds its codes once: `nibbles_of(packed_cpu_w4, record)` gives the scratch path the
    int4 op's own bytes to unpack (`Int4OpLayout`, found by packing a probe, since it follows the CPU), with the
    record's float32 scales and offsets, so the prefill weight stays W_hat exactly.

    pack_cpu_w4(record, dtype) -> PackedCPUW4       cpu_w4_linear(x, packed, bias)
    pack_nibbles(record) -> PackedNibbles           scratch_linear(x, packed, scratch, bias)   scratch = scratch_for(shapes)
    nibbles_of(packed_cpu_w4, record) -> PackedNibbles (over packed_cpu_w4's codes where their layout is known)

bench/cpu_w4.py times both against dense float32 and bfloat16 F.linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spear.errors import SpearError
from spear.record import QuantizedWeight

KERNEL_GROUPS = (256, 128, 64, 32)  # the group sizes the int4 op takes, largest first


def _int4_max_rows() -> int:
    """Steps of up to this many rows take the int4 kernel, longer ones the scratch path. On a 2-core AVX2 EPYC the
    int4 kernel in bfloat16 beat the scratch path up to 32 rows and lost from 64 (Llama-3.2-1B shapes, one thread, ms
    a forward of the linears: 1592 vs 2113 at 32 rows, 3218 vs 2908 at 64; SmolLM2 flips between the same two;
    bench/results/cpu_w4_epyc-avx2_t1_rows.json). Its AVX-512 loop wins up to 128 rows (SmolLM2, one thread of a
    2-core AVX-512 EPYC: 190 vs 255 ms at 64 rows, 354 vs 391 at 128, 679 vs 661 at 256;
    bench/results/cpu_w4_epyc-avx512_t1_rows.json)."""
    return 128 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32


CPU_W4_MAX_ROWS = _int4_max_rows()


def has_int4_op() -> bool:
    """Whether this PyTorch build has the CPU int4 matmul (2.11 and 2.13 have it)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@dataclass
class PackedCPUW4:
    weight: torch.Tensor  # uint8 [N, K / 2], the op's layout for this CPU
    scales_and_zeros: torch.Tensor  # [K / group_size, N, 2] in the compute dtype: (s, (8 - z) s)
    group_size: int  # g': 32, 64, 128 or 256
    in_features: int  # K

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the op computes in: activations are cast to it, the result back."""
        return self.scales_and_zeros.dtype

    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales_and_zeros.nbytes


@dataclass(frozen=True)
class Int4OpLayout:
    """Where the int4 op's packing puts code (n, k). Rows go in blocks of `block` (32 on AVX2, 64 on AVX-512), each
    block k-major: block b's bytes are [K, block / 2]. In a full block, byte j holds rows j (low nibble) and
    j + block / 2 (high) with `halves`, rows 2j and 2j + 1 without (the op's scalar loop); a last, shorter block
    always pairs rows 2j and 2j + 1."""

    block: int
    halves: bool


@dataclass
class PackedNibbles:
    codes: torch.Tensor  # uint8 [N, K / 2]: column j in the low nibble, column j + K / 2 in the high one
    scales: torch.Tensor  # float32 [N, K / g, 1]
    offsets: torch.Tensor  # float32 [N, K / g, 1]: -z s
    group_size: int  # g; K for per-channel
    layout: Int4OpLayout | None = None  # set: `codes` are the int4 op's packing (shared with a PackedCPUW4), not the above

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], 2 * self.codes.shape[1]

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.offsets.nbytes


class Scratch:
    """The buffers a layer is dequantized into, sized for the largest layer and shared by all of them."""

    def __init__(self, numel: int):
        self.codes = torch.empty(numel, dtype=torch.uint8)
        self.weight = torch.empty(numel, dtype=torch.float32)

    def nbytes(self) -> int:
        return self.codes.nbytes + self.weight.nbytes


def _check_record(record: QuantizedWeight, path: str) -> None:
    if record.bits > 4:
        raise SpearError(f"the CPU {path} path takes weights of at most 4 bits, got {record.bits}-bit; serve it dense")
    if not record.standard_form:
        raise SpearError(f"the CPU {path} path takes (q - z) * s with fp16 scales; this record has g_idx, offsets or "
                         f"float32 scales (an imported format): serve it dense")


def kernel_group(record: QuantizedWeight) -> int:
    """The group g' the int4 op runs the record in; SpearError where the op cannot take the record's shape."""
    _check_record(record, "int4")
    n, k = record.shape
    g = record.group_size
    if n % 16:
        raise SpearError(f"the CPU int4 kernel needs an out size that is a multiple of 16, got {n}×{k}: serve it dense "
                         f"or through the scratch path")
    for kg in KERNEL_GROUPS:
        if g % kg == 0:
            return kg
    raise SpearError(f"the CPU int4 kernel needs a group size that is a multiple of 32, got {g} for {n}×{k}: "
                     f"serve it dense or through the scratch path")


def pack_cpu_w4(record: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> PackedCPUW4:
    """The record as the CPU int4 op takes it, computing in `dtype` (float32 or bfloat16)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise SpearError(f"the CPU int4 kernel computes in float32 or bfloat16, not {dtype}")
    if not has_int4_op():
        raise SpearError(f"this PyTorch ({torch.__version__}) has no CPU int4 matmul: serve dense or through the "
                         f"scratch path")
    kg = kernel_group(record)
    weight = _int4pack(record.codes.cpu())
    repeat = record.group_size // kg
    s = record.scales.cpu().float().repeat_interleave(repeat, dim=1)  # [N, K / g']
    m = (8 - record.zeros.cpu().float().repeat_interleave(repeat, dim=1)) * s
    scales_and_zeros = torch.stack([s, m], dim=-1).transpose(0, 1).to(dtype).contiguous()
    return PackedCPUW4(weight, scales_and_zeros, kg, record.shape[1])


PACK_ROWS = 256  # rows converted at a time: whole row blocks of the op's packing (32 or 64 rows)


def _int4pack(codes: torch.Tensor) -> torch.Tensor:
    """The int4 op's packing of codes uint8 [N, K], PACK_ROWS rows at a time: the op takes int32 codes, and a whole
    layer's int32 copy (4 bytes a weight), freed layer after layer among the packings kept, was retained by the
    allocator: +1.3 GB of RSS while a 0.5B model was packed. Its row blocks are packed independently (each block's
    bytes are contiguous), so the pieces are the whole packing; checked against it in tests."""
    n, k = codes.shape
    out = torch.empty(n, k // 2, dtype=torch.uint8)
    for start in range(0, n, PACK_ROWS):
        piece = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes[start : start + PACK_ROWS].int(), 1)
        if piece.dtype != torch.uint8 or piece.shape != (min(PACK_ROWS, n - start), k // 2):
            return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)  # another layout: whole
        out[start : start + PACK_ROWS] = piece
    return out


def cpu_w4_linear(x: torch.Tensor, packed: PackedCPUW4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x W_hatᵀ + bias for x [..., K] on the CPU, computed in packed.dtype, returned in x.dtype."""
    x2 = x.reshape(-1, packed.in_features).to(packed.dtype).contiguous()  # [M, K]
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed.weight, packed.group_size, packed.scales_and_zeros)
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], packed.out_features)


def pack_nibbles(record: QuantizedWeight) -> PackedNibbles:
    _check_record(record, "scratch")
    n, k = record.shape
    if k % 2:
        raise SpearError(f"the CPU scratch path packs two codes a byte and needs an even in size, got {n}×{k}: "
                         f"serve it dense")
    codes = record.codes.cpu()
    half = k // 2
    return PackedNibbles((codes[:, :half] | (codes[:, half:] << 4)).contiguous(), *_scales_offsets(record),
                         record.group_size)


def _scales_offsets(record: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The scratch path's float32 s and -z s [N, K / g, 1] of a standard-form record: W_hat = q s + (-z s)."""
    s = record.scales.cpu().float()
    return s[..., None].contiguous(), (-record.zeros.cpu().float() * s)[..., None].contiguous()


_LAYOUT_CANDIDATES = (Int4OpLayout(32, True), Int4OpLayout(64, True), Int4OpLayout(32, False), Int4OpLayout(64, False))
_layouts: dict[int, Int4OpLayout | None] = {}


def int4_op_layout(n: int) -> Int4OpLayout | None:
    """The layout this CPU's int4 op packs an N-row weight in, found once per N by packing a random probe and
    unpacking it each known way; None if none reproduces it (a PyTorch that packs otherwise)."""
    if n not in _layouts:
        probe = torch.randint(0, 16, (n, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
        found = None
        if packed.dtype == torch.uint8 and packed.shape == (n, 32):
            for layout in _LAYOUT_CANDIDATES:
                q = torch.empty(n, 64, dtype=torch.int32)
                _unpack_int4_op(packed, layout, torch.empty(n * 64, dtype=torch.uint8), q)
                if torch.equal(q, probe):
                    found = layout
                    break
        _layouts[n] = found
    return _layouts[n]


def _unpack_int4_op(packed: torch.Tensor, layout: Int4OpLayout, codes: torch.Tensor, w: torch.Tensor) -> None:
    """Write the codes of the int4 op's packing (uint8 [N, K / 2]) into w ([N, K], any dtype) as numbers, through
    `codes` (uint8, N K elements): the nibbles are split k-major as stored, then transposed by the copy into w (a
    strided read: faster here than the strided write of splitting straight into [N, K])."""
    n, k = w.shape
    flat, full, b = packed.reshape(-1), n - n % layout.block, layout.block

    def split(src: torch.Tensor, into: torch.Tensor) -> None:  # src [..., K, m] -> into [..., 2, K, m]: low, high
        torch.bitwise_and(src, 15, out=into.select(-3, 0))
        torch.bitwise_right_shift(src, 4, out=into.select(-3, 1))

    if full:
        nb = full // b
        q = codes[: full * k].view(nb, 2, k, b // 2)
        split(flat[: full * k // 2].view(nb, k, b // 2), q)
        rows = q.transpose(2, 3)  # [blocks, 2, block / 2, K]: (low, high) of byte j
        if layout.halves:  # rows j and j + block / 2
            w[:full].view(nb, 2, b // 2, k).copy_(rows)
        else:  # rows 2j and 2j + 1
            w[:full].view(nb, b // 2, 2, k).copy_(rows.transpose(1, 2))
    if n > full:  # the last, shorter block: rows 2j and 2j + 1
        m = (n - full) // 2
        q = codes[full * k : n * k].view(2, k, m)
        split(flat[full * k // 2 :].view(k, m), q)
        w[full:].view(m, 2, k).copy_(q.permute(2, 0, 1))


def nibbles_of(packed: PackedCPUW4, record: QuantizedWeight) -> PackedNibbles:
    """The scratch path's view of a layer the int4 op packed: its codes shared with `packed` where their layout is
    known (int4_op_layout), else packed again (pack_nibbles: the codes held twice)."""
    layout = int4_op_layout(record.shape[0])
    if layout is None or packed.weight.dtype != torch.uint8:
        return pack_nibbles(record)
    return PackedNibbles(packed.weight, *_scales_offsets(record), record.group_size, layout)


def dequantize_into(packed: PackedNibbles, scratch: Scratch, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """W_hat[start:stop] [rows, K] float32 in the scratch (valid until the next call): unpack, then (q - z) s as
    q s + (-z s). With the int4 op's layout, `start` is a multiple of its row block and `stop` one too, or N."""
    n, k = packed.shape
    stop = n if stop is None else stop
    rows = stop - start
    if rows * k > scratch.weight.numel():
        raise SpearError(f"the CPU scratch holds {scratch.weight.numel()} weights, {rows} rows of a {n}×{k} layer "
                         f"need more: size it for the largest block (scratch_rows)")
    w = scratch.weight[: rows * k].view(rows, -1, packed.group_size)  # [rows, K / g, g]
    if packed.layout is not None:
        if start % packed.layout.block or (stop % packed.layout.block and stop != n):
            raise SpearError(f"rows {start}:{stop} are not whole blocks of {packed.layout.block} of the int4 packing")
        codes = packed.codes.reshape(-1)[start * k // 2 : stop * k // 2].view(rows, k // 2)
        _unpack_int4_op(codes, packed.layout, scratch.codes, w.view(rows, k))
    else:
        q, codes = scratch.codes[: rows * k].view(rows, k), packed.codes[start:stop]
        torch.bitwise_and(codes, 15, out=q[:, : k // 2])
        torch.bitwise_right_shift(codes, 4, out=q[:, k // 2 :])
        w.copy_(q.view_as(w))
    # two passes: faster than one addcmul here
    return w.mul_(packed.scales[start:stop]).add_(packed.offsets[start:stop]).view(rows, k)


# The scratch holds this many weights (float32: 8 MiB) or 64 rows of the widest layer, whichever is more; a larger
# layer is dequantized and multiplied a block of rows at a time (each output column is the same sum either way). A
# scratch sized for the largest layer was 84 MB of a 1.2B model's idle 2.16 GB.
SCRATCH_WEIGHTS = 1 << 21
SCRATCH_ROW_ALIGN = 64  # blocks of rows start at multiples of this: whole blocks of the int4 op's packing (32 or 64)


def scratch_for(shapes: list[tuple[int, int]]) -> Scratch:
    """The scratch shared by layers of these (N, K) shapes."""
    return Scratch(max(SCRATCH_WEIGHTS, *(SCRATCH_ROW_ALIGN * k for _, k in shapes)))


def scratch_rows(packed: PackedNibbles, scratch: Scratch) -> int:
    """Rows of this layer a block of the scratch holds: all of them, or a multiple of SCRATCH_ROW_ALIGN."""
    n, k = packed.shape
    fit = scratch.weight.numel() // k
    return n if fit >= n else fit // SCRATCH_ROW_ALIGN * SCRATCH_ROW_ALIGN


def scratch_linear(x: torch.Tensor, packed: PackedNibbles, scratch: Scratch,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x W_hatᵀ + bias in float32, the layer dequantized into the shared scratch a block of rows at a
    time (scratch_rows); returned in x.dtype."""
    n, k = packed.shape
    x2 = x.reshape(-1, k).float()
    step = scratch_rows(packed, scratch)
    if step == 0:
        raise SpearError(f"the CPU scratch holds {scratch.weight.numel()} weights, fewer than {SCRATCH_ROW_ALIGN} rows "
                         f"of a {n}×{k} layer: size it with scratch_for")
    b = None if bias is None else bias.float()
    if step >= n:
        y = F.linear(x2, dequantize_into(packed, scratch), b)
    else:
        y = x2.new_empty(x2.shape[0], n)
        for start in range(0, n, step):
            stop = min(start + step, n)
            y[:, start:stop] = F.linear(x2, dequantize_into(packed, scratch, start, stop),
                                        None if b is None else b[start:stop])
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
