"""ECs on AWQ-rescaled linears: the rescaling is read back from the weights, and the ECs fitted in the float basis
correct the rescaled model."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from test_awq import calib_and_test, llama_with_outliers

from spear.cli import main
from spear.compensate.basis import check_quantization_of, fit_rescaling, read_rescalings, relative_error
from spear.compensate.calibrate import CalibrateConfig
from spear.compensate.pipeline import CompensateConfig, compensate
from spear.errors import SpearError
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig, rtn_quantize

CFG = QuantConfig(bits=4, group_size=-1)


def rescaled_quantization(spread: float = 1.0, seed: int = 0):
    """(W, Ŵ' = diag(1/t) Q(W diag(s)), s, t) with log-normal s and t, AWQ-like at spread ≈ 1."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(48, 96, generator=gen)
    s = torch.exp(spread * torch.randn(96, generator=gen))
    t = torch.exp(0.5 * torch.randn(48, generator=gen))
    return W, rtn_quantize(W * s, CFG).dequantize() / t[:, None], s, t


def test_a_foreign_float_model_is_refused():
    W = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    check_quantization_of("m", W, rtn_quantize(W, QuantConfig(bits=2, group_size=-1)).dequantize())  # coarse, but W's
    other = torch.randn(48, 96, generator=torch.Generator().manual_seed(9))
    with pytest.raises(SpearError, match="no quantization of the float model"):
        check_quantization_of("layers.0.mlp.up_proj", W, rtn_quantize(other, CFG).dequantize())


def test_weights_give_the_rescaling_but_not_of_blind_channels():
    W, w_hat, s, _ = rescaled_quantization(spread=1.0)
    blind = w_hat.abs().sum(0) == 0
    assert blind.any()  # channels scaled down to nothing: the weights cannot give their s
    _, identified = fit_rescaling(W, w_hat)
    assert not (identified & blind).any() and identified.float().mean() > 0.8  # (a lone nonzero entry: not enough)
    assert fit_rescaling(W, rtn_quantize(W, CFG).dequantize())[1].all()
    W, w_hat, s, t = rescaled_quantization(spread=0.5)
    fit, identified = fit_rescaling(W, w_hat)
    c = (fit.s[identified] / s[identified]).median()  # (s, t) up to one common factor, which the maps do not see
    assert (fit.s[identified] / c / s[identified] - 1).abs().median() < 0.05  # columns of few nonzeros: biased
    assert torch.allclose(fit.t / c, t.double(), rtol=0.1)
    exact = rtn_quantize(W * s, CFG).dequantize() / s  # Q(W diag(s)) diag(s)⁻¹: what AWQ's search compares with W
    assert relative_error(exact, fit.to_float_basis(w_hat)) < 0.1 < 0.5 < relative_error(W, w_hat)


def test_factors_map_to_the_student_basis():
    W, w_hat, s, _ = rescaled_quantization()
    r = fit_rescaling(W, w_hat)[0]
    A, B = torch.randn(4, 96, dtype=torch.float64), torch.randn(48, 4, dtype=torch.float64)
    x = torch.randn(96, 5, dtype=torch.float64)
    A2, B2 = r.to_student(A, B)
    assert torch.allclose(A2 @ (x / r.s[:, None]), A @ x)  # the rank-space u the gate sees is unchanged
    assert torch.allclose(B2 @ A2 @ (x / r.s[:, None]), (B @ A @ x) / r.t[:, None])  # y' = y / t


def _kl(model, ref, ids):
    with torch.no_grad():
        logits = model(ids).logits
    return F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean").item()


@pytest.fixture(scope="module")
def awq_model():
    teacher = llama_with_outliers(kv_heads=4)  # MHA: AWQ also rescales v→o, so v_proj's outputs are rescaled too
    calib, test = calib_and_test()
    student = copy.deepcopy(teacher)
    quantize_model(student, QuantSettings(method="awq", quant=QuantConfig(bits=3, group_size=32), awq_grid=10), calib)
    with torch.no_grad():
        ref = teacher(test).logits
    return teacher, student, calib, test, ref


def test_awqs_scales_are_read_back(awq_model):
    teacher, student, calib, _, _ = awq_model
    names = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "mlp.up_proj")]
    rescalings = read_rescalings(teacher, student, calib, names)
    assert set(rescalings) == set(names)
    for i in range(2):  # where the op before is a norm, AWQ's s is the ratio of the norms' weights
        for norm, linear in (("input_layernorm", "self_attn.q_proj"), ("post_attention_layernorm", "mlp.up_proj")):
            layer_f, layer_q = teacher.model.layers[i], student.model.layers[i]
            s = getattr(layer_f, norm).weight.double() / getattr(layer_q, norm).weight.double()
            ratio = rescalings[f"model.layers.{i}.{linear}"].s / s
            error = (ratio / ratio.median() - 1).abs()  # up to the common factor; 3-bit rounding and clipping: a few %
            assert error.mean() < 0.05 and error.max() < 0.2


def test_linears_awq_left_alone_are_not_rescaled():
    teacher = llama_with_outliers(kv_heads=2)  # grouped-query attention: AWQ does not rescale v→o
    calib, _ = calib_and_test()
    student = copy.deepcopy(teacher)
    quantize_model(student, QuantSettings(method="awq", quant=QuantConfig(bits=4, group_size=-1), awq_grid=10), calib)
    names = ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    assert read_rescalings(teacher, student, calib, names) == {}


def test_static_ecs_on_awq_need_the_float_basis(awq_model):
    teacher, student, calib, test, ref = awq_model
    plain = _kl(student, ref, test)
    aligned = copy.deepcopy(student)
    report = compensate(aligned, teacher, calib, CompensateConfig(kind="qera", budget=0.3), rescaled=True)
    assert report.plan.entries
    raw = copy.deepcopy(student)
    compensate(raw, teacher, calib, CompensateConfig(kind="qera", budget=0.3))  # Ŵ' compared with W as it is
    assert _kl(aligned, ref, test) < 0.8 * plain
    assert _kl(aligned, ref, test) < 0.8 * _kl(raw, ref, test)


def test_adaptive_ecs_lower_awq_kl(awq_model):
    teacher, student, calib, test, ref = awq_model
    plain = _kl(student, ref, test)
    student = copy.deepcopy(student)
    fast = CalibrateConfig(steps=15, batch_size=4, eval_every=5, patience=10, progress=False)
    report = compensate(student, teacher, calib, CompensateConfig(budget=0.3, calibrate=fast), rescaled=True)
    assert report.calibration.final_heldout_kl < report.calibration.initial_heldout_kl
    assert _kl(student, ref, test) < 0.8 * plain


def test_cli_compensates_an_awq_artifact(tiny_model_dir, tmp_path, capsys):
    art = tmp_path / "awq"
    assert main(["quantize", str(tiny_model_dir), "--method", "awq", "--bits", "4", "--group-size", "32",
                 "--calib-samples", "8", "--calib-len", "32", "--out", str(art), "--device", "cpu"]) == 0
    rc = main(["compensate", str(art), "--budget", "10%", "--steps", "3", "--calib-samples", "8", "--calib-len", "32",
               "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    assert json.loads((art / "config.json").read_text())["ec_modules"]
