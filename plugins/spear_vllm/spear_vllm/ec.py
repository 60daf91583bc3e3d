"""The EC term of one vLLM linear on one tensor-parallel rank; plain PyTorch (no vLLM import), so spear's
tests check it against spear.layer.ErrorCompensator without vLLM installed.

A vLLM linear may fuse several of the checkpoint's linears (q|k|v as qkv_proj, gate|up as gate_up_proj);
each part i has its own EC, and the term is their outputs side by side:

    y_i = alpha_i B_i (gamma_i(u_i) ⊙ u_i),   u_i = A_i x,   gamma_i(u) = 1 + tanh(W2 silu(W1 u + b1) + b2)

Tensor parallelism follows vLLM's sharding of the base weight:
  column-parallel (qkv, gate_up): x is whole on every rank and the rank owns some output rows, so it keeps
      all of A_i and B_i's rows of its shard; u_i is computed whole on every rank, nothing is communicated.
  row-parallel (o, down): x is split along its inputs and the layer sums its outputs over ranks, so the rank
      keeps A_i's columns of its input shard, u_i is all-reduced before the gate (gamma is nonlinear: it
      needs the whole A x), and rank 0 alone adds the term, which the layer's own all-reduce then sums once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

GATE_KEYS = ("gate.0.weight", "gate.0.bias", "gate.2.weight", "gate.2.bias")  # W1, b1, W2, b2


@dataclass(frozen=True)
class Shard:
    """The part of one EC a rank holds: B's rows [rows) (its output features), A's columns [cols) (its inputs)."""

    rows: tuple[int, int]
    cols: tuple[int, int]


def rank_shards(kind: str, rank: int, widths: list[int], in_features: int, kv_replicas: int = 1) -> list[Shard]:
    """Each fused part's shard on `rank`, as vLLM shards the base weight: `widths` are the parts' output widths on
    the rank, `in_features` the inputs the rank sees. kind: "row" (o, down), "qkv" (k and v heads replicated over
    `kv_replicas` ranks), "column" (gate_up and other column-parallel linears) or "replicated"."""
    if kind == "row":
        return [Shard((0, w), (rank * in_features, (rank + 1) * in_features)) for w in widths]
    cols = (0, in_features)
    if kind == "qkv":
        kv = rank // kv_replicas
        return [Shard((i * w, (i + 1) * w), cols) for i, w in zip((rank, kv, kv), widths)]
    if kind == "column":
        return [Shard((rank * w, (rank + 1) * w), cols) for w in widths]
    return [Shard((0, w), cols) for w in widths]


def shard_ec(tensors: dict[str, torch.Tensor], shard: Shard) -> dict[str, torch.Tensor]:
    """An EC's tensors (A, B, alpha, gate.*, as spear names them under `<linear>.ec.`) cut to one rank's shard."""
    (r0, r1), (c0, c1) = shard.rows, shard.cols
    return tensors | {"A": tensors["A"][:, c0:c1], "B": tensors["B"][r0:r1]}


class ECPart(nn.Module):
    """One part's B, alpha and gate (its A lives in FusedEC's stacked A)."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
        super().__init__()
        self.register_buffer("B", tensors["B"].to(dtype).contiguous())
        self.register_buffer("alpha", tensors["alpha"].to(dtype).reshape(()))
        self.gated = all(k in tensors for k in GATE_KEYS)
        for i, key in enumerate(GATE_KEYS if self.gated else ()):
            self.register_buffer(f"gate{i}", tensors[key].to(dtype).contiguous())

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        if self.gated:
            h = F.silu(F.linear(u, self.gate0, self.gate1))
            u = u * (1 + torch.tanh(F.linear(h, self.gate2, self.gate3)))  # gamma(u) ⊙ u
        return self.alpha * (u @ self.B.t())


class FusedEC(nn.Module):
    """The EC term of a (possibly fused) linear on one rank: the parts in output order, None where a part has no EC.

    `widths` are the parts' output widths on this rank; `reduce` (row-parallel) all-reduces u over the ranks;
    `adds` is False on the row-parallel ranks other than 0, which take part in the reduction but add nothing.
    """

    def __init__(self, parts: list[dict[str, torch.Tensor] | None], widths: list[int], dtype: torch.dtype,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, adds: bool = True):
        super().__init__()
        if len(parts) != len(widths) or all(p is None for p in parts):
            raise ValueError("FusedEC needs one entry per part and at least one EC")
        self.register_buffer("A", torch.cat([p["A"] for p in parts if p is not None]).to(dtype).contiguous())
        self.ecs = nn.ModuleList(ECPart(p, dtype) for p in parts if p is not None)
        self.layout: list[tuple[int, int, int] | int] = []  # per part: (rank start, rank end, ec index) or its width
        start, k = 0, 0
        for part, width in zip(parts, widths):
            if part is None:
                self.layout.append(width)
                continue
            r = part["A"].shape[0]
            if part["B"].shape[0] != width:
                raise ValueError(f"EC B has {part['B'].shape[0]} rows for a part of width {width}")
            self.layout.append((start, start + r, k))
            start, k = start + r, k + 1
        self.reduce = reduce
        self.adds = adds

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        u = x @ self.A.to(x.dtype).t()  # [..., sum of ranks]
        if self.reduce is not None:
            u = self.reduce(u)
        if not self.adds:
            return None
        out = []
        for entry in self.layout:
            if isinstance(entry, int):
                out.append(x.new_zeros(*x.shape[:-1], entry))
            else:
                r0, r1, i = entry
                out.append(self.ecs[i](u[..., r0:r1]).to(x.dtype))
        return out[0] if len(out) == 1 else torch.cat(out, dim=-1)
