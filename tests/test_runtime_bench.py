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


def test_decode_history_plot_reads_the_committed_runs(tmp_path):
    """bench/plot_decode_history.py over the committed runs (bench/results/history.jsonl and the current
    decode_h200*.json): the batch-32 runs since 2026-11-30T02:00 come in date order, W4 in at least ten, and the figure
    is written; a batch no run has is a one-line error (exit 2)."""
    script = ROOT / "bench" / "plot_decode_history.py"
    out = tmp_path / "b32.png"
    proc = subprocess.run([sys.executable, str(script), "--batch", "32", "--since", "2026-11-30T02:00", "--out", str(out)],
                          check=False, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("2026-")]
    dates = [line[:16] for line in lines]
    assert dates == sorted(dates) and sum(" w4 " in line for line in lines) >= 10, proc.stdout
    assert out.stat().st_size > 10_000
    bad = subprocess.run([sys.executable, str(script), "--batch", "3", "--out", str(tmp_path / "x.png")],
                         check=False, capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "batch 3" in bad.stderr.strip().splitlines()[-1]


def test_decode_history_marks_runs_off_todays_defaults():
    """A run is an A/B arm when a SPEAR_* knob in its provenance differs from the default src/ reads (or names a knob
    since removed); bookkeeping variables and knobs set to the default are not."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import plot_decode_history as plot
    finally:
        sys.path.pop(0)
    defaults = plot.knob_defaults()
    assert defaults["SPEAR_DENSE_KERNELS"] == "1" and defaults["SPEAR_FOLD_NORM_TP"] == "0"
    assert not plot.is_arm({"SPEAR_DENSE_KERNELS": "1", "SPEAR_TUNE_CACHE": "/tmp/t.json"}, defaults)
    assert plot.is_arm({"SPEAR_DENSE_KERNELS": "0"}, defaults)
    assert plot.is_arm({"SPEAR_ATTN_COMBINE": "fused"}, defaults)  # a switch no longer in src/
    assert not plot.is_arm({"SPEAR_L2_PREFETCH": "0"}, defaults)  # ... turned off: the path that stayed


def test_lab_switches_reject_bad_values():
    """The kernels' lab switches are read at import: a bad value stops there with one line naming the switch."""
    for module, env in (("spear.kernels.w4", {"SPEAR_W4_EVEN": "yes"}),
                        ("spear.kernels.w4", {"SPEAR_W4_GEMV_SPLITS": "2 x"}),
                        ("spear.kernels.ops", {"SPEAR_PDL": "2"})):
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], check=False, capture_output=True, text=True,
                              env={**os.environ, **env})
        name = next(iter(env))
        assert proc.returncode != 0 and f"ValueError: {name}" in proc.stderr.splitlines()[-1], proc.stderr[-300:]
