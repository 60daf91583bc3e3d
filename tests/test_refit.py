"""Joint fitting (compensate.refit): RTN and GPTQ codes re-rounded with the EC's low-rank part in place, the EC refitted."""

import copy

import pytest
import torch

from conftest import make_tiny_llama
from spear.compensate.init import WhitenedError
from spear.data.calibration import CalibConfig
from spear.compensate.pipeline import CompensateConfig, compensate, quantized_layers
from spear.compensate.refit import Rounding, refit_module
from spear.compensate.stats import collect_input_stats
from spear.errors import SpearError
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig, rtn_quantize

CFG = QuantConfig(bits=3)
RTN = Rounding(QuantSettings("rtn", CFG))


@pytest.fixture(scope="module")
def float_and_quantized():
    teacher = make_tiny_llama(hidden=64, layers=2)
    student = copy.deepcopy(teacher)
    quantize_model(student, QuantSettings("rtn", CFG))
    ids = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(0))
    return teacher, student, ids


def test_refit_keeps_the_round_of_least_whitened_residual(float_and_quantized):
    """Each round's residual is Σ_{i>r} σ²_i of the whitened error it leaves; the kept round's codes are RTN of
    W − B A of the round before, and its factors are QERA's of what those codes leave."""
    teacher, _, ids = float_and_quantized
    name = "model.layers.0.mlp.down_proj"
    stats = collect_input_stats(teacher, ids, [name])[name]
    W = teacher.get_submodule(name).weight.detach()
    w_hat = rtn_quantize(W, CFG).dequantize()
    none = refit_module(W, w_hat, stats, 4, RTN, 0)
    A0, B0 = WhitenedError.of(W, w_hat, stats, 4).factors(W, w_hat, 4)
    assert none.record is None and torch.equal(none.A, A0) and torch.equal(none.B, B0)
    refit = refit_module(W, w_hat, stats, 4, RTN, 3)
    assert len(refit.residuals) == 4 and refit.residuals[:1] == none.residuals
    planned = refit_module(W, w_hat, stats, 4, RTN, 3, first=WhitenedError.of(W, w_hat, stats, 16))  # the planner's SVD
    assert planned.residuals == refit.residuals and torch.equal(planned.A, refit.A) and torch.equal(planned.B, refit.B)
    assert refit.residuals[refit.kept] == min(refit.residuals) < refit.residuals[0]  # the alternation helped here
    kept = refit.record.dequantize()
    error = WhitenedError.of(W, kept, stats, 4)
    assert error.spectrum[4:].sum().item() == pytest.approx(refit.residuals[refit.kept], rel=1e-9)
    assert torch.allclose(refit.A, error.factors(W, kept, 4)[0])


def test_compensate_refits_the_planned_modules_codes_only(float_and_quantized):
    teacher, quantized, ids = float_and_quantized
    student = copy.deepcopy(quantized)
    report = compensate(student, teacher, ids, CompensateConfig(kind="qera", budget=0.05, refit_rounds=2), rounding=RTN)
    planned = {e.name for e in report.plan.entries}
    before, after = quantized_layers(quantized), quantized_layers(student)
    changed = {n for n in after if not torch.equal(after[n].codes, before[n].codes)}
    assert changed and changed <= planned  # modules without an EC keep RTN's codes
    for n in changed:  # the dense copy follows the record
        assert torch.equal(after[n].weight_hat, after[n].qweight.dequantize(after[n].dtype))
    assert report.refit["rounds"] == 2 and report.refit["residual_kept"] < 1.0
    assert sum(report.refit["modules_by_kept_round"]) == len(planned)
    assert report.summary()["refit"] == report.refit and "refit" in report.seconds


def test_refit_is_refused_where_the_codes_are_not_rtns(float_and_quantized):
    teacher, quantized, ids = float_and_quantized
    with pytest.raises(SpearError, match="not quantized by SPEAR's RTN or GPTQ"):
        compensate(copy.deepcopy(quantized), teacher, ids, CompensateConfig(kind="qera", refit_rounds=1))
    with pytest.raises(SpearError, match="refits QERA's factors"):
        CompensateConfig(kind="lorc", refit_rounds=1)


def test_refit_rounds_default_to_three_where_spear_rounded_the_codes(float_and_quantized):
    """The default (None) runs REFIT_ROUNDS where SPEAR rounded the codes (RTN, GPTQ) and QERA initialises the EC,
    none elsewhere (AWQ, OmniQuant, imported codes: not refused); an explicit count wins."""
    from spear.compensate.pipeline import REFIT_ROUNDS

    assert REFIT_ROUNDS == 3 and CompensateConfig().refit_rounds is None
    assert [CompensateConfig(kind=k).refit_rounds_for(True) for k in ("adaptive", "qera", "lqer")] == [3, 3, 0]
    assert CompensateConfig().refit_rounds_for(False) == 0 and CompensateConfig(refit_rounds=1).refit_rounds_for(True) == 1
    teacher, quantized, ids = float_and_quantized
    for rounding in (RTN, Rounding(QuantSettings("gptq", CFG))):
        auto = compensate(copy.deepcopy(quantized), teacher, ids, CompensateConfig(kind="qera", budget=0.05),
                          rounding=rounding)
        assert auto.refit["rounds"] == REFIT_ROUNDS
    other = compensate(copy.deepcopy(quantized), teacher, ids, CompensateConfig(kind="qera", budget=0.05))
    assert other.refit is None and "refit" not in other.seconds
    from spear.run import QUICK_REFIT_ROUNDS, RunConfig, quick_calibration

    quick = {ours: quick_calibration(CalibConfig(), CompensateConfig(), ours=ours)[1].refit_rounds for ours in (1, 0)}
    assert quick == {1: QUICK_REFIT_ROUNDS, 0: 0}
    assert quick_calibration(CalibConfig(), CompensateConfig(refit_rounds=2))[1].refit_rounds == 2
    rounds = {m: RunConfig.build("smollm2", QuantSettings(m, CFG), CalibConfig(), quick=True).compensate.refit_rounds
              for m in ("rtn", "gptq", "awq")}
    assert rounds == {"rtn": QUICK_REFIT_ROUNDS, "gptq": QUICK_REFIT_ROUNDS, "awq": 0}


def test_cli_refuses_refit_of_codes_not_rtns_before_any_work(tiny_model_dir, tmp_path, capsys):
    from spear.cli import main

    rc = main(["run", str(tiny_model_dir), "--method", "awq", "--refit-rounds", "2", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--joint-rounds re-round RTN or GPTQ codes" in err
    assert not (tmp_path / "r").exists()  # nothing quantized, nothing written


def test_gptq_codes_are_refit_by_gptq_on_the_ec_corrected_weight(float_and_quantized):
    """GPTQ's codes are re-rounded by GPTQ of W − B A on the layer's input Hessian (Σ x xᵀ), not by RTN: the kept
    round's record is that GPTQ's, and the alternation lowers the whitened residual as it does for RTN."""
    from spear.quant.gptq import gptq_quantize

    teacher, _, ids = float_and_quantized
    name = "model.layers.0.mlp.down_proj"
    stats = collect_input_stats(teacher, ids, [name])[name]
    W = teacher.get_submodule(name).weight.detach()
    gptq = Rounding(QuantSettings("gptq", CFG))
    w_hat = gptq_quantize(W, stats.sum_xx, CFG, act_order=True).dequantize()
    one = refit_module(W, w_hat, stats, 4, gptq, 1)
    A0, B0 = WhitenedError.of(W, w_hat, stats, 4).factors(W, w_hat, 4)
    again = gptq_quantize(W - (B0.double() @ A0.double()).float(), stats.sum_xx, CFG, act_order=True)
    assert len(one.residuals) == 2 and one.residuals[1] < one.residuals[0]
    assert one.kept == 1 and torch.equal(one.record.codes, again.codes)
    assert not torch.equal(again.codes, rtn_quantize(W - (B0.double() @ A0.double()).float(), CFG).codes)
    assert Rounding.of(QuantSettings("awq", CFG)) is None and Rounding.of(QuantSettings("gptq", CFG)) == gptq
    assert Rounding.of(None) is None


def test_reround_under_ecs_removes_the_trained_ecs_mean_linear_part(float_and_quantized):
    """After calibration the codes are RTN of W − α B diag(E γ(A x)) A: the gate's mean over the tokens, measured by
    hooks on the ECs, scales A's rows; the EC itself is left as it is."""
    from spear.compensate.init import attach_ec
    from spear.compensate.refit import mean_gates, reround_under_ecs

    teacher, quantized, ids = float_and_quantized
    student = copy.deepcopy(quantized)
    name = "model.layers.1.self_attn.o_proj"
    layer = quantized_layers(student)[name]
    g = torch.Generator().manual_seed(1)
    attach_ec(layer, 0.1 * torch.randn(4, layer.in_features, generator=g),
              0.1 * torch.randn(layer.out_features, 4, generator=g), gate_hidden=8)
    with torch.no_grad():
        layer.ec.gate[2].weight.normal_(0, 0.5, generator=g)
        layer.ec.alpha.fill_(0.7)
    seen = []
    hook = layer.register_forward_pre_hook(lambda m, inputs: seen.append(inputs[0].reshape(-1, m.in_features)))
    gates = mean_gates(student, ids[:4], batch_size=2)
    hook.remove()
    x = torch.cat(seen)
    A, B = layer.ec.factors()
    expected = layer.ec.gamma(x @ A.t()).mean(0)
    assert set(gates) == {name} and torch.allclose(gates[name], expected, atol=1e-5)
    assert not torch.allclose(expected, torch.ones_like(expected), atol=1e-2)  # a gate that moves
    W = teacher.get_submodule(name).weight.detach()
    ec_before = {k: v.clone() for k, v in layer.ec.state_dict().items()}
    assert reround_under_ecs(quantized_layers(student), {name: W}, RTN, gates) == 1
    target = W - 0.7 * (B.double() @ (gates[name][:, None] * A).double()).float()
    assert torch.equal(layer.qweight.codes, rtn_quantize(target, CFG).codes)
    assert all(torch.equal(v, layer.ec.state_dict()[k]) for k, v in ec_before.items())
    others = [n for n in quantized_layers(student) if n != name]
    assert all(torch.equal(quantized_layers(student)[n].codes, quantized_layers(quantized)[n].codes) for n in others)


def test_joint_rounds_keep_the_training_of_least_kl(float_and_quantized):
    """`joint_rounds` trainings after the first, each after a re-rounding; the report lists every training's
    held-out KL and the state kept is the least's: its codes are the re-rounded ones only when a later round won."""
    teacher, quantized, ids = float_and_quantized
    student = copy.deepcopy(quantized)
    from spear.compensate.calibrate import CalibrateConfig

    cfg = CompensateConfig(budget=0.05, refit_rounds=0, joint_rounds=2,
                           calibrate=CalibrateConfig(steps=6, batch_size=4, eval_every=2, progress=False))
    report = compensate(student, teacher, ids, cfg, rounding=RTN)
    kl = report.joint_kl
    assert len(kl) == 3 and report.calibration.final_heldout_kl == min(kl)
    assert report.calibration.steps <= 6 // 3 and report.summary()["joint_kl"] == kl
    with_ec = {n for n, m in quantized_layers(student).items() if m.ec is not None}
    moved = {n for n in quantized_layers(student)
             if not torch.equal(quantized_layers(student)[n].codes, quantized_layers(quantized)[n].codes)}
    assert moved <= with_ec and bool(moved) == (kl.index(min(kl)) > 0)
    with pytest.raises(SpearError, match="adaptive EC only"):
        CompensateConfig(kind="qera", joint_rounds=1)
    with pytest.raises(SpearError, match="not quantized by SPEAR's RTN or GPTQ"):
        compensate(copy.deepcopy(quantized), teacher, ids, CompensateConfig(joint_rounds=1))


@pytest.mark.parametrize("quant", [QuantConfig(bits=4), QuantConfig(bits=4, group_size=16),
                                   QuantConfig(bits=3, sym=False), QuantConfig(bits=4, sym_grid="gptq")])
def test_clipped_rtn_picks_each_rows_clip_by_whitened_error_on_rtns_own_grid(quant):
    """clipped_rtn's record is RTN's layout (bits, grid, zero points); each row is RTN of its weights on a grid fitted
    to c·w for one c of CLIP_RATIOS, the c of least whitened error, so no row's error exceeds plain RTN's."""
    from spear.compensate.refit import CLIP_RATIOS, clipped_rtn
    from spear.compensate.stats import InputStats
    from spear.record import fit_grid, quantize_to_codes

    gen = torch.Generator().manual_seed(0)
    W = torch.randn(24, 64, generator=gen)
    W[:, 5] *= 6  # an outlier column: clipping pays on most rows
    stats = InputStats.zeros(64)
    stats.update(torch.randn(500, 64, generator=gen) * torch.linspace(0.2, 2.0, 64))
    S = stats.r_xx_sqrt().float()
    plain, clipped = rtn_quantize(W, quant), clipped_rtn(W, quant, stats)
    assert (clipped.bits, clipped.group_size, clipped.codes.shape) == (plain.bits, plain.group_size, plain.codes.shape)
    if quant.sym:
        assert torch.equal(clipped.zeros, plain.zeros)
    row_error = lambda q: ((W - q.dequantize(torch.float32)) @ S).pow(2).sum(1)
    assert (row_error(clipped) <= row_error(plain) * (1 + 1e-6)).all()
    assert row_error(clipped).sum() < row_error(plain).sum()
    g = quant.group_size_for(64)
    for row in (0, 7, 23):
        w = W[row].reshape(-1, g)
        candidates = []
        for c in CLIP_RATIOS:
            scale, zero = fit_grid(w * c, quant)
            q = (quantize_to_codes(w, scale[:, None], zero[:, None], quant) - zero[:, None]) * scale[:, None]
            candidates.append(((W[row] - q.reshape(-1)) @ S).pow(2).sum().item())
        assert row_error(clipped)[row].item() == pytest.approx(min(candidates), rel=1e-5)


@pytest.mark.parametrize("rounding", [RTN, Rounding(QuantSettings("gptq", CFG))], ids=["rtn", "gptq"])
def test_compensate_clips_the_codes_when_it_refits_them_unless_told_not_to(float_and_quantized, rounding):
    """refit_clip (the default) rounds every refit round with clipped_rtn or clipped_gptq; without it, plain RTN or
    GPTQ as before."""
    teacher, quantized, ids = float_and_quantized
    residuals = {}
    for clip in (False, True):
        student = copy.deepcopy(quantized)
        report = compensate(student, teacher, ids, CompensateConfig(kind="qera", budget=0.05, refit_rounds=2,
                                                                    refit_clip=clip), rounding=rounding)
        residuals[clip] = report.refit["residual_kept"]
        assert report.refit["clip"] is clip
    assert CompensateConfig().refit_clip and residuals[True] < residuals[False]


@pytest.mark.parametrize("quant,act_order", [(QuantConfig(bits=4), True), (QuantConfig(bits=4, group_size=16), False),
                                             (QuantConfig(bits=3, sym=False), True)])
def test_clipped_gptq_takes_each_rows_best_clip_of_separate_gptq_sweeps(quant, act_order):
    """clipped_gptq's one stacked sweep gives each row what GPTQ alone gives it at that row's clip: each row equals
    GPTQ of W with every row clipped by the same c, for the c of least Hessian error; c = 1 is plain GPTQ, so no
    row's error exceeds it, and the record keeps GPTQ's layout."""
    from spear.compensate.refit import GPTQ_CLIP_RATIOS, clipped_gptq
    from spear.quant.gptq import gptq_quantize

    gen = torch.Generator().manual_seed(1)
    W = torch.randn(16, 64, generator=gen)
    W[torch.rand(W.shape, generator=gen) < 0.02] *= 6  # outliers: clipping pays on some rows, not all
    X = torch.randn(400, 64, generator=gen) * torch.linspace(0.2, 2.0, 64)
    H = X.T @ X / len(X)
    settings = QuantSettings("gptq", quant, gptq_act_order=act_order)
    gptq = lambda c: gptq_quantize(W, H, quant, settings.gptq_damp, settings.gptq_block_size, act_order=act_order,
                                   clip=torch.full((16,), c))
    row_error = lambda q: (((W - q.dequantize()) @ H) * (W - q.dequantize())).sum(1)
    clipped = clipped_gptq(W, H, settings)
    sweeps = [gptq(c) for c in GPTQ_CLIP_RATIOS]
    assert (clipped.bits, clipped.group_size, clipped.codes.shape) == (quant.bits, quant.group_size_for(64), (16, 64))
    best = torch.stack([row_error(q) for q in sweeps]).argmin(0)
    for row in range(16):
        assert torch.allclose(clipped.dequantize()[row], sweeps[best[row]].dequantize()[row], atol=1e-5)
    plain = gptq_quantize(W, H, quant, settings.gptq_damp, settings.gptq_block_size, act_order=act_order)
    assert torch.equal(sweeps[0].codes, plain.codes)
    assert (row_error(clipped) <= row_error(plain) * (1 + 1e-5)).all()
    assert row_error(clipped).sum() < row_error(plain).sum()


def test_clipped_gptq_gives_the_same_record_in_sweeps_of_any_size(monkeypatch):
    """A large layer's candidates are swept a few c's at a time (STACKED_WEIGHTS); the chosen rows are the same."""
    import spear.compensate.refit as refit

    gen = torch.Generator().manual_seed(2)
    W = torch.randn(8, 32, generator=gen)
    W[torch.rand(W.shape, generator=gen) < 0.05] *= 5
    X = torch.randn(200, 32, generator=gen)
    settings = QuantSettings("gptq", QuantConfig(bits=4))
    whole = refit.clipped_gptq(W, X.T @ X, settings)
    monkeypatch.setattr(refit, "STACKED_WEIGHTS", 2 * W.numel())  # 2 c's a sweep: 5 sweeps
    swept = refit.clipped_gptq(W, X.T @ X, settings)
    assert torch.equal(whole.dequantize(), swept.dequantize())
