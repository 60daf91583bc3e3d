"""Small shared helpers: atomic directory writes, cache location, versions."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator


def stage_done(stage: str, seconds: float, show: bool = True) -> None:
    """One stderr line as a long command finishes a stage ("spear: spectra done in 39.1 s, GPU peak 31.2 GiB"), so
    that a run cut short still says how far it got and what each stage cost. On CUDA the peak is the stage's own:
    torch's allocated high-water mark, reset for the next stage."""
    if not show:
        return
    import torch

    peak = ""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak = f", GPU peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        torch.cuda.reset_peak_memory_stats()
    print(f"spear: {stage} done in {seconds:.1f} s{peak}", file=sys.stderr, flush=True)


def cache_dir(*parts: str) -> Path:
    """~/.cache/spear/... (or $SPEAR_CACHE/...), created on demand."""
    root = Path(os.environ.get("SPEAR_CACHE", Path.home() / ".cache" / "spear"))
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def atomic_dir(target: str | Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temp dir beside `target`; on success it replaces `target`, on error it is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            if not overwrite:
                raise FileExistsError(target)
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def text_config(model):
    """The config of `model`'s language model (a multimodal model's text part; the config itself elsewhere)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def versions() -> dict[str, str]:
    import torch
    import transformers

    import spear

    return {"spear": spear.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


@functools.cache
def _libc():
    """The C library, once: ctypes.util.find_library runs ldconfig in a subprocess each time it is asked."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS (glibc's malloc_trim; nothing elsewhere). Loading frees many
    large tensors (records once packed, a layer's floats once quantized), and glibc keeps what it freed in the
    process: a 1.2B model served on a CPU sat at 4.1 GB of RSS where its tensors take 3.0 (bench/memory.py)."""
    import gc

    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
