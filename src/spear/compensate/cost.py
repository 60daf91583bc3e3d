"""What one error compensator costs the planner, in byte-equivalents.

The planner's marginal allocation takes the rank step with the highest gain per unit of cost
(planner.py); the byte budget is checked apart from the cost. Two cost models:

BytesCost (default): the EC's bytes as stored (A and B in fp16 or int8, gate MLP, alpha), ec_nbytes.

LatencyCost: bytes plus the decode time the EC adds, at an exchange rate of `bytes_per_us`:

    cost_m(r) = bytes_m(r) + bytes_per_us · t_m(r)
    t_m(r)    = t_fixed + t_per_mb · bytes_m(r) / 10⁶          (fused W4+EC kernel at one row over plain W4)
              + t_reduce   if m is row-parallel and tp > 1      (its gate needs the reduced Ax: one more reduction)

t_fixed and t_per_mb are a least-squares fit of the kernel benchmark (`bench/w4_kernels.py` JSON: W4 and W4+EC at
ranks 16–64 on Llama shapes, H200; `fit_latency_cost`). The fixed part makes a module's first rank step dearer
than its later ones, so the plan concentrates on fewer modules as `bytes_per_us` grows. t_reduce is what the
reduction costs where it is not folded into the GEMM epilogue: ~47 µs for a small NCCL all-reduce, ~0 for the
peer-to-peer writes the TP runtime uses (BENCHMARKS §7).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from spear.errors import SpearError
from spear.layer import ec_nbytes  # the formula ErrorCompensator.nbytes() gives; the planner reads it here

ROW_PARALLEL_SUFFIXES = ("o_proj", "down_proj")  # split along their input under TP: they reduce their outputs


class CostModel(Protocol):
    def cost(self, name: str, out_features: int, in_features: int, rank: int, gate_hidden: int,
             factor_bits: int = 16) -> float: ...


@dataclass(frozen=True)
class BytesCost:
    """Cost = bytes of the EC as stored."""

    def cost(self, name: str, out_features: int, in_features: int, rank: int, gate_hidden: int,
             factor_bits: int = 16) -> float:
        return float(ec_nbytes(out_features, in_features, rank, gate_hidden, factor_bits))


@dataclass(frozen=True)
class LatencyCost:
    """Cost = bytes + bytes_per_us · decode µs of the EC (module docstring)."""

    t_fixed_us: float = 0.76  # fit of kernels_h200_m1_1c72e0e, _8b13b_98e7719, _m1_d28e883 (75 points)
    t_per_mb_us: float = 1.99
    bytes_per_us: float = 2.5e5  # exchange rate: 1 µs of decode is worth 250 kB of EC
    tp: int = 1
    t_reduce_us: float = 0.0  # per row-parallel EC at tp > 1 (p2p epilogue: ~0; NCCL all-reduce: ~47)

    def __post_init__(self) -> None:
        if min(self.t_fixed_us, self.t_per_mb_us, self.bytes_per_us, self.t_reduce_us) < 0 or self.tp < 1:
            raise SpearError("latency cost terms must be ≥ 0 and tp ≥ 1")

    def microseconds(self, name: str, out_features: int, in_features: int, rank: int, gate_hidden: int) -> float:
        return self._us(name, ec_nbytes(out_features, in_features, rank, gate_hidden))

    def cost(self, name: str, out_features: int, in_features: int, rank: int, gate_hidden: int,
             factor_bits: int = 16) -> float:
        """Stored bytes (at `factor_bits`) + the time of the bytes the kernels read: fp16 factors either way."""
        nbytes = ec_nbytes(out_features, in_features, rank, gate_hidden, factor_bits)
        read = ec_nbytes(out_features, in_features, rank, gate_hidden)
        return nbytes + self.bytes_per_us * self._us(name, read)

    def _us(self, name: str, nbytes: int) -> float:
        """t_m(r) of the module docstring, from the EC's bytes."""
        reduce = self.t_reduce_us if self.tp > 1 and name.endswith(ROW_PARALLEL_SUFFIXES) else 0.0
        return self.t_fixed_us + self.t_per_mb_us * nbytes / 1e6 + reduce


def fit_latency_cost(paths: list[str | Path], **overrides) -> LatencyCost:
    """LatencyCost with t_fixed and t_per_mb fitted to kernel benchmark JSONs (bench/w4_kernels.py at one row):
    every shape's `us` entries `w4` and `w4_ec_r{rank}`, the EC's time = the difference, against its bytes
    (A and B in fp16, the kernels' measured form has no gate)."""
    rows = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        for shape_rows in data.get("shapes", {}).values():
            for row in shape_rows:
                us, n, k = row["us"], row["N"], row["K"]
                for key, t in us.items():
                    rank = key.removeprefix("w4_ec_r")
                    if key.startswith("w4_ec_r") and rank.isdigit():
                        rows.append((2 * int(rank) * (n + k) / 1e6, t - us["w4"]))
    if len(rows) < 2:
        raise SpearError(f"no W4 / W4+EC timings to fit in {', '.join(map(str, paths))}")
    x = torch.tensor([[1.0, mb] for mb, _ in rows], dtype=torch.float64)
    y = torch.tensor([[t] for _, t in rows], dtype=torch.float64)
    t_fixed, t_per_mb = torch.linalg.lstsq(x, y).solution.flatten().clamp(min=0).tolist()
    return LatencyCost(**{"t_fixed_us": t_fixed, "t_per_mb_us": t_per_mb, **overrides})
