"""The artifact at 4-bit size: packed codes, 16-bit floats, shards with the HF index, streaming load and quantize,
format 1 still readable."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from spear.api import model_key, quantize
from spear.artifact import ArtifactInfo, load_artifact, save_artifact
from spear.data.calibration import CalibConfig, calibration_ids
from spear.errors import SpearError
from spear.layer import SpearLinear
from spear.models import load_float_model
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig, pack_codes, packed_width, rtn_quantize, unpack_codes
from spear.shards import INDEX_FILE, ShardReader, safetensors_bytes

CPU = torch.device("cpu")


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("width", [64, 63, 7])
def test_codes_pack_to_their_bits_and_back(bits, width):
    codes = torch.randint(0, 2**bits, (5, width), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, packed_width(width, bits)) == (5, -(-width * bits // 8))
    assert torch.equal(unpack_codes(packed, bits, width), codes)


def test_four_bit_codes_are_nibbles_low_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x0F]]
    assert pack_codes(torch.tensor([[5, 3, 1]], dtype=torch.uint8), 3).tolist() == [[5 | 3 << 3 | 1 << 6, 0]]


def _quantized(tiny_model_dir, group_size=-1):
    lm = load_float_model(str(tiny_model_dir), CPU, torch.float32)
    quantize_model(lm.model, QuantSettings("rtn", QuantConfig(4, group_size)))
    return lm


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_artifact_is_4_bit_sharded_and_loads_exactly(tiny_model_dir, tmp_path):
    lm = _quantized(tiny_model_dir)
    ids = torch.randint(0, 256, (2, 16))
    out = save_artifact(lm.model, lm.tokenizer, tmp_path / "art", ArtifactInfo("tiny", {"method": "rtn"}),
                        max_shard_bytes=20_000)
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in ShardReader(out).items() for t in [t[1]])
    linears = [m for m in lm.model.modules() if isinstance(m, SpearLinear)]
    codes = ShardReader(out).get("model.layers.0.mlp.down_proj.codes")
    assert codes.dtype == torch.uint8 and codes.shape == (64, 64)  # 128 inputs, two codes a byte
    # every tensor at 4 bits or 16 bits: the files are the served bytes (records + fp16 rest) and headers
    served = sum(m.nbytes() for m in linears) + sum(
        p.numel() * 2 for n, p in lm.model.named_parameters() if ".layers." not in n or "norm" in n)
    assert safetensors_bytes(out) <= 1.05 * served + 8_000 * len(shards)  # headers: a few kB a shard
    back = load_artifact(out, CPU, torch.float32)
    assert torch.equal(_logits(back.model, ids), _logits(lm.model, ids))
    serving = load_artifact(out, CPU, torch.float32, dense=False)
    assert all(m.weight_hat is None for m in serving.model.modules() if isinstance(m, SpearLinear))
    # served from plain modules (models.plain_skeleton: no transformers forward): each linear computes as the dense
    # load's from its codes, every other tensor equal
    served = dict(serving.model.named_modules())
    for name, m in back.model.named_modules():
        if isinstance(m, SpearLinear):
            x = torch.randn(3, m.in_features)
            assert torch.equal(served[name](x), m(x))
    assert all(torch.equal(p, back.model.get_parameter(n)) for n, p in serving.model.named_parameters())


def test_format_1_artifacts_still_load(tiny_model_dir, tmp_path):
    lm = _quantized(tiny_model_dir, group_size=32)
    out = save_artifact(lm.model, lm.tokenizer, tmp_path / "art", ArtifactInfo("tiny", {"method": "rtn"}))
    config = json.loads((out / "config.json").read_text())
    del config["weights_sha256"]  # format 1 recorded none
    tensors = load_file(str(out / "model.safetensors"))
    for name, meta in config["quantized_modules"].items():  # format 1: one uint8 a code
        tensors[f"{name}.codes"] = unpack_codes(tensors[f"{name}.codes"], meta["bits"], meta.pop("in_features"))
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config | {"format_version": 1}))
    ids = torch.randint(0, 256, (1, 12))
    assert torch.equal(_logits(load_artifact(out, CPU, torch.float32).model, ids), _logits(lm.model, ids))
    (out / "config.json").write_text(json.dumps(config | {"format_version": 3}))
    with pytest.raises(SpearError, match="format version 3.*re-create it with `spear quantize`"):
        load_artifact(out, CPU)


def test_streaming_rtn_writes_the_whole_model_artifact(tiny_model_dir, tmp_path):
    """spear quantize --method rtn reads the checkpoint a layer at a time; its artifact equals the one of the
    whole-model path (quantize_model + save_artifact), tensor for tensor."""
    settings = QuantSettings("rtn", QuantConfig(4, 32))
    streamed = quantize(str(tiny_model_dir), settings, tmp_path / "streamed")
    lm = _quantized(tiny_model_dir, group_size=32)
    whole = save_artifact(lm.model, lm.tokenizer, tmp_path / "whole", ArtifactInfo("tiny", {}))
    a, b = ShardReader(streamed), ShardReader(whole)
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        x, y = a.get(name), b.get(name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (streamed, whole))
    assert ca["quantized_modules"] == cb["quantized_modules"] and ca["tied"] == cb["tied"] != {}


@pytest.mark.parametrize("method", ["gptq", "awq", "omniquant"])
def test_streaming_calibrated_methods_write_the_whole_model_artifact(method, tiny_model_dir, tmp_path):
    """spear quantize --method gptq / awq / omniquant walks the checkpoint a layer at a time (the layers filled one
    by one, the inputs captured with the layers left on meta); same records and tensors (AWQ: its folded norms too)
    as the method on the whole float model."""
    settings = QuantSettings(method, QuantConfig(4, 32), omniquant_epochs=2)
    calib = CalibConfig(num_sequences=4, seq_len=24, seed=3)
    streamed = quantize(str(tiny_model_dir), settings, tmp_path / "streamed", calib, device=CPU)
    lm = load_float_model(str(tiny_model_dir), CPU, torch.float32)
    ids = calibration_ids(lm.model, lm.tokenizer, calib, model_key(str(tiny_model_dir)))
    quantize_model(lm.model, settings, ids)
    whole = save_artifact(lm.model, lm.tokenizer, tmp_path / "whole", ArtifactInfo("tiny", {}))
    a, b = ShardReader(streamed), ShardReader(whole)
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        assert torch.equal(a.get(name), b.get(name)), name
    rtn = quantize(str(tiny_model_dir), QuantSettings("rtn", QuantConfig(4, 32)), tmp_path / "rtn")
    codes = [n for n in a.names() if n.endswith(".codes")]
    assert any(not torch.equal(a.get(n), ShardReader(rtn).get(n)) for n in codes)  # the method's, not RTN's, codes
    assert json.loads((streamed / "config.json").read_text())["calibration"]["num_sequences"] == 4


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_streaming_on_a_text_file_never_loads_the_float_model(method, tiny_model_dir, tmp_path, monkeypatch):
    import spear.api

    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    monkeypatch.setattr(spear.api, "load_float_model", lambda *a, **k: pytest.fail("the float model was loaded"))
    calib = CalibConfig(num_sequences=2, seq_len=32, text_file=str(text))
    out = quantize(str(tiny_model_dir), QuantSettings(method, QuantConfig(4, 32)), tmp_path / "art", calib, device=CPU)
    assert json.loads((out / "config.json").read_text())["quant"]["method"] == method


def test_streaming_rtn_refuses_a_bad_group_size_before_writing(tiny_model_dir, tmp_path):
    with pytest.raises(SpearError, match="does not divide"):
        quantize(str(tiny_model_dir), QuantSettings("rtn", QuantConfig(4, 48)), tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_spear_linear_holds_packed_codes_and_serving_releases_them():
    record = rtn_quantize(torch.randn(64, 128), QuantConfig(4, 64))
    layer = SpearLinear(record)
    assert layer.codes.shape == (64, 64) and torch.equal(layer.qweight.codes, record.codes)
    assert layer.nbytes() == record.nbytes_packed()
    x = torch.randn(3, 128)
    y = layer(x)
    layer.release_for_serving()  # on a CPU without a kernel packing: the dense copy stays, the record goes
    assert layer.codes is None and layer.weight_hat is not None and torch.equal(layer(x), y)
    with pytest.raises(SpearError, match="release_for_serving"):
        layer.qweight


def test_commands_refuse_what_cannot_fit_before_loading(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A checkpoint or artifact larger than the memory available: one line that says what is needed and what to
    change, exit 2, before anything is loaded or written."""
    from spear import memory
    from spear.cli import main

    art = quantize(str(tiny_model_dir), QuantSettings("rtn", QuantConfig(4, -1)), tmp_path / "art")
    capsys.readouterr()
    monkeypatch.setattr(memory, "available_bytes", lambda device: 10_000)
    for argv, what in (([str(tiny_model_dir)], "loading"), ([str(art)], "loading")):
        assert main(["eval", *argv, "--device", "cpu", "--max-windows", "1", "--seqlen", "32"]) == 2
        err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("spear:")]
        assert len(err) == 1 and what in err[0] and "needs about" in err[0] and "available" in err[0], err
    assert main(["quantize", str(tiny_model_dir), "--method", "gptq", "--device", "cpu", "--out",
                 str(tmp_path / "gptq")]) == 2
    assert "needs about" in capsys.readouterr().err and not (tmp_path / "gptq").exists()


def test_compensate_estimates_its_peak_and_refuses_before_loading(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """compensate_bytes: the student as loaded with the loader's own, the teacher's parameters, and the largest
    stage; bfloat16 training and checkpointed layers estimate less than float32 and whole activations. `spear compensate` refuses
    a plan that cannot fit with one line, exit 2, the artifact untouched."""
    from dataclasses import replace

    from spear import memory
    from spear.artifact import load_bytes, read_artifact_config
    from spear.cli import main
    from spear.compensate.pipeline import CompensateConfig
    from spear.compensate.precision import LOADER_BYTES, compensate_bytes

    art = quantize(str(tiny_model_dir), QuantSettings("rtn", QuantConfig(4, -1)), tmp_path / "art")
    config = read_artifact_config(art)
    from spear import api

    float_params = sum(p.numel() for p in api.load(str(tiny_model_dir), CPU).model.parameters())
    cfg = CompensateConfig()
    cfg = replace(cfg, calibrate=replace(cfg.calibrate, precision="float32"))
    calib = CalibConfig(num_sequences=64, seq_len=128)
    parts = compensate_bytes(art, config, torch.float32, CPU, cfg, calib)
    assert parts["student"] == load_bytes(art, config, torch.float32, dense=True) + LOADER_BYTES
    assert parts["teacher"] == 4 * float_params and parts["statistics"] > 0
    bf16 = compensate_bytes(art, config, torch.float32, CPU, replace(cfg, calibrate=replace(cfg.calibrate,
                            precision="bfloat16")), calib)
    ckpt = compensate_bytes(art, config, torch.float32, CPU, replace(cfg, calibrate=replace(cfg.calibrate,
                            checkpoint_layers=True)), calib)
    assert bf16["training in bfloat16"] < parts["training in float32"]
    assert ckpt["training in float32"] < parts["training in float32"]

    before = sorted((f.name, f.stat().st_mtime_ns) for f in art.iterdir())
    capsys.readouterr()
    monkeypatch.setattr(memory, "available_bytes", lambda device: 10_000)
    assert main(["compensate", str(art), "--device", "cpu", "--calib-samples", "4", "--calib-len", "32"]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("spear:")]
    assert len(err) == 1 and "compensating" in err[0] and "--checkpoint-layers" in err[0], err
    assert sorted((f.name, f.stat().st_mtime_ns) for f in art.iterdir()) == before


def test_load_bytes_estimates_what_loading_holds(tiny_model_dir, tmp_path):
    from spear.artifact import load_bytes, read_artifact_config
    from spear.runtime.model import held_bytes

    art = quantize(str(tiny_model_dir), QuantSettings("rtn", QuantConfig(4, 32)), tmp_path / "art")
    config = read_artifact_config(art)
    for dense in (True, False):
        held = held_bytes(load_artifact(art, CPU, torch.float32, dense=dense).model)
        estimate = load_bytes(art, config, torch.float32, dense)
        assert 0.9 * estimate <= sum(held.values()) <= 1.25 * estimate, (dense, held, estimate)
