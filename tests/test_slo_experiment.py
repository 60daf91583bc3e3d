"""bench/slo_experiment.py end to end on the tiny model (CPU), through `spear bench slo`."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def test_slo_experiment_tiny_runs_end_to_end(tmp_path, monkeypatch, capsys):
    from spear.cli import main

    monkeypatch.setattr(sys, "argv", sys.argv[:])
    out = tmp_path / "slo.json"
    argv = ["bench", "slo", "--tiny", "--densities", "w4+ec38", "--static-chunks", "32", "16",
            "--itl-slos-ms", "20", "--num-requests", "6", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["driver"].startswith("in-process") and "commit" in result["provenance"]
    assert [r["policy"] for r in result["runs"]] == ["static32", "static16", "slo20ms"]
    for run in result["runs"]:
        assert run["summary"]["completed"] == 6 and run["summary"]["itl_ms"]["p99"] > 0
        assert sum(r["completion_tokens"] for r in run["requests"]) == result["workload"]["output_tokens"]
    assert result["latency_tables"]["w4+ec38"]["prefill_tokens"] == [0, 16, 32, 64]
    assert (tmp_path / "slo.png").stat().st_size > 0
    assert "slo20ms" in capsys.readouterr().out.splitlines()[-1]

    # bench/slo_trace.py reads the per-step trace back: every step counted once, the slowest listed first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from slo_trace import describe

    run = result["runs"][0]
    lines = describe(run, slowest=2)
    counted = sum(int(line.split()[2]) for line in lines if line.lstrip().startswith("prefill"))
    assert counted == run["steps"]["steps"] == len(run["steps"]["trace"]["rows"])
    slow = [float(line.split(": ")[2].split(" ms")[0]) for line in lines if "slow:" in line]
    assert len(slow) == 2 and slow[0] >= slow[1]
    assert slow[0] == float(f"{max(r[1] for r in run['steps']['trace']['rows']):.1f}")  # printed to 0.1 ms
