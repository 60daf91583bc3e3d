"""Decode the quantized weights of other formats into our record, without re-quantizing.

Each decoder takes one linear layer's stored tensors and returns a QuantizedWeight that
dequantizes to the format's own weights bit for bit (spear.record: the product
(q - z) * s is exact in float32, so casting it to the format's dtype rounds it as the format does).

  GPTQ  qweight [in/8, out] int32 (8 codes a word along in, code j at bits 4j), qzeros [groups, out/8]
        (along out), scales [groups, out], g_idx [in]. W[o, i] = s[g, o] * (q[i, o] - z[g, o]), g = g_idx[i].
        checkpoint_format "gptq" (v1) stores z - 1 (so the nibble 15 reads as z = 16); "gptq_v2" stores z.
        Act-order g_idx (columns of a group not consecutive) is kept as the record's g_idx.
  AWQ   GEMM packing: qweight [in, out/8], qzeros [groups, out/8], both packed along out in the interleaved
        order of AutoAWQ (column 8k + j of a word at bits 4 * (0, 4, 1, 5, 2, 6, 3, 7)[j]); scales [groups, out].
        W = (q - z) * s, no offset.
  compressed-tensors pack-quantized (llm-compressor's W4A16): weight_packed [out, in/8] (code j of a word at
        bits 4j, stored as v + 8 for the signed v in [-8, 7]), weight_scale [out, groups], weight_zero_point
        (asymmetric: packed along out, [out/8, groups], or unpacked int8 [out, groups]), weight_shape,
        optional weight_g_idx. W = (v - zp) * s = (q - (zp + 8)) * s.
  GGUF  the types of llama.cpp's legacy and K-quants, each at its own bits, as gguf.quants dequantizes them in
        float32 (its dequantize_blocks is the specification of each layout below; d, dmin, m are fp16):
        Q4_0 (32-weight blocks: d, 16 bytes of nibbles; W = d (q - 8)), Q4_1 (d, m; W = d q + m),
        Q5_0 (d, 4 bytes of fifth bits, 16 of nibbles; W = d (q - 16)), Q5_1 (d, m, the same codes; W = d q + m),
        Q8_0 (d, 32 int8 x; W = d x, kept as q = x + 128, z = 128);
        Q4_K (256-weight superblocks: d, dmin, 12 bytes of 6-bit sub-scales sc and mins mn for 8 blocks of 32,
        128 bytes of nibbles; W = (d sc) q - dmin mn), Q5_K (Q4_K with 32 bytes of fifth bits),
        Q6_K (128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales sc of blocks of 16, then d;
        W = (d sc) (q - 32)). Nibble byte b of a run of r bytes holds weight b of the run's 2r in its low half,
        weight b + r in its high half (r = 16; Q4_K, Q5_K: 32; Q6_K: 64). The minimums of Q4_1, Q5_1, Q4_K and
        Q5_K are the record's offsets; the K-quants' d sc (at most 19 significant bits, exact in float32) stay
        float32 where they are not fp16 values.
"""

from __future__ import annotations

import numpy as np
import torch

from spear.errors import SpearError
from spear.record import QuantizedWeight, fp16_if_exact

BITS = 4
AWQ_SHIFT_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)  # AutoAWQ's packing order, inverted: where column j of a word sits


def unpack_int32(words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 words [..., n] → uint8 codes [..., 8 n]: code 8k + j is the nibble at bits 4 * order[j] of word k."""
    if words.dtype != torch.int32:
        raise SpearError(f"packed 4-bit weights must be int32, got {words.dtype}")
    shifts = 4 * torch.tensor(order, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8).flatten(-2)


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise SpearError(f"malformed checkpoint: {name} has shape {tuple(t.shape)}, expected {shape}")


def _record(codes, scales, zeros, g_idx=None, offsets=None, bits: int = BITS) -> QuantizedWeight:
    """Codes [out, in], per-group scales / zeros / offsets [out, groups]; g_idx kept only where it is not j // g."""
    in_f, groups = codes.shape[1], scales.shape[1]
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32)
        if g_idx.numel() and (g_idx.min() < 0 or g_idx.max() >= groups):
            raise SpearError(f"malformed checkpoint: g_idx names groups outside 0..{groups - 1}")
        if in_f % groups == 0 and torch.equal(g_idx, torch.arange(in_f, dtype=torch.int32) // (in_f // groups)):
            g_idx = None
    elif in_f % groups:
        raise SpearError(f"malformed checkpoint: {groups} groups do not divide {in_f} inputs")
    return QuantizedWeight(
        codes=codes.contiguous(),
        scales=fp16_if_exact(scales).contiguous(),
        zeros=zeros.to(torch.uint8).contiguous(),
        bits=bits,
        group_size=in_f // groups,  # nominal where g_idx says otherwise
        g_idx=None if g_idx is None else g_idx.contiguous(),
        offsets=None if offsets is None else fp16_if_exact(offsets).contiguous(),
    )


def gptq_record(name: str, t: dict[str, torch.Tensor], out_f: int, in_f: int, group_size: int,
                v1: bool = True) -> QuantizedWeight:
    """One GPTQ linear from its qweight, qzeros, scales (and g_idx) tensors, as `name`.* in `t`."""
    groups = t[f"{name}.scales"].shape[0]
    _check_shape(f"{name}.qweight", t[f"{name}.qweight"], (in_f // 8, out_f))
    _check_shape(f"{name}.qzeros", t[f"{name}.qzeros"], (groups, out_f // 8))
    _check_shape(f"{name}.scales", t[f"{name}.scales"], (groups, out_f))
    g_idx = t.get(f"{name}.g_idx")
    if g_idx is None:
        g_idx = torch.arange(in_f, dtype=torch.int32) // (in_f if group_size == -1 else group_size)
    _check_shape(f"{name}.g_idx", g_idx, (in_f,))
    codes = unpack_int32(t[f"{name}.qweight"].t())  # [out, in]
    zeros = unpack_int32(t[f"{name}.qzeros"]).to(torch.int16) + int(v1)  # [groups, out]
    return _record(codes, t[f"{name}.scales"].t(), zeros.t(), g_idx)


def awq_record(name: str, t: dict[str, torch.Tensor], out_f: int, in_f: int) -> QuantizedWeight:
    """One AWQ (GEMM) linear from its qweight, qzeros and scales tensors."""
    groups = t[f"{name}.scales"].shape[0]
    _check_shape(f"{name}.qweight", t[f"{name}.qweight"], (in_f, out_f // 8))
    _check_shape(f"{name}.qzeros", t[f"{name}.qzeros"], (groups, out_f // 8))
    _check_shape(f"{name}.scales", t[f"{name}.scales"], (groups, out_f))
    codes = unpack_int32(t[f"{name}.qweight"], AWQ_SHIFT_OF_COLUMN)  # [in, out]
    zeros = unpack_int32(t[f"{name}.qzeros"], AWQ_SHIFT_OF_COLUMN)  # [groups, out]
    return _record(codes.t(), t[f"{name}.scales"].t(), zeros.t())


def compressed_tensors_record(name: str, t: dict[str, torch.Tensor], out_f: int, in_f: int) -> QuantizedWeight:
    """One compressed-tensors pack-quantized linear: weight_packed, weight_scale (weight_zero_point, weight_g_idx)."""
    scales = t[f"{name}.weight_scale"]
    if scales.dim() != 2:
        raise SpearError(f"malformed checkpoint: {name}.weight_scale must be [out, groups], got {tuple(scales.shape)}")
    groups = scales.shape[1]
    _check_shape(f"{name}.weight_scale", scales, (out_f, groups))
    if t[f"{name}.weight_shape"].tolist() != [out_f, in_f]:
        raise SpearError(f"malformed checkpoint: {name}.weight_shape is {t[f'{name}.weight_shape'].tolist()}, "
                         f"the model's layer is {[out_f, in_f]}")
    _check_shape(f"{name}.weight_packed", t[f"{name}.weight_packed"], (out_f, -(-in_f // 8)))
    codes = unpack_int32(t[f"{name}.weight_packed"])[:, :in_f]
    zp = t.get(f"{name}.weight_zero_point")
    if zp is None:
        zeros = torch.full((out_f, groups), 8, dtype=torch.uint8)
    elif zp.dtype == torch.int32:  # packed along out
        _check_shape(f"{name}.weight_zero_point", zp, (-(-out_f // 8), groups))
        zeros = unpack_int32(zp.t()).t()[:out_f]
    else:
        _check_shape(f"{name}.weight_zero_point", zp, (out_f, groups))
        zeros = zp.to(torch.int16) + 8
    return _record(codes, scales, zeros, t.get(f"{name}.weight_g_idx"))


# --- GGUF blocks --------------------------------------------------------------------------

GGUF_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_0": 22, "Q5_1": 24, "Q5_K": 176, "Q6_K": 210, "Q8_0": 34}
GGUF_BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}


def _fp16(raw: np.ndarray) -> torch.Tensor:
    """[..., 2] bytes → fp16 values [...] (little endian, as GGUF stores them)."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].copy())


def _bytes(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw))


def _nibbles(qs: np.ndarray, n: int) -> torch.Tensor:
    """[..., k n / 2] bytes → codes [..., k, n]: in each chunk of n / 2 bytes, byte b's low nibble is weight b of
    the chunk's n, its high nibble weight b + n / 2."""
    q = _bytes(qs).reshape(*qs.shape[:-1], -1, 1, n // 2)
    return torch.cat([q & 0xF, q >> 4], dim=-2).flatten(-2)


def _high_bits(qh: np.ndarray, count: int, width: int) -> torch.Tensor:
    """[..., 32 m] bytes → high parts [..., m count, 32]: each run of 32 bytes holds `count` parts of `width` bits
    a byte, part j (bits j·width and up) of byte l for weight l of chunk j."""
    h = _bytes(qh).reshape(*qh.shape[:-1], -1, 1, 32)
    shifts = torch.arange(0, count * width, width, dtype=torch.uint8).reshape(count, 1)
    return ((h >> shifts) & ((1 << width) - 1)).flatten(-3, -2)


def _q4k_scales_mins(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes → 8 six-bit sub-scales and 8 six-bit mins (the layout of gguf.quants.Q4_K.get_scale_min)."""
    b = _bytes(raw).to(torch.int32)
    d, m, md = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def gguf_record(name: str, kind: str, data: np.ndarray, out_f: int, in_f: int) -> QuantizedWeight:
    """One GGUF tensor of a type of GGUF_BITS, its raw bytes [out, row bytes], in the file's row order, as a record
    of the type's bits."""
    if kind not in GGUF_BITS:
        raise SpearError(f"{name} is {kind}; spear import takes GGUF {', '.join(GGUF_BITS)} linears")
    n, size = GGUF_BLOCK_WEIGHTS[kind], GGUF_BLOCK_BYTES[kind]
    if in_f % n:
        raise SpearError(f"malformed GGUF: {name} has {in_f} inputs, not a multiple of {kind}'s {n}-weight blocks")
    if data.shape != (out_f, in_f // n * size):
        raise SpearError(f"malformed GGUF: {name} holds {data.shape} bytes, a {out_f}×{in_f} {kind} needs "
                         f"{(out_f, in_f // n * size)}")
    blocks = data.reshape(out_f, in_f // n, size)  # [out, blocks, bytes]
    bits = GGUF_BITS[kind]
    if kind == "Q6_K":
        q = _nibbles(blocks[..., 0:128], 128).reshape(out_f, -1, 8, 32) | (_high_bits(blocks[..., 128:192], 4, 2) << 4)
        sc = torch.from_numpy(np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).copy())  # [out, blocks, 16]
        scales = (_fp16(blocks[..., 208:210]).float()[..., None] * sc.float()).reshape(out_f, -1)  # exact: 11 × 8 bits
        return _record(q.reshape(out_f, in_f), scales, torch.full(scales.shape, 32), bits=bits)
    d = _fp16(blocks[..., 0:2])
    if kind == "Q8_0":
        x = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).copy())  # [out, blocks, 32]
        codes = (x.to(torch.int16) + 128).to(torch.uint8).reshape(out_f, in_f)
        return _record(codes, d, torch.full(d.shape, 128), bits=bits)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        start = 2 if kind.endswith("_0") else 4  # Q4_1, Q5_1: m follows d
        codes = _nibbles(blocks[..., -16:], 32)[..., 0, :]  # [out, blocks, 32]
        if bits == 5:  # a little-endian uint32 of fifth bits, bit i for weight i
            qh = _bytes(blocks[..., start:start + 4]).to(torch.int64)
            qh = (qh << torch.arange(0, 32, 8)).sum(-1, keepdim=True)
            codes = codes | (((qh >> torch.arange(32)) & 1) << 4).to(torch.uint8)
        codes = codes.reshape(out_f, in_f)
        if start == 2:
            return _record(codes, d, torch.full(d.shape, 2 ** (bits - 1)), bits=bits)
        return _record(codes, d, torch.zeros(d.shape), offsets=_fp16(blocks[..., 2:4]).float(), bits=bits)
    dmin = _fp16(blocks[..., 2:4])
    sc, mn = _q4k_scales_mins(blocks[..., 4:16])  # [out, blocks, 8]
    codes = _nibbles(blocks[..., -128:], 64).reshape(out_f, -1, 8, 32)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
    if kind == "Q5_K":
        codes = codes | (_high_bits(blocks[..., 16:48], 8, 1) << 4)  # sub-block j: bit j of the 32 bytes
    scales = (d.float()[..., None] * sc.float()).reshape(out_f, -1)  # exact: 11 × 6 significant bits
    offsets = -(dmin.float()[..., None] * mn.float()).reshape(out_f, -1)
    return _record(codes.reshape(out_f, in_f), scales, torch.zeros(scales.shape), offsets=offsets, bits=bits)
