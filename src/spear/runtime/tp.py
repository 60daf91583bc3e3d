"""Tensor parallelism for the runtime model (after gpt-fast's tp.py), W4 weights and ECs included.

Every rank holds a slice of each decoder linear; embeddings, norms and the LM head are
replicated, and so is everything between the linears (the ranks compute identical x).

Column-parallel (q, k, v, gate, up): a block of output rows per rank: the W4 codes',
scales' and zeros' rows, the bias rows, the EC's B rows; A and the gate are replicated,
so u = A x is the full one and the shard is exact without communication. Heads (query
and KV) are split evenly across the ranks.

Row-parallel (o, down): a block of input columns per rank: the codes' columns, the
scale/zero groups over them (shard boundaries must fall on group boundaries; per-channel
scales are replicated), the EC's A columns. Each rank has partials

    y_r = x_r Ŵ_rᵀ   [M, N]          u_r = x_r A_rᵀ   [M, r]
    y = Σ_r y_r + bias + (alpha·B) (gamma(u) ⊙ u),    u = Σ_r u_r

and the gate needs the summed u, so both partials are reduced first; every rank then
applies the gate and B (replicated) to identical data (spear.kernels.ec_epilogue on CUDA).

An EC with int8 factors stays int8 on every rank, as kernels.pack holds it on one GPU: in the row-parallel layers
(RankSpaceEC) A's scales run along its rows, so a split of its columns keeps them; a column shard (ShardEC) keeps
its rows of B's codes with the whole EC's column scales, which span every rank's rows (the shard's rows alone
would round to other scales).

The reduction has three implementations, chosen per model with `set_reduction` (serving: p2p on GPUs):

  "collective" (the baseline): all_reduce(y) and a separate all_reduce(u), NCCL (gloo on CPU).
  "symmetric"  (CUDA): each layer owns a PyTorch symmetric-memory buffer of
               float32 rows [y_r | u_r]. The W4 decode kernel stores its partial y_r there from
               its epilogue (no output tensor, no copy), u_r = x_r A_rᵀ lands beside it, ONE
               one-shot all-reduce sums the ranks' buffers (each rank reads its peers' over
               NVLink), and ONE epilogue kernel turns the sum into the fp16 output: reduced y,
               bias, gate and B. Rows beyond the buffer's size (prefill) take the collective
               path. Each layer has its own buffer, so a rank never overwrites a buffer a peer
               may still read: between two uses of it lie the other layers' reductions, each a
               barrier of all ranks.

  "p2p"        (the issue's design, CUDA; the fastest on an H200 pair, BENCHMARKS §7): the W4 decode
               kernel's epilogue writes this rank's partials [y_r | u_r] (float32) into its slot of
               EVERY rank's symmetric buffer over NVLink, and the last of its programs to finish
               signals every rank (system-scope release); one epilogue kernel per rank waits for all
               the signals (acquire), sums the slots in rank order and applies bias, gate and B.
               Two launches per row-parallel layer and no collective call. A per-layer epoch in
               device memory makes the waits CUDA-graph safe.

The launcher (`launch`) starts one process per rank with torch.distributed initialised:
NCCL on CUDA (one GPU per rank, NVLink multicast off), gloo on CPU.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
from collections.abc import Callable
from contextlib import contextmanager, suppress
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from spear.errors import SpearError
from spear.kernels import options
from spear.kernels.norm_fold import FoldedNorm
from spear.kernels.pack import PackedEC, dequantize_factor, pow2_at_least_16, served_factors
from spear.layer import ErrorCompensator, LinearMethod, SpearLinear
from spear.record import QuantizedWeight
from spear.runtime.linear import DenseLinear
from spear.runtime.model import Transformer

# Set in every process before NCCL starts (../shared/GPU.md: multicast is unavailable on the host).
TP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

Reduction = Literal["collective", "symmetric", "p2p"]
GRACE_SECONDS = 10  # after one rank fails, how long the others may take to end by themselves before SIGTERM


def _shardable(lin: SpearLinear) -> QuantizedWeight:
    """The layer's record, where sharding rows or columns of codes, scales and zeros shards the weight."""
    if not lin.qweight.standard_form:
        raise SpearError("tensor parallelism splits (q - z) * s records; an imported layer with g_idx, offsets or "
                         "float32 scales cannot be split yet: serve it with --tp 1")
    return lin.qweight


def _rows(t: torch.Tensor | None, rank: int, world: int) -> torch.Tensor | None:
    """This rank's block of dim 0, as its own tensor (the full tensor can be freed)."""
    return None if t is None else t.chunk(world, dim=0)[rank].clone()


def _cols(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim=1)[rank].clone()


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _check_unpacked(lin: LinearMethod) -> None:
    if lin.packed is not None:
        raise SpearError("shard the model (apply_tp) before packing it for the kernels (use_kernels)")


def column_shard(lin: DenseLinear | SpearLinear, rank: int, world: int) -> DenseLinear | SpearLinear:
    """The rank's block of output rows of a float linear or a SpearLinear (EC: B rows; A, gate replicated)."""
    _check_unpacked(lin)
    if lin.out_features % world:
        raise SpearError(f"{lin.out_features} output features do not split over {world} ranks")
    if not isinstance(lin, SpearLinear):  # the weight's format decides how it splits
        bias = None if lin.bias is None else _param(_rows(lin.bias, rank, world))
        return DenseLinear(_param(_rows(lin.weight, rank, world)), bias)
    q = _shardable(lin)
    record = QuantizedWeight(_rows(q.codes, rank, world), _rows(q.scales, rank, world), _rows(q.zeros, rank, world),
                             q.bits, q.group_size)
    shard = SpearLinear(record, _rows(lin.bias, rank, world), lin.dtype)
    if lin.ec is not None:
        ec = lin.ec
        if ec.factor_bits < 16:  # int8 codes (a 4-bit EC's too)
            shard.ec = ShardEC(ec, rank, world)
        else:  # A replicated (the same tensor), B's rows
            shard.ec = ErrorCompensator(lin.in_features, shard.out_features, ec.rank)
            shard.ec.A, shard.ec.alpha, shard.ec.gate = _param(ec.A.detach()), ec.alpha, ec.gate
            shard.ec.B = _param(_rows(ec.B.detach(), rank, world))
    return shard


class ShardEC(ErrorCompensator):
    """A column shard of an 8-bit EC, int8 as the whole EC stores it: A's codes and row scales (replicated), this
    rank's rows of B's codes, and B's column scales, which span every rank's rows. int8_factors() gives these (so
    kernels.pack packs the unsharded packing's rows of B and its b_scale), factors() their float values (the rows
    of the unsharded EC's factors(), bit for bit); there are no float masters to train."""

    def __init__(self, ec: ErrorCompensator, rank: int, world: int):
        (qa, sa), (qb, sb) = ec.int8_factors()
        super().__init__(qa.shape[1], qb.shape[0] // world, ec.rank, factor_bits=8)
        self.A, self.B = _param(qa), _param(_rows(qb, rank, world))  # int8 [r, in], int8 [out / world, r]
        self.alpha, self.gate = ec.alpha, ec.gate
        self.register_buffer("a_scale", sa)  # fp16 [r], as int8_factors gives them
        self.register_buffer("b_scale", sb)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (dequantize_factor(self.A, self.a_scale, 1, torch.float32),
                dequantize_factor(self.B, self.b_scale, 0, torch.float32))

    def int8_factors(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        return (self.A, self.a_scale), (self.B, self.b_scale)


class RankSpaceEC(nn.Module):
    """A row-parallel layer's EC: this rank's columns of A; alpha·B and the gate replicated, in the model's dtype. An
    8-bit EC's A and B stay int8 codes with float32 scales, as kernels.pack holds them (served_factors): a_scale A's
    row scales (a split of A's columns keeps them), b_scale alpha times B's column scales. A is held with its rank
    padded to the W4 kernels' (padded_rank: zero rows, scale 0), so the packing their u-programs read is a view."""

    def __init__(self, ec: ErrorCompensator, rank: int, world: int, dtype: torch.dtype):
        super().__init__()
        self.rank = ec.rank
        a, b, a_scale, b_scale = served_factors(ec, dtype)
        A = torch.zeros(self.padded_rank, a.shape[1] // world, dtype=a.dtype, device=a.device)
        A[: self.rank] = _cols(a, rank, world)
        self.register_buffer("A", A)  # [padded_rank, in / world]
        self.register_buffer("B", b)  # [N, r]
        if a_scale is not None:
            a_scale = torch.cat([a_scale, a_scale.new_zeros(self.padded_rank - self.rank)])
        self.register_buffer("a_scale", a_scale)  # float32 [padded_rank] (int8 A), else None
        self.register_buffer("b_scale", b_scale)  # float32 [r]
        gate = [None] * 4 if ec.gate is None else [ec.gate[0].weight, ec.gate[0].bias, ec.gate[2].weight, ec.gate[2].bias]
        for name, t in zip(("W1", "b1", "W2", "b2"), gate):
            self.register_buffer(name, None if t is None else t.detach().to(dtype))

    def dense_A(self, dtype: torch.dtype) -> torch.Tensor:
        """A_r [r, in / world] in `dtype` (int8: kernels.pack.dequantize_factor)."""
        a = self.A[: self.rank]
        return a.to(dtype) if self.a_scale is None else dequantize_factor(a, self.a_scale[: self.rank], 1, dtype)

    def dense_B(self, dtype: torch.dtype) -> torch.Tensor:
        """alpha·B [N, r] in `dtype`, likewise."""
        return self.B.to(dtype) if self.b_scale is None else dequantize_factor(self.B, self.b_scale, 0, dtype)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """u_r = x_r A_rᵀ  [M, r]. An int8 A is dequantized each call, not cached (a cache would hold it at three
        bytes an entry): served on GPUs (the p2p reduction) decode steps take u_r from the W4 kernel's u-programs,
        which read the int8 codes, and this runs for steps past the reduction's rows (prefill: r × in / world entries
        against a GEMM of thousands of rows), or on decode steps with the baseline reductions only."""
        return x @ self.dense_A(x.dtype).t()

    @property
    def padded_rank(self) -> int:
        """The rank the W4 kernels compute u in (kernels.pack's padding)."""
        return pow2_at_least_16(self.rank)

    def packed_a(self) -> PackedEC:
        """A_r for the W4 decode kernel's u-programs (fp16 or int8 with its scales, rank padded to padded_rank): a
        view of A (a float32 model's A in fp16, a copy); B and the gate act after the reduction, so the packed ones
        are placeholders. Cached."""
        if getattr(self, "_packed_a", None) is None:
            padded = self.padded_rank
            a = self.A if self.A.dtype in (torch.int8, torch.float16) else self.A.half()
            f16 = dict(dtype=torch.float16, device=self.A.device)
            gate = (torch.zeros(16, padded, **f16), torch.zeros(16, **f16), torch.zeros(padded, 16, **f16),
                    torch.zeros(padded, **f16))
            scales = {} if self.a_scale is None else dict(a_scale=self.a_scale, b_scale=self.a_scale)
            self._packed_a = PackedEC(a, a, *gate, self.rank, gated=False, **scales)
        return self._packed_a

    def epilogue(self, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """y + (alpha·B)(gamma(u) ⊙ u) on the reduced y [M, N] and u [M, r]; in place on CUDA fp16."""
        if y.is_cuda and y.dtype == torch.float16:
            from spear.kernels.ec_epilogue import ec_epilogue

            return ec_epilogue(y, u, **epilogue_weights(self))
        from spear.kernels.reference import ec_epilogue_ref

        return ec_epilogue_ref(y, u, self.dense_B(torch.float32), self.W1, self.b1, self.W2, self.b2)


def epilogue_weights(ec: RankSpaceEC | None) -> dict[str, torch.Tensor | None]:
    """alpha·B (int8 with b_scale, or None), W1, b1, W2, b2 for the epilogue kernels (kernels.ec_epilogue); all None
    without an EC."""
    names = ("B", "W1", "b1", "W2", "b2", "b_scale")
    return {name: None if ec is None else getattr(ec, name) for name in names}


class CollectiveReduce:
    """The baseline: one all-reduce of y, a separate one of u (NCCL, or gloo on CPU)."""

    def __call__(self, y: torch.Tensor, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        dist.all_reduce(y)
        if u is not None:
            dist.all_reduce(u)
        return y, u


class SymmetricReduce:
    """The SPEAR path (CUDA): [y_r | u_r] float32 rows in one symmetric-memory buffer, written by the W4 kernel's
    epilogue and the rank-space product, one one-shot all-reduce, one epilogue kernel (see the module docstring).
    `all_reduce` sums a flat float32 buffer over the ranks into a new tensor (tests pass a stand-in)."""

    def __init__(self, buffer: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor]):
        self.buffer = buffer  # [max_rows * (N + r)] float32
        self.all_reduce = all_reduce

    @classmethod
    def create(cls, max_rows: int, width: int, device: torch.device) -> SymmetricReduce:
        import torch.distributed._symmetric_memory as symm_mem

        group_name = dist.group.WORLD.group_name
        # float32: torch 2.11's one_shot_all_reduce has no fp16 kernel ("not implemented for 'Half'", seen on the
        # H200 pair); the sum in float32 is also the more exact one.
        buffer = symm_mem.empty(max_rows * width, dtype=torch.float32, device=device)
        symm_mem.rendezvous(buffer, group_name)
        return cls(buffer, lambda flat: torch.ops.symm_mem.one_shot_all_reduce(flat, "sum", group_name))

    def fits(self, rows: int, width: int) -> bool:
        return rows * width <= self.buffer.numel()

    def __call__(self, layer: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
        """The layer's output [M, N] (x's dtype) for x [M, in / world]."""
        m, n = x.shape[0], layer.out_features
        width = n + (0 if layer.ec is None else layer.ec.rank)
        flat = self.buffer[: m * width]
        staged = flat.view(m, width)
        layer.partial_into(x, staged[:, :n])  # y_r, float32, from the W4 kernel's epilogue
        if layer.ec is not None:
            staged[:, n:].copy_(layer.ec.partial(x))  # u_r = x_r A_rᵀ
        summed = self.all_reduce(flat).view(m, width)
        from spear.kernels.ec_epilogue import ec_epilogue

        return ec_epilogue(summed[:, :n], None if layer.ec is None else summed[:, n:], **epilogue_weights(layer.ec),
                           bias=layer.bias, out=torch.empty(m, n, dtype=x.dtype, device=x.device))


PEER_BLOCK_N = 128  # columns a program of the p2p epilogue (and, folded, the Σ h² partials' width)


class PeerReduce:
    """The "p2p" reduction (see the module docstring): `send` (the W4 kernel writing the partials to every rank and
    signalling), then `receive` (wait, sum, bias, gate, B). Tests run the two halves of several ranks in turn."""

    def __init__(self, slots: torch.Tensor, signals: torch.Tensor, state: torch.Tensor, peers, max_rows: int):
        self.slots = slots  # float32 [world, max_rows, width]: rank s's [y_s | u_s] rows in slot s
        self.signals = signals  # int32 [world]: how many times rank s has sent
        self.state = state  # int32 [2]: this rank's epoch (calls received) and the epilogue's arrival counter
        self.peers = peers  # kernels.w4.PeerRows: this rank's slot and signal in every rank's buffers
        self.max_rows = max_rows

    @classmethod
    def create(cls, max_rows: int, width: int, device: torch.device) -> PeerReduce:
        import torch.distributed._symmetric_memory as symm_mem

        from spear.kernels.w4 import PeerRows

        rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name
        slots = symm_mem.empty(world * max_rows * width, dtype=torch.float32, device=device)
        signals = symm_mem.empty(world, dtype=torch.int32, device=device)
        signals.zero_()
        slot_ptrs, signal_ptrs = (symm_mem.rendezvous(t, group).buffer_ptrs for t in (slots, signals))
        dist.barrier()  # every rank's signals are zero before any rank sends
        rows = [slot_ptrs[p] + 4 * rank * max_rows * width for p in range(world)]  # 4 bytes a float32
        own = [signal_ptrs[p] + 4 * rank for p in range(world)]
        peers = PeerRows(torch.tensor(rows, dtype=torch.int64, device=device),
                         torch.tensor(own, dtype=torch.int64, device=device), width)
        return cls(slots.view(world, max_rows, width), signals, torch.zeros(2, dtype=torch.int32, device=device),
                   peers, max_rows)

    def fits(self, rows: int, width: int) -> bool:
        return rows <= self.max_rows and width == self.peers.width

    def send(self, layer: RowParallelLinear, x: torch.Tensor) -> None:
        from spear.kernels.w4 import w4_decode_to_peers

        packed = layer.base.packed
        if packed is None or x.dtype != torch.float16:
            raise SpearError("the p2p reduction needs the W4 kernels: pack the sharded model (use_kernels), fp16")
        w4_decode_to_peers(x, packed, None if layer.ec is None else layer.ec.packed_a(), self.peers)

    def receive(self, layer: RowParallelLinear, rows: int,
                add_norm: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """The reduced output [rows, N]; with `add_norm` (ec_epilogue.peer_epilogue's), y + residual."""
        from spear.kernels.ec_epilogue import peer_epilogue

        out = torch.empty(rows, layer.out_features, dtype=torch.float16, device=self.slots.device)
        return peer_epilogue(self.slots, self.signals, self.state, rows, layer.out_features, self.peers.width,
                             **epilogue_weights(layer.ec), bias=layer.bias, out=out,
                             rank=0 if layer.ec is None else layer.ec.rank, block_n=PEER_BLOCK_N, add_norm=add_norm)

    def receive_add_norm(self, layer: RowParallelLinear, rows: int, residual: torch.Tensor,
                         norm_weight: torch.Tensor, eps: float) -> FoldedNorm:
        """receive, with the next add + RMSNorm folded into the epilogue (kernels.norm_fold.FoldedNorm)."""
        n = layer.out_features
        hw = torch.empty(rows, n, dtype=torch.float16, device=self.slots.device)
        ssq = torch.empty(rows, -(-n // PEER_BLOCK_N), dtype=torch.float32, device=self.slots.device)
        h = self.receive(layer, rows, (residual.contiguous(), norm_weight.contiguous(), hw, ssq))
        return FoldedNorm(h, hw, ssq, eps)

    def __call__(self, layer: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
        self.send(layer, x)
        return self.receive(layer, x.shape[0])


class RowParallelLinear(LinearMethod):
    """y = reduce(x_r Ŵ_rᵀ) + bias (+ the EC epilogue on the reduced u); `reduce` is set by set_reduction.

    Its own W4 launches are its base's (a SpearLinear over this rank's columns), so it has no `packed` itself."""

    def __init__(self, lin: DenseLinear | SpearLinear, rank: int, world: int):
        super().__init__()
        _check_unpacked(lin)
        if lin.in_features % world:
            raise SpearError(f"{lin.in_features} input features do not split over {world} ranks")
        self.in_features, self.out_features = lin.in_features // world, lin.out_features
        self.bias = lin.bias  # added once, after the reduction
        self.fold_norm = False  # the next add + RMSNorm folded into the p2p epilogue: options' fold_norm_tp (set_reduction)
        self.ec: RankSpaceEC | None = None
        if not isinstance(lin, SpearLinear):  # the weight's format decides how it splits
            self.base = DenseLinear(_param(_cols(lin.weight.detach(), rank, world)), None)
        else:
            q = _shardable(lin)
            if q.group_size != lin.in_features and self.in_features % q.group_size:
                raise SpearError(f"quantization groups of {q.group_size} do not align with the {world}-way split "
                                 f"of {lin.in_features} inputs; use a group size that divides {self.in_features}")
            per_channel = q.group_size == lin.in_features
            scales, zeros = (q.scales, q.zeros) if per_channel else (_cols(q.scales, rank, world), _cols(q.zeros, rank, world))
            record = QuantizedWeight(_cols(q.codes, rank, world), scales.clone(), zeros.clone(), q.bits,
                                     self.in_features if per_channel else q.group_size)
            self.base = SpearLinear(record, None, lin.dtype)
            if lin.ec is not None:
                self.ec = RankSpaceEC(lin.ec, rank, world, lin.dtype)
        self.reduce: CollectiveReduce | SymmetricReduce | PeerReduce = CollectiveReduce()  # set_reduction

    def _staged_width(self) -> int:
        """The columns of a staged [y | u] row: u's at the EC's rank, padded to the kernel's for the p2p path."""
        if self.ec is None:
            return self.out_features
        return self.out_features + (self.ec.padded_rank if isinstance(self.reduce, PeerReduce) else self.ec.rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        width = self._staged_width()
        if isinstance(self.reduce, (SymmetricReduce, PeerReduce)) and self.reduce.fits(x2.shape[0], width):
            return self.reduce(self, x2).view(*x.shape[:-1], self.out_features)
        y = self.base(x)  # [M, N] partial
        u = None if self.ec is None else self.ec.partial(x)  # [M, r] partial
        collective = self.reduce if isinstance(self.reduce, CollectiveReduce) else CollectiveReduce()  # or the fallback
        y, u = collective(y, u)
        if self.ec is not None:
            y = self.ec.epilogue(y, u)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def folds_norm(self, rows: int) -> bool:
        """Whether add_norm can fold the next add + RMSNorm into this layer's reduction (the p2p epilogue) for a
        step of `rows` rows: built with it (fold_norm)."""
        return self.fold_norm and isinstance(self.reduce, PeerReduce) and self.reduce.fits(
            rows, self._staged_width())

    def nbytes(self) -> int:
        """This rank's: its base's, its columns of the EC (RankSpaceEC's buffers) and the bias."""
        ec = 0 if self.ec is None else sum(b.nbytes for b in self.ec.buffers())
        return self.base.nbytes() + ec + (0 if self.bias is None else self.bias.nbytes)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> FoldedNorm:
        """forward(x), then the next norm of forward(x) + residual, folded into the p2p epilogue (folds_norm)."""
        x2 = x.reshape(-1, x.shape[-1])
        self.reduce.send(self, x2)
        return self.reduce.receive_add_norm(self, x2.shape[0], residual, norm_weight, eps)

    def partial_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """This rank's partial y_r = x_r Ŵ_rᵀ into `out` [M, N] (a float32 view with a row stride): stored by the W4
        decode kernel where it runs, else computed and copied."""
        packed = self.base.packed
        if packed is not None and x.is_cuda and x.dtype == torch.float16:
            from spear.kernels.w4 import DECODE_KERNEL_MAX_M, w4_decode

            if x.shape[0] <= DECODE_KERNEL_MAX_M:
                w4_decode(x, packed, out=out)
                return
        out.copy_(self.base(x))


def apply_tp(model: Transformer, rank: int | None = None, world: int | None = None) -> Transformer:
    """Shard `model` in place for this rank (default: torch.distributed's rank and world size).

    Call it before `SpearLinear.use_kernels`. Afterwards `model.args` describes this rank's
    shard (heads per rank), so a KV cache built from it holds this rank's KV heads.
    """
    rank = dist.get_rank() if rank is None else rank
    world = dist.get_world_size() if world is None else world
    args = model.args
    for what, n in (("attention heads", args.n_heads), ("KV heads", args.n_kv_heads), ("MLP features", args.intermediate)):
        if n % world:
            raise SpearError(f"{n} {what} do not split over {world} ranks; pick a TP size that divides {n}")
    if any(layer.attention.wq is None or layer.feed_forward.w_gate is None for layer in model.layers):
        raise SpearError("tensor parallelism does not split a checkpoint's fused qkv_proj / gate_up_proj (Phi-3) "
                         "yet; serve it with --tp 1")
    for layer in model.layers:
        a, f = layer.attention, layer.feed_forward
        a.wq, a.wk, a.wv = (column_shard(m, rank, world) for m in (a.wq, a.wk, a.wv))
        a.wo = RowParallelLinear(a.wo, rank, world)
        a.n_heads, a.n_kv_heads = args.n_heads // world, args.n_kv_heads // world
        f.w_gate, f.w_up = column_shard(f.w_gate, rank, world), column_shard(f.w_up, rank, world)
        f.w_down = RowParallelLinear(f.w_down, rank, world)
    model.args = dataclasses.replace(args, n_heads=args.n_heads // world, n_kv_heads=args.n_kv_heads // world)
    return model


def set_reduction(model: Transformer, reduction: Reduction, max_rows: int = 32) -> None:
    """Reduce the row-parallel layers collectively (baseline) or through symmetric memory (SPEAR, CUDA: "symmetric"
    with one all-reduce, or "p2p" with the W4 epilogue writing to the peers; p2p needs the packed W4 kernels).

    `max_rows`: the most token rows one step reduces through symmetric memory (the decode
    batch); larger steps (prefill) fall back to the collectives. Collective on every rank.
    """
    if reduction != "collective" and model.device.type != "cuda":
        raise SpearError(f"the {reduction} reduction needs CUDA; use 'collective' on CPU")
    for m in model.modules():
        if isinstance(m, RowParallelLinear):
            if reduction == "collective":
                m.reduce = CollectiveReduce()
            elif reduction == "symmetric":
                m.reduce = SymmetricReduce.create(max_rows, m.out_features + (0 if m.ec is None else m.ec.rank),
                                                  model.device)
            else:  # u_r's columns padded to the kernel's rank (packed_a)
                m.reduce = PeerReduce.create(max_rows, m.out_features + (0 if m.ec is None else m.ec.padded_rank),
                                             model.device)
            m.fold_norm = options.OPTIONS.fold_norm_tp  # read once, here


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, cuda: bool, fn: Callable, args: tuple) -> None:
    os.environ.update(TP_ENV)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank) if cuda else None)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, world: int, *args, cuda: bool | None = None) -> None:
    """Run fn(*args) in `world` new processes, one per rank, with torch.distributed initialised.

    NCCL with one GPU per rank when `cuda` (default: where CUDA is present), else gloo on the
    CPU. `fn` must be importable (a module-level function). SIGTERM or SIGINT to this process
    is passed on to the ranks as SIGTERM. A SpearError on any rank is raised here as one; any
    other exception as torch's ProcessRaisedException.
    """
    import torch.multiprocessing as mp
    from torch.multiprocessing import ProcessRaisedException

    cuda = torch.cuda.is_available() if cuda is None else cuda
    if cuda and torch.cuda.device_count() < world:
        raise SpearError(f"--tp {world} needs {world} GPUs, found {torch.cuda.device_count()}")
    os.environ.update(TP_ENV)
    context = mp.spawn(_rank_main, args=(world, _free_port(), cuda, fn, args), nprocs=world, join=False)
    try:
        with _forward_signals([p.pid for p in context.processes]):
            while not context.join(grace_period=GRACE_SECONDS):
                pass
    except ProcessRaisedException as e:
        kind, _, message = e.msg.rstrip().rpartition("\n")[2].partition(": ")  # the traceback's last line
        if kind == f"{SpearError.__module__}.{SpearError.__qualname__}":
            raise SpearError(message) from None
        raise


@contextmanager
def _forward_signals(pids: list[int]):
    """While the ranks run, SIGTERM / SIGINT to the launcher become SIGTERM to every rank (no orphans)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, frame) -> None:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
