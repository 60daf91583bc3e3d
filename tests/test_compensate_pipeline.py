"""The whole compensation chain on a tiny model: plan within budget, KL falls, artifacts round-trip exactly."""

import copy
import json
import re

import pytest
import torch

from conftest import make_tiny_llama
from spear.artifact import ArtifactInfo, load_artifact, save_artifact
from spear.cli import main
from spear.compensate.calibrate import CalibrateConfig
from spear.compensate.pipeline import CompensateConfig, compensate, quantized_layers
from spear.compensate.planner import PlannerConfig
from spear.errors import SpearError
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig

FAST = CalibrateConfig(steps=15, batch_size=4, eval_every=5, patience=10, progress=False)
# fp16 factors where a test is about the pipeline, not the factors' bits: on this tiny random model, 15 steps of
# int8 factors (the default) do not beat their QERA init on held-out KL
FP16 = PlannerConfig(factor_bits=16)


@pytest.fixture(scope="module")
def float_and_quantized():
    teacher = make_tiny_llama(hidden=64, layers=2)
    student = copy.deepcopy(teacher)
    quantize_model(student, QuantSettings("rtn", QuantConfig(bits=3)))
    ids = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(0))
    return teacher, student, ids


@pytest.mark.parametrize("kind", ["adaptive", "lorc", "lqer", "qera"])
def test_compensate_respects_budget_and_attaches_ecs(kind, float_and_quantized):
    teacher, quantized, ids = float_and_quantized
    student = copy.deepcopy(quantized)
    report = compensate(student, teacher, ids, CompensateConfig(kind=kind, budget=0.05, calibrate=FAST, planner=FP16))
    with_ec = {n for n, m in quantized_layers(student).items() if m.ec is not None}
    assert with_ec == {e.name for e in report.plan.entries} and with_ec
    assert report.ec_bytes <= 0.05 * report.w4_bytes and report.plan.mode == "marginal"
    gated = {m.ec.gate is not None for n, m in quantized_layers(student).items() if n in with_ec}
    assert gated == {kind == "adaptive"}
    if kind == "adaptive":
        assert report.calibration.final_heldout_kl < report.calibration.initial_heldout_kl
    else:
        assert report.calibration is None


def test_gate_off_trains_a_static_ec_with_the_gate_bytes_spent_on_rank(float_and_quantized):
    """gate=False: the same KL training, no gate on any EC, and the bytes the gates would take go to rank."""
    teacher, quantized, ids = float_and_quantized
    reports = {}
    for gate in (True, False):
        student = copy.deepcopy(quantized)
        reports[gate] = compensate(student, teacher, ids, CompensateConfig(budget=0.05, calibrate=FAST, gate=gate,
                                                                          planner=FP16))
        assert {m.ec.gate is None for m in quantized_layers(student).values() if m.ec is not None} == {not gate}
    off = reports[False]
    assert off.kind == "adaptive, no gate" and reports[True].kind == "adaptive"
    assert off.calibration.final_heldout_kl < off.calibration.initial_heldout_kl
    assert off.ec_bytes <= 0.05 * off.w4_bytes
    rank_sum = {gate: sum(e.rank for e in r.plan.entries) for gate, r in reports.items()}
    assert rank_sum[False] > rank_sum[True]
    with pytest.raises(SpearError, match="only the adaptive EC has a gate"):
        CompensateConfig(kind="qera", gate=False)


def test_cli_no_gate_with_a_static_kind_is_one_line(capsys):
    assert main(["compensate", "x", "--kind", "lqer", "--no-gate"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--no-gate applies to --kind adaptive" in err and len(err.splitlines()) == 1


def test_compensated_artifact_roundtrips_exactly(float_and_quantized, tiny_model_dir, tmp_path):
    from spear.models import load_float_model

    teacher, quantized, ids = float_and_quantized
    student = copy.deepcopy(quantized)
    report = compensate(student, teacher, ids, CompensateConfig(budget=0.3, calibrate=FAST))
    tokenizer = load_float_model(str(tiny_model_dir), torch.device("cpu"), torch.float32).tokenizer
    plan = json.loads(report.plan.to_json())
    save_artifact(student, tokenizer, tmp_path / "art", ArtifactInfo("tiny", {"method": "rtn"}, plan=plan))
    back = load_artifact(tmp_path / "art", torch.device("cpu"), torch.float32).model
    with torch.no_grad():
        assert torch.equal(back(ids[:2]).logits, student(ids[:2]).logits)
    config = json.loads((tmp_path / "art" / "config.json").read_text())
    assert config["plan"]["mode"] == report.plan.mode and len(config["ec_modules"]) == len(report.plan.entries)


def test_bad_budget_and_kind():
    with pytest.raises(SpearError, match="budget"):
        CompensateConfig(budget=1.5)
    with pytest.raises(SpearError, match="unknown EC kind"):
        CompensateConfig(kind="magic")


def test_cli_compensate_then_eval(tiny_model_dir, tmp_path, capsys):
    art = tmp_path / "art"
    assert main(["quantize", str(tiny_model_dir), "--bits", "3", "--out", str(art), "--device", "cpu"]) == 0
    rc = main(["compensate", str(art), "--budget", "30%", "--steps", "5", "--calib-samples", "8", "--calib-len", "32",
               "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 0, err
    # each stage says when it is done and what it took, in order (a run cut short shows how far it got)
    stages = re.findall(r"^spear: (.+) done in [0-9.]+ s", err, re.M)
    assert stages == ["load", "calibration sequences", "sensitivity", "spectra", "refit", "init", "calibration"]
    config = json.loads((art / "config.json").read_text())
    assert config["ec_modules"] and config["compensation"]["ec_memory_pct"] <= 30
    for png in ("sensitivity.png", "plan_ranks.png"):
        assert (art / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((art / "plan.json").read_text())["why"].startswith("marginal")
    capsys.readouterr()
    assert main(["eval", str(art), "--json", "--seqlen", "64", "--max-windows", "1", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["ppl"] > 0


def test_cli_budget_parse_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["compensate", "x", "--budget", "lots"])
    assert e.value.code == 2 and "budget" in capsys.readouterr().err


@pytest.mark.parametrize("budget", ["0", "0%", "150%", "1.5"])
def test_cli_budget_out_of_range(budget, capsys):
    with pytest.raises(SystemExit) as e:
        main(["compensate", "x", "--budget", budget])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "budget must be between 0% and 100%" in err and len(err.splitlines()) == 1


def test_gpt2_conv1d_model_is_refused_naming_what_runs():
    from transformers import GPT2Config, GPT2LMHeadModel

    from spear.quant.pipeline import check_shapes

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32))
    with pytest.raises(SpearError, match="Conv1D.*nn.Linear.*serves llama, mistral") as e:
        check_shapes(model, QuantConfig(bits=4))
    assert len(str(e.value).splitlines()) == 1


def test_model_without_linear_layers_is_refused():
    from types import SimpleNamespace

    from spear.quant.pipeline import check_shapes

    model = torch.nn.Module()
    model.config = SimpleNamespace(num_hidden_layers=2)
    model.layers = torch.nn.ModuleList([torch.nn.LayerNorm(8), torch.nn.LayerNorm(8)])
    with pytest.raises(SpearError, match="no linear layers"):
        check_shapes(model, QuantConfig(bits=4))
    with pytest.raises(SpearError, match="no linear layers"):
        quantize_model(model, QuantSettings("rtn", QuantConfig(bits=4)))
    with pytest.raises(SpearError, match="no quantized layers"):
        compensate(model, model, torch.zeros(2, 4, dtype=torch.long))


def test_input_statistics_read_at_most_stats_sequences(float_and_quantized, monkeypatch):
    """The inits' R_xx comes from the first `stats_sequences` calibration sequences, not all of them."""
    import spear.compensate.pipeline as pipeline

    teacher, quantized, ids = float_and_quantized
    seen = []
    for fn in ("collect_input_stats", "walk_input_stats"):  # the walk: the marginal plan with QERA inits
        real = getattr(pipeline, fn)
        monkeypatch.setattr(pipeline, fn, lambda model, calib, *a, real=real: seen.append(calib) or real(model, calib, *a))
    for kind in ("qera", "lqer"):
        seen.clear()
        compensate(copy.deepcopy(quantized), teacher, ids, CompensateConfig(kind=kind, budget=0.05, stats_sequences=5))
        assert len(seen) == 1 and torch.equal(seen[0], ids[:5])


def test_spectra_walked_a_layer_at_a_time_give_the_same_plan_and_factors(float_and_quantized, monkeypatch):
    """The default plan's statistics come from the layer walk (one layer's R_xx held at a time); the whole-model
    collection gives the same plan and the same EC factors."""
    import spear.compensate.pipeline as pipeline
    from spear.compensate.calibrate import ec_state_dict

    teacher, quantized, ids = float_and_quantized
    runs = []
    for walk in (True, False):
        if not walk:  # the walk's generator, replaced by one yielding the whole model's statistics at once
            monkeypatch.setattr(pipeline, "walk_input_stats", lambda m, c, names: iter([pipeline.collect_input_stats(m, c, names)]))
        student = copy.deepcopy(quantized)
        report = compensate(student, teacher, ids, CompensateConfig(kind="qera", budget=0.05))
        runs.append((report.plan.to_json(), ec_state_dict(student)))
    (plan_walk, ecs_walk), (plan_whole, ecs_whole) = runs
    assert plan_walk == plan_whole and ecs_walk.keys() == ecs_whole.keys()
    assert all(torch.equal(ecs_walk[k], ecs_whole[k]) for k in ecs_walk)
    with pytest.raises(SpearError, match="stats_sequences"):
        CompensateConfig(stats_sequences=0)


def test_int8_rounding_is_idempotent_and_passes_gradients_straight_through():
    from spear.layer import ErrorCompensator, int8_dequantize, int8_quantize, int8_round

    t = torch.randn(6, 40) * torch.logspace(-3, 1, 6)[:, None]  # rank directions of very different size
    q, scale = int8_quantize(t, dim=1)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (6,)
    once = int8_dequantize(q, scale, 1)
    assert torch.equal(int8_round(once, 1), once)  # what is stored rounds to itself
    assert ((once - t).abs() <= scale.float()[:, None] / 2 + 1e-6).all()  # half a step at most, each direction
    leaf = t.clone().requires_grad_()
    int8_round(leaf, 1).sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(t))
    from spear.compensate.cost import ec_nbytes

    for bits in (16, 8, 4):
        ec = ErrorCompensator(96, 64, rank=8, gate_hidden=4, factor_bits=bits)
        assert ec.nbytes() == ec_nbytes(64, 96, 8, 4, bits)
    assert ec_nbytes(64, 96, 8, 4, 8) < 0.6 * ec_nbytes(64, 96, 8, 4)
    assert ec_nbytes(64, 96, 8, 4, 4) < 0.6 * ec_nbytes(64, 96, 8, 4, 8)
    with pytest.raises(SpearError, match="16, 8 or 4"):
        ErrorCompensator(96, 64, rank=8, factor_bits=2)
    q4, scale4 = int8_quantize(t, dim=1, bits=4)  # the 4-bit measurement option: codes -7..7, a step of absmax / 7
    assert q4.abs().max() == 7 and torch.equal(int8_round(int8_dequantize(q4, scale4, 1), 1, 4),
                                               int8_dequantize(q4, scale4, 1))
    assert ((int8_dequantize(q4, scale4, 1) - t).abs() <= scale4.float()[:, None] / 2 + 1e-6).all()
    from spear.kernels.pack import pack_ec

    ec4 = ErrorCompensator(96, 64, rank=8, gate_hidden=4, factor_bits=4)
    ec4.A.data.normal_(), ec4.B.data.normal_()
    packed = pack_ec(ec4)  # served as the int8 form, the rounded factors the EC applies
    A4, B4 = ec4.factors()
    assert packed.int8 and packed.A.abs().max() <= 7
    assert torch.allclose(packed.dense_A()[:8].float(), A4.float(), rtol=1e-3, atol=1e-4)
    assert torch.allclose(packed.dense_B()[:, :8].float(), B4.float(), rtol=1e-3, atol=1e-4)


def test_four_bit_factors_are_refused_by_the_artifact(float_and_quantized, tiny_model_dir, tmp_path):
    """4-bit EC factors are a measurement (they lose to int8 at equal bytes, BENCHMARKS §2): an artifact refuses them
    in one line and leaves nothing behind."""
    from dataclasses import replace

    from spear.models import load_float_model

    teacher, quantized, ids = float_and_quantized
    cfg = CompensateConfig(budget=0.1, calibrate=replace(FAST, steps=1), planner=PlannerConfig(factor_bits=4))
    compensate(quantized, teacher, ids, cfg)
    tokenizer = load_float_model(str(tiny_model_dir), torch.device("cpu"), torch.float32).tokenizer
    with pytest.raises(SpearError, match="stored in 16 or 8 bits; .* has 4-bit factors"):
        save_artifact(quantized, tokenizer, tmp_path / "art", ArtifactInfo("tiny", {"method": "rtn"}))
    assert not (tmp_path / "art").exists()


def test_int8_factors_buy_more_rank_train_and_roundtrip(float_and_quantized, tiny_model_dir, tmp_path):
    """At one budget, 8-bit factors buy more rank than fp16 ones; calibration trains through their rounding; the
    artifact stores them as int8 with scales (fewer bytes), loads them back to the same logits, and exports them as
    the fp16 the plugin and the static LoRA read."""
    from dataclasses import replace

    from spear.artifact import read_ec_tensors
    from spear.compensate.planner import PlannerConfig
    from spear.models import load_float_model
    from spear.shards import ShardReader

    teacher, quantized, ids = float_and_quantized
    reports, students = {}, {}
    for bits in (16, 8):
        students[bits] = copy.deepcopy(quantized)
        cfg = CompensateConfig(budget=0.1, calibrate=FAST, planner=PlannerConfig(factor_bits=bits))
        reports[bits] = compensate(students[bits], teacher, ids, cfg)
    ranks = {bits: sum(e.rank for e in r.plan.entries) for bits, r in reports.items()}
    assert ranks[8] >= 1.6 * ranks[16], ranks
    for report in reports.values():
        assert report.ec_bytes <= 0.1 * report.w4_bytes
    calibration = reports[8].calibration  # the KL falls while the rounded factors train
    assert min(h["train_kl"] for h in calibration.history) < calibration.initial_train_kl
    student = students[8]
    ec = next(m.ec for m in quantized_layers(student).values() if m.ec is not None)
    assert ec.factor_bits == 8 and torch.equal(ec.factors()[0], ec.A)  # rounded as stored at the end

    tokenizer = load_float_model(str(tiny_model_dir), torch.device("cpu"), torch.float32).tokenizer
    save_artifact(student, tokenizer, tmp_path / "art", ArtifactInfo("tiny", {"method": "rtn"},
                                                                   plan=json.loads(reports[8].plan.to_json())))
    back = load_artifact(tmp_path / "art", torch.device("cpu"), torch.float32).model
    with torch.no_grad():
        assert torch.equal(back(ids[:2]).logits, student(ids[:2]).logits)
    reader = ShardReader(tmp_path / "art")
    name = next(n for n in reader.names() if n.endswith(".ec.A"))
    assert reader.get(name).dtype == torch.int8 and f"{name}_scale" in reader
    config = json.loads((tmp_path / "art" / "config.json").read_text())
    assert {m["factor_bits"] for m in config["ec_modules"].values()} == {8}
    stored = read_ec_tensors(reader, config)
    own = dict(back.named_parameters())
    assert all(torch.equal(v, own[k].float()) for k, v in stored.items())
    assert replace(PlannerConfig(factor_bits=8)).rank_cap == 2 * PlannerConfig(factor_bits=16).rank_cap


def test_budget_names_its_base(float_and_quantized, tiny_model_dir, tmp_path, capsys):
    """--budget 1% is a share of the whole 4-bit model; --budget 2%:linears of its quantized linears alone. The
    report gives the EC bytes against both."""
    teacher, quantized, ids = float_and_quantized
    reports = {}
    for base in ("model", "linears"):
        cfg = CompensateConfig(kind="qera", budget=0.1, budget_base=base)
        reports[base] = compensate(copy.deepcopy(quantized), teacher, ids, cfg)
    model, linears = reports["model"], reports["linears"]
    assert model.linear_bytes == linears.linear_bytes < model.w4_bytes  # the tiny model's embeddings count too
    assert model.ec_bytes <= 0.1 * model.w4_bytes and linears.ec_bytes <= 0.1 * linears.linear_bytes
    assert linears.ec_bytes < model.ec_bytes
    assert linears.summary()["ec_linears_pct"] == pytest.approx(100 * linears.ec_bytes / linears.linear_bytes)
    with pytest.raises(SpearError, match="budget base"):
        CompensateConfig(budget_base="embeddings")
    art = tmp_path / "art"
    assert main(["quantize", str(tiny_model_dir), "--bits", "3", "--out", str(art), "--device", "cpu"]) == 0
    assert main(["compensate", str(art), "--budget", "5%:linears", "--kind", "qera", "--calib-samples", "8",
                 "--calib-len", "32", "--device", "cpu"]) == 0
    summary = json.loads((art / "config.json").read_text())["compensation"]
    assert 0 < summary["ec_linears_pct"] <= 5 and summary["ec_memory_pct"] < summary["ec_linears_pct"]
    assert "of its 4-bit linears" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["compensate", str(art), "--budget", "2%:embeddings"])
    assert exit_info.value.code == 2 and "budget base" in capsys.readouterr().err
