"""The EC planner: which modules get an error compensator, at what rank, within a byte budget.

1. Damage distribution p_m = d_m / Σ d, normalised entropy H = −Σ p log p / log n ∈ [0, 1].
2. Mode ("auto"): H < entropy_threshold → "concentrate": the damage sits in few modules, so
   give few modules high rank (ranks concentrate_min..concentrate_max); otherwise "spread":
   many modules at low rank (spread_min..spread_max). "uniform" ignores the damages.
3. Cost-aware ranking: score_m = d_m / κ_m, κ_m = cost of one unit of rank (pluggable cost
   model: bytes by default, measured µs later).
4. Ranks ∝ score, by greedy water-filling: module m's next step r → r' (r' = min rank, then
   +8) has priority score_m / r'; the highest-priority step that still fits the budget is taken.
   So m reaches rank r' when a common level c passes r' / score_m: r_m ≈ c · score_m, capped at
   the mode's max rank, and the total never exceeds the budget.
Ranks are multiples of 8 (kernel tiles). EC bytes are ErrorCompensator.nbytes: fp16 A, B,
gate MLP with biases, and alpha.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from dataclasses import asdict, dataclass
from typing import Protocol

from torch import nn

from spear.compensate.cka import SensitivityTable
from spear.errors import SpearError
from spear.models.layerwise import quantizable_linears
from spear.quant.record import QuantizedWeight

MODES = ("auto", "concentrate", "spread", "uniform")
RANK_STEP = 8


def ec_nbytes(out_features: int, in_features: int, rank: int, gate_hidden: int, bytes_per_param: int = 2) -> int:
    """ErrorCompensator(in, out, rank, gate_hidden).nbytes(): A, B, alpha, gate r→h→r with biases."""
    gate = 2 * rank * gate_hidden + gate_hidden + rank if gate_hidden > 0 else 0
    return (rank * (in_features + out_features) + 1 + gate) * bytes_per_param


def quantized_model_bytes(model: nn.Module, records: dict[str, QuantizedWeight]) -> int:
    """Bytes of the served W4 model: packed quantized linears + fp16 for every other parameter
    (embeddings, norms, biases; a tied weight counts once). `model` may be float or quantized."""
    quantized = {id(m.weight) for n, m in quantizable_linears(model).items() if n in records}
    other = sum(p.numel() for p in model.parameters() if id(p) not in quantized)
    return sum(r.nbytes_packed() for r in records.values()) + 2 * other


class CostModel(Protocol):
    def cost(self, name: str, out_features: int, in_features: int, rank: int, gate_hidden: int) -> float: ...


@dataclass(frozen=True)
class BytesCost:
    """Cost = fp16 bytes of the EC."""

    def cost(self, name: str, out_features: int, in_features: int, rank: int, gate_hidden: int) -> float:
        return float(ec_nbytes(out_features, in_features, rank, gate_hidden))


@dataclass(frozen=True)
class PlannerConfig:
    mode: str = "auto"
    entropy_threshold: float = 0.85  # auto: H below → concentrate, at or above → spread
    concentrate_ranks: tuple[int, int] = (16, 128)  # (min, max) rank of a selected module
    spread_ranks: tuple[int, int] = (8, 16)
    gate_hidden: int = 8  # h of the gate MLP r → h → r; 0: no gate (static EC)
    rank: int | None = None  # fixed rank for every selected module (ablations)
    ignore_budget: bool = False  # with `rank`: every module at that rank, whatever the budget

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SpearError(f"unknown planner mode {self.mode!r}; choose one of {', '.join(MODES)}")
        for lo, hi in (self.concentrate_ranks, self.spread_ranks):
            if not (RANK_STEP <= lo <= hi and lo % RANK_STEP == 0 and hi % RANK_STEP == 0):
                raise SpearError(f"rank range ({lo}, {hi}) must be multiples of {RANK_STEP} with min ≤ max")
        if self.rank is not None and (self.rank < RANK_STEP or self.rank % RANK_STEP):
            raise SpearError(f"EC rank must be a positive multiple of {RANK_STEP}, got {self.rank}")
        if self.ignore_budget and self.rank is None:
            raise SpearError("ignore_budget needs a fixed rank")


@dataclass
class ModulePlan:
    name: str
    rank: int
    gate_hidden: int
    bytes: int
    damage: float


@dataclass
class Plan:
    mode: str  # concentrate | spread | uniform
    entropy: float  # normalised entropy of the damage distribution
    budget_bytes: int
    total_bytes: int
    entries: list[ModulePlan]
    config: PlannerConfig = PlannerConfig()
    seed: int = 0

    def ranks(self) -> dict[str, int]:
        return {e.name: e.rank for e in self.entries}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in d["config"].items()}
        return cls(
            d["mode"], d["entropy"], d["budget_bytes"], d["total_bytes"],
            [ModulePlan(**e) for e in d["entries"]], PlannerConfig(**cfg), d["seed"],
        )


def normalized_entropy(damages: list[float]) -> float:
    """H(p) / log n with p = d / Σ d (negative damages clamp to 0; all-zero → uniform → 1)."""
    n = len(damages)
    if n <= 1:
        return 0.0
    d = [max(x, 0.0) for x in damages]
    total = sum(d)
    if total == 0:
        return 1.0
    return -sum(x / total * math.log(x / total) for x in d if x > 0) / math.log(n)


def plan_ecs(
    table: SensitivityTable,
    shapes: dict[str, tuple[int, int]],
    budget_bytes: int,
    cost_model: CostModel = BytesCost(),
    seed: int = 0,
    cfg: PlannerConfig = PlannerConfig(),
) -> Plan:
    """Choose (module, rank) pairs with total EC bytes ≤ budget_bytes (module docstring)."""
    damage = {e.name: max(e.damage, 0.0) for e in table.entries}
    missing = [n for n in damage if n not in shapes]
    if missing:
        raise SpearError(f"no shape given for {', '.join(missing[:3])}")
    entropy = normalized_entropy(list(damage.values()))
    mode = cfg.mode if cfg.mode != "auto" else ("concentrate" if entropy < cfg.entropy_threshold else "spread")
    names = list(damage)  # model order
    perm = list(range(len(names)))
    random.Random(seed).shuffle(perm)
    tiebreak = dict(zip(sorted(names), perm))  # seeded tie order, independent of input order
    h = cfg.gate_hidden

    def nbytes(name: str, rank: int) -> int:
        return ec_nbytes(*shapes[name], rank, h)

    def max_rank(name: str) -> int:
        return min(shapes[name]) // RANK_STEP * RANK_STEP

    if cfg.rank is not None:
        for n in names:
            if cfg.rank > max_rank(n):
                raise SpearError(f"rank {cfg.rank} exceeds {n} ({shapes[n][0]}×{shapes[n][1]}); pick at most {max_rank(n)}")
    if mode == "uniform":
        ranks = _uniform(names, nbytes, max_rank, budget_bytes, cfg)
    elif cfg.rank is not None and cfg.ignore_budget:
        ranks = {n: cfg.rank for n in names}
    else:
        kappa = {n: cost_model.cost(n, *shapes[n], RANK_STEP, h) / RANK_STEP for n in names}
        score = {n: damage[n] / kappa[n] for n in names}
        lo, hi = cfg.concentrate_ranks if mode == "concentrate" else cfg.spread_ranks
        if cfg.rank is not None:
            lo = hi = cfg.rank
        ranks = _water_fill(names, score, tiebreak, nbytes, max_rank, budget_bytes, lo, hi)

    entries = [ModulePlan(n, r, h, nbytes(n, r), damage[n]) for n, r in ranks.items() if r > 0]  # model order
    total = sum(e.bytes for e in entries)
    return Plan(mode, entropy, budget_bytes, total, entries, cfg, seed)


def _water_fill(names, score, tiebreak, nbytes, max_rank, budget, lo, hi) -> dict[str, int]:
    """Greedy rank steps by priority score / r' (module docstring, step 4)."""
    ranks = {n: 0 for n in names}
    used = 0
    heap = []

    def push(n: str) -> None:
        r = ranks[n]
        nxt = lo if r == 0 else r + RANK_STEP
        if nxt <= min(hi, max_rank(n)) and score[n] > 0:
            heapq.heappush(heap, (-score[n] / nxt, tiebreak[n], n, nxt))

    for n in names:
        push(n)
    while heap:
        _, _, n, nxt = heapq.heappop(heap)
        extra = nbytes(n, nxt) - (nbytes(n, ranks[n]) if ranks[n] else 0)
        if used + extra > budget:
            continue  # this module stays where it is; smaller steps elsewhere may still fit
        ranks[n] = nxt
        used += extra
        push(n)
    return ranks


def _uniform(names, nbytes, max_rank, budget, cfg: PlannerConfig) -> dict[str, int]:
    """Same rank everywhere (cfg.rank, or the largest multiple of 8 that fits on every module);
    if even that does not fit, the same rank on as many evenly spaced modules as fit."""
    if cfg.rank is not None:
        rank = cfg.rank
        if cfg.ignore_budget:
            return {n: rank for n in names}
    else:
        rank = RANK_STEP
        top = max(max_rank(n) for n in names)
        while rank + RANK_STEP <= top and sum(nbytes(n, min(rank + RANK_STEP, max_rank(n))) for n in names) <= budget:
            rank += RANK_STEP
    chosen = {n: min(rank, max_rank(n)) for n in names}
    for k in range(len(names), 0, -1):
        idx = sorted({round(i * (len(names) - 1) / max(k - 1, 1)) for i in range(k)})
        subset = {names[i]: chosen[names[i]] for i in idx}
        if sum(nbytes(n, r) for n, r in subset.items()) <= budget:
            return subset
    return {}
