"""The EC planner: budget, mode from entropy, determinism, JSON."""

import math

import pytest
import torch

from spear.compensate.cka import ModuleDamage, SensitivityTable
from spear.layer import ErrorCompensator
from spear.compensate.planner import (
    Plan,
    PlannerConfig,
    ec_nbytes,
    normalized_entropy,
    plan_ecs,
    quantized_model_bytes,
)
from spear.errors import SpearError

TYPES = {"q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576), "o_proj": (576, 576),
         "gate_proj": (1536, 576), "up_proj": (1536, 576), "down_proj": (576, 1536)}  # (out, in)


def table(damage_fn, layers: int = 10) -> tuple[SensitivityTable, dict]:
    entries, shapes = [], {}
    for i in range(layers):
        for j, (t, shape) in enumerate(TYPES.items()):
            name = f"model.layers.{i}.{t}"
            entries.append(ModuleDamage(name, i, t, damage_fn(i, j)))
            shapes[name] = shape
    return SensitivityTable(entries, tokens=100), shapes


def peaked(i, j):
    return 0.5 if (i, j) in {(0, 6), (9, 6)} else 1e-4 * (1 + (i + j) % 3)


def flat(i, j):
    return 0.01 * (1 + 0.2 * ((i * 7 + j) % 5))


def spectra(shapes, decay=lambda name: 0.7):
    """Geometric whitened error spectra σ²_i = decay^i per module."""
    return {n: decay(n) ** torch.arange(min(s), dtype=torch.float64) for n, s in shapes.items()}


def total_bytes_of_all(shapes, rank, h=8):
    return sum(ec_nbytes(*s, rank, h) for s in shapes.values())


@pytest.mark.parametrize("fn", [peaked, flat])
@pytest.mark.parametrize("mode", ["auto", "concentrate", "spread", "uniform"])
@pytest.mark.parametrize("frac", [0.0, 0.003, 0.05, 0.3, 2.0])
def test_budget_is_respected(fn, mode, frac):
    t, shapes = table(fn)
    budget = int(frac * total_bytes_of_all(shapes, 8))
    cfg = PlannerConfig(mode=mode)
    plan = plan_ecs(t, shapes, budget, cfg=cfg, spectra=spectra(shapes))
    assert plan.total_bytes == sum(e.bytes for e in plan.entries) <= budget
    assert all(e.rank >= 1 and e.bytes == ec_nbytes(*shapes[e.name], e.rank, 8, cfg.factor_bits) for e in plan.entries)
    if mode != "auto":
        assert all(e.rank % 8 == 0 for e in plan.entries)  # the fixed modes step by 8
    else:
        assert plan.mode == "marginal" and all(e.rank <= cfg.rank_cap for e in plan.entries)
    if frac >= 0.05:
        assert plan.entries and plan.total_bytes > 0.5 * min(budget, total_bytes_of_all(shapes, 64))


def test_marginal_allocation_takes_the_largest_gain_per_byte():
    """Two modules of one shape and equal damage: the one whose error sits in fewer directions gets the
    rank first; a module whose spectrum is flat spreads its gain thin and gets rank only later."""
    shapes = {"model.layers.0.q_proj": (576, 576), "model.layers.0.o_proj": (576, 576)}
    t = SensitivityTable([ModuleDamage(n, 0, n.rsplit(".", 1)[-1], 0.01) for n in shapes], tokens=10)
    spec = {"model.layers.0.q_proj": torch.tensor([8.0, 1.0, 1.0] + [0.0] * 573, dtype=torch.float64),
            "model.layers.0.o_proj": torch.ones(576, dtype=torch.float64)}
    step = ec_nbytes(576, 576, 1, 8)
    plan = plan_ecs(t, shapes, step, spectra=spec)
    assert plan.ranks() == {"model.layers.0.q_proj": 1}
    plan = plan_ecs(t, shapes, 10 * step, spectra=spec)
    ranks = plan.ranks()
    assert ranks["model.layers.0.q_proj"] == 3  # its spectrum ends at 3: no gain beyond
    assert ranks["model.layers.0.o_proj"] >= 5 and plan.total_bytes <= 10 * step
    assert "β" in plan.why and plan.mode == "marginal"
    with pytest.raises(SpearError, match="spectrum"):
        plan_ecs(t, shapes, step)


def test_marginal_entropy_prior_concentrates_peaked_damage():
    """Peaked damage (low entropy) → β > 1 → the two peaks take most of the budget."""
    tp, sp = table(peaked)
    tf, sf = table(flat)
    budget = 300_000
    concentrated = plan_ecs(tp, sp, budget, spectra=spectra(sp))
    spread = plan_ecs(tf, sf, budget, spectra=spectra(sf))
    assert len(concentrated.entries) < len(spread.entries)
    ranks = concentrated.ranks()
    peaks = ranks.pop("model.layers.0.down_proj"), ranks.pop("model.layers.9.down_proj")
    assert min(peaks) > 3 * max(ranks.values(), default=0)
    assert "concentrate" in concentrated.why and "spread" in spread.why


def test_ec_nbytes_matches_module():
    for rank, h in ((8, 0), (16, 8), (24, 4)):
        assert ec_nbytes(192, 576, rank, h) == ErrorCompensator(576, 192, rank, h).nbytes()


def test_entropy_picks_the_mode():
    budget = 1_500_000
    tp, sp = table(peaked)
    tf, sf = table(flat)
    fixed = PlannerConfig(mode="spread"), PlannerConfig(mode="concentrate")
    concentrated = plan_ecs(tp, sp, budget, cfg=PlannerConfig(mode="concentrate"))
    spread = plan_ecs(tf, sf, budget, cfg=PlannerConfig(mode="spread"))
    assert fixed and concentrated.entropy < 0.85 <= spread.entropy
    assert concentrated.mode == "concentrate" and spread.mode == "spread"
    assert len(concentrated.entries) < len(spread.entries)
    assert max(e.rank for e in concentrated.entries) > max(e.rank for e in spread.entries)
    top = {e.name: e.rank for e in concentrated.entries}
    assert top["model.layers.0.down_proj"] == top["model.layers.9.down_proj"] == 128  # the two peaks


def test_ranks_follow_damage_per_byte():
    t, shapes = table(lambda i, j: 0.001 * (1 + i))  # damage grows with depth
    plan = plan_ecs(t, shapes, 600_000, cfg=PlannerConfig(mode="concentrate"))
    ranks = plan.ranks()
    same_type = [ranks.get(f"model.layers.{i}.q_proj", 0) for i in range(10)]
    assert same_type == sorted(same_type) and same_type[-1] > same_type[0]


def test_entropy_values():
    assert normalized_entropy([1.0] * 10) == pytest.approx(1.0)
    assert normalized_entropy([1.0] + [0.0] * 9) == 0.0
    assert normalized_entropy([0.0] * 4) == 1.0
    assert normalized_entropy([3.0, 1.0]) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(2))


def test_uniform_and_fixed_rank():
    t, shapes = table(peaked)
    everything = total_bytes_of_all(shapes, 16)  # in fp16 factors
    plan = plan_ecs(t, shapes, everything, cfg=PlannerConfig(mode="uniform", factor_bits=16))
    assert len(plan.entries) == 70 and {e.rank for e in plan.entries} == {16}
    half = plan_ecs(t, shapes, total_bytes_of_all(shapes, 8) // 2, cfg=PlannerConfig(mode="uniform", factor_bits=16))
    assert {e.rank for e in half.entries} == {8} and 25 <= len(half.entries) < 70
    layers = [int(e.name.split(".")[2]) for e in half.entries]
    assert min(layers) == 0 and max(layers) == 9  # evenly spaced over the stack

    fixed = plan_ecs(t, shapes, 300_000, cfg=PlannerConfig(rank=32))
    assert {e.rank for e in fixed.entries} == {32} and fixed.total_bytes <= 300_000
    forced = plan_ecs(t, shapes, 1000, cfg=PlannerConfig(rank=32, ignore_budget=True))
    assert len(forced.entries) == 70 and forced.total_bytes > 1000
    with pytest.raises(SpearError, match="exceeds"):
        plan_ecs(t, shapes, 10**9, cfg=PlannerConfig(rank=256))
    with pytest.raises(SpearError, match="mode"):
        PlannerConfig(mode="greedy")


def test_deterministic_and_json_round_trip():
    t, shapes = table(lambda i, j: 0.01)  # all ties
    budget = total_bytes_of_all(shapes, 8) // 3
    spec = spectra(shapes)
    a = plan_ecs(t, shapes, budget, seed=3, spectra=spec)
    assert a == plan_ecs(t, shapes, budget, seed=3, spectra=spec)
    assert Plan.from_json(a.to_json()) == a
    reordered = SensitivityTable(list(reversed(t.entries)), t.tokens)
    assert plan_ecs(reordered, shapes, budget, seed=3, spectra=spec).ranks() == a.ranks()
    cfg = PlannerConfig(mode="spread")
    others = [set(plan_ecs(t, shapes, budget, seed=s, cfg=cfg).ranks()) for s in range(4)]
    assert any(o != others[0] for o in others)  # ties are broken by the seed


def test_quantized_model_bytes():
    from conftest import make_tiny_llama

    from spear.models.layerwise import quantizable_linears
    from spear.record import QuantConfig, rtn_quantize

    model = make_tiny_llama()  # vocab 256 × 64, tied lm_head, 2 layers
    records = {n: rtn_quantize(m.weight, QuantConfig(bits=4)) for n, m in quantizable_linears(model).items()}
    linear_params = sum(m.weight.numel() for m in quantizable_linears(model).values())
    others = sum(p.numel() for p in model.parameters()) - linear_params
    assert others == 256 * 64 + 64 * 5  # embedding (tied, once) + 2×2 layer norms + final norm
    expected = sum(r.nbytes_packed() for r in records.values()) + 2 * others
    assert quantized_model_bytes(model, records) == expected
    assert expected < 2 * sum(p.numel() for p in model.parameters())
