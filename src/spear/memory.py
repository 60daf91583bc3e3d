"""Memory up front: each command estimates what it will hold before it loads anything, and refuses a plan that
cannot fit with one line that says what to change, instead of an out-of-memory kill halfway.

The estimates count the tensors a command holds (weights in their compute dtype, dense copies, records at their
bits), not the allocator's slack or activations; `HEADROOM` covers those. On a CPU the budget is the host's
available memory (MemAvailable: free plus reclaimable page cache), on CUDA the device's free memory. What the
process holds already (`process_bytes`: its resident memory, or the CUDA context) is part of a peak, not of the budget.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import torch

from spear.errors import SpearError

HEADROOM = 1.1  # activations, allocator slack, the tokenizer: 10% over the tensors' bytes
# the device memory a process holds beyond its tensors: the CUDA context alone 612 MiB, 678 MiB once cuBLAS and a
# Triton kernel are loaded (H100, torch 2.11; bench/cuda_context.py, memory/cuda_context_h100_0473ab5.json)
CUDA_CONTEXT = 768 * 2**20


def gib(nbytes: float) -> str:
    return f"{nbytes / 1024**3:.1f} GiB"


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can take on `device`: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def process_bytes(device: torch.device) -> int:
    """What this process holds already where `device` counts: the CUDA context on a GPU, else its resident memory
    (/proc/self/statm: the interpreter, torch, transformers' modules imported so far)."""
    if device.type == "cuda":
        return CUDA_CONTEXT
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError, AttributeError):  # no /proc (not Linux)
        return 0


def require(nbytes: int, device: torch.device, what: str, advice: str) -> None:
    """Raise SpearError (one line: what needs how much, what there is, what to change) when `nbytes` with headroom
    does not fit in what `device` has available."""
    need, have = int(nbytes * HEADROOM), available_bytes(device)
    if need > have:
        where = "GPU" if device.type == "cuda" else "host"
        raise SpearError(f"{what} needs about {gib(need)} of {where} memory and {gib(have)} is available: {advice}")


def checkpoint_floats(directory: Path) -> int:
    """Floating-point elements of the safetensors of an HF directory, from the headers alone."""
    from spear.shards import ShardReader

    reader = ShardReader(directory)
    entries = (reader.entry(name) for name in reader.names())
    return sum(e.numel for e in entries if e.dtype in ("F16", "BF16", "F32", "F64"))


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim) after a stage that freed many large CPU
    temporaries (the refit's float64 SVDs): otherwise RSS keeps them and the next stage's peak stacks on top of
    them. Nothing elsewhere (no glibc)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # musl and others: no malloc_trim
        pass
