"""An artifact served from plain torch modules (models.plain_skeleton) instead of transformers' model classes: the
same tensor names and shapes as transformers' skeleton for every family the runtime serves, the same served logits,
and a serving process that never imports transformers' modeling code."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import make_byte_tokenizer, make_tiny_family
from test_runtime_model import FAMILIES, new_cache

from spear import artifact as artifact_module
from spear.artifact import ArtifactInfo, load_artifact, save_artifact
from spear.layer import ErrorCompensator
from spear.models.plain_skeleton import PlainCausalLM, plain_skeleton
from spear.models.skeleton import causal_lm_skeleton
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig
from spear.runtime.engine import eos_token_ids
from spear.runtime.kv_cache import Batch, Chunk
from spear.runtime.model import build_runtime_model

CPU = torch.device("cpu")
CONFIGS = {  # the runtime tests' families, and the biases each family may carry
    **FAMILIES,
    "llama_biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
    "qwen3_bias": ("qwen3", {"head_dim": 24, "attention_bias": True}),
    "gemma3_bias": ("gemma3_text", {"head_dim": 24, "attention_bias": True}),
}


def tiny(name: str) -> torch.nn.Module:
    model_type, config = CONFIGS[name]
    return make_tiny_family(model_type, noise=0.3, **{"tie_word_embeddings": False, **config})


@pytest.mark.parametrize("name", CONFIGS)
def test_the_plain_skeleton_has_transformers_names_shapes_and_ties(name):
    config = tiny(name).config
    for tie in (False, True):
        config.tie_word_embeddings = tie
        plain, hf = plain_skeleton(config, torch.bfloat16), causal_lm_skeleton(config, torch.bfloat16)
        shapes = {m: {n: (t.shape, t.dtype) for n, t in model.state_dict().items()} for m, model in
                  (("plain", plain), ("hf", hf))}
        assert shapes["plain"] == shapes["hf"]
        assert all(p.is_meta for p in plain.parameters())
        assert (plain.lm_head.weight is plain.model.embed_tokens.weight) == tie
    assert eos_token_ids(plain) == eos_token_ids(hf) == (2,)


def test_a_family_the_runtime_does_not_serve_has_no_plain_skeleton():
    assert plain_skeleton(make_tiny_family("gemma2").config, torch.float32) is None


@torch.no_grad()
def served_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Prefill of all but the last 3 tokens, then one token a step: the logits of each step."""
    runtime = build_runtime_model(model)
    cache, outs, start = new_cache(runtime), [], len(ids) - 3
    outs.append(runtime(Batch.build([Chunk(ids[:start], 0, [0, 1, 2, 3])], 16, CPU), cache)[0])
    for pos in range(start, len(ids)):
        outs.append(runtime(Batch.build([Chunk([ids[pos]], pos, [0, 1, 2, 3])], 16, CPU), cache)[0])
    return torch.stack(outs)


@pytest.mark.parametrize("name", ["gemma3", "phi3", "qwen2", "llama_biases"])
def test_an_artifact_served_from_plain_modules_gives_transformers_skeletons_logits(name, tmp_path, monkeypatch):
    """A 4-bit artifact with a gated EC, served (packed for the CPU kernels) from either skeleton: the same logits,
    bit for bit; and close to transformers' own forward of the dense load."""
    hf = tiny(name)
    quantize_model(hf, QuantSettings("rtn", QuantConfig(4, -1)))
    a = hf.model.layers[1].self_attn
    proj = a.qkv_proj if name == "phi3" else a.k_proj
    proj.ec = ErrorCompensator(proj.in_features, proj.out_features, 4, gate_hidden=8)
    for t in (proj.ec.A, proj.ec.B, proj.ec.gate[2].weight):
        torch.nn.init.normal_(t, std=0.3)
    save_artifact(hf, make_byte_tokenizer(), tmp_path / "art", ArtifactInfo(name, {"method": "rtn"}))
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()

    plain = load_artifact(tmp_path / "art", CPU, torch.float32, dense=False).model
    assert isinstance(plain, PlainCausalLM)
    got = served_logits(plain, ids)
    monkeypatch.setattr(artifact_module, "plain_skeleton", lambda config, dtype: None)
    hf_served = load_artifact(tmp_path / "art", CPU, torch.float32, dense=False).model
    assert not isinstance(hf_served, PlainCausalLM)
    assert torch.equal(got, served_logits(hf_served, ids))
    reference = load_artifact(tmp_path / "art", CPU, torch.float32).model(torch.tensor([ids])).logits[0, -4:]
    assert ((got - reference).abs().max() / reference.abs().max()).item() < 2e-2  # the int4 kernel runs in bf16


def test_serving_an_artifact_imports_no_transformers_modeling_code(tmp_path):
    """What `spear serve` loads and builds, in a fresh interpreter: transformers' model classes (and torch._dynamo,
    which they import) stay out of the process."""
    hf = tiny("mistral")
    quantize_model(hf, QuantSettings("rtn", QuantConfig(4, -1)))
    save_artifact(hf, make_byte_tokenizer(), tmp_path / "art", ArtifactInfo("mistral", {"method": "rtn"}))
    code = (f"import sys, torch\nfrom spear import api\nfrom spear.runtime.engine import EngineConfig, build_engine\n"
            f"lm = api.load({str(tmp_path / 'art')!r}, torch.device('cpu'), serving=True)\n"
            f"build_engine(lm.model, lm.tokenizer, EngineConfig(max_model_len=64, num_kv_blocks=8))\n"
            f"print(sorted(m for m in ('transformers.modeling_utils', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
