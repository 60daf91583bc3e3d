"""The CKA sensitivity's cost model (bench/sensitivity_cost.py): the layer passes it counts are the ones it runs."""

from __future__ import annotations

import torch

import sensitivity_cost  # bench/, on sys.path through conftest
from conftest import make_tiny_llama
from spear.compensate import cka
from spear.compensate.cka import SensitivityConfig, module_sensitivity
from spear.record import QuantConfig, rtn_quantize


def test_the_damage_loop_runs_the_layer_passes_the_cost_model_counts(monkeypatch):
    model = make_tiny_llama(layers=3)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    w4 = QuantConfig(bits=4, group_size=-1)
    w_hat = {n: rtn_quantize(m.weight.data, w4).dequantize() for n, m in linears.items()}
    calls = []
    real = cka.run_layer
    monkeypatch.setattr(cka, "run_layer", lambda layer, h: calls.append(layer) or real(layer, h))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    table = module_sensitivity(model, w_hat, ids, SensitivityConfig(num_sequences=2, seq_len=16, batch_size=2))
    assert len(table.entries) == len(linears) == 3 * sensitivity_cost.LINEARS_A_LAYER
    # the float pass runs each layer once, then each module re-runs its own layer and the ones after it
    assert len(calls) == 3 + sensitivity_cost.layer_passes(3) == 3 + 7 * 6
    # a module of the last layer re-runs one layer, one of the first all three: quadratic in depth
    assert sensitivity_cost.layer_passes(32) == 3696 and sensitivity_cost.layer_passes(80) == 22680
