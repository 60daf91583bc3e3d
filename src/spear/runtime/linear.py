"""The runtime's own linear methods (spear.layer.LinearMethod) beside SpearLinear and tp.RowParallelLinear.

DenseLinear runs a float linear (cuBLAS, or the fp16 GEMV at one row on CUDA). FusedDenseLinear and FusedLinear
run several linears over one input as one launch (q/k/v, gate/up), float or W4 (+ EC), as gpt-fast's fp16 model
does, and FusedCPULinear as one call of PyTorch's CPU int4 matmul; runtime.model.fuse_projections builds them from
linears whose stack_key is equal, or from a checkpoint's own fused linear (Phi-3's qkv_proj, gate_up_proj), which
SplitLinear runs until then.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from spear.kernels.cpu_w4 import CPU_W4_MAX_ROWS, PackedCPUW4, cpu_w4_linear
from spear.kernels.norm_fold import FoldedNorm
from spear.kernels.pack import PackedW4, concat_ec, concat_w4
from spear.kernels.reference import w4_linear_ref
from spear.layer import LinearMethod


class DenseLinear(LinearMethod):
    """A float linear whose one-row fp16 steps on CUDA take the fp16 GEMV kernel where tune_gemv found it faster
    than cuBLAS (kernels.f16_gemv.dense_linear); cuBLAS (F.linear) everywhere else."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None):
        super().__init__()
        self.weight, self.bias = weight, bias

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from spear.kernels.f16_gemv import dense_linear

            return dense_linear(x, self.weight, self.bias)
        return nn.functional.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def stack_key(self) -> tuple | None:
        """Float layers of one input width, dtype and device stack into one GEMM (FusedDenseLinear)."""
        return "dense", self.in_features, self.weight.dtype, self.weight.device

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, dtype={self.weight.dtype}"


class SplitLinear(LinearMethod):
    """One linear whose output is several projections side by side (Phi-3's qkv_proj, gate_up_proj), returned as
    views of its [..., Σ sizes] output, as a fused launch returns its parts'. fuse_projections turns it into that
    launch (FusedLinear, FusedDenseLinear) where the model is packed for the kernels."""

    def __init__(self, linear: LinearMethod, sizes: list[int]):
        super().__init__()
        self.linear, self.sizes = linear, sizes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)

    def nbytes(self) -> int:
        return self.linear.nbytes()


class FusedDenseLinear(DenseLinear):
    """Float linears over the same input as one GEMM: y = x [W_1; W_2; ...]ᵀ + [b_1; b_2; ...], returned as the
    parts' outputs (views of one [..., Σ N_i] result), or as `sizes` columns each where given (one part holding
    several projections: SplitLinear). At one decode row the three q/k/v GEMVs of a 7B layer become one over
    100 MB, which streams nearer the copy bandwidth than three over 33 MB.

    The parts' parameters are re-pointed in place at their rows of the stacked weight, so it is held once (by every
    module sharing them: the transformers layer a DenseLinear was built over too)."""

    def __init__(self, parts: list[DenseLinear], sizes: list[int] | None = None):
        weight = nn.Parameter(torch.cat([m.weight.detach() for m in parts]), requires_grad=False)
        bias = None
        if any(m.bias is not None for m in parts):
            bias = nn.Parameter(torch.cat([torch.zeros_like(m.weight[:, 0]) if m.bias is None else m.bias.detach()
                                           for m in parts]), requires_grad=False)
        super().__init__(weight, bias)
        self.sizes = sizes or [m.out_features for m in parts]
        start = 0
        for m in parts:
            n = m.out_features
            m.weight.data = weight.data[start : start + n]
            if m.bias is not None:
                m.bias.data = bias.data[start : start + n]
            start += n

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().forward(x).split(self.sizes, dim=-1)

    def stack_key(self) -> tuple | None:
        return None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={'+'.join(map(str, self.sizes))}, dtype={self.weight.dtype}"


class FusedLinear(LinearMethod):
    """Packed SpearLinears over the same input as one W4 launch: y = [y_1 | y_2 | ...] from the stacked
    weight (concat_w4), the concatenated bias and the block-diagonal EC (concat_ec): exact. The output splits
    as the parts', or as `sizes` where given (one part holding several projections: SplitLinear).

    The parts are re-pointed at their rows of the stacked weight, and their ECs at the stacked EC with their rows of
    B (exact: the others' rank columns are zero in those rows, their gate blocks apart), so both are held once.

    On the steps the W4 decode kernel takes, it runs a [gate; up] stack's SiLU·up in its epilogue with `fuse_swiglu`,
    and takes the norm folded into the launch before with `fold_norm` (options' switches, read by fuse_projections)."""

    def __init__(self, parts: list[LinearMethod], sizes: list[int] | None = None, fuse_swiglu: bool = False,
                 fold_norm: bool = False):
        super().__init__()
        part_sizes = [m.packed.out_features for m in parts]
        self.sizes = sizes or part_sizes
        self.fuse_swiglu, self.fold_norm = fuse_swiglu, fold_norm
        if fuse_swiglu:
            assert len(self.sizes) == 2 and self.sizes[0] == self.sizes[1], f"not [gate; up]: {self.sizes}"
        self.served_bytes = sum(m.nbytes() for m in parts)
        self.packed = concat_w4([m.packed for m in parts])
        device = self.packed.qweight.device
        self.packed_ec = concat_ec([m.packed_ec for m in parts], part_sizes, self.packed.in_features, device)
        self.bias = None
        if any(m.bias is not None for m in parts):
            self.bias = torch.cat([torch.zeros(n, dtype=torch.float16, device=device) if m.bias is None else m.bias.half()
                                   for m, n in zip(parts, part_sizes)])
        start = 0
        for m, n in zip(parts, part_sizes):
            w = self.packed
            m.packed = PackedW4(w.qweight[start : start + n], w.scales[start : start + n], w.zeros[start : start + n],
                                w.group_size, w.in_features)
            if m.packed_ec is not None:
                m.packed_ec = dataclasses.replace(self.packed_ec, B=self.packed_ec.B[start : start + n])
            start += n

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        device = fn(self.packed.qweight).device  # int32: only a move changes it; the packed dtypes are fixed
        self.packed = self.packed.to(device)
        self.packed_ec = None if self.packed_ec is None else self.packed_ec.to(device)
        self.bias = None if self.bias is None else self.bias.to(device)
        return self

    def forward(self, x: torch.Tensor, rms: FoldedNorm | None = None) -> tuple[torch.Tensor, ...]:
        """The parts' outputs, as views of one [..., Σ N_i] result; with `rms` (a decode step), of norm(rms.h),
        x being rms.hw (FoldedNorm)."""
        if rms is not None:
            from spear.kernels.w4 import w4_decode

            return w4_decode(x, self.packed, self.packed_ec, self.bias, rms=rms).split(self.sizes, dim=-1)
        if x.dtype == torch.float16:  # the kernels (CUDA, or the Triton interpreter on CPU)
            from spear.kernels.w4 import w4_linear

            y = w4_linear(x, self.packed, self.packed_ec, self.bias)
        else:
            y = w4_linear_ref(x, self.packed, self.packed_ec, self.bias)
        return y.split(self.sizes, dim=-1)

    def fuses_swiglu(self, x: torch.Tensor) -> bool:
        return self.fuse_swiglu and _decode_launch(x)

    def swiglu(self, x: torch.Tensor, rms: FoldedNorm | None = None) -> torch.Tensor:
        """silu(gate) ⊙ up [T, N / 2] of fused [gate; up] parts in one W4 decode launch (the activation in its
        epilogue), for fp16 x [T, K] with T ≤ DECODE_PATH_MAX_M (x = rms.hw with `rms`, as forward)."""
        from spear.kernels.w4 import w4_decode

        return w4_decode(x, self.packed, self.packed_ec, self.bias, swiglu=True, rms=rms)

    def takes_folded_norm(self, x: torch.Tensor) -> bool:
        return self.fold_norm and _decode_launch(x)

    def nbytes(self) -> int:
        """As its parts serve them (SpearLinear.nbytes), measured when they were stacked."""
        return self.served_bytes

    def extra_repr(self) -> str:
        ec = "none" if self.packed_ec is None else f"rank={self.packed_ec.rank}, gated={self.packed_ec.gated}"
        return f"in={self.packed.in_features}, out={'+'.join(map(str, self.sizes))}, group={self.packed.group_size}, ec={ec}"


def _decode_launch(x: torch.Tensor) -> bool:
    """Whether a W4 launch on x [T, K] takes the decode kernel (fp16, T ≤ DECODE_PATH_MAX_M): the steps its epilogue
    fusions apply to."""
    if x.dtype != torch.float16:  # the kernels' dtype (checked first: triton may be missing off the GPU)
        return False
    from spear.kernels.w4 import DECODE_PATH_MAX_M

    return x.shape[0] <= DECODE_PATH_MAX_M


class FusedCPULinear(LinearMethod):
    """SpearLinears served on a CPU (kernels.cpu_w4) over the same input as one int4 matmul: steps of up to
    CPU_W4_MAX_ROWS rows (decode) run the stacked packing (the parts' rows side by side; each part's rows are whole
    blocks of the op's packing, so the stack is the packing of the stacked codes), then each part's EC adds into its
    columns; longer steps (prefill) run each part's own scratch path. Every output is the parts' bit for bit (the op
    sums each output over K alone, whatever N). The outputs split as the parts', or as `sizes` where given (one part
    holding several projections: SplitLinear).

    The parts' codes are re-pointed at their rows of the stacked packing, so they are held once."""

    def __init__(self, parts: list[LinearMethod], sizes: list[int] | None = None):
        super().__init__()
        packings = [m.cpu_w4 for m in parts]
        part_sizes = [p.out_features for p in packings]
        self.sizes = sizes or part_sizes
        self.parts = tuple(parts)  # not submodules: the model holds them where it did
        self.served_bytes = sum(m.nbytes() for m in parts)
        self.cpu_w4 = PackedCPUW4(torch.cat([p.weight for p in packings]),
                                  torch.cat([p.scales_and_zeros for p in packings], dim=1).contiguous(),
                                  packings[0].group_size, packings[0].in_features)
        self.bias = None
        if any(m.bias is not None for m in parts):
            self.bias = torch.cat([torch.zeros(n) if m.bias is None else m.bias.detach().float()
                                   for m, n in zip(parts, part_sizes)])
        self.ecs = []  # (first column, columns, the part's EC)
        start = 0
        for m, n in zip(parts, part_sizes):
            rows = self.cpu_w4.weight[start : start + n]
            if m.cpu_nibbles.codes is m.cpu_w4.weight:  # the scratch path reads the int4 packing's codes
                m.cpu_nibbles.codes = rows
            m.cpu_w4.weight = rows
            if m.cpu_ec is not None:
                self.ecs.append((start, n, m.cpu_ec))
            start += n

    @property
    def in_features(self) -> int:
        return self.cpu_w4.in_features

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x.numel() // self.in_features <= CPU_W4_MAX_ROWS:
            y = cpu_w4_linear(x, self.cpu_w4, self.bias)
            xf = x.float()
            for start, n, ec in self.ecs:
                y.narrow(-1, start, n).add_(ec(xf).to(y.dtype))
        else:
            outs = [m(x) for m in self.parts]
            y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y.split(self.sizes, dim=-1)

    def nbytes(self) -> int:
        """As its parts serve them (SpearLinear.nbytes), measured when they were stacked."""
        return self.served_bytes

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={'+'.join(map(str, self.sizes))}, ecs={len(self.ecs)}"
