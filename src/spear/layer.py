"""The one shared abstraction: a linear layer with a quantized weight and an optional error compensator (EC).

    y = dequant(Q) x + bias + ec(x),    ec(x) = alpha * B (gamma(A x) ⊙ A x),    gamma(u) = 1 + tanh(MLP(u))

The EC: A r×in, B out×r, MLP r → h → r with its last layer zero-initialised, so gamma ≡ 1 at the
start and the EC begins as the static correction alpha * B A x. Without a gate (gate_hidden 0) the
EC *is* a static low-rank correction (LoRC / LQER / QERA).

Factors in 8 bits (`factor_bits` 8; EoRA keeps its factors at 3–4 bits): A and B stored as int8 with one fp16 scale
per rank direction (A's rows, B's columns: a direction's magnitude is its singular value's), ~half the bytes of fp16
a rank step, so a byte budget buys about twice the rank. The float parameters stay the masters; forward applies
their int8 rounding (int8_round) with a straight-through gradient, so calibration trains what is stored.

The PyTorch backend (the specification) keeps the dequantized weight as a non-persistent
buffer in the compute dtype, so forward is one matmul plus the EC branch; the codes, scales
and zeros stay the source of truth. For inference on CUDA, `use_kernels()` packs the weight
(and a snapshot of the EC) for the Triton W4A16 kernels (spear.kernels.w4): fp16 inputs
then take the kernels, with the decode or prefill path picked by the number of rows.

LinearMethod is the interface every linear of the serving runtime implements (SpearLinear here; the float,
fused and tensor-parallel ones in spear.runtime): the runtime model calls it and never asks a linear's type.

This module is the bottom of the model stack: quantizers, compensators, kernels and the runtime
all import it; it imports only the quantized-weight record and the kernels (their packing, kernels.pack, at once).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from spear.errors import SpearError
from spear.kernels.pack import dequantize_factor
from spear.record import QuantizedWeight, pack_codes, packed_width, unpack_codes

if TYPE_CHECKING:
    from spear.kernels.cpu_w4 import PackedCPUW4, PackedNibbles, Scratch
    from spear.kernels.norm_fold import FoldedNorm
    from spear.kernels.pack import PackedEC, PackedW4


class LinearMethod(nn.Module, ABC):
    """A linear layer y = x Wᵀ + b as the serving runtime runs it; the layer picks its own kernel.

    vLLM's quantized linear method (LinearMethodBase: create_weights, then apply(layer, x, bias)) without
    create_weights, since our layers hold their weights before the runtime sees them: `forward(x)` is the apply,
    where each implementation launches its kernel (cuBLAS or the fp16 GEMV, the W4 kernels with the EC fused, a
    tensor-parallel reduction). The runtime model (spear.runtime.model) asks its linears only this; what each can do
    is settled when the model is built (kernels packed, launches fused, options read), a step asks only whether its
    rows and dtype take it:

      stack_key()            linears over one input with equal keys stack into one launch (model.fuse_projections)
      fuses_swiglu, swiglu   a stacked [gate; up] that runs silu(gate) ⊙ up in its decode launch's epilogue
      takes_folded_norm      a launch that takes the RMSNorm folded into the launch before it: forward(x.hw, rms=x)
      folds_norm, add_norm   the add + RMSNorm after this linear, folded into its decode launch (kernels.norm_fold)
      nbytes()               the bytes of its weights as served

    The builders (model.use_kernels, held_bytes) read `packed` and `packed_ec`, the weight and EC as the W4 kernels
    take them (kernels.pack; None: no W4 launch), to tune and count them.

    Implementations: SpearLinear (W4 + EC once packed, else the PyTorch reference), runtime.linear's DenseLinear,
    FusedDenseLinear and FusedLinear, and tp.RowParallelLinear.
    """

    packed: PackedW4 | None = None
    packed_ec: PackedEC | None = None

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y [..., out] for x [..., in]."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of the weights as served (a decode step reads them all)."""

    def stack_key(self) -> tuple | None:
        """Linears over one input whose keys are equal stack into one launch; None: this one runs alone."""
        return None

    def fuses_swiglu(self, x: torch.Tensor) -> bool:
        """Whether swiglu runs on the step x [T, in] (this linear a stacked [gate; up])."""
        return False

    def swiglu(self, x: torch.Tensor, rms: FoldedNorm | None = None) -> torch.Tensor:
        """silu(gate) ⊙ up [T, out / 2] in one launch (where fuses_swiglu); x = rms.hw with `rms`, as forward."""
        raise NotImplementedError(f"{type(self).__name__} fuses no SwiGLU")

    def takes_folded_norm(self, x: torch.Tensor) -> bool:
        """Whether forward (and swiglu) take the step x [T, in] as a FoldedNorm: forward(rms.hw, rms=rms)."""
        return False

    def folds_norm(self, rows: int) -> bool:
        """Whether add_norm runs on a decode step of `rows` fp16 rows."""
        return False

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> FoldedNorm:
        """forward(x), then the RMSNorm of forward(x) + residual in the same launch (where folds_norm)."""
        raise NotImplementedError(f"{type(self).__name__} folds no norm")


FACTOR_BITS = (16, 8, 4)


def ec_nbytes(out_features: int, in_features: int, rank: int, gate_hidden: int, factor_bits: int = 16) -> int:
    """Bytes of an EC (out, in, rank, gate_hidden, factor_bits) as stored: A and B in fp16, or as `factor_bits` codes
    with an fp16 scale per rank direction of each; alpha and the gate r→h→r with biases in fp16."""
    gate = 2 * rank * gate_hidden + gate_hidden + rank if gate_hidden > 0 else 0
    if factor_bits < 16:
        return (rank * (in_features + out_features) * factor_bits + 7) // 8 + 2 * 2 * rank + 2 * (1 + gate)
    return (rank * (in_features + out_features) + 1 + gate) * 2


def factor_bits_text() -> str:
    """FACTOR_BITS for an error message: '16, 8 or 4'."""
    return ", ".join(map(str, FACTOR_BITS[:-1])) + f" or {FACTOR_BITS[-1]}"


def code_max(bits: int) -> int:
    """The largest code of a symmetric `bits`-bit factor grid: 127 for int8, 7 for int4 (codes in -qmax..qmax)."""
    return 2 ** (bits - 1) - 1


def int8_quantize(t: torch.Tensor, dim: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8, scale fp16) with t ≈ q · scale, one scale per slice along `dim` (absmax / qmax, rounded to fp16); with
    `bits` 4 the codes lie in -7..7 (held in int8)."""
    qmax = code_max(bits)
    scale = (t.detach().abs().amax(dim=dim, keepdim=True).float() / qmax).half().clamp(min=torch.finfo(torch.half).tiny)
    q = torch.round(t.detach().float() / scale.float()).clamp(-qmax, qmax).to(torch.int8)
    return q, scale.squeeze(dim)


def int8_dequantize(q: torch.Tensor, scale: torch.Tensor, dim: int) -> torch.Tensor:
    """int8_quantize's inverse in float32: the kernels' dequantization (kernels.pack.dequantize_factor)."""
    return dequantize_factor(q, scale, dim, torch.float32)


def int8_round(t: torch.Tensor, dim: int, bits: int = 8) -> torch.Tensor:
    """t rounded to its int8 (or int4) form (int8_quantize), in t's dtype, with a straight-through gradient;
    idempotent."""
    q, scale = int8_quantize(t, dim, bits)
    return t + (int8_dequantize(q, scale, dim).to(t.dtype) - t).detach()


class ErrorCompensator(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, gate_hidden: int = 0, alpha: float = 1.0,
                 factor_bits: int = 16):
        super().__init__()
        if factor_bits not in FACTOR_BITS:
            raise SpearError(f"EC factors are held in {factor_bits_text()} bits, not {factor_bits}")
        self.rank = rank
        self.factor_bits = factor_bits
        self.A = nn.Parameter(torch.zeros(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        self.alpha = nn.Parameter(torch.tensor(float(alpha)))
        self.gate: nn.Sequential | None = None
        if gate_hidden > 0:
            self.gate = nn.Sequential(nn.Linear(rank, gate_hidden), nn.SiLU(), nn.Linear(gate_hidden, rank))
            nn.init.zeros_(self.gate[2].weight)
            nn.init.zeros_(self.gate[2].bias)

    @property
    def gate_hidden(self) -> int:
        return 0 if self.gate is None else self.gate[0].out_features

    def gamma(self, u: torch.Tensor) -> torch.Tensor:
        """The gate gamma(u) = 1 + tanh(MLP(u)) for rank-space activations u [..., r] (ones without a gate)."""
        if self.gate is None:
            return torch.ones_like(u)
        return 1 + torch.tanh(self.gate.to(u.dtype)(u))

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) as the EC applies them: the parameters, or in 8 bits their int8 rounding per rank direction
        (A's rows, B's columns) with a straight-through gradient."""
        if self.factor_bits < 16:
            return int8_round(self.A, 1, self.factor_bits), int8_round(self.B, 0, self.factor_bits)
        return self.A, self.B

    def int8_factors(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """An 8-bit EC's factors as stored: ((A's int8 codes [r, in], its row scales [r]), (B's int8 codes [out, r],
        its column scales [r])), scales in fp16 (int8_quantize); int8_dequantize of each is factors()' value."""
        if self.factor_bits == 16:
            raise SpearError(f"this EC keeps its factors in {self.factor_bits} bits, not int8")
        return int8_quantize(self.A, 1, self.factor_bits), int8_quantize(self.B, 0, self.factor_bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        A, B = self.factors()
        u = x @ A.to(x.dtype).t()  # [..., r]
        if self.gate is not None:
            u = u * self.gamma(u)  # gamma(u) ⊙ u
        # alpha scales B [out, r], as the packed kernels do, not the output [..., out]: O(out·r) work, forward and
        # backward, instead of O(tokens·out)
        return u @ (self.alpha * B).to(x.dtype).t()

    def nbytes(self) -> int:
        """Bytes as stored (ec_nbytes)."""
        return ec_nbytes(self.B.shape[0], self.A.shape[1], self.rank, self.gate_hidden, self.factor_bits)

    @torch.no_grad()
    def served(self, dtype: torch.dtype) -> ServedEC:
        """A snapshot in `dtype` for a serving path: the same function, without a cast or a module call per step."""
        gate = None
        if self.gate is not None:
            w1, b1, w2, b2 = (t.detach().to(dtype) for t in (self.gate[0].weight, self.gate[0].bias,
                                                             self.gate[2].weight, self.gate[2].bias))
            gate = (w1.t(), b1, w2.t(), b2)
        A, B = self.factors()
        return ServedEC(A.detach().to(dtype).t(), (self.alpha * B).detach().to(dtype).t(), gate)


@dataclass(frozen=True)
class ServedEC:
    """An EC as the CPU serving path runs it: ec(x) = alpha * B (gamma(A x) ⊙ A x), its tensors cast once and held
    as transposed views, which torch.mm / addmm read as F.linear hands them its weights (the same products bit for
    bit, without F.linear's dispatch and transposes: nine ops a call, about 18 µs on the 2-core EPYC)."""

    At: torch.Tensor  # [in, r], a view of A [r, in]
    alpha_Bt: torch.Tensor  # [r, out], a view of alpha * B [out, r]
    gate: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None  # W1ᵀ [r, h], b1, W2ᵀ [h, r], b2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.mm(x.reshape(-1, self.At.shape[0]), self.At)  # [T, r]
        if self.gate is not None:
            w1t, b1, w2t, b2 = self.gate
            hidden = F.silu(torch.addmm(b1, u, w1t), inplace=True)
            u = torch.addmm(b2, hidden, w2t).tanh_().add_(1).mul_(u)  # gamma(u) ⊙ u
        return torch.mm(u, self.alpha_Bt).view(*x.shape[:-1], -1)


class SpearLinear(LinearMethod):
    """The record's codes are held packed at `bits` a weight (record.pack_codes: the artifact's layout), with its
    scales and zeros; `weight_hat`, the dequantized weight in the compute dtype, is there for the PyTorch path
    (calibration, evaluation) unless built with `dense=False` (loading for serving), where that path dequantizes on
    the fly. `release_for_serving` keeps only what the serving path reads (vLLM's process_weights_after_loading): the
    EC too, where a kernel's snapshot of it (packed_ec, cpu_ec) is what forward reads."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 dense: bool = True):
        super().__init__()
        self._hold(pack_codes(qweight.codes, qweight.bits), qweight.scales, qweight.zeros, qweight.bits,
                   qweight.shape[1], qweight.g_idx, qweight.offsets, bias, dtype)
        self.register_buffer("weight_hat", qweight.dequantize(dtype) if dense else None, persistent=False)

    @classmethod
    def from_packed(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                    in_features: int, g_idx: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                    dense: bool = True) -> "SpearLinear":
        """From the packed codes uint8 [out, packed_width(in, bits)] as an artifact stores them, without unpacking."""
        layer = cls.__new__(cls)
        LinearMethod.__init__(layer)
        layer._hold(codes, scales, zeros, bits, in_features, g_idx, offsets, bias, dtype)
        layer.register_buffer("weight_hat", layer.qweight.dequantize(dtype) if dense else None, persistent=False)
        return layer

    def _hold(self, codes, scales, zeros, bits, in_features, g_idx, offsets, bias, dtype) -> None:
        if codes.shape[1] != packed_width(in_features, bits):
            raise SpearError(f"packed codes of {codes.shape[1]} bytes a row do not hold {in_features} {bits}-bit codes")
        self.out_features, self.in_features = codes.shape[0], in_features
        self.bits = bits
        self.group_size = in_features // scales.shape[1]
        self.dtype = dtype
        self.register_buffer("codes", codes)  # uint8 [out, packed_width(in, bits)]
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("g_idx", g_idx)  # None (not in the state dict) unless imported
        self.register_buffer("offsets", offsets)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.record_bytes = QuantizedWeight.nbytes_of(self.out_features, in_features, bits, scales, g_idx, offsets)
        self.ec: ErrorCompensator | None = None
        self.released_ec_bytes = 0  # ec.nbytes() of an EC release_for_serving freed (its snapshot serves)
        self.packed = None  # PackedW4 once use_kernels() ran
        self.packed_ec = None  # PackedEC snapshot of self.ec, likewise
        self.cpu_w4: PackedCPUW4 | None = None  # once use_cpu_kernels() ran: the CPU int4 kernel's packing
        self.cpu_nibbles: PackedNibbles | None = None  # and the codes the CPU prefill path dequantizes
        self.cpu_scratch: Scratch | None = None  # into this buffer, shared by a model's layers
        self.cpu_ec: ServedEC | None = None  # and the EC, in float32

    @property
    def qweight(self) -> QuantizedWeight:
        if self.codes is None:
            raise SpearError("this layer holds only its kernels' packing (release_for_serving); load the artifact "
                             "again to read its record")
        return QuantizedWeight(unpack_codes(self.codes, self.bits, self.in_features), self.scales, self.zeros,
                               self.bits, self.group_size, self.g_idx, self.offsets)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, so code that reads `.weight` (dtype, device, shape) keeps working."""
        return self.weight_hat if self.weight_hat is not None else self.qweight.dequantize(self.dtype)

    def set_record(self, qweight: QuantizedWeight) -> None:
        """Hold `qweight` (same shape and bits) instead of the current record, its dense copy too where one is held:
        codes re-rounded in place (compensate.refit)."""
        if qweight.shape != (self.out_features, self.in_features) or qweight.bits != self.bits:
            raise SpearError(f"a {qweight.bits}-bit {tuple(qweight.shape)} record cannot replace this "
                             f"{self.bits}-bit {self.out_features}×{self.in_features} one")
        device = self.scales.device
        self.codes = pack_codes(qweight.codes, qweight.bits).to(device)
        self.scales, self.zeros = qweight.scales.to(device), qweight.zeros.to(device)
        self.g_idx = None if qweight.g_idx is None else qweight.g_idx.to(device)
        self.offsets = None if qweight.offsets is None else qweight.offsets.to(device)
        self.group_size = self.in_features // qweight.scales.shape[1]
        if self.weight_hat is not None:
            self.weight_hat = qweight.dequantize(self.dtype).to(device)

    def use_kernels(self, drop_dense: bool = False) -> bool:
        """Pack for the Triton kernels (inference: the EC is snapshotted, so call it after calibration).

        Returns False, changing nothing, where the kernels do not apply (not 4-bit, sizes not
        multiples of 64, an unsupported group size). With `drop_dense` only what the kernels read
        stays (release_for_serving); forward then needs CUDA fp16 inputs.
        """
        from spear.kernels.pack import pack_ec, pack_w4

        try:
            self.packed = pack_w4(self.qweight)
        except SpearError:
            return False
        self.packed_ec = None if self.ec is None else pack_ec(self.ec)
        if drop_dense:
            self.release_for_serving()
        return True

    def use_cpu_kernels(self, scratch: Scratch) -> bool:
        """Serve on a CPU without a float copy of the weight (kernels.cpu_w4): steps of up to CPU_W4_MAX_ROWS rows
        through PyTorch's int4 kernel in bfloat16, longer ones dequantize the same codes into `scratch` (float32,
        shared by the model's layers: kernels.cpu_w4.scratch_for) a block of rows at a time and run F.linear.
        Returns False, changing nothing, where neither applies (not a 4-bit standard-form record, shapes the int4 op refuses)."""
        from spear.kernels.cpu_w4 import nibbles_of, pack_cpu_w4

        try:
            record = self.qweight
            self.cpu_w4 = pack_cpu_w4(record)
            self.cpu_nibbles = nibbles_of(self.cpu_w4, record)  # the same codes, where their layout is known
        except SpearError:
            return False
        self.cpu_scratch = scratch
        self.cpu_ec = None if self.ec is None else self.ec.served(torch.float32)
        return True

    def release_for_serving(self) -> None:
        """Free what the serving path does not read: with a kernel packing (CUDA or CPU), the record and the dense
        copy (the packing holds the codes, scales and zeros) and the EC module (packed_ec or cpu_ec holds the EC as
        forward reads it; has_ec and nbytes still count it); without one, the record (forward reads the dense copy,
        made here if it was not, and the EC module)."""
        if self.codes is None:  # released already
            return
        kernels = self.packed is not None or self.cpu_w4 is not None
        if not kernels and self.weight_hat is None:
            self.weight_hat = self.qweight.dequantize(self.dtype)
        if kernels:
            self.weight_hat = None
        if self.ec is not None and (self.packed_ec is not None or self.cpu_ec is not None):
            self.released_ec_bytes, self.ec = self.ec.nbytes(), None
        self.codes = self.scales = self.zeros = self.g_idx = self.offsets = None

    @property
    def has_ec(self) -> bool:
        """Whether an EC is applied: the module, or the kernels' snapshot of it after release_for_serving."""
        return self.ec is not None or self.packed_ec is not None or self.cpu_ec is not None

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.packed is not None:  # follow .to(device); the packed dtypes are fixed
            device = fn(self.packed.qweight).device  # int32: only a move changes it
            self.packed = self.packed.to(device)
            self.packed_ec = None if self.packed_ec is None else self.packed_ec.to(device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.is_cuda and x.dtype == torch.float16:
            from spear.kernels.w4 import w4_linear

            return w4_linear(x, self.packed, self.packed_ec, None if self.bias is None else self.bias.half())
        if self.cpu_w4 is not None and not x.is_cuda:
            from spear.kernels.cpu_w4 import CPU_W4_MAX_ROWS, cpu_w4_linear, scratch_linear

            if x.numel() // self.in_features <= CPU_W4_MAX_ROWS:
                y = cpu_w4_linear(x, self.cpu_w4, self.bias)
            else:
                y = scratch_linear(x, self.cpu_nibbles, self.cpu_scratch, self.bias)
            if self.cpu_ec is not None:
                y += self.cpu_ec(x.float()).to(y.dtype)  # y: this call's own
            return y
        weight = self.weight_hat if self.weight_hat is not None else self.qweight.dequantize(x.dtype)
        y = F.linear(x, weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if self.ec is not None:
            y = y + self.ec(x)
        return y

    def nbytes(self) -> int:
        """The record at `bits` a weight (QuantizedWeight.nbytes_packed), the bias in fp16 and the EC as stored
        (ErrorCompensator.nbytes: int8 factors a byte an entry)."""
        bias = 0 if self.bias is None else self.bias.numel() * 2
        return self.record_bytes + bias + (self.released_ec_bytes if self.ec is None else self.ec.nbytes())

    def stack_key(self) -> tuple | None:
        """Packed layers of one input width and group size stack into one W4 launch (runtime.linear.FusedLinear);
        on a CPU, int4-packed ones of whole blocks of the op's packing into one int4 matmul
        (runtime.linear.FusedCPULinear)."""
        if self.packed is not None:
            return "w4", self.packed.in_features, self.packed.group_size
        if self.cpu_w4 is not None:
            from spear.kernels.cpu_w4 import SCRATCH_ROW_ALIGN  # whole blocks of the int4 op's packing

            if self.out_features % SCRATCH_ROW_ALIGN == 0:
                return "cpu_w4", self.in_features, self.cpu_w4.group_size, self.cpu_w4.dtype
        return None

    def folds_norm(self, rows: int) -> bool:
        return self.packed is not None

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> FoldedNorm:
        from spear.kernels.w4 import w4_decode_add_norm

        bias = None if self.bias is None else self.bias.half()
        return w4_decode_add_norm(x, self.packed, self.packed_ec, bias, residual, norm_weight, eps)

    def extra_repr(self) -> str:
        ec = "none" if self.ec is None else (f"rank={self.ec.rank}, gate_hidden={self.ec.gate_hidden}"
                                             + ("" if self.ec.factor_bits == 16 else f", factor_bits={self.ec.factor_bits}"))
        if self.ec is None and self.has_ec:  # released: the kernels' snapshot
            ec = f"served, rank={self.packed_ec.rank if self.packed_ec is not None else self.cpu_ec.At.shape[1]}"
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group={self.group_size}, ec={ec}"
