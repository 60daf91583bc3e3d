"""`profile` measures real step latency through the runner; `spear profile` stores the table (tiny model, CPU)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from fixtures import random_model

from spear.cli import main
from spear.record import QuantConfig
from spear.runtime.engine import Engine, EngineConfig, make_runner
from spear.runtime.latency import TABLE_FILE, LatencyTable, profile
from spear.runtime.model import ModelArgs
from spear.server.launch import serving_table

TINY = ModelArgs(dim=64, intermediate=128, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2, vocab=256, max_seq_len=256)


def tiny_model(ec_fraction: float = 0.0):
    return random_model(TINY, QuantConfig(bits=4, group_size=-1), ec_fraction, rank=8, dtype=torch.float32)


def tiny_runner(ec_fraction: float = 0.0):
    return make_runner(tiny_model(ec_fraction), EngineConfig(max_num_seqs=4, max_model_len=128, cuda_graphs=False))


def test_profile_measures_the_grid():
    runner = tiny_runner(0.5)
    table = profile(runner, [4, 1, 2], [16, 0], decode_context=20, warmup=1, repeats=2)
    assert table.batch_sizes == [1, 2, 4] and table.prefill_tokens == [0, 16]
    assert all(s is not None and 0 < s < 5 for row in table.seconds for s in row)
    assert table.ec_density == pytest.approx(0.5) and table.device == "cpu" and table.decode_context == 20
    assert table.predict(3, 8) is not None


def test_profile_never_runs_more_sequences_than_the_engine():
    """At max_num_seqs decodes, a prefill point measures max_num_seqs - 1 decodes beside the chunk."""
    runner = tiny_runner()
    seen = []
    forward = runner.forward
    runner.forward = lambda chunks: seen.append((len(chunks), sum(len(c.tokens) for c in chunks))) or forward(chunks)
    profile(runner, [4], [0, 8], decode_context=8, warmup=0, repeats=1)
    assert sorted(set(seen)) == [(4, 4), (4, 11)]  # 4 decodes; 3 decodes + 8 prompt tokens


def test_profile_prefill_only_row():
    table = profile(tiny_runner(), [0, 1], [0, 8], decode_context=8, warmup=0, repeats=1)
    assert table.seconds[0][0] is None and table.seconds[0][1] is not None  # no step at (0, 0)


def test_profile_checks_the_cache_fits():
    from spear.errors import SpearError

    with pytest.raises(SpearError, match="context"):
        profile(tiny_runner(), [1], [0], decode_context=200)
    with pytest.raises(SpearError, match="KV blocks"):
        profile(tiny_runner(), [64], [0], decode_context=100)


def test_serving_table_profiles_once_and_reuses(tmp_path, capsys):
    config = EngineConfig(max_num_seqs=6, max_model_len=256, cuda_graphs=False)
    engine = Engine(make_runner(tiny_model(), config), SimpleNamespace(eos_token_id=None), config)
    (tmp_path / "config.json").write_text(json.dumps({"format": "spear-artifact"}))  # looks like an artifact
    first = serving_table(str(tmp_path), engine)
    assert (tmp_path / TABLE_FILE).is_file() and "profiling" in capsys.readouterr().err
    assert first.batch_sizes == [1, 4, 6] and first.prefill_tokens == [0, 16, 32, 48, 64, 96, 128], "the grid the engine can run"
    assert serving_table(str(tmp_path), engine) == first and "profiling" not in capsys.readouterr().err
    first.device = "another device"
    first.save(tmp_path / TABLE_FILE)
    assert serving_table(str(tmp_path), engine).device == "cpu" and "another device" in capsys.readouterr().err


def test_serving_table_of_a_plain_model_is_cached(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Not an artifact (an HF dir, a GGUF, smollm2): the table is stored in the cache, keyed by model, device, EC
    density and engine shape, so the next start does not profile again."""
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path))
    config = EngineConfig(max_num_seqs=2, max_model_len=64, cuda_graphs=False)
    engine = Engine(make_runner(tiny_model(), config), SimpleNamespace(eos_token_id=None), config)
    first = serving_table(str(tiny_model_dir), engine)
    assert "profiling" in capsys.readouterr().err and len(list((tmp_path / "latency").glob("*.json"))) == 1
    assert not (tiny_model_dir / TABLE_FILE).exists()
    assert serving_table(str(tiny_model_dir), engine) == first and "profiling" not in capsys.readouterr().err
    other = EngineConfig(max_num_seqs=3, max_model_len=64, cuda_graphs=False)
    serving_table(str(tiny_model_dir), Engine(make_runner(tiny_model(), other), SimpleNamespace(eos_token_id=None), other))
    assert "profiling" in capsys.readouterr().err, "another engine shape is profiled anew"


def test_cli_profile(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = main(["profile", str(tiny_model_dir), "--out", str(out), "--batch-sizes", "1", "2",
               "--prefill-tokens", "0", "32", "--device", "cpu", "--json"])
    printed, err = capsys.readouterr()
    assert rc == 0 and str(out) in err
    table = LatencyTable.load(out)
    assert json.loads(printed) == table.to_dict()
    assert table.batch_sizes == [1, 2] and table.prefill_tokens == [0, 32]


def test_cli_profile_needs_out_for_a_plain_model(tiny_model_dir, capsys):
    rc = main(["profile", str(tiny_model_dir), "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--out" in err
