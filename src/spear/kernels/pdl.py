"""Programmatic dependent launch (PDL, sm_90+) for the decode step's chain of small kernels.

A batch-1 decode step of a 7B model is ~10 launches a layer, most of them a few µs long, and in a CUDA
graph each still pays the gap between one grid draining and the next one being launched and filling the
SMs. With PDL a kernel is launched while its predecessor in the stream still runs: its programs become
resident, optionally start reading what no earlier kernel writes (the W4 weights: `prefetch_l2`), and
wait in `griddepcontrol.wait` until the predecessor has finished and its memory is visible. Each kernel
that takes part calls `enter` before it touches an activation, the KV cache or a workspace:

    wait for the previous grid (complete, memory flushed)  →  let the next grid launch  →  the kernel's work

Triggering the next launch only after the wait keeps at most two grids resident at once, and a kernel
launched without PDL (cuBLAS, a PyTorch op) waits for everything before it as usual, so the order of the
stream's memory effects is unchanged: PDL moves launch latency, not results.

Opt-in: SPEAR_PDL=1 in the environment, or `ENABLED` at run time. Measured on the H200 (session 7,
BENCHMARKS.md §5), Llama-2-7B through the engine: W4 batch 1 2.75 ms/token with it against 2.77 without,
and batches 8 and 32 slower (4.58 / 7.02 against 4.35 / 6.59 ms) — no gain to pay for. Never on CPU (the
interpreter has no griddepcontrol), before sm_90, or with a Triton that lacks `launch_pdl`; timing
(kernels.timing) runs without it so that a launch's time is its own.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is a dev extra
    triton = None

ENABLED = os.environ.get("SPEAR_PDL", "0") == "1"


@functools.cache
def _supported(device_index: int) -> bool:
    if triton is None or not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    if "launch_pdl" not in CUDAOptions.__dataclass_fields__ or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_args(x: torch.Tensor) -> dict:
    """The keyword arguments of a launch on x's device: the kernel's USE_PDL constexpr, and Triton's launch_pdl
    flag where PDL is on."""
    if ENABLED and x.is_cuda and _supported(x.device.index if x.device.index is not None else 0):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


if triton is not None:

    @triton.jit
    def enter(USE_PDL: tl.constexpr):
        """Wait for the previous grid in the stream, then allow the next one to launch (no-ops without PDL)."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs, mask, USE_PDL: tl.constexpr):
        """Ask L2 for the lines at `ptrs` (where `mask`), before `enter`: only for memory no kernel writes."""
        if USE_PDL:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
