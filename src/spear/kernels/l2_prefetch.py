"""Weights read into L2 ahead of their GEMV, beside the latency-bound launches before it (decode steps of few rows).

At one decode row a Llama-2-7B layer's HBM is idle from the end of the q|k|v GEMV to the start of the o GEMV:
RoPE + the K/V write, decode attention and its combine read a few MB in ~10 µs (BENCHMARKS §5's profiles). A warm
launch on a side stream reads the o projection's weight and the first part of each gate|up row meanwhile, so that
those GEMVs find them in L2. Nothing on the main stream waits for it until the end of the step (join), and it reads
weights only, so results never depend on it: a line evicted first comes from HBM as before.

Session 21 first asked L2 for the same bytes by bulk prefetches (cp.async.bulk.prefetch.L2) from the RoPE launch,
before its PDL wait (607c966, S21B). That made the step slower, not faster (Llama-2-7B W4 batch 1 2.04 ms off,
2.27 with o alone, 2.50–2.60 with a share of gate|up too; Llama-3-8B 2.45 against 3.15): the RoPE launch did not
complete before its prefetches had, and they moved about 1 TB/s, so attention waited for them. Here they are plain
loads in a launch of their own, which only the step's end waits for.

Knobs (read once a process): SPEAR_L2_PREFETCH ("1": on, "0": off), SPEAR_L2_PREFETCH_NEXT (the fraction of each
gate|up row read as well, 0 to 1) and SPEAR_L2_PREFETCH_ROWS (the most step rows it is done for: with more,
attention streams the KV cache and the warm launch would compete with it). At most half the L2 is read ahead (a
float 7B o weight alone is 32 MB of the H200's 50): o's rows are cut first to fit, then gate|up's share.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is a dev extra: without it nothing is read ahead (the runtime model imports this)
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
WARM_DEVICES = ("cuda",)  # where it is done (the tests add "cpu": the warm launch then runs in Triton's interpreter)


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


CHUNK = 64 << 10  # a whole weight is read in pieces of this many bytes (rows of a WeightRows), not by its rows


def weight_rows(module: torch.nn.Module | None, fraction: float = 1.0) -> WeightRows | None:
    """The first `fraction` of each row of what a decode launch of `module` streams from HBM: a packed W4 layer's
    codes (its scales and EC are small), else a float weight; None where there is none or nothing to ask for.
    All of it (fraction 1) comes as CHUNK-byte pieces where the size divides (long rows: wide loads a program)."""
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
    L2; a CPU, as in tests: 1 MB). Empty when off, on steps of more than MAX_ROWS rows, or off WARM_DEVICES."""
    if not ENABLED or rows > MAX_ROWS or triton is None or x.device.type not in WARM_DEVICES:
        return ()
    l2 = _l2_bytes(x.device.index or 0) if x.device.type == "cuda" else 2 << 20
    return plan_within(o_proj, gate_up, l2 // 2)


# int32 words a warm program loads a step (32 KB: 8 warps × 32 lanes × 8 16-byte loads), so that one program an SM
# keeps ~4 MB in flight over the GPU, about what HBM's latency needs at full bandwidth
WARM_TILE = 8192
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream | None] = {}
_SINKS: dict[torch.device, torch.Tensor] = {}
_PENDING: set[torch.device] = set()  # devices whose side stream has work the main stream has not joined


def warm_l2(plan: tuple[WeightRows, ...], device: torch.device) -> torch.Tensor | None:
    """Read the plan's bytes into L2 on the device's side stream, once the main stream's work so far is done; the
    main stream goes on at once (join waits for it). One program an SM (4 on CPU). Returns the sink: each region's
    per-program sums of the words read (so that nothing optimizes the loads away), or None for an empty plan."""
    if not plan:
        return None
    programs = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device) if device.type == "cuda" else None
        _SINKS[device] = torch.zeros(4 * programs, dtype=torch.int32, device=device)
    side, sink = _SIDE_STREAMS[device], _SINKS[device]
    if side is None:  # CPU (the interpreter, in tests): the same launch, in order
        _warm(plan, sink, programs)
        return sink
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        _warm(plan, sink, programs)
    _PENDING.add(device)
    return sink


def join(device: torch.device) -> None:
    """Make the main stream wait for the side stream's warm launches (before a CUDA graph's capture ends)."""
    if device in _PENDING:
        torch.cuda.current_stream(device).wait_stream(_SIDE_STREAMS[device])
        _PENDING.discard(device)


def _warm(plan: tuple[WeightRows, ...], sink: torch.Tensor, programs: int) -> None:
    assert len(plan) <= 2 and programs * 2 <= sink.numel(), (len(plan), programs)
    for i, region in enumerate(plan):
        words = region.row_bytes // 4
        block_w = min(WARM_TILE, 1 << (words - 1).bit_length())
        _warm_kernel[(programs,)](region.base.view(torch.int32), region.rows, region.stride // 4, words,
                                  sink[i * programs:], BLOCK_R=max(1, WARM_TILE // block_w), BLOCK_W=block_w,
                                  num_warps=8)


if triton is not None:

    @triton.jit
    def _warm_kernel(base_ptr, rows, stride, words, sink_ptr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
        """Program pid reads rows pid·BLOCK_R .. of every programs·BLOCK_R, the first `words` int32 of each (stride
        apart), through L2 (.cg: not kept in L1), and stores the sum of what it read at sink[pid]."""
        pid, programs = tl.program_id(0), tl.num_programs(0)
        total = tl.zeros((BLOCK_R, BLOCK_W), dtype=tl.int32)
        for r0 in range(pid * BLOCK_R, rows, programs * BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            for c0 in range(0, words, BLOCK_W):
                c = c0 + tl.arange(0, BLOCK_W)
                total += tl.load(base_ptr + r[:, None].to(tl.int64) * stride + c[None, :],
                                 mask=(r[:, None] < rows) & (c[None, :] < words), other=0, cache_modifier=".cg")
        tl.store(sink_ptr + pid, tl.sum(tl.sum(total, axis=1), axis=0))
