"""`spear export-vllm` (spear.export.vllm) and the EC term of the spear-vllm plugin (plugins/spear_vllm/ec.py),
without vLLM: the compressed-tensors weights decompress to our records bit for bit, the ECs round-trip, the static
LoRA adapter's B @ A is the EC's static product, and the plugin's EC term (sharded over tensor-parallel ranks as
vLLM shards the base weight) is spear's ErrorCompensator. tests/test_vllm_plugin.py runs vLLM itself."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_byte_tokenizer, make_tiny_llama
from test_cli import assert_clean_error, run_cli

from spear.artifact import ArtifactInfo, load_artifact, save_artifact
from spear.errors import SpearError
from spear.export.vllm import EC_FILE, LORA_DIR, SPEAR_KEY, export_vllm
from spear.compensate.pipeline import quantized_layers
from spear.layer import ErrorCompensator
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "spear_vllm"))
from spear_vllm.ec import FusedEC, rank_shards, shard_ec  # noqa: E402

pytest.importorskip("compressed_tensors")

EC_LINEARS = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj",
              "model.layers.1.mlp.up_proj")


def random_ec(in_f: int, out_f: int, rank: int, gate_hidden: int, seed: int) -> ErrorCompensator:
    """An EC with every tensor random, the gate's last layer included (so gamma is not 1)."""
    ec = ErrorCompensator(in_f, out_f, rank, gate_hidden, alpha=0.7)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ec.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return ec


def write_artifact(path: Path, sym: bool = True, group_size: int = -1, ec_linears=EC_LINEARS) -> Path:
    model = make_tiny_llama()
    quantize_model(model, QuantSettings("rtn", QuantConfig(group_size=group_size, sym=sym)))
    for i, name in enumerate(ec_linears):
        layer = model.get_submodule(name)
        layer.ec = random_ec(layer.in_features, layer.out_features, 4 + 4 * (i % 2), 8 * (i % 3), seed=i)
    save_artifact(model, make_byte_tokenizer(), path, ArtifactInfo("tiny", {"method": "rtn"}))
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    art = write_artifact(root / "art")
    return art, export_vllm(art, root / "vllm")


@pytest.mark.parametrize("sym, group_size", [(True, -1), (True, 32), (False, -1), (False, 32)])
def test_weights_decompress_bit_equal(sym, group_size, tmp_path):
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    art = write_artifact(tmp_path / "art", sym, group_size)
    result = export_vllm(art, tmp_path / "vllm")
    assert (result.symmetric, result.group_size) == (sym, group_size)
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    qc = config["quantization_config"]
    scheme = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k != SPEAR_KEY}).config_groups["group_0"]
    assert qc["format"] == "pack-quantized" and config["architectures"] == ["LlamaForCausalLM"]
    tensors = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    model = load_artifact(art, torch.device("cpu"), torch.float32).model
    for name, layer in quantized_layers(model).items():
        state = {k.removeprefix(f"{name}."): v for k, v in tensors.items() if k.startswith(f"{name}.weight")}
        assert ("weight_zero_point" in state) == (not sym)
        for dtype in (torch.float32, torch.float16):
            state["weight_scale"] = state["weight_scale"].to(dtype)
            weight = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
            assert weight.dtype == dtype and torch.equal(weight, layer.qweight.dequantize(dtype))
    # everything else as the artifact stores it; the index lists model.safetensors alone (the ECs stay out)
    assert torch.equal(tensors["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    index = json.loads((tmp_path / "vllm" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == {"model.safetensors"}
    assert not any(".ec." in k for k in tensors)


def test_ecs_round_trip(exported):
    art, result = exported
    model = load_artifact(art, torch.device("cpu"), torch.float32).model
    ecs = load_file(str(result.out_dir / EC_FILE))
    spear = json.loads((result.out_dir / "config.json").read_text())["quantization_config"][SPEAR_KEY]
    assert set(spear["ec_modules"]) == set(EC_LINEARS) and spear["ec_file"] == EC_FILE
    for name in EC_LINEARS:
        ec = model.get_submodule(name).ec
        assert spear["ec_modules"][name] == {"rank": ec.rank, "gate_hidden": ec.gate_hidden}
        for key, value in ec.state_dict().items():
            assert torch.equal(ecs[f"{name}.ec.{key}"], value)
    assert len(ecs) == sum(len(model.get_submodule(n).ec.state_dict()) for n in EC_LINEARS)


def test_import_of_the_export_is_the_compensated_artifact(exported, tmp_path, capsys):
    """`spear import VDIR` reads the weights its index lists and the ECs its spear entry names: the same records,
    the same EC tensors, the same logits as the artifact exported."""
    art, result = exported
    rc, _, err = run_cli(capsys, "import", result.out_dir, "--out", tmp_path / "imported")
    assert rc == 0, err
    original = load_artifact(art, torch.device("cpu"), torch.float32).model
    imported = load_artifact(tmp_path / "imported", torch.device("cpu"), torch.float32).model
    layers = quantized_layers(imported)
    assert set(layers) == set(quantized_layers(original))
    for name, layer in quantized_layers(original).items():
        ours, theirs = layer.qweight, layers[name].qweight
        assert torch.equal(ours.codes, theirs.codes) and torch.equal(ours.scales, theirs.scales)
        assert torch.equal(ours.zeros.long(), theirs.zeros.long())
        assert (layer.ec is None) == (layers[name].ec is None)
        if layer.ec is not None:
            assert layer.ec.state_dict().keys() == layers[name].ec.state_dict().keys()
            assert all(torch.equal(v, layers[name].ec.state_dict()[k]) for k, v in layer.ec.state_dict().items())
    ids = torch.randint(0, original.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(imported(ids).logits, original(ids).logits)


def test_import_of_an_export_with_a_bad_ec_file_is_one_line(exported, tmp_path, capsys):
    _, result = exported
    vdir = tmp_path / "vllm"
    shutil.copytree(result.out_dir, vdir)
    ecs = load_file(str(vdir / EC_FILE))
    del ecs[f"{EC_LINEARS[0]}.ec.B"]
    save_file(ecs, str(vdir / EC_FILE))
    rc, _, err = run_cli(capsys, "import", vdir, "--out", tmp_path / "imported")
    assert_clean_error(rc, err, f"malformed EC {EC_LINEARS[0]}")
    assert not (tmp_path / "imported").exists()


def test_static_lora_is_the_ec_static_product(exported):
    art, result = exported
    model = load_artifact(art, torch.device("cpu"), torch.float32).model
    lora = load_file(str(result.out_dir / LORA_DIR / "adapter_model.safetensors"))
    adapter = json.loads((result.out_dir / LORA_DIR / "adapter_config.json").read_text())
    assert adapter["r"] == adapter["lora_alpha"] == result.lora_rank == 8
    assert set(adapter["target_modules"]) == {"q_proj", "v_proj", "down_proj", "up_proj"}
    for name in EC_LINEARS:
        ec = model.get_submodule(name).ec
        a, b = lora[f"base_model.model.{name}.lora_A.weight"], lora[f"base_model.model.{name}.lora_B.weight"]
        assert a.shape[0] == b.shape[1] == result.lora_rank
        assert torch.equal(b @ a, (ec.alpha * ec.B) @ ec.A)
        torch.testing.assert_close(b @ a, ec.alpha * (ec.B @ ec.A), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["qkv", "column", "row"])
def test_plugin_ec_term_is_spear_ec_over_ranks(exported, kind, tp):
    """Each rank builds its FusedEC from the export's EC file; concatenating (column-parallel) or summing
    (row-parallel, u all-reduced) the ranks' terms gives spear's ErrorCompensator on every part."""
    art, result = exported
    model = load_artifact(art, torch.device("cpu"), torch.float32).model
    ecs = load_file(str(result.out_dir / EC_FILE))
    parts = {"qkv": ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                     "model.layers.0.self_attn.v_proj"],
             "column": ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"],
             "row": ["model.layers.0.mlp.down_proj"]}[kind]
    layers = [model.get_submodule(n) for n in parts]
    x = torch.randn(5, layers[0].in_features)
    expected = torch.cat([m.ec(x) if m.ec is not None else torch.zeros(5, m.out_features) for m in layers], -1)
    tensors = [None if m.ec is None else {k.removeprefix(f"{n}.ec."): v for k, v in ecs.items()
                                          if k.startswith(f"{n}.ec.")} for n, m in zip(parts, layers)]
    in_f = layers[0].in_features // (tp if kind == "row" else 1)
    widths = [m.out_features // (1 if kind == "row" else tp) for m in layers]
    xs = x.chunk(tp, -1) if kind == "row" else [x] * tp
    reduced = []  # the row-parallel all-reduce: the sum of every rank's partial u
    ranks = [[None if t is None else shard_ec(t, s) for t, s in zip(tensors, rank_shards(kind, r, widths, in_f))]
             for r in range(tp)]
    fused = [FusedEC(ranks[r], widths, torch.float32, reduce=(lambda u: reduced[0]) if kind == "row" else None,
                     adds=kind != "row" or r == 0) for r in range(tp)]
    if kind == "row":
        reduced.append(sum(xr @ f.A.t() for f, xr in zip(fused, xs)))
    outs = [f(xr) for f, xr in zip(fused, xs)]
    if kind == "row":
        assert all(o is None for o in outs[1:])  # only rank 0 adds; the layer's all-reduce sums it once
        outs = outs[:1]
    else:  # each rank holds its rows of every part (q, then k, then v): regroup by part
        outs = [torch.cat([o.split(widths, -1)[i] for o in outs], -1) for i in range(len(parts))]
    torch.testing.assert_close(torch.cat(outs, -1), expected, rtol=1e-5, atol=1e-6)


def test_cli_export(exported, tmp_path, capsys):
    art, _ = exported
    rc, _, err = run_cli(capsys, "export-vllm", art, "--out", tmp_path / "out")
    assert rc == 0 and "compressed-tensors W4A16" in err and (tmp_path / "out" / EC_FILE).is_file()


def test_bad_input_is_one_line(exported, tmp_path, capsys):
    art, _ = exported
    rc, _, err = run_cli(capsys, "export-vllm", tmp_path / "missing", "--out", tmp_path / "out")
    assert_clean_error(rc, err, "not a SPEAR artifact")
    rc, _, err = run_cli(capsys, "export-vllm", art, "--out", art)
    assert_clean_error(rc, err, "the artifact itself")
    assert not (tmp_path / "out").exists()


def test_refuses_what_compressed_tensors_cannot_hold(tmp_path):
    art = write_artifact(tmp_path / "art", ec_linears=())
    tensors = load_file(str(art / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj"
    tensors[f"{name}.g_idx"] = torch.arange(64, dtype=torch.int32).flip(0) // 64
    save_file(tensors, str(art / "model.safetensors"))
    with pytest.raises(SpearError, match="act-order g_idx"):
        export_vllm(art, tmp_path / "out")
    config = json.loads((art / "config.json").read_text())
    config["quantized_modules"][name]["bits"] = 3
    (art / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpearError, match="3-bit"):
        export_vllm(art, tmp_path / "out")
    (art / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SpearError, match="corrupt or missing weights"):
        export_vllm(art, tmp_path / "out")
    assert not (tmp_path / "out").exists()
