"""ECs on AWQ-rescaled linears: the rescaling is read back from the weights, and the ECs fitted in the float basis
correct the rescaled model."""

import copy
import json

import pytest
import torch
from conftest import logits_kl
from test_awq import calib_and_test, llama_with_outliers

from spear.cli import main
from spear.compensate.basis import (
    Rescaling, check_quantization_of, column_scales, read_awq_rescalings, relative_error, row_scales,
)
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


def test_rows_and_columns_give_the_scales():
    W, w_hat, s, t = rescaled_quantization(spread=1.0)
    assert torch.allclose(row_scales(W, w_hat, s), t.double(), rtol=0.1)  # t given s: rows are never all zero
    W, w_hat, s, _ = rescaled_quantization(spread=1.0)
    w_hat = rtn_quantize(W * s, CFG).dequantize()  # t = 1: the linear after a rescaled one (o, down)
    blind = (w_hat != 0).sum(0) < 2
    assert blind.any()  # channels scaled down to nothing: their weights cannot give their s
    fallback = torch.full_like(s, 7.0)
    fitted = column_scales(W, w_hat, fallback)
    assert torch.equal(fitted[blind], fallback[blind].double())
    error = (fitted / s - 1).abs()
    assert error[s > 2].max() < 0.1 and error[s > 1].median() < 0.05  # the weights' large columns; few nonzeros: biased
    exact = rtn_quantize(W * s, CFG).dequantize() / s  # Q(W diag(s)) diag(s)⁻¹: what AWQ's search compares with W
    fit = Rescaling(fitted, torch.ones(48, dtype=torch.float64))
    assert relative_error(exact, fit.to_float_basis(w_hat)) < 0.25 < 1 < relative_error(W, w_hat)  # a 70× spread of s


def test_factors_map_to_the_student_basis():
    W, w_hat, s, t = rescaled_quantization()
    r = Rescaling(s.double(), t.double())
    A, B = torch.randn(4, 96, dtype=torch.float64), torch.randn(48, 4, dtype=torch.float64)
    x = torch.randn(96, 5, dtype=torch.float64)
    A2, B2 = r.to_student(A, B)
    assert torch.allclose(A2 @ (x / r.s[:, None]), A @ x)  # the rank-space u the gate sees is unchanged
    assert torch.allclose(B2 @ A2 @ (x / r.s[:, None]), (B @ A @ x) / r.t[:, None])  # y' = y / t


def _kl(model, ref, ids):
    with torch.no_grad():
        return logits_kl(ref, model(ids).logits)


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
    teacher, student, *_ = awq_model
    rescalings = read_awq_rescalings(teacher, student)
    assert len(rescalings) == 14  # 2 layers × 7 linears: under multi-head attention AWQ rescales v→o too
    for i in range(2):
        layer_f, layer_q = teacher.model.layers[i], student.model.layers[i]
        for norm, linear in (("input_layernorm", "self_attn.q_proj"), ("post_attention_layernorm", "mlp.up_proj")):
            s = getattr(layer_f, norm).weight.double() / getattr(layer_q, norm).weight.double()
            assert torch.equal(rescalings[f"model.layers.{i}.{linear}"].s, s)  # fold_scale divided the norm by s
        for linear, gain in (("self_attn.q_proj", 0.8), ("mlp.up_proj", 0.8), ("mlp.down_proj", 0.9),
                             ("self_attn.o_proj", 1.02)):  # AWQ's search left v→o nearly unscaled here
            n = f"model.layers.{i}.{linear}"
            W, w_hat = teacher.get_submodule(n).weight, student.get_submodule(n).weight_hat
            assert relative_error(W, rescalings[n].to_float_basis(w_hat)) < gain * relative_error(W, w_hat)


def test_linears_awq_left_alone_are_not_rescaled():
    teacher = llama_with_outliers(kv_heads=2)  # grouped-query attention: AWQ does not rescale v→o
    calib, _ = calib_and_test()
    student = copy.deepcopy(teacher)
    quantize_model(student, QuantSettings(method="awq", quant=QuantConfig(bits=4, group_size=-1), awq_grid=10), calib)
    rescalings = read_awq_rescalings(teacher, student)
    assert len(rescalings) == 12 and not any("o_proj" in n for n in rescalings)
    assert all(torch.equal(r.t, torch.ones_like(r.t)) for n, r in rescalings.items() if "v_proj" in n)


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
