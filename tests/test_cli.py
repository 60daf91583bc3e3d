"""The CLI end to end on a tiny model, and every bad input: one line, exit 2, nothing half-written."""

import json
import shutil
import subprocess
import sys

import pytest

from spear.cli import main

EVAL_ARGS = ["--seqlen", "64", "--max-windows", "2", "--device", "cpu"]


def run_cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_clean_error(rc, err, match):
    assert rc == 2
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("spear:")]
    assert len(lines) == 1 and match in lines[0], err


def test_quantize_then_eval_roundtrip(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "art"
    rc, _, _ = run_cli(capsys, "quantize", tiny_model_dir, "--method", "rtn", "--bits", "4", "--group-size", "32",
                       "--out", out, "--device", "cpu")
    assert rc == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quant"]["method"] == "rtn" and config["quant"]["group_size"] == 32
    assert config["quant"]["grid"] == "absmax" and "torch" in config["versions"]
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind

    rc, stdout, _ = run_cli(capsys, "eval", out, "--json", *EVAL_ARGS)
    assert rc == 0
    first = json.loads(stdout)  # exactly one JSON object on stdout
    assert {"dataset", "ppl", "windows", "seqlen"} <= set(first) and first["windows"] == 2

    # re-quantizing gives the same artifact, and evaluating it the identical perplexity
    run_cli(capsys, "quantize", tiny_model_dir, "--group-size", "32", "--out", tmp_path / "art2", "--device", "cpu")
    rc, stdout, _ = run_cli(capsys, "eval", tmp_path / "art2", "--json", *EVAL_ARGS)
    assert json.loads(stdout)["ppl"] == first["ppl"]

    rc, stdout, _ = run_cli(capsys, "eval", tiny_model_dir, "--json", *EVAL_ARGS)
    assert json.loads(stdout)["ppl"] != first["ppl"]  # the float model differs from its 4-bit version


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_methods_end_to_end(method, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / method
    rc, _, err = run_cli(capsys, "quantize", tiny_model_dir, "--method", method, "--bits", "3", "--out", out,
                         "--calib-samples", "4", "--calib-len", "32", "--device", "cpu")
    assert rc == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["quant"]["method"] == method and config["calibration"]["num_sequences"] == 4
    assert len(config["calibration"]["ids_sha256"]) == 16  # which tokens calibrated it (data.calibration.ids_digest)


def test_run_quick_on_tiny_model(tiny_model_dir, tmp_path, capsys):
    rc, stdout, _ = run_cli(capsys, "run", tiny_model_dir, "--quick", "--json", "--seqlen", "64",
                            "--out", tmp_path / "run", "--device", "cpu")
    assert rc == 0
    report = json.loads(stdout)
    assert report["fp_ppl"] > 0 and report["w4_ppl"] > 0
    seconds = report["seconds"]  # where a run's time went: each stage, and the whole
    assert {"load", "evaluate", "calibration_ids", "quantize", "total"} <= seconds.keys()
    assert seconds["total"] >= seconds["load"] + seconds["evaluate"] + seconds["quantize"] > 0
    assert (tmp_path / "run" / "report.json").exists() and (tmp_path / "run" / "artifact" / "config.json").exists()
    config = json.loads((tmp_path / "run" / "artifact" / "config.json").read_text())
    assert len(config["calibration"]["ids_sha256"]) == 16


def test_full_protocol_on_a_cpu_gets_a_one_line_note(capsys):
    """`spear run` without --quick on a CPU says, before hours of work, that --quick exists; --quick says nothing."""
    import torch

    from spear.cli import _note_full_protocol_on_cpu
    from spear.data.calibration import CalibConfig
    from spear.quant.pipeline import QuantSettings
    from spear.record import QuantConfig
    from spear.run import RunConfig

    settings = QuantSettings("rtn", QuantConfig(bits=4))
    for quick in (False, True):
        _note_full_protocol_on_cpu(RunConfig.build("m", settings, CalibConfig(), quick=quick), torch.device("cpu"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4096 self-samples" in err[0] and "--quick" in err[0]


def test_missing_model(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "eval", tmp_path / "nope", *EVAL_ARGS)
    assert_clean_error(rc, err, "model not found")


def test_corrupt_gguf(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00garbage" * 100)
    rc, _, err = run_cli(capsys, "quantize", bad, "--out", tmp_path / "out")
    assert_clean_error(rc, err, "cannot read GGUF")
    assert not (tmp_path / "out").exists()


def test_not_a_model_file(capsys, tmp_path):
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"\x80\x04pickle")
    rc, _, err = run_cli(capsys, "eval", bad, *EVAL_ARGS)
    assert_clean_error(rc, err, "not a .gguf")


def test_corrupt_safetensors_in_hf_dir(tiny_model_dir, capsys, tmp_path):
    bad = tmp_path / "bad-model"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"not safetensors at all")
    rc, _, err = run_cli(capsys, "eval", bad, *EVAL_ARGS)
    assert_clean_error(rc, err, "corrupt or missing weights")


def test_unsupported_architecture(capsys, tmp_path):
    d = tmp_path / "weird"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "definitely-not-a-model"}))
    rc, _, err = run_cli(capsys, "eval", d, *EVAL_ARGS)
    assert_clean_error(rc, err, "unsupported architecture")

    (d / "config.json").write_text(json.dumps({"model_type": "vit"}))  # real, but not a causal LM
    rc, _, err = run_cli(capsys, "eval", d, *EVAL_ARGS)
    assert_clean_error(rc, err, "unsupported architecture")


@pytest.mark.parametrize("bits", ["1", "9"])
def test_bits_out_of_range(bits, tiny_model_dir, capsys, tmp_path):
    rc, _, err = run_cli(capsys, "quantize", tiny_model_dir, "--bits", bits, "--out", tmp_path / "out")
    assert_clean_error(rc, err, "bits must be between 2 and 8")
    assert not (tmp_path / "out").exists()


def test_impossible_group_size(tiny_model_dir, capsys, tmp_path):
    rc, _, err = run_cli(capsys, "quantize", tiny_model_dir, "--group-size", "48", "--out", tmp_path / "out",
                         "--device", "cpu")
    assert_clean_error(rc, err, "does not divide")
    assert list(tmp_path.iterdir()) == []


def test_incompatible_and_corrupt_artifact(tiny_model_dir, capsys, tmp_path):
    out = tmp_path / "art"
    assert run_cli(capsys, "quantize", tiny_model_dir, "--out", out, "--device", "cpu")[0] == 0
    config = json.loads((out / "config.json").read_text())

    (out / "config.json").write_text(json.dumps(config | {"format_version": 999}))
    rc, _, err = run_cli(capsys, "eval", out, *EVAL_ARGS)
    assert_clean_error(rc, err, "format version 999")

    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").write_bytes(b"\x00" * 64)
    rc, _, err = run_cli(capsys, "eval", out, *EVAL_ARGS)
    assert_clean_error(rc, err, "corrupt")

    (out / "config.json").write_text("{ not json")
    rc, _, err = run_cli(capsys, "eval", out, *EVAL_ARGS)
    assert_clean_error(rc, err, "cannot read the config")


def test_bad_arguments_exit_2_one_line(capsys):
    for argv in (["quantize"], ["eval", "x", "--dataset", "c4"], ["eval", "x", "--max-windows", "zero"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_console_script_installed():
    proc = subprocess.run([sys.executable, "-m", "spear.cli", "eval", "/no/such/model"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("spear: error: model not found")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_benchmark_without_a_gpu_exits_2_one_line(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "bench", "kernels", "--models", "7b", "--ms", "1", "--json", tmp_path / "k.json")
    assert_clean_error(rc, err, "needs a CUDA GPU")
    assert not (tmp_path / "k.json").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_decode_benchmark_of_a_real_shape_on_cpu_exits_2_one_line(capsys):
    with pytest.raises(SystemExit) as e:  # one line, exit 2, before any model is built
        main(["bench", "decode", "--models", "llama2-7b", "--settings", "w4"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "decode.py: error: llama2-7b needs a CUDA GPU; on CPU run --tiny"


@pytest.mark.parametrize("raised", ["torch", "host"])
def test_out_of_memory_past_the_estimates_is_one_line_with_what_to_change(raised, monkeypatch, capsys):
    import torch

    from spear import cli

    def compensate(args):
        if raised == "torch":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 744.00 MiB. GPU 0 has a total capacity")
        raise MemoryError()

    monkeypatch.setattr(cli, "cmd_compensate", compensate)
    assert main(["compensate", "ART", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("spear: error: out of memory during `spear compensate`")
    assert "--calib-kv-gb" in err[0] and ("744.00 MiB" in err[0]) == (raised == "torch")


def test_other_runtime_errors_are_not_called_out_of_memory(monkeypatch):
    from spear import cli

    monkeypatch.setattr(cli, "cmd_compensate", lambda args: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["compensate", "ART"])
