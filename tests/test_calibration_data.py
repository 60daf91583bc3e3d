"""Self-sampled calibration data: the sampler's diversity knobs and their validation."""

import pytest
import torch

from conftest import make_tiny_llama
from spear.data.calibration import CalibConfig, pack_sequences, sample_from_model
from spear.errors import SpearError


class _Tok:
    bos_token_id = 1
    eos_token_id = 2
    all_special_ids = [0, 1, 2]

    def __len__(self):
        return 256


def test_random_first_token_follows_bos_and_is_never_special():
    model = make_tiny_llama()
    ids = sample_from_model(model, _Tok(), CalibConfig(num_sequences=12, seq_len=8, first_token="random", batch_size=6))
    assert ids.shape == (12, 8) and (ids[:, 0] == 1).all()
    assert not torch.isin(ids[:, 1], torch.tensor([0, 1, 2])).any() and len(set(ids[:, 1].tolist())) > 3
    bos = sample_from_model(model, _Tok(), CalibConfig(num_sequences=4, seq_len=8, batch_size=4))
    assert bos.shape == (4, 8) and (bos[:, 0] == 1).all()


class _ChatTok(_Tok):
    chat_template = "<|user|>{content}<|end|>"

    def apply_chat_template(self, messages, tokenize=False):
        assert not tokenize
        return "<|sys|>be brief<|end|><|user|>" + messages[0]["content"] + "<|end|>"

    def __call__(self, text, add_special_tokens=True):
        return type("Encoded", (), {"input_ids": [3 + ord(c) % 250 for c in text]})()


def test_chat_samples_open_the_template_and_may_end_turns():
    """first_token="chat": every sequence starts with the template's text before the user's message, and the
    end-of-sequence token (which ends a chat turn) stays drawable; other modes never draw it."""
    from torch import nn

    from spear.data.calibration import chat_prefix

    model = make_tiny_llama()
    head = nn.Linear(64, 256, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[2] = 6.0  # eos (2) likely at every step
    model.lm_head = head
    prefix = chat_prefix(_ChatTok())
    assert prefix == [3 + ord(c) % 250 for c in "<|sys|>be brief<|end|><|user|>"]
    ids = sample_from_model(model, _ChatTok(), CalibConfig(num_sequences=4, seq_len=40, first_token="chat"))
    assert ids.shape == (4, 40) and (ids[:, : len(prefix)] == torch.tensor(prefix)).all()
    assert (ids[:, len(prefix) :] == 2).any()
    plain = sample_from_model(model, _ChatTok(), CalibConfig(num_sequences=4, seq_len=40))
    assert not (plain[:, 1:] == 2).any()
    with pytest.raises(SpearError, match="chat template"):
        chat_prefix(_Tok())
    with pytest.raises(SpearError, match="calib-len"):
        sample_from_model(model, _ChatTok(), CalibConfig(num_sequences=2, seq_len=len(prefix), first_token="chat"))


def test_mid_text_windows_have_no_bos_and_come_from_inside_one_sample():
    """start="mid": each sequence is a window of a longer sample, starting after its BOS at a seeded offset."""
    from spear.data.calibration import MID_MARGIN

    model = make_tiny_llama()
    cfg = CalibConfig(num_sequences=6, seq_len=8, batch_size=6, start="mid", seed=3)
    ids = sample_from_model(model, _Tok(), cfg)
    assert ids.shape == (6, 8) and not (ids[:, 0] == 1).any()
    torch.manual_seed(0)  # the sampler reseeds from cfg.seed: the full samples are the same
    full = sample_from_model(model, _Tok(), CalibConfig(num_sequences=6, seq_len=8 + MID_MARGIN, batch_size=6, seed=3))
    assert full.shape == (6, 8 + MID_MARGIN)
    for window, sample in zip(ids.tolist(), full.tolist()):
        starts = [o for o in range(1, MID_MARGIN + 1) if sample[o : o + 8] == window]
        assert starts, "each window is a run of its own sample after BOS"
    offsets = {next(o for o in range(1, MID_MARGIN + 1) if s[o : o + 8] == w) for w, s in zip(ids.tolist(), full.tolist())}
    assert len(offsets) > 1


def test_bad_sampler_settings():
    for kwargs in ({"start": "end"}, {"first_token": "middle"}, {"temperature": 0.0}, {"top_p": 1.5}, {"seq_len": 1},
                   {"surprise": 1.0}, {"surprise": -0.1}):
        with pytest.raises(SpearError):
            CalibConfig(**kwargs)


def test_warp_mixes_the_usual_sampler_with_a_hot_untruncated_one():
    """Rows drawn as surprised get scores / SURPRISE_TEMPERATURE over the whole vocabulary; the others exactly what
    transformers' own temperature and top-p warpers give."""
    from transformers import TopPLogitsWarper

    from spear.data.calibration import SURPRISE_TEMPERATURE, _warp

    scores = torch.randn(400, 50, generator=torch.Generator().manual_seed(0))
    ids = torch.zeros(400, 3, dtype=torch.long)
    usual = TopPLogitsWarper(0.9)(ids, scores / 0.8)
    torch.manual_seed(1)
    out = _warp(scores, CalibConfig(temperature=0.8, top_p=0.9, surprise=0.25))
    hot = (out == scores / SURPRISE_TEMPERATURE).all(dim=1)
    assert 60 < int(hot.sum()) < 140  # about a quarter of 400
    assert torch.equal(out[~hot], usual[~hot]) and torch.isinf(usual).any()
    assert not torch.isinf(out[hot]).any()
    never = _warp(scores, CalibConfig(top_p=0.9, surprise=0.0))
    assert torch.equal(never, TopPLogitsWarper(0.9)(ids, scores))


def test_cached_sampling_matches_generate_when_greedy():
    """sample_with_cache runs the model's KV cache as generate does: with top-p tiny (greedy) both give the same
    tokens, and neither ever draws the end-of-sequence token."""
    from spear.data.calibration import sample_with_cache

    model = make_tiny_llama()
    first = torch.tensor([[1], [5], [7]])
    ours = sample_with_cache(model, first, 12, CalibConfig(top_p=1e-6))
    ref = model.generate(first, attention_mask=torch.ones_like(first), do_sample=False, max_new_tokens=11,
                         min_new_tokens=11, pad_token_id=0)
    assert torch.equal(ours, ref)
    teacher_forced = model(ours).logits[:, :-1].argmax(-1)  # each token the argmax given all before it
    eos = model.generation_config.eos_token_id
    assert torch.equal(teacher_forced[teacher_forced != eos], ours[:, 1:][teacher_forced != eos])


def test_surprise_sampling():
    """Full-length sequences from BOS, other ids than without surprise from the same seed, the same ids again from
    the same seed."""
    model = make_tiny_llama()
    cfg = CalibConfig(num_sequences=6, seq_len=12, batch_size=6, surprise=0.5)
    ids = sample_from_model(model, _Tok(), cfg)
    assert ids.shape == (6, 12) and (ids[:, 0] == 1).all() and not (ids[:, 1:] == 2).any()
    assert torch.equal(sample_from_model(model, _Tok(), cfg), ids)
    plain = sample_from_model(model, _Tok(), CalibConfig(num_sequences=6, seq_len=12, batch_size=6))
    assert not torch.equal(plain, ids)


def test_ids_digest_names_exactly_the_tokens():
    from spear.data.calibration import ids_digest

    ids = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0))
    assert ids_digest(ids) == ids_digest(ids.clone().to(torch.int32)) and len(ids_digest(ids)) == 16
    changed = ids.clone()
    changed[3, 15] += 1
    assert ids_digest(changed) != ids_digest(ids)


def test_packed_samples_run_end_to_end_without_the_later_bos():
    ids = torch.arange(1, 25).view(6, 4)
    ids[:, 0] = 0  # every sample starts with BOS 0
    packed = pack_sequences(ids, 2, drop_bos=True)
    assert packed.tolist() == [[0, 2, 3, 4, 6, 7, 8], [0, 10, 11, 12, 14, 15, 16], [0, 18, 19, 20, 22, 23, 24]]
    assert pack_sequences(ids, 4, drop_bos=False).tolist() == [ids[:4].flatten().tolist()]  # leftover rows dropped
    assert pack_sequences(ids, 1, drop_bos=True) is ids
    with pytest.raises(SpearError, match="pack"):
        CalibConfig(num_sequences=4, pack=5)


def test_sampling_batch_keeps_the_kv_cache_under_its_budget():
    """Fewer sequences at once where their KV cache would pass kv_cache_gb; the ids keep their shape."""
    from spear.data.calibration import sampling_batch

    model = make_tiny_llama()
    c = model.config
    row = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4 * 8
    assert sampling_batch(model, CalibConfig(num_sequences=12, seq_len=8)) == 12
    assert sampling_batch(model, CalibConfig(num_sequences=5000, seq_len=8)) == 4096  # batch_size caps it (16 GB on CPU)
    assert sampling_batch(model, CalibConfig(num_sequences=5000, seq_len=8, kv_cache_gb=1000 * row / 2**30)) == 1000
    small = CalibConfig(num_sequences=12, seq_len=8, kv_cache_gb=3.5 * row / 2**30)
    assert sampling_batch(model, small) == 3
    assert sample_from_model(model, _Tok(), small).shape == (12, 8)
    with pytest.raises(SpearError):
        CalibConfig(kv_cache_gb=0)


def test_the_cuda_sampler_budget_leaves_room_beside_large_models():
    """40% of the card while the models are small (the batch, in the cache key, as before), at most half of what
    they leave once they are large: an 8B student and teacher (33.2 GiB) on an H100 (79.2 GiB) ran out at 40%."""
    from spear.data.calibration import cuda_kv_budget

    gib = 2**30
    assert cuda_kv_budget(int(79.2 * gib), int(0.6 * gib)) == pytest.approx(0.4 * 79.2 * gib)  # 135M: unchanged
    assert cuda_kv_budget(int(140.4 * gib), int(0.6 * gib)) == pytest.approx(0.4 * 140.4 * gib)
    at_8b = cuda_kv_budget(int(79.2 * gib), int(33.2 * gib))
    assert at_8b == pytest.approx(23.0 * gib) and 33.2 * gib + 2 * at_8b < 79.2 * gib + gib
    assert cuda_kv_budget(gib, 2 * gib) == 0  # a full card: no room (sampling_batch still takes one sequence)


def test_the_samplers_estimate_takes_the_batch_the_sampler_will():
    """sampler_bytes, from the config alone, counts the batch sampling_batch takes from the model: its KV cache, one
    layer's cache again (growth by concatenation) and a step's logits with their nucleus copies."""
    from spear.data.calibration import sampler_bytes, sampling_batch

    model = make_tiny_llama()
    config = model.config.to_dict()
    c = model.config
    row = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4 * 8
    cpu = torch.device("cpu")
    for calib in (CalibConfig(num_sequences=12, seq_len=8), CalibConfig(num_sequences=12, seq_len=8,
                                                                        kv_cache_gb=3.5 * row / 2**30)):
        batch = sampling_batch(model, calib)
        expected = batch * row * (1 + 1 / c.num_hidden_layers) + batch * c.vocab_size * 24
        assert sampler_bytes(config, torch.float32, cpu, calib, 0) == pytest.approx(expected, abs=1)
    assert sampler_bytes(config, torch.float32, cpu, CalibConfig(text_file="t.txt"), 0) == 0