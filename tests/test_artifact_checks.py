"""Broken artifacts (issue 52, finding 4): a broken tokenizer, config value or chat template, and weight bytes that
are not as written, each end in one line and exit 2 before anything serves; `spear verify` checks an artifact
against the sha256 of its shards that config.json records."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from spear import api
from spear.artifact import ArtifactInfo, load_artifact, save_artifact
from spear.cli import main
from spear.errors import SpearError
from spear.models import load_float_model
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig

CPU = torch.device("cpu")
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def artifact(tiny_model_dir, tmp_path_factory):
    """A W4 artifact of the tiny Llama in several shards, with a chat template."""
    lm = load_float_model(str(tiny_model_dir), CPU, torch.float32)
    quantize_model(lm.model, QuantSettings("rtn", QuantConfig(4, -1)))
    lm.tokenizer.chat_template = CHAT_TEMPLATE
    return save_artifact(lm.model, lm.tokenizer, tmp_path_factory.mktemp("art") / "art",
                         ArtifactInfo("tiny", {"method": "rtn"}), max_shard_bytes=20_000)


@pytest.fixture
def copy(artifact, tmp_path):
    return shutil.copytree(artifact, tmp_path / "art")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line(rc: int, err: str, match: str) -> None:
    assert rc == 2 and "Traceback" not in err
    assert err.startswith("spear: error: ") and err.count("\n") == 1 and match in err, err


def edit_model_config(**values):
    def edit(path):
        config = json.loads((path / "config.json").read_text())
        config["model_config"] |= values
        (path / "config.json").write_text(json.dumps(config))
    return edit


def flip_last_byte(file):
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF  # the end of the data section: the header stays intact
    file.write_bytes(bytes(data))


def test_every_shard_records_its_sha256(artifact, tiny_model_dir, tmp_path, capsys):
    shards = sorted(p.name for p in artifact.glob("*.safetensors"))
    recorded = json.loads((artifact / "config.json").read_text())["weights_sha256"]
    assert len(shards) > 2 and sorted(recorded) == shards
    assert all(recorded[name] == hashlib.sha256((artifact / name).read_bytes()).hexdigest() for name in shards)
    rc, out, _ = run_cli(capsys, "verify", artifact)
    assert rc == 0 and out.startswith(f"ok: {artifact}: {len(shards)} shards") and out.count("\n") == 1
    streamed = api.quantize(str(tiny_model_dir), QuantSettings("rtn", QuantConfig(4, -1)), tmp_path / "streamed")
    recorded = json.loads((streamed / "config.json").read_text())["weights_sha256"]
    assert recorded == {"model.safetensors": hashlib.sha256((streamed / "model.safetensors").read_bytes()).hexdigest()}


@pytest.mark.parametrize("case, edit, match", [
    ("corrupt tokenizer.json", lambda p: (p / "tokenizer.json").write_text('{"version": "1.0", "model": {'),
     "corrupt tokenizer file"),
    ("missing tokenizer.json", lambda p: (p / "tokenizer.json").unlink(), "has no tokenizer.json"),
    ("broken tokenizer_config.json", lambda p: (p / "tokenizer_config.json").write_text('{"bos_token": '),
     "tokenizer_config.json"),
    ("layers as a word", edit_model_config(num_hidden_layers="thirty"), "num_hidden_layers is 'thirty'"),
    ("hidden size unlike the weights", edit_model_config(hidden_size=100), "[256, 100] by config.json's model_config"),
    ("negative vocabulary", edit_model_config(vocab_size=-1), "vocab_size is -1"),
])
def test_broken_tokenizer_or_config_is_one_line_exit_2_before_serving(case, edit, match, copy, capsys):
    edit(copy)
    assert_one_line(*run_cli(capsys, "serve", copy, "--port", "0", "--device", "cpu")[::2], match)
    assert_one_line(*run_cli(capsys, "verify", copy)[::2], match)


def test_a_chat_template_that_does_not_render_refuses_to_start(copy, capsys):
    assert api.load(str(copy), CPU, serving=True).tokenizer.chat_template == CHAT_TEMPLATE
    (copy / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(SpearError, match="chat_template.jinja does not render"):
        api.load(str(copy), CPU, serving=True)  # what `spear serve` loads before it listens
    assert_one_line(*run_cli(capsys, "eval", copy, "--seqlen", "16", "--max-windows", "1", "--device", "cpu")[::2],
                    "chat_template.jinja")
    (copy / "chat_template.jinja").unlink()  # no template: it loads (chat requests get a 400)
    assert api.load(str(copy), CPU, serving=True).tokenizer.chat_template is None


def test_corrupt_weight_bytes_fail_the_load_and_verify(copy, capsys):
    shard = sorted(copy.glob("model-*.safetensors"))[1]
    flip_last_byte(shard)
    with pytest.raises(SpearError, match=f"{shard.name} does not match the sha256"):
        load_artifact(copy, CPU)
    assert_one_line(*run_cli(capsys, "serve", copy, "--port", "0", "--device", "cpu")[::2], shard.name)
    assert_one_line(*run_cli(capsys, "verify", copy)[::2], f"{shard} does not match the sha256")


def test_artifacts_from_before_the_sha256_load_unchecked(copy, capsys):
    config = json.loads((copy / "config.json").read_text())
    del config["weights_sha256"]
    (copy / "config.json").write_text(json.dumps(config))
    flip_last_byte(sorted(copy.glob("model-*.safetensors"))[0])  # nothing to tell it by
    load_artifact(copy, CPU)
    rc, out, _ = run_cli(capsys, "verify", copy)
    assert rc == 0 and "no sha256 recorded" in out and out.count("\n") == 1


def test_the_digest_bench_runs_on_a_tiny_shape(tmp_path):
    import artifact_digest  # bench/, on sys.path through conftest

    row = artifact_digest.measure("tiny", tmp_path, repeats=1)
    assert row["shards"] == 1 and row["load_checked_min_s"] > 0 and row["load_unchecked_min_s"] > 0
    unchecked = json.loads((tmp_path / "tiny-w4-unchecked" / "config.json").read_text())
    assert "weights_sha256" not in unchecked
