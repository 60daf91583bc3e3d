import copy

import pytest
import torch
from conftest import logits_kl, make_tiny_llama
from torch import nn

from spear.errors import SpearError
from spear.layer import SpearLinear
from spear.models.layerwise import (
    capture_layer_inputs, decoder_layers, layer_linears, quantizable_linears, run_layer,
)
from spear.quant.awq import awq_scale_layer, fold_scale, scale_groups
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig, rtn_quantize


def llama_with_outliers(kv_heads: int = 2, seed: int = 0) -> nn.Module:
    """Tiny Llama whose norms amplify a few channels, as trained LLMs do (what AWQ exploits)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=512, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in decoder_layers(model):
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
                norm.weight[torch.randperm(64)[:4]] *= 15
    return model


def calib_and_test(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (16, 48), generator=gen), torch.randint(0, 256, (4, 48), generator=gen)


def test_groups_follow_the_paper_and_skip_v_o_under_gqa():
    gqa, mha = llama_with_outliers(kv_heads=2), llama_with_outliers(kv_heads=4)
    assert len(scale_groups(decoder_layers(gqa)[0])) == 3
    groups = scale_groups(decoder_layers(mha)[0])
    attn = decoder_layers(mha)[0].self_attn
    assert len(groups) == 4 and groups[1].prev is attn.v_proj and groups[1].linears == [attn.o_proj]


def test_unknown_layout_raises():
    layer = decoder_layers(make_tiny_llama())[0]
    layer.extra_norm = nn.LayerNorm(64)
    with pytest.raises(SpearError, match="layout"):
        scale_groups(layer)


def test_folding_random_scales_preserves_the_float_model():
    model = llama_with_outliers(kv_heads=4)
    _, test = calib_and_test()
    with torch.no_grad():
        ref = model(test).logits
        for layer in decoder_layers(model):
            for group in scale_groups(layer):
                s = torch.rand(group.linears[0].in_features) * 4 + 0.25
                fold_scale(group.prev, group.linears, s)
        torch.testing.assert_close(model(test).logits, ref, rtol=1e-5, atol=1e-5)


def test_searched_scales_preserve_the_float_model():
    model = llama_with_outliers(kv_heads=4)
    calib, test = calib_and_test()
    norm_before = decoder_layers(model)[0].input_layernorm.weight.clone()
    with torch.no_grad():
        ref = model(test).logits
        inputs = capture_layer_inputs(model, list(calib.split(8)))
        for layer in decoder_layers(model):
            awq_scale_layer(layer, inputs, QuantConfig(bits=3), n_grid=10, clip=False)
            inputs = run_layer(layer, inputs)
        assert not torch.equal(decoder_layers(model)[0].input_layernorm.weight, norm_before)  # scales were folded
        torch.testing.assert_close(model(test).logits, ref, rtol=1e-5, atol=1e-5)


def rtn_layer_(layer: nn.Module, cfg: QuantConfig) -> None:
    with torch.no_grad():
        for m in layer_linears(layer).values():
            m.weight.copy_(rtn_quantize(m.weight, cfg).dequantize())


@pytest.mark.parametrize("group_size", [-1, 32])
@pytest.mark.parametrize("clip", [False, True])
def test_awq_layer_error_at_most_rtn(group_size, clip):
    model = llama_with_outliers(kv_heads=4)
    calib, _ = calib_and_test()
    cfg = QuantConfig(bits=3, group_size=group_size)
    inputs = capture_layer_inputs(model, list(calib.split(8)))
    layer = decoder_layers(model)[0]
    ref = torch.cat(run_layer(layer, inputs).hidden)

    rtn, awq = copy.deepcopy(layer), copy.deepcopy(layer)
    rtn_layer_(rtn, cfg)
    awq_scale_layer(awq, inputs, cfg, n_grid=20, clip=clip)
    rtn_layer_(awq, cfg)
    err_rtn = (torch.cat(run_layer(rtn, inputs).hidden) - ref).pow(2).mean()
    err_awq = (torch.cat(run_layer(awq, inputs).hidden) - ref).pow(2).mean()
    assert err_awq < 0.9 * err_rtn


def test_awq_model_quantizes_every_linear_and_beats_rtn():
    model = llama_with_outliers(kv_heads=2)
    names = set(quantizable_linears(model))
    calib, test = calib_and_test()
    with torch.no_grad():
        ref = model(test).logits
    cfg = QuantConfig(bits=3, group_size=32)
    rtn_model, awq_model = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(rtn_model, QuantSettings(method="rtn", quant=cfg))
    records = quantize_model(awq_model, QuantSettings(method="awq", quant=cfg, awq_grid=10), calib)

    assert set(records) == names
    assert all(isinstance(m, SpearLinear) for m in quantizable_linears(awq_model).values())
    with torch.no_grad():
        awq_logits, rtn_logits = awq_model(test).logits, rtn_model(test).logits
    assert torch.isfinite(awq_logits).all()

    assert logits_kl(ref, awq_logits) < logits_kl(ref, rtn_logits)
