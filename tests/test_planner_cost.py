"""The planner's cost models: bytes, and bytes + the decode µs an EC adds (compensate/cost.py)."""

import json
from pathlib import Path

import pytest

from spear.compensate.cost import BytesCost, LatencyCost, ec_nbytes, fit_latency_cost
from spear.compensate.planner import plan_ecs
from spear.errors import SpearError
from test_planner import flat, spectra, table

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
KERNEL_TABLES = ["kernels_h200_m1_1c72e0e.json", "kernels_h200_8b13b_98e7719.json", "kernels_h200_m1_d28e883.json"]


def test_fit_recovers_a_known_line(tmp_path):
    """W4+EC − W4 = 2 µs + 3 µs per MB of EC bytes, exactly: the fit returns 2 and 3."""
    shapes = {"a": [], "b": []}
    for (n, k), key in (((4096, 4096), "a"), ((1024, 8192), "b")):
        us = {"w4": 10.0} | {f"w4_ec_r{r}": 10.0 + 2.0 + 3.0 * 2 * r * (n + k) / 1e6 for r in (16, 32, 64)}
        shapes[key].append({"N": n, "K": k, "us": us})
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"shapes": shapes}))
    cost = fit_latency_cost([path], tp=2)
    assert cost.t_fixed_us == pytest.approx(2.0) and cost.t_per_mb_us == pytest.approx(3.0) and cost.tp == 2
    with pytest.raises(SpearError, match="no W4"):
        fit_latency_cost([_empty(tmp_path)])


def _empty(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"shapes": {}}))
    return path


def test_defaults_are_the_fit_of_the_committed_kernel_tables():
    fitted = fit_latency_cost([RESULTS / name for name in KERNEL_TABLES])
    default = LatencyCost()
    assert fitted.t_fixed_us == pytest.approx(default.t_fixed_us, abs=0.01)
    assert fitted.t_per_mb_us == pytest.approx(default.t_per_mb_us, abs=0.01)


def test_a_fixed_cost_per_module_concentrates_the_plan():
    """At the same byte budget, a µs-aware cost spends it on fewer modules at higher rank; its plan says
    how many µs a token the ECs add; both plans stay within the budget."""
    t, shapes = table(flat)
    budget = 300_000
    by_bytes = plan_ecs(t, shapes, budget, BytesCost(), spectra=spectra(shapes))
    by_latency = plan_ecs(t, shapes, budget, LatencyCost(t_fixed_us=5.0), spectra=spectra(shapes))
    assert len(by_latency.entries) < len(by_bytes.entries)
    assert max(by_latency.ranks().values()) > max(by_bytes.ranks().values())
    assert by_latency.total_bytes <= budget and by_bytes.total_bytes <= budget
    assert "µs a token" in by_latency.why and "µs" not in by_bytes.why


def test_tensor_parallel_reduction_moves_rank_off_row_parallel_modules():
    t, shapes = table(flat)
    budget = 300_000
    row_parallel = ("o_proj", "down_proj")

    def row_share(plan):
        return sum(e.bytes for e in plan.entries if e.name.endswith(row_parallel)) / plan.total_bytes

    single = plan_ecs(t, shapes, budget, LatencyCost(), spectra=spectra(shapes))
    tp = plan_ecs(t, shapes, budget, LatencyCost(tp=2, t_reduce_us=47.0), spectra=spectra(shapes))
    assert row_share(tp) < 0.5 * row_share(single)
    cost = LatencyCost(tp=2, t_reduce_us=47.0)
    assert cost.microseconds("model.layers.0.o_proj", 576, 576, 4, 8) == pytest.approx(
        cost.microseconds("model.layers.0.q_proj", 576, 576, 4, 8) + 47.0)
    assert cost.cost("x.q_proj", 576, 576, 4, 8) > ec_nbytes(576, 576, 4, 8)


def test_bad_terms_are_refused():
    with pytest.raises(SpearError, match="≥ 0"):
        LatencyCost(t_fixed_us=-1.0)
    with pytest.raises(SpearError, match="tp"):
        LatencyCost(tp=0)


def test_cli_tp_terms_need_the_latency_cost(capsys):
    from spear.cli import main

    assert main(["compensate", "missing-dir", "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--cost latency" in err and len(err.splitlines()) == 1
