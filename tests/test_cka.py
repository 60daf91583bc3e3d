"""Linear CKA and the per-module sensitivity table."""

import pytest
import torch

from spear.compensate.cka import ModuleDamage, SensitivityConfig, SensitivityTable, linear_cka, module_sensitivity
from spear.models.layerwise import quantizable_linears
from spear.record import QuantConfig, rtn_quantize


def rand(n, d, seed):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("n", [20, 500])  # sample-space and feature-space forms
def test_cka_invariances(n):
    X, Y = rand(n, 32, 0), rand(n, 32, 1)
    Q, _ = torch.linalg.qr(rand(32, 32, 2))
    assert linear_cka(X, X) == pytest.approx(1.0)
    assert linear_cka(X, X @ Q) == pytest.approx(1.0)
    assert linear_cka(X, 7.5 * X + 3.0) == pytest.approx(1.0)
    mixed = X + 0.3 * Y
    c = linear_cka(X, mixed)
    assert c == pytest.approx(linear_cka(X @ Q, 0.1 * mixed)) and c == pytest.approx(linear_cka(mixed, X))
    assert 0 <= linear_cka(X, Y) < c < 1


@pytest.mark.parametrize("n", [40, 400])  # n < d: sample space; n ≥ d: feature space
def test_cka_matches_definition(n):
    Z = rand(n, 50, 3)
    X, Y = Z[:, :30], rand(n, 50, 4) + 0.5 * Z  # correlated, different widths
    Xc, Yc = X - X.mean(0), Y - Y.mean(0)
    ref = (Yc.t() @ Xc).square().sum() / (torch.linalg.norm(Xc.t() @ Xc) * torch.linalg.norm(Yc.t() @ Yc))
    assert linear_cka(X, Y) == pytest.approx(float(ref))


def test_independent_inputs_give_low_cka():
    assert linear_cka(rand(4000, 16, 5), rand(4000, 16, 6)) < 0.05


@pytest.fixture(scope="module")
def tiny_model():
    from conftest import make_tiny_llama

    return make_tiny_llama()


@pytest.fixture(scope="module")
def tiny_table(tiny_model):
    model = tiny_model
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    w_hat = {n: rtn_quantize(m.weight, QuantConfig(bits=2)).dequantize() for n, m in quantizable_linears(model).items()}
    before = {n: m.weight.clone() for n, m in quantizable_linears(model).items()}
    table = module_sensitivity(model, w_hat, ids, SensitivityConfig(num_sequences=3, seq_len=24, batch_size=2))
    for n, m in quantizable_linears(model).items():
        assert torch.equal(m.weight, before[n])  # every weight restored
    return table


def test_module_sensitivity(tiny_model, tiny_table, tmp_path):
    t = tiny_table
    assert [e.name for e in t.entries] == list(quantizable_linears(tiny_model))
    assert all(0 <= e.damage <= 1 and e.damage == e.damage for e in t.entries)
    assert any(e.damage > 0 for e in t.entries)
    assert t.tokens == 72 and {e.layer for e in t.entries} == {0, 1}
    assert t.entries[0].type == "q_proj" and t.entries[-1].type == "down_proj"
    assert SensitivityTable.from_json(t.to_json()) == t
    path = tmp_path / "heat.png"
    t.save_heatmap(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heatmap_with_missing_cells(tmp_path):
    t = SensitivityTable([ModuleDamage("m.layers.0.q_proj", 0, "q_proj", 0.1), ModuleDamage("m.layers.2.up", 2, "up", 0.0)], 10)
    t.save_heatmap(tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 0
