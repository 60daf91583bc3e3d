"""Programmatic dependent launch (PDL, sm_90+): a launch may start while the launch before it on the stream is
still running, so that the gap between two kernels (launch, the first loads' latency, the last wave's tail) is
hidden (the W4 kernel can also stream its first weights from HBM into L2 before its input exists: W4Launch).

The contract every PDL launch keeps (CUDA programming guide, "Programmatic Dependent Launch"):
- before `griddepcontrol.wait` a program reads only what no kernel writes (weights) and writes nothing;
- every program executes the wait, so a launch completes only after the one before it has completed, and a
  chain of PDL launches stays ordered;
- `griddepcontrol.launch_dependents` after the wait (the W4 kernel: after its main loops): the next launch may
  start once every program of this one has passed it (one launch of lookahead, never more).
- one exception, by construction: a launch whose programs all call `launch_dependents` only after their own wait
  (the prefill rank programs, w4.py's `_ec_rank_programs_kernel`) lets the next launch (the tile GEMM) read that
  launch's inputs before its wait too: they were written before its dependent could start.

Off under the Triton interpreter and before sm_90; kernels.options's `pdl` (SPEAR_PDL=0) turns it off.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from spear.kernels import options


@functools.cache
def _triton_launches_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # no NVIDIA backend in this triton build
        return False
    return "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)} and hasattr(tl.extra.cuda, "gdc_wait")


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def runs_compiled(x: torch.Tensor) -> bool:
    """Whether a launch on x runs compiled code (inline PTX and griddepcontrol included), not the Triton interpreter."""
    return x.device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def uses_pdl(x: torch.Tensor) -> bool:
    """Whether launches on x's device go as programmatic dependent launches (compiled code on sm_90+)."""
    return (runs_compiled(x) and options.OPTIONS.pdl and _triton_launches_pdl()
            and _device_has_pdl(x.device.index if x.device.index is not None else torch.cuda.current_device()))


def launch_options(x: torch.Tensor) -> dict:
    """The keyword arguments of a launch that takes a `PDL: tl.constexpr`: both it and triton's launch_pdl."""
    return {"PDL": True, "launch_pdl": True} if uses_pdl(x) else {"PDL": False}


@dataclasses.dataclass(frozen=True)
class W4Launch:
    """How the W4 decode kernel uses PDL (kernels.options: pdl_late, pdl_late_gemv, w4_preload): late, let
    the next launch start after the main loops (else right after the wait) on launches of the dot loop; late_gemv,
    the same on launches of the GEMV loop (a few rows). Both release late by default. Early releases were timed
    releases twice on Llama-2-7B W4, each arm twice in alternating order, and the two calls disagree. S20D (every
    launch early): 1.97 ms at batch 1 against 2.04 late, but 2.92-3.00 at batch 8 against 2.87. S20E (the GEMV loop
    alone early): 2.01 against 1.96-1.97 late. So there is no default change. An L2 prefetch of each tile's first
    codes before the wait and of the next weights while attention runs were refuted and
    removed (bench/NOTES-kernels.md; the code is at 3a42402)."""

    late: bool
    preload: bool  # the single-stage GEMV loops load each step's codes a step ahead, the first before the wait
    late_gemv: bool = True


def w4_launch() -> W4Launch:
    o = options.OPTIONS
    return W4Launch(o.pdl_late, o.w4_preload, o.pdl_late_gemv)


@triton.jit
def pdl_enter(PDL: tl.constexpr, LATE: tl.constexpr = False):
    """Wait for the launch before this one (its writes are then visible), then (unless LATE: pdl_release later)
    let the next one start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if not LATE:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next launch start (it may once every program has called this or exited)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
