"""OmniQuant's learnable weight clipping: the fake quantizer is RTN on the clipped range, training lowers a layer's
output error, and the quantized model beats RTN."""

import copy

import pytest
import torch
from conftest import logits_kl
from torch.nn.utils import parametrize
from test_awq import calib_and_test, llama_with_outliers

from spear.cli import main
from spear.layer import SpearLinear
from spear.models.layerwise import capture_layer_inputs, decoder_layers, layer_linears, quantizable_linears, run_layer
from spear.quant.omniquant import ClippedFakeQuant, train_layer_clipping
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig, rtn_quantize


@pytest.mark.parametrize("cfg", [QuantConfig(bits=4), QuantConfig(bits=3, group_size=32, sym=False),
                                 QuantConfig(bits=4, sym_grid="gptq")])
def test_fake_quant_is_rtn_of_the_clipped_weight(cfg):
    W = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    fq = ClippedFakeQuant(W, cfg)
    with torch.no_grad():
        fq.gamma_logit.uniform_(0.0, 3.0)  # clip ranges between σ(0) = 0.5 and σ(3) ≈ 0.95 of the max
        fq.beta_logit.uniform_(0.0, 3.0)
        fake = fq(W)
    record = rtn_quantize(fq.clipped(W), cfg).dequantize()  # what the quantizer stores
    # equal up to the record's fp16 scales: a weight may round the other way, one step at most
    step = (fake - record).abs().max()
    assert torch.isclose(fake, record, atol=1e-3).float().mean() > 0.97
    assert step < 0.6 * W.abs().max()
    assert not torch.allclose(fake, rtn_quantize(W, cfg).dequantize())  # the clipping acts


def test_gradients_reach_both_clip_logits():
    W = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    fq = ClippedFakeQuant(W, QuantConfig(bits=3, sym=False))
    fq(W).square().sum().backward()
    assert fq.gamma_logit.grad.abs().sum() > 0 and fq.beta_logit.grad.abs().sum() > 0


def test_training_lowers_the_layer_error_below_rtn():
    model = llama_with_outliers(kv_heads=2)
    calib, _ = calib_and_test()
    cfg = QuantConfig(bits=3, group_size=-1)
    inputs = capture_layer_inputs(model, list(calib.split(8)))
    layer = decoder_layers(model)[0]
    ref = run_layer(layer, inputs).hidden
    rtn, lwc = copy.deepcopy(layer), copy.deepcopy(layer)
    clipped = train_layer_clipping(lwc, inputs, ref, cfg, epochs=50, lr=5e-2)
    assert set(clipped) == set(layer_linears(layer))
    with torch.no_grad():
        for name, m in layer_linears(lwc).items():
            assert not parametrize.is_parametrized(m) and type(m.weight) is torch.nn.Parameter
            m.weight.copy_(rtn_quantize(clipped[name], cfg).dequantize())
        for m in layer_linears(rtn).values():
            m.weight.copy_(rtn_quantize(m.weight, cfg).dequantize())

    def error(q):
        return sum((y - r).pow(2).sum() for y, r in zip(run_layer(q, inputs).hidden, ref)).item()

    assert error(lwc) < 0.6 * error(rtn)  # 134.7 → 54.7 here


def test_omniquant_model_beats_rtn():
    model = llama_with_outliers(kv_heads=2)
    calib, test = calib_and_test()
    with torch.no_grad():
        ref = model(test).logits
    cfg = QuantConfig(bits=3, group_size=-1)
    rtn_model, omni = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(rtn_model, QuantSettings(method="rtn", quant=cfg))
    records = quantize_model(omni, QuantSettings(method="omniquant", quant=cfg, omniquant_epochs=25, omniquant_lr=5e-2), calib)
    assert set(records) == set(quantizable_linears(model))
    assert all(isinstance(m, SpearLinear) for m in quantizable_linears(omni).values())

    def kl(m):
        with torch.no_grad():
            return logits_kl(ref, m(test).logits)

    assert kl(omni) < kl(rtn_model)


def test_cli_refuses_zero_epochs(tiny_model_dir, tmp_path, capsys):
    rc = main(["quantize", str(tiny_model_dir), "--method", "omniquant", "--omniquant-epochs", "0",
               "--out", str(tmp_path / "q"), "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--omniquant-epochs" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "q").exists()


def test_a_half_precision_model_trains_in_float32_and_keeps_its_dtype():
    model = llama_with_outliers(kv_heads=2).to(torch.bfloat16)
    calib, test = calib_and_test()
    quantize_model(model, QuantSettings(method="omniquant", quant=QuantConfig(bits=4), omniquant_epochs=2), calib)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.isfinite(model(test).logits).all()
