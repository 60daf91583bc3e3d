"""vLLM itself on an exported artifact (marked `vllm`, not in CI): the spear-vllm plugin's greedy tokens are
SPEAR's, with and without the ECs, and stock vLLM serves the static LoRA adapter. vLLM runs in its own
environment, named by SPEAR_VLLM_PYTHON (its python, with vllm and plugins/spear_vllm installed):

    SPEAR_VLLM_PYTHON=/work/vllm-venv/bin/python python -m pytest -m vllm tests/test_vllm_plugin.py
"""

from __future__ import annotations

import os

import pytest
import torch

from test_export_vllm import random_ec
from vllm_compare import LORA_DIR, matched, spear_generate, vllm_generate

from spear.artifact import ArtifactInfo, save_artifact
from spear.export.vllm import export_vllm
from spear.models.layerwise import quantizable_linears
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not os.environ.get("SPEAR_VLLM_PYTHON"), reason="SPEAR_VLLM_PYTHON is not set")]
TOKENS = 32


@pytest.fixture(scope="module")
def export(smollm2, tmp_path_factory):
    """SmolLM2 at W4 RTN per-channel with random gated ECs on every fourth linear, exported."""
    import copy

    root = tmp_path_factory.mktemp("vllm")
    model = copy.deepcopy(smollm2.model)
    quantize_model(model, QuantSettings("rtn", QuantConfig()))
    for i, (name, layer) in enumerate(quantizable_linears(model).items()):
        if i % 4 == 0:
            layer.ec = random_ec(layer.in_features, layer.out_features, 8, 8, seed=i)
            with torch.no_grad():
                layer.ec.B.mul_(3)
    save_artifact(model, smollm2.tokenizer, root / "art", ArtifactInfo("smollm2", {"method": "rtn"}))
    export_vllm(root / "art", root / "vllm")
    prompts = [smollm2.tokenizer("The history of the French language")["input_ids"]]
    return root / "art", root / "vllm", prompts


@pytest.mark.parametrize("args, variant", [
    (["--eager"], "ec"),
    (["--eager", "--quantization", "compressed-tensors"], "no-ec"),
    (["--eager", "--quantization", "compressed-tensors", "--lora", LORA_DIR], "gate-off"),
])
def test_vllm_greedy_tokens_are_spears(export, args, variant):
    art, out, prompts = export
    got = vllm_generate(os.environ["SPEAR_VLLM_PYTHON"], out, args, prompts, TOKENS)
    assert "error" not in got, got
    want = spear_generate(str(art), variant, prompts, TOKENS)
    assert matched(got["token_ids"], want["token_ids"]) == [TOKENS]
    if variant == "ec":  # the ECs took effect: W4 alone generates otherwise
        assert want["token_ids"] != spear_generate(str(art), "no-ec", prompts, TOKENS)["token_ids"]
