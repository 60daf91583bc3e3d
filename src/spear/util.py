"""Small shared helpers: atomic directory writes, cache location, versions."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


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


def versions() -> dict[str, str]:
    import torch
    import transformers

    import spear

    return {"spear": spear.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
