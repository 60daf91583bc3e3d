"""The runtime transformer against the transformers model it is built from (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_family, make_tiny_llama
from fixtures import random_model

from spear.errors import SpearError
from spear.layer import ErrorCompensator, LinearMethod, SpearLinear
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig
from spear.runtime.kv_cache import Batch, Chunk, KVCache
from spear.runtime.model import (
    ModelArgs,
    Transformer,
    build_runtime_model,
)

CPU = torch.device("cpu")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def new_cache(model: Transformer, num_blocks: int = 16, block_size: int = 16) -> KVCache:
    a = model.args
    return KVCache(a.n_layers, num_blocks, block_size, a.n_kv_heads, a.head_dim, model.dtype, model.device)


@torch.no_grad()
def check_against_hf(hf, ids: list[int], chunks: list[int]) -> None:
    """Full prefill, then chunked prefill + token-by-token decode, against the HF logits at each position."""
    ref = hf(torch.tensor([ids])).logits[0]  # [L, vocab]
    model = build_runtime_model(hf)
    table = [3, 1, 4, 5, 9, 2]  # out of order on purpose
    out = model(Batch.build([Chunk(ids, 0, table)], 16, CPU), new_cache(model))
    assert rel_err(out[0], ref[-1]) <= 1e-4

    cache, start = new_cache(model), 0
    for n in chunks:
        out = model(Batch.build([Chunk(ids[start:start + n], start, table)], 16, CPU), cache)
        start += n
        assert rel_err(out[0], ref[start - 1]) <= 1e-4
    for pos in range(start, len(ids)):
        out = model(Batch.build([Chunk([ids[pos]], pos, table)], 16, CPU), cache)
        assert rel_err(out[0], ref[pos]) <= 1e-4


def test_tiny_llama_matches_transformers():
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    check_against_hf(make_tiny_llama(), ids, [7, 20, 13])


def test_every_linear_is_a_linear_method_over_the_transformers_weights():
    """build_runtime_model: the head and every decoder linear are LinearMethods (the model asks them, not their type);
    a float one runs over the transformers layer's own parameters, and nbytes counts them."""
    hf = make_tiny_llama()
    model = build_runtime_model(hf)
    a, f = model.layers[0].attention, model.layers[0].feed_forward
    linears = (model.head, a.wq, a.wk, a.wv, a.wo, f.w_gate, f.w_up, f.w_down)
    assert all(isinstance(m, LinearMethod) and m.packed is None for m in linears)
    q_proj = hf.model.layers[0].self_attn.q_proj
    assert a.wq.weight is q_proj.weight and a.wq.nbytes() == q_proj.weight.numel() * 4
    assert model.head.weight is model.embed.weight  # tied


def test_quantized_with_ecs_reuses_spear_linears_and_matches(tiny_model_dir):
    from spear.api import load

    hf = load(str(tiny_model_dir), CPU, torch.float32).model
    quantize_model(hf, QuantSettings("rtn", QuantConfig(4, -1)))
    q_proj = hf.model.layers[0].self_attn.q_proj
    q_proj.ec = ErrorCompensator(q_proj.in_features, q_proj.out_features, 4, gate_hidden=8)
    torch.nn.init.normal_(q_proj.ec.A)
    torch.nn.init.normal_(q_proj.ec.B)
    torch.nn.init.normal_(q_proj.ec.gate[2].weight)
    assert build_runtime_model(hf).layers[0].attention.wq is q_proj
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    check_against_hf(hf, ids, [16, 9])


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_rope_scaling_and_attention_bias_match(kind):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    shape = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False}
    if kind == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        hf = LlamaForCausalLM(LlamaConfig(**shape, rope_parameters=rope)).eval()
    else:
        hf = Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
        for layer in hf.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_proj.bias)
            torch.nn.init.normal_(layer.self_attn.k_proj.bias)
    args = ModelArgs.from_hf_config(hf.config)
    assert (args.rope_scaling is not None) == (kind == "llama3") and args.attention_bias == (kind == "qwen2")
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    check_against_hf(hf, ids, [33, 40])


# Beside Llama: Mistral; Qwen3 (q/k norms before RoPE, an explicit head_dim); Phi-3 (q|k|v and gate|up as one linear
# each, partial rotary, LongRoPE, a sliding window shorter than the test's sequence); Gemma 3 (norms by 1 + w, four a
# layer, GELU-tanh, query_pre_attn_scalar, sliding layers with their own RoPE base, tied and soft-capped logits).
FAMILIES = {
    "mistral": ("mistral", {"head_dim": 24}),
    "qwen3": ("qwen3", {"head_dim": 24}),
    "phi3": ("phi3", {"hidden_size": 96, "sliding_window": 24,
                      "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                          "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
                                          "long_factor": [2.0] * 6}, "original_max_position_embeddings": 128}),
    "gemma3": ("gemma3_text", {"head_dim": 24, "sliding_window": 24, "query_pre_attn_scalar": 40,
                               "layer_types": ["sliding_attention", "full_attention"], "rope_local_base_freq": 100.0,
                               "final_logit_softcapping": 2.0, "tie_word_embeddings": True}),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quantized", [False, True])
def test_family_matches_transformers(family, quantized):
    """Prefill, chunked prefill and decode against transformers' own modeling code, float and 4-bit with a gated EC."""
    model_type, config = FAMILIES[family]
    hf = make_tiny_family(model_type, noise=0.3, **{"tie_word_embeddings": False, **config})
    args = ModelArgs.from_hf_config(hf.config)
    assert args.qk_norm == (family in ("qwen3", "gemma3")) and args.head_dim == 24
    if family == "phi3":
        assert args.rotary_dim == 12 and args.rope_scaling["rope_type"] == "longrope" and args.max_seq_len == 128
        assert args.rope_gain > 1 and args.window(0) == 24
    if family == "gemma3":
        assert args.gemma_norms and args.hidden_act == "gelu_tanh" and (args.window(0), args.window(1)) == (24, None)
    if quantized:
        quantize_model(hf, QuantSettings("rtn", QuantConfig(4, -1)))
        a = hf.model.layers[1].self_attn
        proj = a.qkv_proj if family == "phi3" else a.k_proj
        proj.ec = ErrorCompensator(proj.in_features, proj.out_features, 4, gate_hidden=8)
        for t in (proj.ec.A, proj.ec.B, proj.ec.gate[2].weight):
            torch.nn.init.normal_(t)
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    check_against_hf(hf, ids, [17, 20])


def test_smollm2_matches_transformers(smollm2):
    ids = smollm2.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    check_against_hf(smollm2.model, ids, [5, len(ids) - 9])


def test_unsupported_architecture_is_a_spear_error():
    from transformers import GPT2Config

    with pytest.raises(SpearError, match="gpt2"):
        ModelArgs.from_hf_config(GPT2Config())


def test_what_the_runtime_refuses_is_one_spear_error():
    """Gemma 3's multimodal wrapper, attention logit soft-capping, a sliding layer's scaled RoPE, and tensor
    parallelism over Phi-3's fused checkpoint linears are refused with one line."""
    from transformers import AutoConfig

    from spear.runtime.tp import apply_tp

    with pytest.raises(SpearError, match="gemma3_text"):
        ModelArgs.from_hf_config(AutoConfig.for_model("gemma3"))
    with pytest.raises(SpearError, match="attn_logit_softcapping"):
        ModelArgs.from_hf_config(AutoConfig.for_model("gemma3_text", attn_logit_softcapping=50.0))
    local = {"sliding_attention": {"rope_type": "linear", "factor": 2.0}, "full_attention": {"rope_type": "default"}}
    with pytest.raises(SpearError, match="sliding layers"):
        ModelArgs.from_hf_config(AutoConfig.for_model("gemma3_text", rope_parameters=local))
    with pytest.raises(SpearError, match="--tp 1"):
        apply_tp(build_runtime_model(make_tiny_family("phi3"), kernels=False), rank=0, world=2)


def test_random_model_shapes_ecs_and_forward():
    args = ModelArgs(dim=64, intermediate=96, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=3, vocab=100)
    model = random_model(args, QuantConfig(4, -1), ec_fraction=0.38, rank=8, dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, SpearLinear)]
    assert len(linears) == 21 and sum(m.ec is not None for m in linears) == 7
    assert all(m.weight_hat.abs().sum() > 0 for m in linears)
    assert all(m.ec.B.abs().sum() > 0 for m in linears if m.ec is not None)
    out = model(Batch.build([Chunk([1, 2, 3], 0, [1]), Chunk([4], 0, [2])], 16, CPU), new_cache(model, 4))
    assert out.shape == (2, 100) and torch.isfinite(out).all()
