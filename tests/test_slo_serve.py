"""`spear serve --itl-slo-ms` end to end: profiles the artifact once, stores its table, serves bench/serve.py's load."""

from __future__ import annotations

import json
import sys

from spear.cli import main
from spear.runtime.latency import TABLE_FILE, LatencyTable


def test_serve_with_itl_slo_profiles_then_serves(tiny_model_dir, tmp_path, monkeypatch, capsys):
    artifact = tmp_path / "art"
    assert main(["quantize", str(tiny_model_dir), "--group-size", "32", "--out", str(artifact), "--device", "cpu"]) == 0
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--launch", str(artifact), "--serve-args", "--itl-slo-ms 40 --device cpu",
            "--num-requests", "6", "--rate", "20", "--input-median", "20", "--output-median", "6", "--max-output", "8",
            "--itl-slo-ms", "40", "--json", str(out)]
    assert main(argv) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 6 and summary["failed"] == 0 and summary["itl_ms"]["p50"] > 0
    table = LatencyTable.load(artifact / TABLE_FILE)
    assert table.batch_sizes == [1, 4, 8, 16, 32, 256] and table.prefill_tokens == [0, 16, 32, 48, 64, 96, 128, 192, 256] and table.device == "cpu"
    assert out.with_suffix(".png").stat().st_size > 0
    capsys.readouterr()
