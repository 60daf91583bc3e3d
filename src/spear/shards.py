"""Sharded safetensors, as Hugging Face lays them out: `model.safetensors` when one file holds everything, else
`model-00001-of-0000N.safetensors` ... with `model.safetensors.index.json` mapping each tensor to its file.

ShardWriter takes tensors one at a time and writes a shard whenever the next tensor would pass the size cap, so a
model written layer by layer never has more than one shard's tensors in memory. ShardReader opens the files lazily
and reads one tensor at a time straight onto the device it is asked for (safetensors memory-maps the file), so
loading never holds a second copy of the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from spear.errors import SpearError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' and vLLM's usual cap
# A reader closes its files after this many bytes read: the pages of a memory-mapped file count in the process's
# resident memory while it is open, so a long read would otherwise hold the whole file beside its copies.
REMAP_BYTES = 256 * 1024**2


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ShardWriter:
    """Write tensors into `directory` as shards of at most `max_shard_bytes` (a larger tensor gets a shard alone)."""

    def __init__(self, directory: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, metadata: dict | None = None):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self.metadata = metadata or {}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names), in order
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor_bytes(tensor)
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous().cpu()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        name = f".shard-{len(self._files):05d}.safetensors"
        save_file(self._pending, str(self.directory / name), metadata=self.metadata)
        self._files.append((name, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, give the shards their final names (and the index when there are several)."""
        if self._pending or not self._files:
            self._flush()
        n = len(self._files)
        final = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (tmp, names), name in zip(self._files, final):
            (self.directory / tmp).rename(self.directory / name)
            weight_map.update(dict.fromkeys(names, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
        return [self.directory / name for name in final]


class ShardReader:
    """The tensors of a directory's safetensors (one file or an indexed set), read one at a time."""

    def __init__(self, directory: Path, device: torch.device | str = "cpu"):
        self.directory = Path(directory)
        self.device = str(device)
        self.weight_map = weight_map(self.directory)
        self._handles: dict[str, object] = {}
        self._read_bytes = 0  # since the files were opened

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name` on the reader's device, cast to `dtype` if given (floating tensors only)."""
        file = self.weight_map.get(name)
        if file is None:
            raise SpearError(f"corrupt checkpoint {self.directory}: no tensor {name}")
        try:
            if file not in self._handles:
                self._handles[file] = safe_open(str(self.directory / file), framework="pt", device=self.device)
            tensor = self._handles[file].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise SpearError(f"corrupt or missing weights in {self.directory / file}: {_first_line(e)}") from None
        self._read_bytes += tensor_bytes(tensor)
        if self._read_bytes > REMAP_BYTES:
            self.release()
        return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor

    def release(self) -> None:
        """Close the files (their memory maps count in the process's resident memory until then); the next get
        opens them again."""
        self._handles.clear()
        self._read_bytes = 0

    def get_optional(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return self.get(name, dtype) if name in self else None

    def items(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.weight_map:
            yield name, self.get(name, dtype)


def weight_map(directory: Path) -> dict[str, str]:
    """Tensor name -> file name for the safetensors of `directory`."""
    index = directory / INDEX_FILE
    try:
        if index.is_file():
            return dict(json.loads(index.read_text())["weight_map"])
        if (directory / SINGLE_FILE).is_file():
            with safe_open(str(directory / SINGLE_FILE), framework="pt") as f:
                return dict.fromkeys(f.keys(), SINGLE_FILE)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise SpearError(f"corrupt weight index {index}: {_first_line(e)}") from None
    except (SafetensorError, OSError) as e:
        raise SpearError(f"corrupt or missing weights in {directory / SINGLE_FILE}: {_first_line(e)}") from None
    raise SpearError(f"no weights in {directory}: neither {SINGLE_FILE} nor {INDEX_FILE}")


def safetensors_bytes(directory: Path) -> int:
    """Bytes of the directory's safetensors files on disk."""
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
