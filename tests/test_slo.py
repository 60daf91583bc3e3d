"""The SLO-aware prefill policy and its latency tables, on synthetic tables and the tiny model (CPU)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from spear.errors import SpearError
from spear.runtime.engine import EngineConfig, StepStats, build_engine
from spear.runtime.latency import LatencyTable
from spear.runtime.requests import SamplingParams
from spear.runtime.slo import SLOPolicy

BATCHES = [1, 4, 8, 16, 32]
PREFILL = [0, 64, 128, 256, 512]


def synthetic(ms_per_decode: float = 0.1, ms_per_token: float = 0.02, base_ms: float = 8.0) -> LatencyTable:
    """Step ms = base + per-decode x b + per-token x p: linear, so interpolation is exact."""
    seconds = [[(base_ms + ms_per_decode * b + ms_per_token * p) / 1e3 for p in PREFILL] for b in BATCHES]
    return LatencyTable(BATCHES, PREFILL, seconds, "synthetic")


def test_interpolation_is_bilinear():
    table = LatencyTable([1, 3], [0, 100], [[1.0, 2.0], [3.0, 6.0]])
    assert table.predict(1, 0) == 1.0 and table.predict(3, 100) == 6.0
    assert table.predict(2, 0) == pytest.approx(2.0)
    assert table.predict(1, 50) == pytest.approx(1.5)
    assert table.predict(2, 50) == pytest.approx((1.0 + 2.0 + 3.0 + 6.0) / 4)
    assert table.predict(3, 25) == pytest.approx(3.75)
    for b, p in [(0, 0), (4, 0), (1, -1), (1, 101)]:
        assert table.predict(b, p) is None


def test_linear_table_predicts_exactly_between_grid_points():
    table = synthetic()
    assert table.predict(12, 200) == pytest.approx((8.0 + 1.2 + 4.0) / 1e3)


def test_json_round_trip(tmp_path):
    table = synthetic()
    table.seconds[2][4] = None
    path = table.save(tmp_path / "sub" / "latency_table.json")
    assert LatencyTable.load(path) == table
    assert not list(path.parent.glob("*.tmp")), "written atomically, no temp file left"


def test_load_rejects_other_json(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(SpearError, match="not a SPEAR latency table"):
        LatencyTable.load(tmp_path / "t.json")
    with pytest.raises(SpearError, match="cannot read"):
        LatencyTable.load(tmp_path / "missing.json")


def test_bad_grid_rejected():
    with pytest.raises(SpearError, match="increasing"):
        LatencyTable([4, 1], [0], [[1.0], [1.0]])
    with pytest.raises(SpearError, match="2 x 1"):
        LatencyTable([1, 4], [0], [[1.0]])


@pytest.mark.parametrize("slo_ms", [10.0, 12.0, 16.0, 22.0])
@pytest.mark.parametrize("num_decodes", [1, 5, 8, 20, 32])
def test_policy_respects_the_slo(slo_ms, num_decodes):
    table = synthetic()
    policy = SLOPolicy(table, slo_ms, min_chunk=16, max_chunk=512, headroom=0.0)
    chunk = policy.prefill_budget(num_decodes, 0, 10_000)
    predicted = table.predict(num_decodes, chunk)
    if chunk > 16:
        assert predicted <= slo_ms / 1e3 + 1e-12
        # the largest such chunk: one more token (if within max_chunk) would break the SLO
        assert chunk == 512 or table.predict(num_decodes, chunk + 1) > slo_ms / 1e3
    else:
        assert table.predict(num_decodes, 17) > slo_ms / 1e3


def test_headroom_leaves_margin():
    table = synthetic()
    chunk = SLOPolicy(table, 16.0, headroom=0.1).prefill_budget(8, 0, 10_000)
    assert table.predict(8, chunk) <= 0.9 * 16e-3 + 1e-12


def test_faster_table_gives_larger_chunks():
    slow = SLOPolicy(synthetic(ms_per_token=0.03), 16.0)
    fast = SLOPolicy(synthetic(ms_per_token=0.015), 16.0)
    for b in (1, 8, 32):
        assert fast.prefill_budget(b, 0, 10_000) > slow.prefill_budget(b, 0, 10_000)


def test_more_decodes_give_smaller_chunks():
    policy = SLOPolicy(synthetic(ms_per_decode=0.1), 16.0)
    chunks = [policy.prefill_budget(b, 0, 10_000) for b in (1, 8, 16, 32)]
    assert chunks == sorted(chunks, reverse=True) and chunks[0] > chunks[-1]


def test_no_answer_falls_back_to_min_chunk():
    empty = LatencyTable([], [], [])
    assert SLOPolicy(empty, 16.0, min_chunk=32).prefill_budget(4, 0, 1000) == 32
    table = synthetic()
    policy = SLOPolicy(table, 16.0, min_chunk=32)
    assert policy.prefill_budget(64, 0, 1000) == 32, "batch beyond the grid"
    assert SLOPolicy(table, 1.0, min_chunk=32).prefill_budget(4, 0, 1000) == 32, "even a decode-only step is over"
    assert policy.prefill_budget(0, 0, 1000) == 512, "nothing decoding: no ITL at stake"


def test_partial_table_stops_at_the_first_unmeasured_point():
    table = synthetic(ms_per_token=0.001)  # every chunk fits a 16 ms SLO
    assert SLOPolicy(table, 16.0).prefill_budget(8, 0, 10_000) == 512
    table.seconds[2][3] = None  # (8 decodes, 256 tokens) not measured
    assert SLOPolicy(table, 16.0).prefill_budget(8, 0, 10_000) == 128
    assert SLOPolicy(table, 16.0).prefill_budget(6, 0, 10_000) == 128, "interpolated rows inherit the gap"
    assert SLOPolicy(table, 16.0).prefill_budget(16, 0, 10_000) == 512
    table.seconds[2][0] = None
    assert SLOPolicy(table, 16.0, min_chunk=8).prefill_budget(8, 0, 10_000) == 8


def test_feedback_moves_predictions_toward_measured():
    table = synthetic()
    policy = SLOPolicy(table, 16.0, smoothing=0.2)
    before = policy.prefill_budget(8, 0, 10_000)
    truth = table.predict(8, 128) * 1.5  # the device runs 1.5x slower than profiled
    errors = []
    for _ in range(30):
        errors.append(abs(policy.predict(8, 128) - truth))
        policy.observe(StepStats(truth, 8, 128))
    assert errors[-1] < 0.01 * truth < errors[0]
    assert errors == sorted(errors, reverse=True)
    assert policy.prefill_budget(8, 0, 10_000) < before
    for ignored in (StepStats(1.0, 64, 64), StepStats(1.0, 8, 0), StepStats(1.0, 0, 128)):
        policy.observe(ignored)  # no prediction (batch beyond the grid), or not a step the policy sized
    assert policy.correction == pytest.approx(1.5, rel=0.01)


def simulate(policy: SLOPolicy, table: LatencyTable, ratios: list[float], num_decodes: int = 8) -> list[float]:
    """Step seconds when every step decodes `num_decodes` beside the policy's chunk and runs `ratio` x the table."""
    seconds = []
    for ratio in ratios:
        chunk = policy.prefill_budget(num_decodes, 0, 10_000)
        seconds.append(table.predict(num_decodes, chunk) * ratio)
        policy.observe(StepStats(seconds[-1], num_decodes, chunk))
    return seconds


def p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))]


def test_noisy_steps_keep_the_p99_within_the_slo():
    """Measured / predicted spreads ±15% (lognormal) around a 1.2x slower device: size for the tail, not the mean."""
    table = synthetic(base_ms=4.0)
    rng = random.Random(0)
    ratios = [1.2 * rng.lognormvariate(0.0, 0.15) for _ in range(3000)]
    tail = SLOPolicy(table, 16.0)
    mean_only = SLOPolicy(table, 16.0, window=10_000, min_samples=10_000)  # the moving average throughout
    tail_ms = [s * 1e3 for s in simulate(tail, table, ratios)[64:]]
    mean_ms = [s * 1e3 for s in simulate(mean_only, table, ratios)[64:]]
    assert p99(tail_ms) <= 16.0 < p99(mean_ms)
    assert 1.2 < mean_only.correction < 1.3 < tail.correction < 1.2 * 1.5  # mean vs tail of the ratios
    assert 16 < tail.prefill_budget(8, 0, 10_000) < mean_only.prefill_budget(8, 0, 10_000), "smaller, real chunks"


def test_few_sized_steps_take_a_lower_quantile_and_keep_the_p99_of_all_gaps():
    """When most gaps come from decode-only steps, the P99 of all gaps tolerates slower sized steps: the
    policy takes a lower quantile of their ratios (larger chunks) and the P99 over every gap stays within."""
    table = synthetic(base_ms=4.0)
    rng = random.Random(1)
    policy, always = SLOPolicy(table, 16.0), SLOPolicy(table, 16.0)
    gaps = []  # one per decode per step, as the ITL sees them
    for step in range(6000):
        ratio = 1.2 * rng.lognormvariate(0.0, 0.15)
        if step % 6:  # five decode-only steps in six
            seconds = table.predict(8, 0) * ratio
            policy.observe(StepStats(seconds, 8, 0))
        else:
            chunk = policy.prefill_budget(8, 0, 10_000)
            seconds = table.predict(8, chunk) * ratio
            policy.observe(StepStats(seconds, 8, chunk))
            always.observe(StepStats(table.predict(8, chunk) * ratio, 8, chunk))  # the same ratios, every step sized
        if step >= 600:
            gaps += [seconds * 1e3] * 8
    assert 0.15 < policy.sized_share < 0.19 and always.sized_share == pytest.approx(1.0)
    assert policy.correction < always.correction
    assert policy.prefill_budget(8, 0, 10_000) > always.prefill_budget(8, 0, 10_000)
    assert p99(gaps) <= 16.0


def test_steady_steps_keep_the_full_chunk():
    table = synthetic()
    policy = SLOPolicy(table, 16.0)
    fresh = policy.prefill_budget(8, 0, 10_000)
    simulate(policy, table, [1.0] * 200)
    assert policy.correction == pytest.approx(1.0)
    assert policy.prefill_budget(8, 0, 10_000) == fresh > 256


def test_window_forgets_a_slow_burst_and_shrugs_off_one_outlier():
    table = synthetic()
    policy = SLOPolicy(table, 16.0)
    simulate(policy, table, [1.0] * 64)
    simulate(policy, table, [10.0])
    assert policy.correction == pytest.approx(1.0), "one outlier in a full window sits above the quantile"
    simulate(policy, table, [2.0] * 8)
    assert policy.correction == pytest.approx(2.0)
    simulate(policy, table, [1.0] * 64)
    assert policy.correction == pytest.approx(1.0) and len(policy._ratios) == 64


def test_invalid_settings():
    for kwargs in ({"itl_slo_ms": 0}, {"min_chunk": 0}, {"min_chunk": 64, "max_chunk": 32}, {"headroom": 1.0},
                   {"quantile": 0.0}, {"quantile": 1.5}, {"window": 0}, {"min_samples": 0},
                   {"itl_percentile": 1.0}, {"share_smoothing": 0.0},
                   {"window": 16, "min_samples": 32}):
        with pytest.raises(SpearError):
            SLOPolicy(synthetic(), **{"itl_slo_ms": 16.0, **kwargs})


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from spear.api import load

    return load(str(tiny_model_dir), torch.device("cpu"), torch.float32)


def test_engine_never_stalls_decodes_for_a_long_prompt(tiny):
    """A long prompt arriving while requests decode: every step still decodes all of them, in small chunks."""
    table = LatencyTable([1, 4], [0, 16, 64], [[0.010, 0.015, 0.030]] * 2)  # 16 ms SLO: 19 tokens a step
    policy = SLOPolicy(table, 16.0, min_chunk=4, max_chunk=64, headroom=0.0)
    engine = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=256, policy=policy))
    policy.observe = lambda stats: None  # keep the synthetic table's predictions (CPU steps are not these times)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"d{i}", list(range(3 + i, 11 + i)), params)
    while len(engine.running) < 3 or not all(s.prefilled for s in engine.running):
        engine.step()
    engine.add_request("long", list(range(3, 203)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    chunks = []
    while any(not s.prefilled for s in (*engine.running, *engine.waiting)):
        engine.step()
        assert engine.last_step.num_decodes == 3
        chunks.append(engine.last_step.num_prefill_tokens)
    assert sum(chunks) == 200
    assert max(chunks) == int(table.max_prefill(3, 0.016)) == 19  # 15 ms + 1 ms / (15 ms / 48 tokens)
