"""The EC planner: which modules get an error compensator, at what rank, within a byte budget.

Damage distribution p_m = d_m / Σ d, normalised entropy H = −Σ p log p / log n ∈ [0, 1].

"marginal" (the default, "auto"): rank allocation over every linear by marginal gain per cost.
  The whitened error spectrum σ²_{m,1} ≥ σ²_{m,2} ≥ … of E_m R_xx^{1/2} (QERA's SVD) says how much of
  E_x ‖E_m x‖² rank r captures: Σ_{i≤r} σ²_{m,i}. Module m's damage buys its share of that energy:

      gain_m(r → r+1) = w_m · σ²_{m,r+1} / Σ_i σ²_{m,i},      w_m = d_m^β,  β = 1 / H  (the entropy prior)

  A low entropy (damage in few modules) sharpens the weights, so few modules get high rank
  (concentrate); a flat one (H → 1) leaves them proportional to damage, so many modules share
  the budget at low rank (spread). The step with the highest gain per unit cost (bytes, or any
  CostModel: measured µs) that still fits the budget is taken next; gains fall with rank, so the
  greedy order is the optimal fractional knapsack. Any rank 1..max_rank (the kernels pad).

The fixed-mode ablations ("concentrate", "spread", "uniform"):
  "concentrate" gives few modules high rank (concentrate_ranks), "spread" many modules low rank
  (spread_ranks), by water-filling on score_m = d_m / κ_m (κ_m: cost of one unit of rank): module
  m's next step r → r' (min rank, then +8) has priority score_m / r', the highest-priority step that
  fits is taken, so r_m ≈ c · score_m. "uniform" ignores the damages.
EC bytes are ErrorCompensator.nbytes: fp16 A, B, gate MLP with biases, and alpha.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from torch import nn

from spear.compensate.cka import SensitivityTable
from spear.compensate.cost import BytesCost, CostModel, ec_nbytes
from spear.errors import SpearError
from spear.layer import FACTOR_BITS, factor_bits_text
from spear.models.layerwise import quantizable_linears
from spear.record import QuantizedWeight

if TYPE_CHECKING:
    import torch

MODES = ("auto", "marginal", "concentrate", "spread", "uniform")
RANK_STEP = 8  # rank step of the fixed-mode ablations


def quantized_model_bytes(model: nn.Module, records: dict[str, QuantizedWeight]) -> int:
    """Bytes of the served W4 model: packed quantized linears + fp16 for every other parameter
    (embeddings, norms, biases; a tied weight counts once). `model` may be float or quantized."""
    quantized = {id(m.weight) for n, m in quantizable_linears(model).items() if n in records}
    other = sum(p.numel() for p in model.parameters() if id(p) not in quantized)
    return sum(r.nbytes_packed() for r in records.values()) + 2 * other


@dataclass(frozen=True)
class PlannerConfig:
    mode: str = "auto"  # auto = marginal
    max_rank: int = 64  # marginal: highest rank of one module
    max_beta: float = 4.0  # marginal: cap of the entropy prior's exponent β = 1 / H
    entropy_threshold: float = 0.85  # the fixed modes' rule: H below → concentrate, at or above → spread
    concentrate_ranks: tuple[int, int] = (16, 128)  # (min, max) rank of a selected module
    spread_ranks: tuple[int, int] = (8, 16)
    gate_hidden: int = 8  # h of the gate MLP r → h → r; 0: no gate (static EC)
    # A and B stored in int8 or fp16 (layer.ErrorCompensator): int8 buys ~2× the rank a byte, +1.7 / +2.4 points of
    # the hard case's gap at the defaults (BENCHMARKS §2)
    factor_bits: int = 8
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
        if self.max_rank < 1 or self.max_beta < 1:
            raise SpearError(f"max_rank must be ≥ 1 and max_beta ≥ 1, got {self.max_rank} and {self.max_beta}")
        if self.factor_bits not in FACTOR_BITS:
            raise SpearError(f"EC factors are held in {factor_bits_text()} bits, not {self.factor_bits}")

    @property
    def rank_cap(self) -> int:
        """marginal: the highest rank of one module, max_rank at fp16 factors; in int8, the rank the same bytes
        buy (2× max_rank)."""
        return self.max_rank * 16 // self.factor_bits

    @property
    def allocation(self) -> str:
        """"marginal" or one of the fixed modes."""
        return "marginal" if self.mode in ("auto", "marginal") and self.rank is None else self.mode


@dataclass
class ModulePlan:
    name: str
    rank: int
    gate_hidden: int
    bytes: int
    damage: float


@dataclass
class Plan:
    mode: str  # marginal | concentrate | spread | uniform
    entropy: float  # normalised entropy of the damage distribution
    budget_bytes: int
    total_bytes: int
    entries: list[ModulePlan]
    config: PlannerConfig = PlannerConfig()
    seed: int = 0
    why: str = ""  # one line: what the entropy rule decided and what the allocation gave

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
            [ModulePlan(**e) for e in d["entries"]], PlannerConfig(**cfg), d["seed"], d.get("why", ""),
        )

    def save_rank_plot(self, path, title: str = "EC rank per module") -> None:
        """PNG: rank of each module's EC, decoder layers (x) × module types (one line each)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        by_type: dict[str, dict[int, int]] = {}
        for e in self.entries:
            parts = e.name.split(".")
            layer = next((int(p) for p in parts if p.isdigit()), 0)
            by_type.setdefault(parts[-1], {})[layer] = e.rank
        fig, ax = plt.subplots(figsize=(9, 3.6))
        for t, ranks in by_type.items():
            layers = sorted(ranks)
            ax.plot(layers, [ranks[i] for i in layers], marker="o", markersize=3, linewidth=1, label=t)
        ax.set_xlabel("decoder layer")
        ax.set_ylabel("EC rank")
        ax.set_title(f"{title}: {self.mode}, {len(self.entries)} modules, "
                     f"{self.total_bytes / 1e6:.2f} of {self.budget_bytes / 1e6:.2f} MB, H = {self.entropy:.2f}", fontsize=9)
        ax.legend(fontsize=7, ncol=4)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


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
    spectra: dict[str, "torch.Tensor"] | None = None,
) -> Plan:
    """Choose (module, rank) pairs with total EC bytes ≤ budget_bytes (module docstring).

    `spectra` (module → whitened error spectrum σ², descending; `init.WhitenedError.spectrum`) is what
    the marginal allocation needs; the fixed modes ignore it."""
    damage = {e.name: max(e.damage, 0.0) for e in table.entries}
    missing = [n for n in damage if n not in shapes]
    if missing:
        raise SpearError(f"no shape given for {', '.join(missing[:3])}")
    entropy = normalized_entropy(list(damage.values()))
    names = list(damage)  # model order
    perm = list(range(len(names)))
    random.Random(seed).shuffle(perm)
    tiebreak = dict(zip(sorted(names), perm))  # seeded tie order, independent of input order
    if cfg.allocation == "marginal":
        return _marginal_plan(damage, entropy, tiebreak, shapes, budget_bytes, cost_model, seed, cfg, spectra)
    mode = cfg.mode if cfg.mode not in ("auto", "marginal") else (
        "concentrate" if entropy < cfg.entropy_threshold else "spread")
    h = cfg.gate_hidden

    def nbytes(name: str, rank: int) -> int:
        return ec_nbytes(*shapes[name], rank, h, cfg.factor_bits)

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
        kappa = {n: cost_model.cost(n, *shapes[n], RANK_STEP, h, cfg.factor_bits) / RANK_STEP for n in names}
        score = {n: damage[n] / kappa[n] for n in names}
        lo, hi = cfg.concentrate_ranks if mode == "concentrate" else cfg.spread_ranks
        if cfg.rank is not None:
            lo = hi = cfg.rank
        ranks = _water_fill(names, score, tiebreak, nbytes, max_rank, budget_bytes, lo, hi)

    entries = [ModulePlan(n, r, h, nbytes(n, r), damage[n]) for n, r in ranks.items() if r > 0]  # model order
    total = sum(e.bytes for e in entries)
    why = f"fixed mode {mode}" + (f" (entropy {entropy:.2f} vs threshold {cfg.entropy_threshold})" if cfg.mode == "auto" else "")
    return Plan(mode, entropy, budget_bytes, total, entries, cfg, seed, why)


def _marginal_plan(damage, entropy, tiebreak, shapes, budget_bytes, cost_model, seed, cfg, spectra) -> Plan:
    """Greedy rank steps by gain_m(r → r+1) / Δcost_m (module docstring, "marginal")."""
    if spectra is None:
        raise SpearError("the marginal rank allocation needs each module's error spectrum (init.WhitenedError.spectrum)")
    missing = [n for n in damage if n not in spectra]
    if missing:
        raise SpearError(f"no error spectrum given for {', '.join(missing[:3])}")
    h = cfg.gate_hidden
    beta = min(1.0 / max(entropy, 1e-9), cfg.max_beta)
    names = list(damage)
    gains = {}
    for n in names:
        s2 = spectra[n].double().clamp(min=0)
        total = float(s2.sum())
        top = min(cfg.rank_cap, *shapes[n], len(s2))
        gains[n] = [] if total == 0 else (damage[n] ** beta * s2[:top] / total).tolist()

    def cost(n: str, r: int) -> float:
        return cost_model.cost(n, *shapes[n], r, h, cfg.factor_bits) if r else 0.0

    ranks = {n: 0 for n in names}
    heap = []

    def push(n: str) -> None:
        r = ranks[n]
        if r < len(gains[n]) and gains[n][r] > 0:
            heapq.heappush(heap, (-gains[n][r] / (cost(n, r + 1) - cost(n, r)), tiebreak[n], n))

    for n in names:
        push(n)
    used = 0
    while heap:
        _, _, n = heapq.heappop(heap)
        r = ranks[n]
        extra = ec_nbytes(*shapes[n], r + 1, h, cfg.factor_bits) - (ec_nbytes(*shapes[n], r, h, cfg.factor_bits) if r else 0)
        if used + extra > budget_bytes:
            continue  # this module stays where it is; cheaper steps elsewhere may still fit
        ranks[n] = r + 1
        used += extra
        push(n)
    entries = [ModulePlan(n, r, h, ec_nbytes(*shapes[n], r, h, cfg.factor_bits), damage[n])
               for n, r in ranks.items() if r > 0]
    total = sum(e.bytes for e in entries)
    rs = [e.rank for e in entries] or [0]
    us = getattr(cost_model, "microseconds", None)  # a latency-aware cost: report the plan's decode time too
    timing = "" if us is None else f"; ≈{sum(us(e.name, *shapes[e.name], e.rank, h) for e in entries):.0f} µs a token"
    why = (f"marginal gain per {type(cost_model).__name__}{timing}; entropy {entropy:.3f} → prior exponent β = {beta:.2f} "
           f"({'concentrate' if entropy < cfg.entropy_threshold else 'spread'} side); {len(entries)} of {len(names)} "
           f"modules, rank {min(rs)}–{max(rs)} (median {sorted(rs)[len(rs) // 2]})")
    return Plan("marginal", entropy, budget_bytes, total, entries, cfg, seed, why)


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
