"""bench/: the named suites of `spear bench` and the one table of model shapes the benchmarks time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import quality  # noqa: E402
import shapes  # noqa: E402

from spear.cli import BENCH_SUITES  # noqa: E402


def test_every_suite_names_a_script_of_bench():
    assert {"quality", "decode", "kernels", "slo", "tp"} <= set(BENCH_SUITES)
    for script in BENCH_SUITES.values():
        assert (ROOT / "bench" / f"{script}.py").is_file(), script


def test_no_bench_script_shadows_an_installed_module():
    """bench/ is on sys.path ahead of site-packages (tests, `python bench/X.py`): a script named like an installed
    module hides it from every library that imports it (transformers imports `kernels`, the HF kernel hub)."""
    import importlib.machinery

    site = [p for p in sys.path if Path(p or ".").resolve() not in (ROOT / "bench", ROOT / "tests")]
    for script in (ROOT / "bench").glob("*.py"):
        spec = importlib.machinery.PathFinder.find_spec(script.stem, site)
        assert spec is None or Path(spec.origin or "").parent == ROOT / "bench", f"bench/{script.name} hides {spec.origin}"


def test_shapes_derive_the_linears_from_the_model_table():
    """The (N, K) the kernel benches time follow from ModelArgs: GQA splits q/o from k/v, the launches stack q|k|v
    and gate|up."""
    assert shapes.linears("7b") == {"qkvo": (4096, 4096), "gate_up": (11008, 4096), "down": (4096, 11008)}
    assert shapes.linears("70b") == {"q_o": (8192, 8192), "k_v": (1024, 8192), "gate_up": (28672, 8192),
                                     "down": (8192, 28672)}
    assert shapes.launches("8b") == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                     "down": (4096, 14336)}
    assert shapes.linears("13b")["down"] == (5120, 13824)


def test_quality_suites_write_distinct_files():
    """Every row runs as its own process into OUTDIR/NAME.json, and several suites run at once into one OUTDIR:
    no two rows of any suites share a name."""
    rows = [row for rows in quality.suites("/data").values() for row in rows]
    names = [name for name, _, _ in rows]
    assert len(names) == len(set(names))
    assert all((ROOT / "bench" / script).is_file() for _, script, _ in rows)


def test_quality_warm_up_caches_the_self_samples_the_rows_share():
    """A suite whose rows all ask for N self-samples (and nothing else that changes them) warms up N, once."""
    suites = quality.suites("/data")
    assert quality.shared_calib_samples([opts for *_, opts in suites["full"]]) == 4096
    assert quality.shared_calib_samples([opts for *_, opts in suites["tables"]]) is None  # the defaults
    assert quality.shared_calib_samples([["--calib-samples", "4096"], ["--calib-samples", "2048"]]) is None
    assert quality.shared_calib_samples([["--calib-samples", "8", "--calib-top-p", "0.9"]]) is None
    assert quality.shared_calib_samples([["--calib-samples", "8", "--calib-batch", "32"]]) == 8


def test_quality_levers_plot_reads_every_lever_from_its_json(tmp_path):
    """bench/plot_quality_levers.py: each lever's row is found in its JSON, the earlier default is BENCHMARKS §2's
    76.4 / 79.4%, and the chart is written."""
    import plot_quality_levers

    levers = plot_quality_levers.lever_gaps()
    assert len(levers) == len(plot_quality_levers.LEVERS)
    default = levers[0]
    assert default[1] == "default" and round(100 * default[2], 1) == 76.4 and round(100 * default[3], 1) == 79.4
    assert all(0.5 < wiki < 0.9 and 0.5 < ptb < 0.9 for _, _, wiki, ptb in levers)
    wiki = {label: w for label, _, w, _ in levers}  # a `spear run` record read too: the 80% row of §2
    assert round(100 * wiki["4096 samples, 1000 KL steps (spear run)"], 1) == 80.4
    assert round(100 * wiki["today's defaults: 4096 × 1500"], 1) == 80.8  # BENCHMARKS §2's first row
    plot_quality_levers.plot(levers, tmp_path / "levers.png")
    assert (tmp_path / "levers.png").read_bytes()[:4] == b"\x89PNG"


def test_spear_run_record_times_the_main_job_in_its_own_process(tiny_model_dir, tmp_path):
    """bench/spear_run.py: the child's report comes back whole, with the wall seconds around it."""
    import spear_run

    record = spear_run.timed_run(str(tiny_model_dir), ["--quick", "--seqlen", "64", "--device", "cpu"], tmp_path / "r")
    assert record["report"]["w4_ppl"] > 0 and (tmp_path / "r" / "report.json").is_file()
    assert record["wall_s"] >= record["report"]["seconds"]["total"] > 0


def test_gate_drop_leaves_the_static_form_of_each_ec():
    """bench/gate_drop.py: with the gates dropped, each EC computes alpha·B·A x (what vLLM's static LoRA serves)."""
    import torch

    import gate_drop
    from spear.layer import ErrorCompensator, SpearLinear
    from spear.record import QuantConfig, rtn_quantize

    torch.manual_seed(0)
    layer = SpearLinear(rtn_quantize(torch.randn(24, 32), QuantConfig(bits=4)))
    layer.ec = ErrorCompensator(32, 24, rank=4, gate_hidden=8, alpha=0.7)
    for p in layer.ec.parameters():
        torch.nn.init.normal_(p)  # the gate's last layer too, so gamma is not 1
    x = torch.randn(5, 32)
    static = (x @ layer.ec.A.t()) @ (layer.ec.alpha * layer.ec.B).t()
    assert not torch.allclose(layer.ec(x), static)
    model = torch.nn.Sequential(layer)
    assert gate_drop.drop_gates(model) == 1 and gate_drop.drop_gates(model) == 0
    torch.testing.assert_close(layer.ec(x), static)


def test_eval_memory_scores_both_variants_to_the_same_perplexity(tiny_model_dir, tmp_path):
    """bench/eval_memory.py: dense copies and codes only, each in its own process, the same windows, equal
    perplexities, and the codes-only model's `spear eval` load holds no dense copy (tests/test_eval.py)."""
    import eval_memory

    from spear.api import quantize
    from spear.quant.pipeline import QuantSettings
    from spear.record import QuantConfig

    art = quantize(str(tiny_model_dir), QuantSettings("rtn", QuantConfig(4, 32)), tmp_path / "art")
    rows = [eval_memory.run_variant(str(art), "cpu", 2, v) for v in ("dense", "codes")]
    assert [r["rc"] for r in rows] == [0, 0], rows
    assert rows[0]["ppl"] == rows[1]["ppl"] and rows[0]["windows"] == 2
    assert all(r["peak_bytes"] > 0 and r["peak_kind"] == "rss" for r in rows)
    batched = eval_memory.run_variant(str(art), "cpu", 2, "codes", batch=2)  # both windows in one forward
    assert batched["rc"] == 0 and batched["ppl"] == pytest.approx(rows[1]["ppl"], rel=1e-5)
