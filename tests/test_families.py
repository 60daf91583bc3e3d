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
from spear.errors import SpearError
from spear.models.layerwise import LayerInputs, capture_layer_inputs, check_replay, decoder_layers, run_layer
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig, pack_codes

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
MIXED = {  # families whose decoder layers differ (issue 51): sliding-window and global attention layers, with windows
    # shorter than the prompts, so their masks differ (and Gemma-3's rotary bases)
    "gemma3_text": {**FAMILIES["gemma3_text"], "layer_types": ["sliding_attention", "full_attention"]},
    "qwen2": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
}


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


@pytest.mark.parametrize("family", list(MIXED))
def test_chain_on_mixed_layers(family):
    """The walk replays each decoder layer with its own mask and rotary embeddings; GPTQ and the ECs' sensitivity
    walk a model that mixes layer kinds, and the chain closes part of the gap."""
    teacher = make_tiny_family(family, **MIXED[family])
    assert len(set(teacher.config.layer_types)) == 2
    ids = torch.randint(3, 256, (16, 48), generator=torch.Generator().manual_seed(1))
    held = torch.randint(3, 256, (4, 48), generator=torch.Generator().manual_seed(2))
    batches = list(ids.split(8))
    first = capture_layer_inputs(teacher, batches)
    assert first.layer_kwargs[0][0]["attention_mask"] is not first.layer_kwargs[1][0]["attention_mask"]
    for kwargs in (first.layer_kwargs, [first.layer_kwargs[0]] * 2):  # each layer's own, then layer 0's for all
        inputs = LayerInputs(first.hidden, kwargs)
        for layer in decoder_layers(teacher):
            inputs = run_layer(layer, inputs)
        if kwargs is first.layer_kwargs:
            check_replay(teacher, batches, inputs)
        else:
            with pytest.raises(SpearError, match="does not reproduce"):
                check_replay(teacher, batches, inputs)

    student = copy.deepcopy(teacher)
    quantize_model(student, QuantSettings("gptq", QuantConfig(bits=3)), ids)
    w4_kl = mean_kl(student, teacher, held)
    compensate(student, teacher, ids, CompensateConfig(budget=0.2, calibrate=FAST))
    assert mean_kl(student, teacher, held) < w4_kl


@pytest.mark.parametrize("family", list(MIXED))
def test_gptq_walk_from_the_shards_on_mixed_layers(family, tmp_path):
    """`spear quantize --method gptq` on a checkpoint of mixed layer kinds: the layers filled from the shards one at
    a time, each layer's mask and rotary embeddings captured with the layers left on meta; the same records as
    GPTQ on the whole float model."""
    from spear.api import quantize
    from spear.data.calibration import CalibConfig, text_file_ids
    from spear.shards import ShardReader

    model = make_tiny_family(family, **MIXED[family])
    model.save_pretrained(tmp_path / "hf")
    tokenizer = make_byte_tokenizer()
    tokenizer.save_pretrained(tmp_path / "hf")
    (tmp_path / "calib.txt").write_text(" ".join(f"word{i % 97} and more text" for i in range(400)))
    calib = CalibConfig(num_sequences=4, seq_len=40, text_file=str(tmp_path / "calib.txt"))
    settings = QuantSettings("gptq", QuantConfig(bits=4, group_size=16))
    streamed = ShardReader(quantize(str(tmp_path / "hf"), settings, tmp_path / "art", calib, device=torch.device("cpu")))
    records = quantize_model(model, settings, text_file_ids(tokenizer, tmp_path / "calib.txt", calib))
    for name, record in records.items():  # the codes: act-order fits the scales on the weights alone
        assert torch.equal(streamed.get(f"{name}.codes"), pack_codes(record.codes, record.bits)), name


def test_a_walk_that_does_not_replay_is_refused_before_any_work(monkeypatch):
    """A model the walk cannot replay stops `run` with one SpearError before evaluating or quantizing anything."""
    import spear.run
    from spear.data.calibration import CalibConfig
    from spear.models.loading import LoadedModel

    model = make_tiny_family("llama")
    model.model.register_forward_hook(lambda _m, _a, out: out.__class__(last_hidden_state=2 * out.last_hidden_state))
    monkeypatch.setattr(spear.run, "load_float_model", lambda *a: LoadedModel(model, make_byte_tokenizer(), "m", None))
    monkeypatch.setattr(spear.run, "_evaluate", lambda *a: pytest.fail("evaluated before the check"))
    config = spear.run.RunConfig.build("m", QuantSettings("gptq", QuantConfig(bits=4)), CalibConfig(), quick=True)
    with pytest.raises(SpearError, match="does not reproduce LlamaForCausalLM"):
        spear.run.run(config, torch.device("cpu"))
