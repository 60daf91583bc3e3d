"""Self-sampled calibration data: the sampler's diversity knobs and their validation."""

import pytest
import torch

from conftest import make_tiny_llama
from spear.data.calibration import CalibConfig, sample_from_model
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
    for kwargs in ({"start": "end"}, {"first_token": "middle"}, {"temperature": 0.0}, {"top_p": 1.5}, {"seq_len": 1}):
        with pytest.raises(SpearError):
            CalibConfig(**kwargs)
