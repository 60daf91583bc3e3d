"""compensate.resume: a calibration cut short and started again with the same checkpoint directory ends where an
uninterrupted one ends, bit for bit on a CPU; a checkpoint of another calibration is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from spear.compensate import calibrate as calibrate_module
from spear.compensate.calibrate import calibrate_ecs, ec_state_dict
from spear.compensate.resume import FILE
from spear.errors import SpearError
from test_calibrate import FAST, calib_ids, quantized_pair

CFG = replace(FAST, steps=12, eval_every=3)


class Cut(Exception):
    pass


def cut_after(monkeypatch, steps: int) -> None:
    """The training stops (as a killed process would) during step `steps` + 1."""
    calls, loss = [0], calibrate_module._batch_loss

    def counted(*args, **kwargs):
        calls[0] += 1
        if calls[0] > steps:
            raise Cut
        return loss(*args, **kwargs)

    monkeypatch.setattr(calibrate_module, "_batch_loss", counted)


def test_a_cut_calibration_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    teacher, student = quantized_pair()
    whole = calibrate_ecs(student, teacher, calib_ids(), CFG)
    expected = ec_state_dict(student)

    teacher, student = quantized_pair()
    cfg = replace(CFG, checkpoint_dir=str(tmp_path))
    with monkeypatch.context() as m:
        cut_after(m, 7)  # the last scoring written was step 6's
        with pytest.raises(Cut):
            calibrate_ecs(student, teacher, calib_ids(), cfg)
    assert (tmp_path / FILE).exists()
    teacher, student = quantized_pair()  # a new process: the pipeline builds the same student again
    resumed = calibrate_ecs(student, teacher, calib_ids(), cfg)
    assert resumed.steps == whole.steps == 12 and resumed.best_step == whole.best_step
    assert resumed.final_heldout_kl == whole.final_heldout_kl
    assert [h["step"] for h in resumed.history] == [h["step"] for h in whole.history]
    assert [h["train_kl"] for h in resumed.history] == [h["train_kl"] for h in whole.history]
    state = ec_state_dict(student)
    assert all(torch.equal(state[k], expected[k]) for k in expected)

    teacher, student = quantized_pair()  # a finished checkpoint: its result again, no step trained
    again = calibrate_ecs(student, teacher, calib_ids(), cfg)
    assert again.final_heldout_kl == whole.final_heldout_kl and again.steps == 12
    assert all(torch.equal(ec_state_dict(student)[k], expected[k]) for k in expected)


def test_a_checkpoint_of_another_calibration_is_refused(tmp_path):
    teacher, student = quantized_pair()
    calibrate_ecs(student, teacher, calib_ids(), replace(CFG, steps=3, checkpoint_dir=str(tmp_path)))
    for other in (replace(CFG, steps=3, seed=1), replace(CFG, steps=3, lr=2e-2)):
        teacher, student = quantized_pair()
        with pytest.raises(SpearError, match="checkpoint of another calibration"):
            calibrate_ecs(student, teacher, calib_ids(), replace(other, checkpoint_dir=str(tmp_path)))
    teacher, student = quantized_pair()
    with pytest.raises(SpearError, match="checkpoint of another calibration"):
        calibrate_ecs(student, teacher, calib_ids(n=20), replace(CFG, steps=3, checkpoint_dir=str(tmp_path)))
    teacher, student = quantized_pair(rank=4)  # another plan
    with pytest.raises(SpearError, match="checkpoint of another calibration"):
        calibrate_ecs(student, teacher, calib_ids(), replace(CFG, steps=3, checkpoint_dir=str(tmp_path)))
    teacher, student = quantized_pair()  # reporting and scoring batch size are not the training
    calibrate_ecs(student, teacher, calib_ids(), replace(CFG, steps=3, eval_batch_size=5, checkpoint_dir=str(tmp_path)))


def test_spear_compensate_writes_and_resumes_its_checkpoint(tiny_model_dir, tmp_path, capsys):
    from spear.cli import main

    art, checkpoint = tmp_path / "art", tmp_path / "ck"
    assert main(["quantize", str(tiny_model_dir), "--bits", "3", "--out", str(art), "--device", "cpu"]) == 0
    options = ["--budget", "30%", "--steps", "50", "--calib-samples", "8", "--calib-len", "32", "--device", "cpu",
               "--calib-checkpoint", str(checkpoint)]
    assert main(["compensate", str(art), *options]) == 0, capsys.readouterr().err
    assert (checkpoint / FILE).exists()
    capsys.readouterr()
    assert main(["compensate", str(art), *options, "--joint-rounds", "1"]) == 2
    assert "resumes one training" in capsys.readouterr().err
