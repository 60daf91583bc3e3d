"""Perplexity protocol on a tiny random Llama, checked against a direct computation."""

import math

import pytest
import torch
import torch.nn.functional as F

from spear.errors import SpearError
from spear.eval.perplexity import cut_windows, dataset_path, perplexity, tokenize_file
from spear.models import load_float_model


def test_perplexity_matches_direct_computation(tiny_model_dir):
    lm = load_float_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)
    result = perplexity(lm.model, lm.tokenizer, "wikitext2", seqlen=64, max_windows=3, batch_size=2, progress=False)
    ids = tokenize_file(lm.tokenizer, dataset_path("wikitext2"))[: 3 * 64].view(3, 64)
    with torch.no_grad():
        logits = lm.model(ids).logits
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert result.windows == 3 and result.seqlen == 64 and result.tokens_scored == 3 * 63
    assert result.ppl == pytest.approx(math.exp(nll.item()), rel=1e-5)
    # a random model over 256 byte tokens is near-uniform: perplexity near the vocabulary size
    assert 100 < result.ppl < 1000


def test_windows_are_nonoverlapping_and_tail_dropped():
    ids = torch.arange(10)
    assert cut_windows(ids, 3).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert cut_windows(ids, 3, max_windows=2).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert cut_windows(ids, 11).shape == (0, 11)


def test_too_short_dataset_is_a_clear_error(tiny_model_dir):
    lm = load_float_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)
    n_tokens = len(tokenize_file(lm.tokenizer, dataset_path("ptb")))
    with pytest.raises(SpearError, match="fewer than one window"):
        perplexity(lm.model, lm.tokenizer, "ptb", seqlen=n_tokens + 1, progress=False)


def test_unknown_dataset(tiny_model_dir):
    lm = load_float_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)
    with pytest.raises(SpearError, match="unknown dataset"):
        perplexity(lm.model, lm.tokenizer, "c4")
