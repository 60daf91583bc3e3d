"""The runtime's own linear methods (spear.layer.LinearMethod) beside SpearLinear and tp.RowParallelLinear.

DenseLinear runs a float linear (cuBLAS, or the fp16 GEMV at one row on CUDA). FusedDenseLinear and FusedLinear
run several linears over one input as one launch (q/k/v, gate/up), float or W4 (+ EC), as gpt-fast's fp16 model
does; runtime.model.fuse_projections builds them from linears whose stack_key is equal, or from a checkpoint's own
fused linear (Phi-3's qkv_proj, gate_up_proj), which SplitLinear runs until then.
"""

from __future__ import annotations

import torch
from torch import nn

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

    The parts are re-pointed at their rows of the stacked weight, so it is held once."""

    def __init__(self, parts: list[LinearMethod], sizes: list[int] | None = None):
        super().__init__()
        part_sizes = [m.packed.out_features for m in parts]
        self.sizes = sizes or part_sizes
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

    def swiglu(self, x: torch.Tensor, rms: FoldedNorm | None = None) -> torch.Tensor:
        """silu(gate) ⊙ up [T, N / 2] of fused [gate; up] parts in one W4 decode launch (the activation in its
        epilogue), for fp16 x [T, K] with T ≤ DECODE_PATH_MAX_M (x = rms.hw with `rms`, as forward)."""
        from spear.kernels.w4 import w4_decode

        assert len(self.sizes) == 2 and self.sizes[0] == self.sizes[1], f"not [gate; up]: {self.sizes}"
        return w4_decode(x, self.packed, self.packed_ec, self.bias, swiglu=True, rms=rms)

    def nbytes(self) -> int:
        """As its parts serve them (SpearLinear.nbytes), measured when they were stacked."""
        return self.served_bytes

    def extra_repr(self) -> str:
        ec = "none" if self.packed_ec is None else f"rank={self.packed_ec.rank}, gated={self.packed_ec.gated}"
        return f"in={self.packed.in_features}, out={'+'.join(map(str, self.sizes))}, group={self.packed.group_size}, ec={ec}"


# ---- float tables held at half their bytes on a CPU ---------------------------------------------------------------

HALF_STORED_BLOCK = 1 << 21  # weights of the float32 scratch a HalfStoredLinear multiplies through (8 MiB)


def exact_half(weight: torch.Tensor) -> torch.dtype | None:
    """fp16 or bf16 where every value of the float32 `weight` is one of theirs (a checkpoint stored in it, upcast on
    loading), else None; checked a block of rows at a time, without a whole copy."""
    for dtype in (torch.float16, torch.bfloat16):
        if all(torch.equal(rows.to(dtype).float(), rows) for rows in weight.detach().split(4096)):
            return dtype
    return None


def to_half(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` in `dtype`, converted a block of rows at a time (no whole float32 temporary)."""
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    for start in range(0, weight.shape[0], 4096):
        out[start : start + 4096].copy_(weight.detach()[start : start + 4096])
    return out


class HalfStoredLinear(DenseLinear):
    """y = x Wᵀ + b in float32 with W held in fp16 or bf16 where that holds it exactly (exact_half): W is upcast a
    block of HALF_STORED_BLOCK weights at a time into one float32 scratch and multiplied there, so the products and
    their sums are float32's (the same logits bit for bit as the float32 weight, tested) at half the held bytes.
    The LM head on a CPU: 1.05 GB of 1.2B Llama's 128k-vocabulary model in float32. Time against F.linear on the
    float32 weight: bench/cpu_head.py."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None):
        super().__init__(weight, bias)
        # blocks of a multiple of 64 rows: a gemv groups rows from the first, and a block starting off that grid
        # summed its rows in another order (blocks of 1,170 rows moved logits by 1e-6; multiples of 64: none)
        rows = min(weight.shape[0], max(64, HALF_STORED_BLOCK // weight.shape[1] // 64 * 64))
        self.scratch = torch.empty(rows, weight.shape[1], dtype=torch.float32, device=weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()
        out = x2.new_empty(x2.shape[0], self.out_features)
        step, bias = self.scratch.shape[0], None if self.bias is None else self.bias.float()
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            block = self.scratch[: stop - start]
            block.copy_(self.weight[start:stop])
            out[:, start:stop] = nn.functional.linear(x2, block, None if bias is None else bias[start:stop])
        return out.reshape(*x.shape[:-1], self.out_features)

    def stack_key(self) -> tuple | None:
        return None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, held={self.weight.dtype}, computed=float32"


class HalfStoredEmbedding(nn.Module):
    """An embedding lookup from a table held in fp16 or bf16 (exactly: exact_half), returned in float32, times the
    module's `embed_scale` where it had one (Gemma's scaled embedding, applied in float32 as there)."""

    def __init__(self, weight: nn.Parameter, embed_scale: torch.Tensor | None):
        super().__init__()
        self.weight = weight
        self.embed_scale = embed_scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = nn.functional.embedding(tokens, self.weight).float()
        return x if self.embed_scale is None else x * self.embed_scale.float()


def hold_tables_at_half(model: nn.Module) -> int:
    """Give a float32 CPU model's embedding table and LM head (`model.embed`, `model.head`) fp16 or bf16 copies where
    that holds every value exactly, computing in float32 as before (HalfStoredEmbedding, HalfStoredLinear; a tied
    head shares the embedding's copy). The transformers modules they came from keep their float32 tensors, freed
    with that model (`spear serve` drops it once the engine is built). Returns the bytes the copies save."""
    embed, head = model.embed, model.head
    halves: dict[int, nn.Parameter | None] = {}

    def half_of(param: nn.Parameter) -> nn.Parameter | None:
        if id(param) not in halves:
            dtype = None if param.dtype != torch.float32 or param.is_cuda else exact_half(param)
            halves[id(param)] = None if dtype is None else nn.Parameter(to_half(param, dtype), requires_grad=False)
        return halves[id(param)]

    plain = type(embed) is nn.Embedding or hasattr(embed, "embed_scale")
    if plain and getattr(embed, "max_norm", None) is None and (weight := half_of(embed.weight)) is not None:
        model.embed = HalfStoredEmbedding(weight, getattr(embed, "embed_scale", None))
    if type(head) is DenseLinear and (weight := half_of(head.weight)) is not None:
        model.head = HalfStoredLinear(weight, head.bias)
    return sum(p.numel() * 2 for p in halves.values() if p is not None)
