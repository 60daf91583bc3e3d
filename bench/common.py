"""Shared by the benchmark scripts: the provenance block every results JSON carries."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

import torch


def provenance() -> dict:
    # The device machine's copy of the tree may carry a stale .git: pass SPEAR_COMMIT=$(git rev-parse HEAD).
    commit = os.environ.get("SPEAR_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    import transformers

    info["transformers"] = transformers.__version__
    return info


def write_json(path: str | Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"provenance": provenance(), **payload}, indent=2))
    tmp.rename(path)
