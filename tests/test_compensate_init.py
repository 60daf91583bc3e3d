"""Closed-form EC inits (LoRC, LQER, QERA) and attaching an EC to a quantized layer."""

import pytest
import torch

from spear.compensate.init import attach_ec, init_ec
from spear.compensate.stats import InputStats, collect_input_stats
from spear.errors import SpearError
from spear.layer import SpearLinear
from spear.record import QuantConfig, rtn_quantize

OUT, IN, N = 48, 64, 4096


def correlated_inputs(seed: int = 0) -> torch.Tensor:
    """x = M z: M with a decaying spectrum, and a few channels of large magnitude. [N, IN] float64."""
    g = torch.Generator().manual_seed(seed)
    Q1, _ = torch.linalg.qr(torch.randn(IN, IN, generator=g, dtype=torch.float64))
    Q2, _ = torch.linalg.qr(torch.randn(IN, IN, generator=g, dtype=torch.float64))
    M = Q1 @ torch.diag(0.9 ** torch.arange(IN, dtype=torch.float64)) @ Q2
    x = torch.randn(N, IN, generator=g, dtype=torch.float64) @ M.t()
    x[:, :4] *= 20  # outlier channels
    return x


@pytest.fixture(scope="module")
def problem():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(OUT, IN, generator=g) * 0.05
    W_hat = rtn_quantize(W, QuantConfig(bits=3)).dequantize()
    x = correlated_inputs()
    stats = InputStats.zeros(IN)
    stats.update(x)
    return W, W_hat, x, stats


def output_error(W, W_hat, x, A=None, B=None) -> float:
    """E_x ‖(W − Ŵ − BA) x‖² on the samples."""
    E = W.double() - W_hat.double()
    if A is not None:
        E = E - B.double() @ A.double()
    return float(((x @ E.t()) ** 2).sum(1).mean())


def optimum(W, W_hat, stats, rank) -> float:
    """Σ_{i>r} σ_i² of (W − Ŵ) R^{1/2}: the least output error of any rank-r correction."""
    lam, Q = torch.linalg.eigh(stats.r_xx)
    s = torch.linalg.svdvals((W.double() - W_hat.double()) @ Q @ torch.diag(lam.clamp(min=0).sqrt()))
    return float((s[rank:] ** 2).sum())


@pytest.mark.parametrize("rank", [4, 8, 16])
def test_inits_reduce_output_error_in_order(problem, rank):
    W, W_hat, x, stats = problem
    base = output_error(W, W_hat, x)
    err = {k: output_error(W, W_hat, x, *init_ec(k, W, W_hat, rank, stats)) for k in ("lorc", "lqer", "qera")}
    assert err["lorc"] < base
    assert err["lorc"] >= err["lqer"] >= err["qera"] * (1 - 1e-6)
    assert err["qera"] == pytest.approx(optimum(W, W_hat, stats, rank), rel=1e-4)


def test_qera_is_optimal_and_improves_with_rank(problem):
    W, W_hat, x, stats = problem
    errs = [output_error(W, W_hat, x, *init_ec("qera", W, W_hat, r, stats)) for r in (2, 4, 8, 16, 32)]
    assert all(a > b for a, b in zip(errs, errs[1:]))
    A, B = init_ec("qera", W, W_hat, 8, stats)
    g = torch.Generator().manual_seed(2)
    for _ in range(5):  # no nearby rank-8 correction does better
        dA, dB = 1e-2 * torch.randn(A.shape, generator=g), 1e-2 * torch.randn(B.shape, generator=g)
        assert output_error(W, W_hat, x, A + dA, B + dB) >= output_error(W, W_hat, x, A, B)


def test_qera_split_is_balanced(problem):
    W, W_hat, _, stats = problem
    A, B = init_ec("qera", W, W_hat, 8, stats)
    second_moment = torch.diag(A.double() @ stats.r_xx @ A.double().t())  # E[(A x)_i²] = σ_i
    assert torch.allclose(second_moment, B.double().norm(dim=0) ** 2, rtol=1e-4)


def test_lorc_is_truncated_svd(problem):
    W, W_hat, _, _ = problem
    A, B = init_ec("lorc", W, W_hat, 8, None)
    U, S, Vh = torch.linalg.svd((W - W_hat).double())
    assert torch.allclose((B @ A).double(), U[:, :8] @ torch.diag(S[:8]) @ Vh[:8], atol=1e-6)


def test_init_errors(problem):
    W, W_hat, _, stats = problem
    with pytest.raises(SpearError, match="statistics"):
        init_ec("qera", W, W_hat, 8, None)
    with pytest.raises(SpearError, match="unknown"):
        init_ec("svd", W, W_hat, 8, stats)
    with pytest.raises(SpearError, match="rank"):
        init_ec("lorc", W, W_hat, OUT + 1, stats)


def test_rank_deficient_error_gives_finite_factors():
    W = torch.zeros(16, 32)
    W[:, 0] = 1.0  # rank-1 error after "quantizing" to zero
    A, B = init_ec("qera", W, torch.zeros_like(W), 8, _stats(torch.randn(100, 32)))
    assert torch.isfinite(A).all() and torch.isfinite(B).all()
    assert torch.allclose(B @ A, W, atol=1e-5)


def _stats(x):
    st = InputStats.zeros(x.shape[1])
    st.update(x)
    return st


def test_attach_ec():
    torch.manual_seed(0)
    W = torch.randn(32, 64)
    layer = SpearLinear(rtn_quantize(W, QuantConfig(bits=4)))
    x = torch.randn(5, 7, 64)
    plain = layer(x)
    A = torch.randn(8, 64)
    attach_ec(layer, A, torch.zeros(32, 8), gate_hidden=4)
    assert torch.equal(layer(x), plain)  # B = 0: the plain W4 layer
    B = torch.randn(32, 8)
    for gate_hidden in (0, 4):  # gate off, and gate at its initial gamma ≡ 1
        ec = attach_ec(layer, A, B, gate_hidden)
        assert ec.gate_hidden == gate_hidden and layer.ec is ec
        assert torch.allclose(layer(x), x @ (layer.weight_hat + B @ A).t(), atol=1e-4)
    with pytest.raises(SpearError, match="do not fit"):
        attach_ec(layer, A.t(), B)


def test_collect_input_stats_shares_inputs():
    from conftest import make_tiny_llama

    model = make_tiny_llama()
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    stats = collect_input_stats(model, ids, batch_size=2)
    attn = "model.layers.0.self_attn"
    assert stats[f"{attn}.q_proj"] is stats[f"{attn}.k_proj"] is stats[f"{attn}.v_proj"]
    assert stats[f"{attn}.o_proj"] is not stats[f"{attn}.q_proj"]
    assert stats[f"{attn}.q_proj"].tokens == 48
    assert stats["model.layers.1.mlp.down_proj"].r_xx.shape == (128, 128)

    captured = []  # R_xx of q_proj equals E[x xᵀ] of what it actually saw
    h = model.get_submodule(f"{attn}.q_proj").register_forward_pre_hook(lambda m, a: captured.append(a[0].reshape(-1, 64)))
    model.base_model(input_ids=ids)
    h.remove()
    x = torch.cat(captured).double()
    assert torch.allclose(stats[f"{attn}.q_proj"].r_xx, x.t() @ x / len(x), atol=1e-6)
    assert torch.allclose(stats[f"{attn}.q_proj"].mean_abs, x.abs().mean(0), atol=1e-6)


@pytest.mark.parametrize("out_features, in_features, gram", [(48, 32, False), (48, 32, True), (32, 48, False)])
def test_whitened_error_factors_equal_qera_init(out_features, in_features, gram, monkeypatch):
    """One decomposition serves the plan and the init: WhitenedError's spectrum is E_x ‖E x‖² split by direction,
    and its factors at any kept rank equal qera_init's, by each route: a tall error's SVD (or, above
    GRAM_ABOVE_ELEMENTS, its Gram matrix's eigh), a wide one's E R_xx Eᵀ eigh."""
    from spear.compensate import init as init_module
    from spear.compensate.init import WhitenedError

    if gram:
        monkeypatch.setattr(init_module, "GRAM_ABOVE_ELEMENTS", 0)
    torch.manual_seed(0)
    W = torch.randn(out_features, in_features)
    W_hat = W + 0.1 * torch.randn(out_features, in_features)
    x = torch.randn(500, in_features) * torch.linspace(0.1, 3.0, in_features)
    stats = _stats(x)
    err = WhitenedError.of(W, W_hat, stats, max_rank=8)
    E = (W - W_hat).double()
    assert err.spectrum.sum().item() == pytest.approx((x.double() @ E.t()).square().sum(1).mean().item(), rel=1e-9)
    for rank in (1, 5, 8):
        A, B = err.factors(W, W_hat, rank)
        A0, B0 = init_ec("qera", W, W_hat, rank, stats)
        assert torch.allclose(B @ A, B0 @ A0, atol=1e-5)
    with pytest.raises(SpearError, match="kept"):
        err.factors(W, W_hat, 9)
