"""bench/decode.py end to end on a tiny model (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_decode_bench_tiny_runs_end_to_end(tmp_path):
    out = tmp_path / "decode.json"
    cmd = [sys.executable, str(ROOT / "bench" / "decode.py"), "--tiny", "--batches", "1", "3", "--new-tokens", "5",
           "--settings", "fp16", "w4+ec38", "--json", str(out)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert "commit" in result["provenance"] and result["new_tokens"] == 5
    rows = result["rows"]
    assert [(r["setting"], r["batch"]) for r in rows] == [("fp32", 1), ("fp32", 3), ("w4+ec38", 1), ("w4+ec38", 3)]
    assert all(r["decode_steps"] == 4 and r["ms_per_token"] > 0 and r["floor_ms_per_token"] > 0 for r in rows)
    assert rows[2]["weight_bytes"] < rows[0]["weight_bytes"]
    assert "ms/token" in proc.stdout.splitlines()[-5]


def test_spear_bench_decode_runs_the_script(tmp_path, monkeypatch, capsys):
    from spear.cli import main

    monkeypatch.setattr(sys, "argv", sys.argv[:])
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--tiny", "--batches", "2", "--new-tokens", "3", "--settings", "w4", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["tokens_per_s"] > 0
    assert "tok/s" in capsys.readouterr().out


def test_host_step_bench_runs_end_to_end(tmp_path):
    """bench/host_step.py drives the engine with a stand-in forward: the engine's forward signature is its contract."""
    out = tmp_path / "host.json"
    cmd = [sys.executable, str(ROOT / "bench" / "host_step.py"), "--batches", "1", "2", "--steps", "5",
           "--json", str(out)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["host_us"] > 0 for r in rows)
