"""Perplexity protocol on a tiny random Llama, checked against a direct computation."""

import math

import pytest
import torch
import torch.nn.functional as F

from spear.errors import SpearError
from spear.eval.perplexity import cut_windows, dataset_path, eval_batch, perplexity, tokenize_file, window_nll
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


def test_logits_made_a_chunk_at_a_time_give_the_whole_windows_nll(tiny_model_dir):
    """Chunks of 7 positions (18 chunks, the last one short, across both windows of the batch) sum to the NLL of the
    model's own whole logits (a chunk dropped or a target shifted by one moves the sum by ≥ 4e-4 on this model)."""
    lm = load_float_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)
    ids = tokenize_file(lm.tokenizer, dataset_path("wikitext2"))[: 2 * 64].view(2, 64)
    with torch.no_grad():
        logits = lm.model(ids).logits
        whole = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
        vocab = logits.shape[-1]
        chunked = window_nll(lm.model, ids, chunk_bytes=4 * vocab * 7)
    assert chunked == pytest.approx(whole, rel=1e-6)


def test_an_artifact_is_evaluated_without_dense_copies_to_the_same_perplexity(tiny_model_dir, tmp_path):
    """`spear eval`'s load (api.load(dense=False)): transformers' model, every quantized linear holding its codes and
    no dequantized copy, and the perplexity of the dense copies exactly."""
    from spear import api
    from spear.layer import SpearLinear
    from spear.quant.pipeline import QuantSettings
    from spear.record import QuantConfig

    art = api.quantize(str(tiny_model_dir), QuantSettings("rtn", QuantConfig(4, 32)), tmp_path / "art")
    dense, codes_only = api.load(str(art), torch.device("cpu")), api.load(str(art), torch.device("cpu"), dense=False)
    linears = [m for m in codes_only.model.modules() if isinstance(m, SpearLinear)]
    assert linears and all(m.weight_hat is None for m in linears)
    assert all(m.weight_hat is not None for m in dense.model.modules() if isinstance(m, SpearLinear))
    assert (eval_batch(codes_only.model), eval_batch(dense.model)) == (4, 1)  # a forward's dequantization shared
    args = ("wikitext2", 64, 2, 1, False)
    assert perplexity(codes_only.model, codes_only.tokenizer, *args).ppl == perplexity(dense.model, dense.tokenizer,
                                                                                         *args).ppl


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
