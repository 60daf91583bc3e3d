"""The W4 tuner's choices on disk, so that a later process on the same GPU does not time the candidates again
(`kernels.w4.tune_w4`; the file's entries: key → {"kind": config class name, "fields": its fields, "fastest_us":
the fastest candidates' median µs and fields, for reading only}).

The key holds the GPU's name, the Triton and torch versions, a hash of the kernel code (`code_hash`: comments
and docstrings do not count) and the switches off their defaults (kernels.options; any of them can change the
winner), then the tuner's own key (shape, row bucket, EC rank). A stale or corrupt entry is timed
again, never trusted: its fields must be the config class's, and the config one of the current candidates.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch

from spear.kernels import options

_warned = False  # an unwritable cache is reported once per process


def path() -> Path | None:
    """$SPEAR_TUNE_CACHE ("0": no cache), else w4_tuning.json in $SPEAR_CACHE, else in $XDG_CACHE_HOME/spear
    or ~/.cache/spear."""
    env = os.environ.get("SPEAR_TUNE_CACHE")
    if env == "0":
        return None
    if env:
        return Path(env).expanduser()
    if os.environ.get("SPEAR_CACHE"):
        return Path(os.environ["SPEAR_CACHE"]) / "w4_tuning.json"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spear" / "w4_tuning.json"


def code_hash(*files: Path) -> str:
    """12 hex digits of sha256 over the files' code as ast.unparse writes it without docstrings: editing a comment
    or a docstring keeps the hash (and the tuned choices)."""
    digest = hashlib.sha256()
    for file in files:
        tree = ast.parse(file.read_text())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        digest.update(ast.unparse(tree).encode())
    return digest.hexdigest()[:12]


@functools.cache
def _kernel_hash() -> str:
    return code_hash(*sorted((Path(__file__).parent / "w4").glob("*.py")))


def key(device: torch.device, tune_key: tuple, source: str | None = None) -> str:
    """The entry's key; `source` names the kernel code and its hash (default the W4 kernels', kernels/w4/)."""
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    switches = options.OPTIONS.changed() or "default switches"
    return (f"{name}|triton {triton.__version__}|torch {torch.__version__}|{source or f'w4 {_kernel_hash()}'}|"
            f"{switches}|" + ",".join(map(str, tune_key)))


def read(file: Path) -> dict:
    """The file's entries; a missing, unreadable or corrupt file reads as empty."""
    try:
        entries = json.loads(file.read_text())
    except (OSError, ValueError):  # ValueError: bad JSON or bad UTF-8
        return {}
    return entries if isinstance(entries, dict) else {}


def config(entry: object, classes: tuple[type, ...], candidates: list) -> object | None:
    """A cached choice rebuilt as one of `classes`; None where it is stale (fields not the class's, or no longer
    one of `candidates`)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("fields"), dict):
        return None
    cls = next((c for c in classes if c.__name__ == entry.get("kind")), None)
    if cls is None or set(entry["fields"]) != {f.name for f in dataclasses.fields(cls)}:
        return None
    cfg = cls(**entry["fields"])
    return cfg if cfg in candidates else None


def write(file: Path, new: dict[str, object], fastest: dict[str, list] | None = None) -> None:
    """Merge `new` (key → config dataclass) into the file, atomically (a temp file beside it, then os.replace);
    where it cannot be written, warn once and go on: the cache never fails tuning. `fastest` (key → the fastest
    candidates' (µs, config)) is kept beside each choice, to read how close the race was; nothing reads it back."""
    global _warned
    entries = read(file)
    for k, cfg in new.items():
        entries[k] = {"kind": type(cfg).__name__, "fields": dataclasses.asdict(cfg)}
        if fastest and k in fastest:
            entries[k]["fastest_us"] = [[us, dataclasses.asdict(c)] for us, c in fastest[k]]
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".tmp", dir=file.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(tmp, file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        if not _warned:
            _warned = True
            warnings.warn(f"W4 tuning cache {file} not written ({e}); set SPEAR_TUNE_CACHE to another file, "
                          "or to 0 for none", stacklevel=3)
