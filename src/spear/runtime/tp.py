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
The reduction has two implementations, chosen per model with `set_reduction`:

  "collective" (the baseline): all_reduce(y) and a separate all_reduce(u), NCCL (gloo on CPU).
  "symmetric"  (the SPEAR path, CUDA): y_r and u_r are packed into one PyTorch symmetric-memory
               buffer of the layer, [y_r | u_r], reduced by ONE one-shot all-reduce (every rank
               reads its peers' buffers over NVLink), then split. Rows beyond the buffer's size
               (prefill) take the collective path. Each layer has its own buffer, so a rank
               never overwrites a buffer a peer may still read: between two uses of it lie the
               other layers' reductions, each a barrier of all ranks.

Future work: the W4 GEMM's epilogue writing y_r and u_r straight into the peers' buffers,
and one kernel that waits, reduces, gates and adds (no separate all-reduce launch, no copy).

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

from spear.compensate.ec import ErrorCompensator
from spear.errors import SpearError
from spear.layer import SpearLinear
from spear.quant.record import QuantizedWeight
from spear.runtime.model import Transformer

# Set in every process before NCCL starts (../shared/GPU.md: multicast is unavailable on the host).
TP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

Reduction = Literal["collective", "symmetric"]
GRACE_SECONDS = 10  # after one rank fails, how long the others may take to end by themselves before SIGTERM


def _rows(t: torch.Tensor | None, rank: int, world: int) -> torch.Tensor | None:
    """This rank's block of dim 0, as its own tensor (the full tensor can be freed)."""
    return None if t is None else t.chunk(world, dim=0)[rank].clone()


def _cols(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim=1)[rank].clone()


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _check_unpacked(lin: nn.Module) -> None:
    if isinstance(lin, SpearLinear) and lin.packed is not None:
        raise SpearError("shard the model (apply_tp) before packing it for the kernels (use_kernels)")


def column_shard(lin: nn.Module, rank: int, world: int) -> nn.Module:
    """The rank's block of output rows of an nn.Linear or SpearLinear (EC: B rows; A, gate replicated)."""
    _check_unpacked(lin)
    if lin.out_features % world:
        raise SpearError(f"{lin.out_features} output features do not split over {world} ranks")
    if isinstance(lin, nn.Linear):
        shard = nn.Linear(lin.in_features, lin.out_features // world, bias=lin.bias is not None, device="meta")
        shard.weight = _param(_rows(lin.weight, rank, world))
        shard.bias = None if lin.bias is None else _param(_rows(lin.bias, rank, world))
        return shard
    q = lin.qweight
    record = QuantizedWeight(_rows(q.codes, rank, world), _rows(q.scales, rank, world), _rows(q.zeros, rank, world),
                             q.bits, q.group_size)
    shard = SpearLinear(record, _rows(lin.bias, rank, world), lin.weight_hat.dtype)
    if lin.ec is not None:
        ec = ErrorCompensator(lin.in_features, shard.out_features, lin.ec.rank)
        ec.A, ec.alpha, ec.gate = lin.ec.A, lin.ec.alpha, lin.ec.gate
        ec.B = _param(_rows(lin.ec.B.detach(), rank, world))
        shard.ec = ec
    return shard


class RankSpaceEC(nn.Module):
    """A row-parallel layer's EC: this rank's columns of A; alpha·B and the gate replicated."""

    def __init__(self, ec: ErrorCompensator, rank: int, world: int, dtype: torch.dtype):
        super().__init__()
        self.rank = ec.rank
        self.register_buffer("A", _cols(ec.A.detach(), rank, world).to(dtype))  # [r, in / world]
        self.register_buffer("B", (ec.alpha.detach().float() * ec.B.detach().float()).to(dtype))  # [N, r]
        gate = [None] * 4 if ec.gate is None else [ec.gate[0].weight, ec.gate[0].bias, ec.gate[2].weight, ec.gate[2].bias]
        for name, t in zip(("W1", "b1", "W2", "b2"), gate):
            self.register_buffer(name, None if t is None else t.detach().to(dtype))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """u_r = x_r A_rᵀ  [M, r]."""
        return x @ self.A.t()

    def epilogue(self, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """y + (alpha·B)(gamma(u) ⊙ u) on the reduced y [M, N] and u [M, r]; in place on CUDA fp16."""
        if y.is_cuda and y.dtype == torch.float16:
            from spear.kernels.ec_epilogue import ec_epilogue

            return ec_epilogue(y, u, self.B, self.W1, self.b1, self.W2, self.b2)
        from spear.kernels.ec_epilogue import ec_epilogue_ref

        return ec_epilogue_ref(y, u, self.B, self.W1, self.b1, self.W2, self.b2)


class CollectiveReduce:
    """The baseline: one all-reduce of y, a separate one of u (NCCL, or gloo on CPU)."""

    def __call__(self, y: torch.Tensor, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        dist.all_reduce(y)
        if u is not None:
            dist.all_reduce(u)
        return y, u


class SymmetricReduce:
    """The SPEAR path: [y_r | u_r] in one symmetric-memory buffer, one one-shot all-reduce (CUDA)."""

    def __init__(self, max_rows: int, width: int, dtype: torch.dtype, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        # float32 staging: torch 2.11's one_shot_all_reduce has no fp16 kernel ("not implemented for 'Half'",
        # seen on the H200 pair); the sum in float32 is also the more exact one.
        self.buffer = symm_mem.empty(max_rows * width, dtype=torch.float32, device=device)  # [max_rows * (N + r)]
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.fallback = CollectiveReduce()

    def __call__(self, y: torch.Tensor, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        n_y = y.numel()
        n = n_y + (0 if u is None else u.numel())
        if n > self.buffer.numel():
            return self.fallback(y, u)
        staged = self.buffer[:n]
        staged[:n_y].view_as(y).copy_(y)
        if u is not None:
            staged[n_y:].view_as(u).copy_(u)
        out = torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name)  # [n] float32, a new tensor
        y_sum = out[:n_y].view(y.shape).to(y.dtype)
        return y_sum, None if u is None else out[n_y:].view(u.shape).to(u.dtype)


class RowParallelLinear(nn.Module):
    """y = reduce(x_r Ŵ_rᵀ) + bias (+ the EC epilogue on the reduced u); `reduce` is set by set_reduction."""

    def __init__(self, lin: nn.Module, rank: int, world: int):
        super().__init__()
        _check_unpacked(lin)
        if lin.in_features % world:
            raise SpearError(f"{lin.in_features} input features do not split over {world} ranks")
        self.in_features, self.out_features = lin.in_features // world, lin.out_features
        self.bias = lin.bias  # added once, after the reduction
        self.ec: RankSpaceEC | None = None
        if isinstance(lin, nn.Linear):
            self.base = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
            self.base.weight = _param(_cols(lin.weight.detach(), rank, world))
        else:
            q = lin.qweight
            if q.group_size != lin.in_features and self.in_features % q.group_size:
                raise SpearError(f"quantization groups of {q.group_size} do not align with the {world}-way split "
                                 f"of {lin.in_features} inputs; use a group size that divides {self.in_features}")
            per_channel = q.group_size == lin.in_features
            scales, zeros = (q.scales, q.zeros) if per_channel else (_cols(q.scales, rank, world), _cols(q.zeros, rank, world))
            record = QuantizedWeight(_cols(q.codes, rank, world), scales.clone(), zeros.clone(), q.bits,
                                     self.in_features if per_channel else q.group_size)
            self.base = SpearLinear(record, None, lin.weight_hat.dtype)
            if lin.ec is not None:
                self.ec = RankSpaceEC(lin.ec, rank, world, lin.weight_hat.dtype)
        self.reduce: CollectiveReduce | SymmetricReduce = CollectiveReduce()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [M, N] partial
        u = None if self.ec is None else self.ec.partial(x)  # [M, r] partial
        y, u = self.reduce(y, u)
        if self.ec is not None:
            y = self.ec.epilogue(y, u)
        return y if self.bias is None else y + self.bias.to(y.dtype)


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
    """Reduce the row-parallel layers collectively (baseline) or through symmetric memory (SPEAR, CUDA).

    `max_rows`: the most token rows one step reduces through symmetric memory (the decode
    batch); larger steps (prefill) fall back to the collectives. Collective on every rank.
    """
    if reduction == "symmetric" and model.device.type != "cuda":
        raise SpearError("the symmetric-memory reduction needs CUDA; use 'collective' on CPU")
    for m in model.modules():
        if isinstance(m, RowParallelLinear):
            width = m.out_features + (0 if m.ec is None else m.ec.rank)
            m.reduce = CollectiveReduce() if reduction == "collective" else SymmetricReduce(max_rows, width, model.dtype, model.device)


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
