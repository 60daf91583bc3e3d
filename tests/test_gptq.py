import copy

import pytest
import torch
from conftest import logits_kl, make_tiny_llama

from spear.errors import SpearError
from spear.layer import SpearLinear
from spear.models.layerwise import quantizable_linears
from spear.quant.gptq import Hessian, gptq_quantize, inverse_hessian_cholesky
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig, rtn_quantize


def correlated_layer(seed: int = 0, out_f: int = 96, in_f: int = 128, n: int = 2048):
    """A random weight and inputs X = Z M (mixed, with channel magnitudes from 0.2 to 3)."""
    gen = torch.Generator().manual_seed(seed)
    Z = torch.randn(n, in_f, generator=gen)
    M = torch.eye(in_f) + torch.randn(in_f, in_f, generator=gen) / in_f**0.5
    X = Z @ M * torch.linspace(0.2, 3, in_f)
    W = torch.randn(out_f, in_f, generator=gen)
    return W, X


def hessian_of(X: torch.Tensor) -> torch.Tensor:
    h = Hessian(X.shape[1], X.device)
    for x in X.split(300):
        h.add_batch(x)
    return h.H


def test_hessian_is_mean_of_outer_products():
    _, X = correlated_layer()
    torch.testing.assert_close(hessian_of(X), 2 / X.shape[0] * X.T @ X, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("group_size", [-1, 32])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_layer_output(group_size, sym, act_order):
    W, X = correlated_layer()
    cfg = QuantConfig(bits=4, group_size=group_size, sym=sym)
    gptq = gptq_quantize(W, hessian_of(X), cfg, act_order=act_order)
    err_gptq = ((W - gptq.dequantize()) @ X.T).norm()
    err_rtn = ((W - rtn_quantize(W, cfg).dequantize()) @ X.T).norm()
    assert err_gptq < 0.95 * err_rtn


@pytest.mark.parametrize("group_size", [-1, 32])
@pytest.mark.parametrize("sym", [True, False])
def test_record_is_well_formed(group_size, sym):
    W, X = correlated_layer()
    cfg = QuantConfig(bits=3, group_size=group_size, sym=sym, sym_grid="gptq")
    q = gptq_quantize(W, hessian_of(X), cfg, block_size=48, act_order=True)
    groups = W.shape[1] // cfg.group_size_for(W.shape[1])
    assert q.codes.dtype == torch.uint8 and q.codes.shape == W.shape and int(q.codes.max()) <= cfg.max_code
    assert q.scales.dtype == torch.float16 and q.scales.shape == (W.shape[0], groups)
    assert q.zeros.dtype == torch.uint8 and int(q.zeros.max()) <= cfg.max_code
    assert q.group_size == W.shape[1] // groups and torch.isfinite(q.dequantize()).all()


@pytest.mark.parametrize("group_size", [-1, 32])
def test_uncorrelated_inputs_give_rtn_exactly(group_size):
    # With H diagonal nothing propagates (H⁻¹ is diagonal): GPTQ is RTN, bit for bit,
    # which checks that the codes come from the same fp16 grid the errors were taken on.
    W, _ = correlated_layer()
    cfg = QuantConfig(bits=4, group_size=group_size, sym=False)
    H = torch.diag(torch.linspace(0.5, 2, W.shape[1]))
    gptq, rtn = gptq_quantize(W, H, cfg, block_size=40), rtn_quantize(W, cfg)
    assert torch.equal(gptq.codes, rtn.codes) and torch.equal(gptq.scales, rtn.scales)
    assert torch.equal(gptq.zeros, rtn.zeros)


def test_dead_inputs_are_zeroed():
    W, X = correlated_layer()
    X[:, :5] = 0
    q = gptq_quantize(W, hessian_of(X), QuantConfig(bits=4, group_size=32, sym=False))
    assert (q.dequantize()[:, :5] == 0).all() and torch.isfinite(q.dequantize()).all()


def test_singular_hessian_is_rescued_by_more_dampening():
    x = torch.randn(1, 16)
    assert torch.isfinite(inverse_hessian_cholesky(x.T @ x, damp=0.0)).all()


def test_hessian_with_nan_raises():
    H = torch.eye(16)
    H[3, 4] = H[4, 3] = float("nan")
    with pytest.raises(SpearError, match="not positive definite"):
        gptq_quantize(torch.randn(8, 16), H, QuantConfig())


@pytest.mark.parametrize("group_size", [-1, 32])
def test_gptq_model_beats_rtn(group_size):
    model = make_tiny_llama(hidden=64)
    names = set(quantizable_linears(model))
    gen = torch.Generator().manual_seed(1)
    calib = torch.randint(0, 256, (16, 48), generator=gen)
    test = torch.randint(0, 256, (4, 48), generator=gen)
    with torch.no_grad():
        ref = model(test).logits
    cfg = QuantConfig(bits=3, group_size=group_size)
    rtn_model, gptq_model = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(rtn_model, QuantSettings(method="rtn", quant=cfg))
    records = quantize_model(gptq_model, QuantSettings(method="gptq", quant=cfg), calib)

    assert set(records) == names
    assert all(isinstance(m, SpearLinear) for m in quantizable_linears(gptq_model).values())
    with torch.no_grad():
        gptq_logits, rtn_logits = gptq_model(test).logits, rtn_model(test).logits
    assert torch.isfinite(gptq_logits).all()
    assert logits_kl(ref, gptq_logits) < logits_kl(ref, rtn_logits)


def test_act_order_is_the_default_and_can_be_turned_off():
    import argparse

    from spear.cli import _add_quant_args

    p = argparse.ArgumentParser()
    _add_quant_args(p)
    assert QuantSettings().gptq_act_order and p.parse_args([]).act_order
    assert not p.parse_args(["--no-act-order"]).act_order
