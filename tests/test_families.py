"""The whole chain on non-Llama families (issue 32, item 5): tiny random-weight configs built with transformers,
whose own modeling code is the reference. Quantize → sensitivity → plan → calibrate → artifact → reload, and the
compensated model must be closer to the float one (KL) than plain W4."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_byte_tokenizer, make_tiny_family
from test_runtime_model import check_against_hf
from spear.artifact import ArtifactInfo, load_artifact, save_artifact
from spear.compensate.calibrate import CalibrateConfig, mean_kl
from spear.compensate.pipeline import CompensateConfig, compensate, quantized_layers
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig

FAMILIES = {  # what each brings beside Llama
    "qwen2": {},  # q/k/v biases, untied head
    "qwen3": {"head_dim": 16},  # q/k RMSNorm (qk-norm)
    "mistral": {"sliding_window": 16},
    "phi3": {},  # fused qkv_proj and gate_up_proj
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "final_logit_softcapping": 0.5},  # soft-capping (a cap
    # small enough to matter at random weights), tied
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16},  # qk-norm, tied
}
FAST = CalibrateConfig(steps=20, batch_size=4, eval_every=5, patience=10, progress=False)


def make_tiny(family: str) -> torch.nn.Module:
    return make_tiny_family(family, **FAMILIES[family])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chain_on_family(family, tmp_path):
    teacher = make_tiny(family)
    student = copy.deepcopy(teacher)
    quantize_model(student, QuantSettings("rtn", QuantConfig(bits=3)))
    ids = torch.randint(3, 256, (16, 48), generator=torch.Generator().manual_seed(1))
    held = torch.randint(3, 256, (4, 48), generator=torch.Generator().manual_seed(2))
    w4_kl = mean_kl(student, teacher, held)
    with torch.no_grad():  # the calibration's KL is the one between the models' own logits (soft-capping included)
        p, q = (m(held).logits.float().log_softmax(-1) for m in (teacher, student))
        assert w4_kl == pytest.approx((p.exp() * (p - q)).sum(-1).mean().item(), rel=1e-5)
    report = compensate(student, teacher, ids, CompensateConfig(budget=0.2, calibrate=FAST))
    assert report.plan.entries and report.ec_bytes <= 0.2 * report.w4_bytes
    assert set(quantized_layers(student)) == {n for n, m in teacher.named_modules()
                                             if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert mean_kl(student, teacher, held) < w4_kl

    save_artifact(student, make_byte_tokenizer(), tmp_path / "art", ArtifactInfo(family, {"method": "rtn"}))
    back = load_artifact(tmp_path / "art", torch.device("cpu"), torch.float32).model
    with torch.no_grad():
        assert torch.equal(back(held).logits, student(held).logits)
    if family != "gemma2":  # the serving runtime's families: it serves the artifact with its logits
        check_against_hf(back, held[0].tolist(), [20, 9])
