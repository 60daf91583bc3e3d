"""Latency tables: measured engine step time over decode batch size × prefill tokens in the step.

A table is measured once per model and device (`profile`) by running synthetic steps
through the real model runner: `b` sequences decoding one token each at a fixed context
length, beside one prompt chunk of `p` tokens. Between grid points the step time is
interpolated bilinearly; outside the grid, or where a corner was not measured, the
table has no answer (None) and its caller falls back to something safe.
The SLO-aware scheduler policy (spear.runtime.slo) reads it.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from spear.errors import SpearError
from spear.layer import SpearLinear
from spear.runtime.kv_cache import Chunk, cdiv
from spear.runtime.runner import ModelRunner

TABLE_FILE = "latency_table.json"
FORMAT = "spear-latency-table"
DEFAULT_BATCH_SIZES = (1, 4, 8, 16, 32)
# Fine below 128: a step's cost jumps where its rows (decodes + prompt tokens) pass a W4 row tile (16, 32, 64,
# 128) and where whole-step graphs give way to graph pieces (EngineConfig.row_graph_tokens); a coarse grid
# interpolates across those jumps and the SLO policy's chunks land on the wrong side of them.
DEFAULT_PREFILL_TOKENS = (0, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass
class LatencyTable:
    batch_sizes: list[int]  # grid rows: decodes in the step, increasing
    prefill_tokens: list[int]  # grid columns: prompt tokens in the step, increasing
    seconds: list[list[float | None]]  # [row][column] median step time; None: not measured
    device: str = ""
    ec_density: float = 0.0  # share of the quantized linears that carry an EC
    decode_context: int = 0  # context length of each decoding sequence while profiling
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, grid in (("batch_sizes", self.batch_sizes), ("prefill_tokens", self.prefill_tokens)):
            if any(b <= a for a, b in itertools.pairwise(grid)):
                raise SpearError(f"latency table {name} must be strictly increasing, got {grid}")
        if len(self.seconds) != len(self.batch_sizes) or any(len(r) != len(self.prefill_tokens) for r in self.seconds):
            raise SpearError(f"latency table is not {len(self.batch_sizes)} x {len(self.prefill_tokens)}")

    def predict(self, num_decodes: int, prefill_tokens: int) -> float | None:
        """Interpolated step seconds; None outside the grid or next to an unmeasured point."""
        row = self._row(num_decodes)
        cols = self.prefill_tokens
        j = bisect.bisect_left(cols, prefill_tokens)
        if row is None or j == len(cols) or (j == 0 and prefill_tokens < cols[0]):
            return None
        if cols[j] == prefill_tokens:
            return row[j]
        if row[j - 1] is None or row[j] is None:
            return None
        w = (prefill_tokens - cols[j - 1]) / (cols[j] - cols[j - 1])
        return (1 - w) * row[j - 1] + w * row[j]

    def max_prefill(self, num_decodes: int, seconds: float) -> float | None:
        """The most prefill tokens P such that every step of up to P tokens is predicted within `seconds`.

        Walks the interpolated row from its first column and stops at the first point over
        budget (interpolating the crossing) or the first unmeasured point; None: no answer.
        """
        row = self._row(num_decodes)
        if row is None or row[0] is None or row[0] > seconds:
            return None
        best = self.prefill_tokens[0]
        for (a, fa), (b, fb) in itertools.pairwise(zip(self.prefill_tokens, row)):
            if fb is None:
                break
            if fb > seconds:
                return a + (seconds - fa) / (fb - fa) * (b - a)
            best = b
        return best

    def _row(self, num_decodes: int) -> list[float | None] | None:
        """The grid row at `num_decodes`, interpolated between the two nearest rows; None outside."""
        rows = self.batch_sizes
        i = bisect.bisect_left(rows, num_decodes)
        if not rows or i == len(rows) or (i == 0 and num_decodes < rows[0]):
            return None
        if rows[i] == num_decodes:
            return self.seconds[i]
        w = (num_decodes - rows[i - 1]) / (rows[i] - rows[i - 1])
        return [None if lo is None or hi is None else (1 - w) * lo + w * hi
                for lo, hi in zip(self.seconds[i - 1], self.seconds[i])]

    def format(self) -> str:
        """The grid as a text table of milliseconds."""
        lines = [f"step ms on {self.device}, EC density {self.ec_density:.2f}, decode context {self.decode_context}",
                 f"{'decodes':>8} " + " ".join(f"{f'+{p} tok':>9}" for p in self.prefill_tokens)]
        for b, row in zip(self.batch_sizes, self.seconds):
            lines.append(f"{b:>8} " + " ".join(f"{'-' if s is None else f'{1e3 * s:.2f}':>9}" for s in row))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    def save(self, path: str | Path) -> Path:
        """Write JSON atomically (temp file + rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> LatencyTable:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SpearError(f"cannot read the latency table {path}: {e}") from None
        if not isinstance(data, dict) or data.pop("format", None) != FORMAT:
            raise SpearError(f"{path} is not a SPEAR latency table; write one with `spear profile`")
        try:
            return cls(**data)
        except TypeError as e:
            raise SpearError(f"malformed latency table {path}: {e}") from None


def profile_model(spec: str, out: str | Path | None = None, batch_sizes=None, prefill_tokens=None,
                  device: torch.device | None = None) -> tuple[LatencyTable, Path]:
    """Profile `spec` with the serving engine's default runner; write the table to `out` (default: in the artifact)."""
    from spear import api
    from spear.artifact import is_artifact
    from spear.runtime.engine import EngineConfig, make_runner
    from spear.runtime.model import build_runtime_model

    if out is None and not is_artifact(spec):
        raise SpearError(f"{spec} is not a SPEAR artifact directory; give --out FILE for its latency table")
    path = Path(out) if out is not None else Path(spec) / TABLE_FILE
    lm = api.load(spec, device, serving=True)
    config = EngineConfig(max_num_seqs=DEFAULT_BATCH_SIZES[-1])  # the default grid's batches: the KV cache holds them
    runner = make_runner(build_runtime_model(lm.model), config)
    default_batches, default_prefill = default_grid(config.max_num_seqs, runner.max_model_len)
    table = profile(runner, batch_sizes or default_batches, prefill_tokens or default_prefill)
    return table, table.save(path)


def default_grid(max_num_seqs: int, max_model_len: int) -> tuple[list[int], list[int]]:
    """The default grid cut to what an engine runs: batch sizes up to max_num_seqs (itself included),
    prefill chunks up to half the context."""
    batches = sorted({b for b in DEFAULT_BATCH_SIZES if b < max_num_seqs} | {max_num_seqs})
    return batches, [p for p in DEFAULT_PREFILL_TOKENS if p <= max_model_len // 2]


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def ec_density(model: torch.nn.Module) -> float:
    """The share of the model's SpearLinear layers that carry an error compensator."""
    linears = [m for m in model.modules() if isinstance(m, SpearLinear)]
    return sum(m.has_ec for m in linears) / len(linears) if linears else 0.0


def profile(runner: ModelRunner, batch_sizes=DEFAULT_BATCH_SIZES, prefill_tokens=DEFAULT_PREFILL_TOKENS,
            decode_context: int | None = None, warmup: int = 2, repeats: int = 5) -> LatencyTable:
    """Measure the runner's step time over the grid: median of `repeats` timed steps after `warmup`.

    Run it before serving: the synthetic sequences write K/V into the cache's blocks
    (garbage for timing only) without the engine's allocator knowing.
    Point (0 decodes, 0 prefill tokens) is no step at all and is left unmeasured.
    A point with a prefill chunk and max_num_seqs decodes measures max_num_seqs − 1 decodes beside it (the
    engine's most).
    Decoding sequences sit at `decode_context` tokens (default: 256, at most a quarter of the context).
    """
    if decode_context is None:
        decode_context = min(256, runner.max_model_len // 4)
    batch_sizes, prefill_tokens = sorted(set(batch_sizes)), sorted(set(prefill_tokens))
    if not batch_sizes or batch_sizes[0] < 0 or not prefill_tokens or prefill_tokens[0] < 0:
        raise SpearError("profile needs non-empty grids of non-negative batch sizes and prefill token counts")
    if warmup < 0 or repeats < 1:
        raise SpearError(f"profile needs warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    block_size = runner.cache.block_size
    if decode_context + 1 > runner.max_model_len or prefill_tokens[-1] > runner.max_model_len:
        raise SpearError(f"the profiling grid (decode context {decode_context}, prefill {prefill_tokens[-1]}) "
                         f"exceeds the runner's context of {runner.max_model_len} tokens")
    per_decode = cdiv(decode_context + 1, block_size)
    needed = batch_sizes[-1] * per_decode + cdiv(prefill_tokens[-1], block_size)
    if needed > runner.cache.num_blocks - 1:
        raise SpearError(f"the profiling grid needs {needed} KV blocks, the cache has {runner.cache.num_blocks - 1}; "
                         f"use smaller batch sizes, prefill chunks or decode context")
    decode_tables = [list(range(1 + i * per_decode, 1 + (i + 1) * per_decode)) for i in range(batch_sizes[-1])]
    prefill_table = list(range(1 + batch_sizes[-1] * per_decode, 1 + needed))
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model.args.vocab

    def step_seconds(b: int, p: int) -> float | None:
        if b == 0 and p == 0:
            return None
        if p:  # the engine never runs more than max_num_seqs sequences: a prompt displaces a decode
            b = min(b, runner.max_num_seqs - 1)
        chunks = [Chunk([int(t)], decode_context, decode_tables[i]) for i, t in enumerate(torch.randint(vocab, (b,), generator=gen))]
        if p:
            chunks.append(Chunk(torch.randint(vocab, (p,), generator=gen).tolist(), 0, prefill_table))
        times = []
        for k in range(warmup + repeats):
            start = time.perf_counter()
            runner.forward(chunks).argmax(-1).tolist()  # the host waits for the device, as the sampler does
            if k >= warmup:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    seconds = [[step_seconds(b, p) for p in prefill_tokens] for b in batch_sizes]
    return LatencyTable(batch_sizes, prefill_tokens, seconds, device_name(runner.cache.device), ec_density(runner.model),
                        decode_context,
                        {"warmup": warmup, "repeats": repeats, "dtype": str(runner.model.dtype),
                         "cuda_graphs": bool(runner.graphs)})
