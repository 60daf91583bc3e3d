"""Sharded safetensors, as Hugging Face lays them out: `model.safetensors` when one file holds everything, else
`model-00001-of-0000N.safetensors` ... with `model.safetensors.index.json` mapping each tensor to its file.

ShardWriter takes tensors one at a time and writes a shard whenever the next tensor would pass the size cap, so a
model written layer by layer never has more than one shard's tensors in memory; it returns each shard's sha256 (what
`sha256sum` prints, and the Hugging Face Hub's LFS oid), which check_sha256 checks. ShardReader reads one tensor at a
time with plain file reads (the files' headers parsed once) and moves it to the device it is asked for, so loading
never holds a second copy of the model, nor the files' pages.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from spear.errors import SpearError, first_line

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' and vLLM's usual cap


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
        self._files: list[tuple[str, list[str], str]] = []  # (temporary file name, tensor names, sha256), in order
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
        self._files.append((name, list(self._pending), file_sha256(self.directory / name)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> dict[str, str]:
        """Write the last shard, give the shards their final names (and the index when there are several); each
        shard's sha256 by its name."""
        if self._pending or not self._files:
            self._flush()
        n = len(self._files)
        final = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map, sha256 = {}, {}
        for (tmp, names, digest), name in zip(self._files, final):
            (self.directory / tmp).rename(self.directory / name)
            weight_map.update(dict.fromkeys(names, name))
            sha256[name] = digest
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
        return sha256


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read a MiB at a time (hashlib lets other threads run while it hashes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(directory: Path, sha256: dict[str, str]) -> None:
    """SpearError, one line naming the file, where a file of `directory` has not the sha256 `sha256` records for it
    (file name -> hex digest)."""
    for name, expected in sha256.items():
        path = Path(directory) / name
        try:
            actual = file_sha256(path)
        except OSError as e:
            raise SpearError(f"corrupt or missing weights in {path}: {first_line(e)}") from None
        if actual != expected:
            raise SpearError(f"corrupt weights: {path} does not match the sha256 that "
                             f"{Path(directory) / 'config.json'} records; restore the file, or re-create the artifact")


class Sha256Check(threading.Thread):
    """check_sha256 on a thread of its own, started before a load and waited for after it: file reads and hashlib let
    the loading thread run meanwhile, so the files hash on another core while their tensors load."""

    def __init__(self, directory: Path, sha256: dict[str, str]):
        super().__init__(daemon=True)  # an interrupted load does not wait for it
        self.directory, self.sha256 = directory, sha256
        self.error: SpearError | None = None

    def run(self) -> None:
        try:
            check_sha256(self.directory, self.sha256)
        except SpearError as e:
            self.error = e

    def result(self) -> None:
        """Wait for the check; its SpearError where a file is not as recorded."""
        self.join()
        if self.error is not None:
            raise self.error


# safetensors' dtype names (the format's header) -> torch dtypes
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file: its dtype and shape, and its bytes [begin, end) of the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of a safetensors file from its header alone (8 bytes of length, then JSON), checked against
    the file's size; SpearError (one line) for anything that is not such a file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        entries = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            begin, end = meta["data_offsets"]
            entry = TensorEntry(meta["dtype"], tuple(meta["shape"]), 8 + length + begin, 8 + length + end)
            if entry.dtype not in DTYPES or entry.end > size or \
                    entry.end - entry.begin != entry.numel * DTYPES[entry.dtype].itemsize:
                raise ValueError(f"tensor {name} does not fit its dtype, shape or the file")
            entries[name] = entry
        return entries
    except (OSError, ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError) as e:
        raise SpearError(f"corrupt or missing weights in {path}: {first_line(e)}") from None


class ShardReader:
    """The tensors of a directory's safetensors (one file or an indexed set), read one at a time: each read into
    memory of its own with plain file reads, so the process holds the tensors it keeps and nothing of the files
    (a memory map's pages count in the resident memory, which would hold the whole file beside its copies)."""

    def __init__(self, directory: Path, device: torch.device | str = "cpu"):
        self.directory = Path(directory)
        self.device = torch.device(device)
        self.weight_map = weight_map(self.directory)
        self._headers: dict[str, dict[str, TensorEntry]] = {}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def entry(self, name: str) -> TensorEntry:
        file = self.weight_map.get(name)
        if file is None:
            raise SpearError(f"corrupt checkpoint {self.directory}: no tensor {name}")
        if file not in self._headers:
            self._headers[file] = read_header(self.directory / file)
        if name not in self._headers[file]:
            raise SpearError(f"corrupt checkpoint {self.directory}: {file} has no tensor {name}")
        return self._headers[file][name]

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name` on the reader's device, cast to `dtype` if given (floating tensors only)."""
        entry, path = self.entry(name), self.directory / self.weight_map[name]
        tensor = torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
        try:
            with open(path, "rb") as f:
                f.seek(entry.begin)
                if f.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) != entry.end - entry.begin:
                    raise OSError("file shorter than its header says")
        except OSError as e:
            raise SpearError(f"corrupt or missing weights in {path}: {first_line(e)}") from None
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        return tensor.to(self.device)

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
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise SpearError(f"corrupt weight index {index}: {first_line(e)}") from None
    if (directory / SINGLE_FILE).is_file():
        return dict.fromkeys(read_header(directory / SINGLE_FILE), SINGLE_FILE)
    raise SpearError(f"no weights in {directory}: neither {SINGLE_FILE} nor {INDEX_FILE}")


def safetensors_bytes(directory: Path) -> int:
    """Bytes of the directory's safetensors files on disk."""
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))

