"""Weights asked into L2 ahead of their GEMV by the latency-bound launch before it (decode steps of few rows).

At one decode row a Llama-2-7B layer's HBM is idle from the end of the q|k|v GEMV to the start of the o GEMV:
RoPE + the K/V write, decode attention and its combine read a few MB in ~10 µs (BENCHMARKS §5's profiles). The
RoPE launch (ops.rope_write_kv), before its PDL wait, asks L2 for the o projection's weight and the first part of
each gate|up row, so that those GEMVs begin on L2 hits instead of HBM round trips. That keeps kernels.pdl's
contract: before the wait a program reads only weights and writes nothing. A prefetch is a hint nothing waits for:
a line evicted before its GEMV reads it comes from HBM as before, so results never depend on it.

Knobs (read once a process): SPEAR_L2_PREFETCH ("1": on, "0": off), SPEAR_L2_PREFETCH_NEXT (the fraction of each
gate|up row asked for as well, 0 to 1) and SPEAR_L2_PREFETCH_ROWS (the most step rows it is done for: with more,
attention streams the KV cache and the prefetch would compete with it). At most half the L2 is asked for (a float
7B o weight alone is 32 MB of the H200's 50): o's rows are cut first to fit, then gate|up's share.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl

    from spear.kernels.pdl import prefetch_l2, runs_compiled
except ImportError:  # triton is a dev extra: without it nothing is prefetched (the runtime model imports this)
    triton = None


def _fraction(name: str, default: str) -> float:
    text = os.environ.get(name, default)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} is a fraction of each row, 0 to 1; got {text!r}")
    return value


ENABLED = os.environ.get("SPEAR_L2_PREFETCH", "0") == "1"
NEXT_FRACTION = _fraction("SPEAR_L2_PREFETCH_NEXT", "0.25")
MAX_ROWS = int(os.environ.get("SPEAR_L2_PREFETCH_ROWS", "1"))


@dataclass(frozen=True)
class WeightRows:
    """The first `row_bytes` of each of `rows` rows, `stride` bytes apart, of a weight seen as bytes (`base`)."""

    base: torch.Tensor  # uint8 view of the weight, [rows, stride]
    rows: int
    stride: int
    row_bytes: int  # a multiple of 16, at most stride

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


CHUNK = 64 << 10  # a whole weight is asked for in pieces of this many bytes (a bulk prefetch each), not by rows


def weight_rows(module: torch.nn.Module | None, fraction: float = 1.0) -> WeightRows | None:
    """The first `fraction` of each row of what a decode launch of `module` streams from HBM: a packed W4 layer's
    codes (its scales and EC are small), else a float weight; None where there is none or nothing to ask for.
    All of it (fraction 1) comes as CHUNK-byte pieces where the size divides, so that fewer prefetches are issued."""
    packed = getattr(module, "packed", None)
    weight = packed.qweight if packed is not None else getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_contiguous():
        return None
    stride = weight.shape[1] * weight.element_size()
    row_bytes = int(stride * fraction) // 16 * 16
    if row_bytes == 0 or stride % 16 or weight.data_ptr() % 16:
        return None
    total = weight.shape[0] * stride
    if row_bytes == stride and total % CHUNK == 0:
        return WeightRows(weight.view(torch.uint8), total // CHUNK, CHUNK, CHUNK)
    return WeightRows(weight.view(torch.uint8), weight.shape[0], stride, row_bytes)


@functools.cache
def _l2_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).L2_cache_size


def plan_within(o_proj: torch.nn.Module, gate_up: torch.nn.Module | None, budget: int,
                next_fraction: float = NEXT_FRACTION) -> tuple[WeightRows, ...]:
    """o's weight and the first `next_fraction` of each gate|up row, within `budget` bytes: o's rows are cut to
    the budget first, then gate|up's share to what is left. A share of every gate|up row rather than its leading
    rows: a GEMV's programs all start at the front of their rows, so every program gains, none waits on HBM alone."""
    o_full, next_full = weight_rows(o_proj), weight_rows(gate_up)
    o = o_full if o_full is None or o_full.nbytes <= budget else weight_rows(o_proj, budget / o_full.nbytes)
    left = budget - (o.nbytes if o is not None else 0)
    nxt = None
    if next_full is not None and next_fraction > 0:
        nxt = weight_rows(gate_up, min(next_fraction, left / next_full.nbytes))
    return tuple(r for r in (o, nxt) if r is not None)


def prefetch_plan(o_proj: torch.nn.Module, gate_up: torch.nn.Module | None, x: torch.Tensor,
                  rows: int) -> tuple[WeightRows, ...]:
    """What a decode step of `rows` rows on x's device asks into L2 while attention runs (plan_within half the
    L2). Empty when off, on steps of more than MAX_ROWS rows, or where the kernels run interpreted."""
    if not ENABLED or rows > MAX_ROWS or triton is None or not runs_compiled(x):
        return ()
    return plan_within(o_proj, gate_up, _l2_bytes(x.device.index or 0) // 2)


def launch_args(plan: tuple[WeightRows, ...], like: torch.Tensor) -> dict:
    """The keyword arguments of a launch that takes prefetch_regions' parameters (two regions at most)."""
    assert len(plan) <= 2, f"at most two regions a launch, got {len(plan)}"
    args: dict = {"PREFETCH": len(plan)}
    for i in range(2):
        region = plan[i] if i < len(plan) else None
        args[f"pf{i}_ptr"] = region.base if region else like
        args[f"pf{i}_rows"] = region.rows if region else 0
        args[f"pf{i}_stride"] = region.stride if region else 0
        args[f"pf{i}_bytes"] = region.row_bytes if region else 0
    return args


if triton is not None:

    @triton.jit
    def _prefetch_region(base_ptr, rows, stride, row_bytes, pid, programs, LANES: tl.constexpr):
        """Program pid of `programs` asks for rows pid·LANES .. of every programs·LANES (the last rows repeated)."""
        for r0 in range(pid * LANES, rows, programs * LANES):
            r = tl.minimum(r0 + tl.arange(0, LANES), rows - 1).to(tl.int64)
            prefetch_l2(base_ptr + r * stride, row_bytes)

    @triton.jit
    def prefetch_regions(pf0_ptr, pf0_rows, pf0_stride, pf0_bytes, pf1_ptr, pf1_rows, pf1_stride, pf1_bytes, pid,
                         programs, PREFETCH: tl.constexpr):
        """This program's share of up to two WeightRows regions (PREFETCH of them), asked into L2 (nothing waits)."""
        if PREFETCH > 0:  # 32 rows at a time: one a lane of the first warp (prefetch_l2)
            _prefetch_region(pf0_ptr, pf0_rows, pf0_stride, pf0_bytes, pid, programs, 32)
        if PREFETCH > 1:
            _prefetch_region(pf1_ptr, pf1_rows, pf1_stride, pf1_bytes, pid, programs, 32)
