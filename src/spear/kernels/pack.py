"""Packing for the W4A16 kernels.

Weight W [N, K] (out × in) as the record holds it: W_hat = (q − z) · s, q ∈ [0, 15].
Kernel layout:
    qweight  int32 [N, K' / 8]  K' = K rounded up to a multiple of 128 (padding codes are 0).
             Pair layout per block of 128 columns: word 16 b + 8 h + p (h ∈ {0, 1}, p ∈ 0..7) holds,
             for jj ∈ 0..3, the codes of columns 128 b + 16 (4 h + jj) + 2 p and + 1 at bits 4 jj and
             16 + 4 jj. Slice j = 4 h + jj (16 columns) of a block is then the 8 words 8 h .. 8 h + 7,
             each giving a column pair in its two 16-bit halves: one LOP3 with Marlin's masks
             (0x000F000F, 0x00F000F0, on the word or the word >> 8) OR 0x64006400 makes both codes as
             fp16 (1024 + q, or 1024 + 16 q) in one register, as a tensor-core operand pairs them.
    scales   fp16  [N, K / g]   one per row and group (g = K for per-channel)
    zeros    fp16  [N, K / g]   the integer zero points, exact in fp16
The kernels use Σ_k (q − z) s x = s (Σ_k q x − z Σ_k x) over each group: exact in real
arithmetic, float32 in practice.

The EC is packed as the kernels read it (ec(x) = alpha · B (gamma(A x) ⊙ A x)):
    A fp16 [R, K], alpha·B fp16 [N, R], gate W1 [H, R], b1 [H], W2 [R, H], b2 [R], with R and H
    zero-padded to tensor-core sizes (≥ 16, powers of two). Zero padding is exact: padded rank
    rows give u = 0 and padded hidden units feed W2's zero columns.
An EC with 8-bit factors (ErrorCompensator factor_bits 8) is packed as it is stored: A int8 [R, K] with a_scale
float32 [R] (A's row scales), B int8 [N, R] with b_scale float32 [R] (alpha times B's column scales: alpha goes
into the scale, not into B); padded rank directions have zero codes and scale 0. The kernels read the int8 codes
and dequantize each tile in registers, q · scale in float32 rounded once to fp16 (dequantize_factor): dense_A() /
dense_B()'s numbers, which the PyTorch paths and the reference take. served_factors folds alpha, for pack_ec and
for tensor parallelism's shards (runtime.tp) alike.

Linears over the same input fuse into one launch (concat_w4, concat_ec): the weights' rows stack,
the ECs go block-diagonal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from spear.errors import SpearError
from spear.record import QuantizedWeight

if TYPE_CHECKING:  # spear.layer packs through this module: it sits above the kernels
    from spear.layer import ErrorCompensator

BLOCK = 128  # columns per packed block


@dataclass
class PackedW4:
    qweight: torch.Tensor  # int32 [N, K' / 8], pair layout (see the module docstring)
    scales: torch.Tensor  # fp16 [N, K / g]
    zeros: torch.Tensor  # fp16 [N, K / g]
    group_size: int  # g; K for per-channel
    in_features: int  # K

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))

    def to(self, device: torch.device) -> PackedW4:
        return PackedW4(self.qweight.to(device), self.scales.to(device), self.zeros.to(device), self.group_size,
                        self.in_features)

    def clone(self) -> PackedW4:
        """A copy in new memory (timing over several copies reads HBM, not the L2 cache)."""
        return PackedW4(self.qweight.clone(), self.scales.clone(), self.zeros.clone(), self.group_size, self.in_features)


@dataclass
class PackedEC:
    A: torch.Tensor  # fp16 [R, K]; int8 codes with a_scale
    B: torch.Tensor  # fp16 [N, R], alpha folded in; int8 codes with b_scale
    W1: torch.Tensor  # fp16 [H, R]
    b1: torch.Tensor  # fp16 [H]
    W2: torch.Tensor  # fp16 [R, H]
    b2: torch.Tensor  # fp16 [R]
    rank: int  # the true rank r ≤ R
    gated: bool
    a_scale: torch.Tensor | None = None  # float32 [R], int8 A's row scales (None: fp16 factors)
    b_scale: torch.Tensor | None = None  # float32 [R], alpha times int8 B's column scales

    @property
    def padded_rank(self) -> int:
        return self.A.shape[0]

    @property
    def int8(self) -> bool:
        return self.a_scale is not None

    def dims(self) -> tuple[int, int, bool, bool]:
        """(padded rank R, the gate's hidden size H, gated, int8 factors): what the kernels compile for."""
        return self.padded_rank, self.W1.shape[0], bool(self.gated), self.int8

    def dense_A(self) -> torch.Tensor:
        """A [R, K] in fp16 as the kernels multiply by it (dequantize_factor)."""
        return self.A if not self.int8 else dequantize_factor(self.A, self.a_scale, 1)

    def dense_B(self) -> torch.Tensor:
        """alpha·B [N, R] in fp16 as the kernels multiply by it (dequantize_factor)."""
        return self.B if not self.int8 else dequantize_factor(self.B, self.b_scale, 0)

    def scale_args(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' scale pointers (a_scale, b_scale): an fp16 EC's kernels read none, and get A twice."""
        return (self.a_scale, self.b_scale) if self.int8 else (self.A, self.A)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors held, by field name (the scales only in the int8 form)."""
        names = ("A", "B", "W1", "b1", "W2", "b2", "a_scale", "b_scale")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    def nbytes(self) -> int:
        """Bytes held: the factors at 1 (int8) or 2 bytes an entry, the int8 form's scales, the gate."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device) -> PackedEC:
        return PackedEC(**{k: t.to(device) for k, t in self.tensors().items()}, rank=self.rank, gated=self.gated)


def dequantize_factor(codes: torch.Tensor, scale: torch.Tensor, dim: int,
                      dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """An int8 factor as a float one: the codes times their rank directions' scales (float32 [R], along `dim`: 1 for
    A's rows, 0 for B's columns) in float32, rounded once to `dtype`; in fp16 the kernels' numbers (in float32 the
    float model's: ErrorCompensator.factors)."""
    return (codes.float() * scale.float().unsqueeze(dim)).to(dtype)


def served_factors(ec: ErrorCompensator, dtype: torch.dtype = torch.float16) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(A [r, K], alpha·B [N, r], a_scale, b_scale): the EC's factors as served, alpha folded into B here and only
    here. An 8-bit EC's as stored (ErrorCompensator.int8_factors): int8 codes, a_scale float32 [r] A's row scales and
    b_scale float32 [r] alpha times B's column scales (a 4-bit EC's codes, -7..7, are held the same way); else A and
    alpha·B in `dtype`, the scales None."""
    alpha = ec.alpha.detach().float()
    if ec.factor_bits < 16:
        (qa, sa), (qb, sb) = ec.int8_factors()
        return qa, qb, sa.float(), alpha * sb.float()
    return ec.A.detach().to(dtype), (alpha * ec.B.detach().float()).to(dtype), None, None


def pow2_at_least_16(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _pair_shifts(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[jj, t] → the bit of column 16 jj + 2 p + t's code in its word (4 jj + 16 t)."""
    return (4 * torch.arange(4, device=device)[:, None] + 16 * torch.arange(2, device=device)).to(dtype)


def pack_w4(record: QuantizedWeight) -> PackedW4:
    if record.bits != 4:
        raise SpearError(f"the W4A16 kernels take 4-bit weights, got {record.bits}-bit")
    if not record.standard_form:
        raise SpearError("the W4A16 kernels take (q - z) * s with fp16 scales; this record has g_idx, offsets or "
                         "float32 scales (an imported format)")
    n, k = record.shape
    if k % 64 or n % 64:
        raise SpearError(f"the W4A16 kernels need in and out sizes that are multiples of 64, got {n}×{k}")
    if record.group_size not in (32, 64, 128, k) and not (record.group_size % 128 == 0 and k % record.group_size == 0):
        raise SpearError(f"the W4A16 kernels take group sizes 32, 64, multiples of 128, or per-channel; got {record.group_size}")
    blocks = -(-k // BLOCK)
    codes = torch.zeros(n, blocks * BLOCK, dtype=torch.int64, device=record.codes.device)
    codes[:, :k] = record.codes
    codes = codes.view(n, blocks, 2, 4, 8, 2).permute(0, 1, 2, 4, 3, 5)  # [n, b, h, p, jj, t]
    words = (codes << _pair_shifts(codes.device, torch.int64)).sum((-2, -1))  # [n, b, h, p], < 2^32
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return PackedW4(words.reshape(n, blocks * 16).contiguous(), record.scales.half().contiguous(),
                    record.zeros.half().contiguous(), record.group_size, k)


def unpack_w4(packed: PackedW4) -> torch.Tensor:
    """The uint8 codes [N, K] back from the packed words (the inverse of pack_w4's packing)."""
    n = packed.out_features
    words = packed.qweight.view(n, -1, 2, 8)[..., None, None]  # [n, b, h, p, 1, 1]
    codes = (words >> _pair_shifts(words.device, torch.int32)) & 0xF  # [n, b, h, p, jj, t]
    return codes.permute(0, 1, 2, 4, 3, 5).reshape(n, -1)[:, : packed.in_features].to(torch.uint8)


def pack_ec(ec: ErrorCompensator) -> PackedEC:
    """The EC as the kernels read it (the module docstring): fp16 factors, or an 8-bit EC's int8 codes and scales."""
    r, k = ec.A.shape
    n = ec.B.shape[0]
    R = pow2_at_least_16(r)
    dev = ec.A.device
    a, b, a_scale, b_scale = served_factors(ec)
    A, B = torch.zeros(R, k, dtype=a.dtype, device=dev), torch.zeros(n, R, dtype=b.dtype, device=dev)
    A[:r], B[:, :r] = a, b
    scales = {}
    if a_scale is not None:
        scales = {name: torch.zeros(R, dtype=torch.float32, device=dev) for name in ("a_scale", "b_scale")}
        scales["a_scale"][:r], scales["b_scale"][:r] = a_scale, b_scale
    h = max(ec.gate_hidden, 1)
    H = pow2_at_least_16(h)
    W1 = torch.zeros(H, R, dtype=torch.float16, device=dev)
    b1 = torch.zeros(H, dtype=torch.float16, device=dev)
    W2 = torch.zeros(R, H, dtype=torch.float16, device=dev)
    b2 = torch.zeros(R, dtype=torch.float16, device=dev)
    if ec.gate is not None:
        W1[:h, :r] = ec.gate[0].weight.detach().half()
        b1[:h] = ec.gate[0].bias.detach().half()
        W2[:r, :h] = ec.gate[2].weight.detach().half()
        b2[:r] = ec.gate[2].bias.detach().half()
    return PackedEC(A, B, W1, b1, W2, b2, rank=r, gated=ec.gate is not None, **scales)


def concat_w4(parts: list[PackedW4]) -> PackedW4:
    """Several weights over the same input as one [Σ N_i, K] weight: the rows are independent, so the
    packed rows (codes, scales, zeros) simply stack."""
    first = parts[0]
    for p in parts[1:]:
        if (p.group_size, p.in_features) != (first.group_size, first.in_features):
            raise SpearError(f"cannot concatenate W4 weights with group size / in_features {p.group_size}/{p.in_features} "
                             f"and {first.group_size}/{first.in_features}")
    qweight, scales, zeros = (torch.cat([getattr(p, name) for p in parts]) for name in ("qweight", "scales", "zeros"))
    return PackedW4(qweight, scales, zeros, first.group_size, first.in_features)


def concat_ec(ecs: list[PackedEC | None], out_features: list[int], in_features: int,
              device: torch.device) -> PackedEC | None:
    """The ECs of linears over the same input (out_features[i] rows each) as one block-diagonal EC.

    Module i gets its own rank columns: A = [A_1; A_2; ...], B = diag(B_1, B_2, ...) (rows without an EC
    are zero), and the gate runs per block: W1 = diag(W1_i) [Σ H_i, Σ R_i], b1 = [b1_i], W2 = diag(W2_i),
    b2 = [b2_i], so gamma(u) restricted to block i is gamma_i(u_i). An ungated EC in a gated fusion has
    zero gate blocks: 1 + tanh(0) = 1. R and H are zero-padded to powers of two ≥ 16 as pack_ec does.
    None when no module has an EC; ungated when none is gated. Int8 where every EC is (the codes block-diagonal,
    the scales concatenated: each rank direction keeps its own), else fp16 (int8 parts dequantized: dense_A, dense_B).
    """
    if all(ec is None for ec in ecs):
        return None
    int8 = all(ec is None or ec.int8 for ec in ecs)
    gated = any(ec is not None and ec.gated for ec in ecs)
    ranks = [0 if ec is None else ec.rank for ec in ecs]  # the padded rank columns are zero: drop them
    hiddens = [ec.W1.shape[0] if ec is not None and ec.gated else 0 for ec in ecs]
    R, H = pow2_at_least_16(sum(ranks)), pow2_at_least_16(max(sum(hiddens), 1))
    factor = torch.int8 if int8 else torch.float16
    A, B = (torch.zeros(shape, dtype=factor, device=device) for shape in ((R, in_features), (sum(out_features), R)))
    W1, b1, W2, b2 = (torch.zeros(shape, dtype=torch.float16, device=device) for shape in ((H, R), (H,), (R, H), (R,)))
    scales = {}
    if int8:
        scales = {name: torch.zeros(R, dtype=torch.float32, device=device) for name in ("a_scale", "b_scale")}
    n0 = r0 = h0 = 0
    for ec, n, r, h in zip(ecs, out_features, ranks, hiddens):
        if ec is not None:
            A[r0 : r0 + r] = (ec.A if int8 else ec.dense_A())[:r]
            B[n0 : n0 + n, r0 : r0 + r] = (ec.B if int8 else ec.dense_B())[:, :r]
            for name, scale in scales.items():
                scale[r0 : r0 + r] = getattr(ec, name)[:r]
            if h:
                W1[h0 : h0 + h, r0 : r0 + r] = ec.W1[:, :r]
                b1[h0 : h0 + h] = ec.b1
                W2[r0 : r0 + r, h0 : h0 + h] = ec.W2[:r]
                b2[r0 : r0 + r] = ec.b2[:r]
        n0, r0, h0 = n0 + n, r0 + r, h0 + h
    return PackedEC(A, B, W1, b1, W2, b2, rank=sum(ranks), gated=gated, **scales)
