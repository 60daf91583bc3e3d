"""`spear import` end to end on tiny checkpoints: the artifact evaluates exactly as the format's own dequantized
model, compensates against its --base, and a malformed checkpoint is one line, exit 2, nothing written."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest import logits_kl, make_byte_tokenizer, make_tiny_llama
from spear.artifact import load_artifact
from spear.cli import main
from spear.models import load_float_model
from spear.models.layerwise import quantizable_linears
from spear.record import QuantConfig, rtn_quantize
from spear.quant.formats import AWQ_SHIFT_OF_COLUMN, GGUF_BITS
from test_import_formats import act_order_g_idx, assert_bitwise_equal, pack_gptq, pack_words, random_gguf_blocks

# one window a forward on both sides: an artifact (codes only) and a float directory default to different batches
# (eval.perplexity.eval_batch), and a batch of 2 windows multiplies in another order than two of 1
EVAL_ARGS = ["--seqlen", "64", "--max-windows", "2", "--batch-size", "1", "--device", "cpu", "--json"]
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True,
               "checkpoint_format": "gptq"}


def run_cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_clean_error(rc, err, match):
    assert rc == 2 and "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("spear:")]
    assert len(lines) == 1 and match in lines[0], err


def fp16_valued(model):
    """The model's float tensors rounded to fp16 values, as a pre-quantized checkpoint (and the artifact) stores
    them."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


def write_gptq_checkpoint(path, reference_path=None, quantization_config=GPTQ_CONFIG, drop=None, reshape=None):
    """A tiny Llama as GPTQ v1 with act-order (every decoder linear), and optionally the float model holding
    the weights AutoGPTQ's formula dequantizes them to (scales[g_idx] * (q - zeros[g_idx]), in float32)."""
    model = fp16_valued(make_tiny_llama())
    tensors = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for i, (name, linear) in enumerate(quantizable_linears(model).items()):
        record = rtn_quantize(linear.weight, QuantConfig(group_size=32, sym_grid="gptq"))
        g_idx = act_order_g_idx(linear.in_features, 32, seed=i)
        codes, zeros, scales = record.codes.long(), record.zeros.long(), record.scales
        packed = pack_gptq(codes, zeros, scales, g_idx)
        del tensors[f"{name}.weight"]
        tensors |= {f"{name}.{k[2:]}": v for k, v in packed.items()}
        g = g_idx.long()
        linear.weight.data = (codes - zeros[:, g]).float() * scales[:, g].float()
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1].clone()
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    config = model.config.to_dict() | {"quantization_config": quantization_config}
    (path / "config.json").write_text(json.dumps(config))
    make_byte_tokenizer().save_pretrained(path)
    if reference_path is not None:
        model.save_pretrained(reference_path)
        make_byte_tokenizer().save_pretrained(reference_path)
    return path


def test_gptq_import_evaluates_as_its_dequantized_model_and_compensates(tiny_model_dir, tmp_path, capsys):
    src = write_gptq_checkpoint(tmp_path / "gptq", reference_path=tmp_path / "dequantized")
    art = tmp_path / "art"
    rc, _, err = run_cli(capsys, "import", src, "--out", art, "--base", tiny_model_dir)
    assert rc == 0, err
    config = json.loads((art / "config.json").read_text())
    assert config["quant"]["method"] == "gptq" and config["base_model"] == str(tiny_model_dir)

    lm = load_artifact(art, torch.device("cpu"), torch.float32)
    reference = load_float_model(str(tmp_path / "dequantized"), torch.device("cpu"), torch.float32)
    ref_linears = quantizable_linears(reference.model)
    for name, layer in quantizable_linears(lm.model).items():
        assert layer.g_idx is not None  # act-order survives the artifact
        assert torch.equal(layer.weight, ref_linears[name].weight)

    _, out_art, _ = run_cli(capsys, "eval", art, *EVAL_ARGS)
    _, out_ref, _ = run_cli(capsys, "eval", tmp_path / "dequantized", *EVAL_ARGS)
    assert json.loads(out_art)["ppl"] == json.loads(out_ref)["ppl"]

    rc, _, err = run_cli(capsys, "compensate", art, "--kind", "lorc", "--budget", "30%", "--calib-samples", "4",
                         "--calib-len", "32", "--device", "cpu")
    assert rc == 0, err
    assert json.loads((art / "config.json").read_text())["ec_modules"]


def test_compensating_an_import_without_base_exits_2(tmp_path, capsys):
    src = write_gptq_checkpoint(tmp_path / "gptq")
    assert run_cli(capsys, "import", src, "--out", tmp_path / "art")[0] == 0
    rc, _, err = run_cli(capsys, "compensate", tmp_path / "art", "--device", "cpu")
    assert_clean_error(rc, err, "imported without its float model")


@pytest.mark.parametrize("case, match", [
    ({"drop": "model.layers.0.mlp.up_proj.qzeros"}, "missing tensor model.layers.0.mlp.up_proj.qzeros"),
    ({"drop": "model.norm.weight"}, "missing tensor model.norm.weight"),
    ({"reshape": "model.layers.1.self_attn.q_proj.qweight"}, "q_proj.qweight has shape"),
    ({"quantization_config": GPTQ_CONFIG | {"bits": 3}}, "3-bit gptq"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method 'bitsandbytes'"),
    ({"quantization_config": None}, "no quantization_config"),
])
def test_malformed_checkpoint_is_one_line_exit_2_nothing_written(case, match, tmp_path, capsys):
    src = write_gptq_checkpoint(tmp_path / "bad", **case)
    rc, _, err = run_cli(capsys, "import", src, "--out", tmp_path / "art")
    assert_clean_error(rc, err, match)
    assert not (tmp_path / "art").exists() and [p.name for p in tmp_path.iterdir()] == ["bad"]


def write_awq_or_compressed_tensors(path, fmt: str, sym: bool = False) -> dict[str, torch.Tensor]:
    """A tiny Llama as AWQ GEMM (packed here in AutoAWQ's order) or compressed-tensors pack-quantized (written by
    the library, bf16 scales); returns the weights the format's reader dequantizes each linear to."""
    from spear.quant.formats import AWQ_SHIFT_OF_COLUMN

    model = fp16_valued(make_tiny_llama())
    tensors = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    expected = {}
    for name, linear in quantizable_linears(model).items():
        record = rtn_quantize(linear.weight, QuantConfig(group_size=32, sym=sym))
        codes, zeros, scales = record.codes.long(), record.zeros.long(), record.scales
        del tensors[f"{name}.weight"]
        if fmt == "awq":
            tensors |= {f"{name}.qweight": pack_words(codes.t(), AWQ_SHIFT_OF_COLUMN),
                        f"{name}.qzeros": pack_words(zeros.t(), AWQ_SHIFT_OF_COLUMN), f"{name}.scales": scales.t()}
            expected[name] = record.dequantize(torch.float16)
        else:
            from compressed_tensors.compressors import PackedQuantizationCompressor

            state = {"weight": record.dequantize(torch.bfloat16), "weight_scale": scales.bfloat16(),
                     "weight_zero_point": (zeros - 8).to(torch.int8)}
            compressed = PackedQuantizationCompressor.compress(state, ct_scheme(sym))
            tensors |= {f"{name}.{k}": v for k, v in compressed.items()}
            expected[name] = PackedQuantizationCompressor.decompress(compressed, ct_scheme(sym))["weight"]
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    else:
        from compressed_tensors.quantization import QuantizationConfig

        qc = QuantizationConfig(config_groups={"group_0": ct_scheme(sym)}, format="pack-quantized",
                                quant_method="compressed-tensors").model_dump(mode="json")
    path.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_dict() | {"quantization_config": qc}))
    make_byte_tokenizer().save_pretrained(path)
    return expected


def ct_scheme(sym: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy="group", group_size=32)
    return QuantizationScheme(targets=["Linear"], weights=args)


@pytest.mark.parametrize("fmt, sym", [("awq", False), ("compressed-tensors", False), ("compressed-tensors", True)])
def test_awq_and_compressed_tensors_import(fmt, sym, tmp_path, capsys):
    if fmt == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    expected = write_awq_or_compressed_tensors(tmp_path / fmt, fmt, sym)
    rc, _, err = run_cli(capsys, "import", tmp_path / fmt, "--out", tmp_path / "art")
    assert rc == 0, err
    assert json.loads((tmp_path / "art" / "config.json").read_text())["quant"]["method"] == fmt
    lm = load_artifact(tmp_path / "art", torch.device("cpu"), torch.float32)
    for name, layer in quantizable_linears(lm.model).items():
        assert torch.equal(layer.qweight.dequantize(expected[name].dtype), expected[name])


def test_awq_import_compensates_against_its_base(tmp_path, capsys):
    """An AWQ checkpoint (scales folded into the norms and the weights) compensates against its float --base, and
    the closed-form ECs read in the float basis lower its KL (compensate.basis; compared with Ŵ' as it is, they
    raise it)."""
    from test_awq import llama_with_outliers

    from spear.quant.pipeline import QuantSettings, quantize_model

    base = tmp_path / "base"
    llama_with_outliers(kv_heads=4).save_pretrained(base)  # outlier channels: AWQ rescales strongly
    make_byte_tokenizer().save_pretrained(base)
    model = load_float_model(str(base), torch.device("cpu"), torch.float32).model
    names = list(quantizable_linears(model))
    calib = torch.randint(0, 256, (16, 48), generator=torch.Generator().manual_seed(3))
    records = quantize_model(model, QuantSettings("awq", QuantConfig(bits=4, group_size=32, sym=False), awq_grid=10),
                             calib)
    tensors = {k: v for k, v in model.state_dict().items()
               if k != "lm_head.weight" and not any(k.startswith(n + ".") for n in names)}
    for name, record in records.items():
        codes, zeros = record.codes.long(), record.zeros.long()
        tensors |= {f"{name}.qweight": pack_words(codes.t(), AWQ_SHIFT_OF_COLUMN),
                    f"{name}.qzeros": pack_words(zeros.t(), AWQ_SHIFT_OF_COLUMN), f"{name}.scales": record.scales.t()}
    src = tmp_path / "awq"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(src / "model.safetensors"))
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    (src / "config.json").write_text(json.dumps(model.config.to_dict() | {"quantization_config": qc}))
    make_byte_tokenizer().save_pretrained(src)

    art = tmp_path / "art"
    assert run_cli(capsys, "import", src, "--out", art, "--base", base)[0] == 0
    teacher = load_float_model(str(base), torch.device("cpu"), torch.float32).model
    ids = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(4))

    def kl() -> float:
        student = load_artifact(art, torch.device("cpu"), torch.float32).model
        with torch.no_grad():
            return logits_kl(teacher(ids).logits, student(ids).logits)

    plain = kl()
    rc, _, err = run_cli(capsys, "compensate", art, "--kind", "qera", "--budget", "30%", "--calib-samples", "16",
                         "--calib-len", "48", "--device", "cpu")
    assert rc == 0, err
    assert kl() < 0.8 * plain


# --- GGUF ------------------------------------------------------------------------------------

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 256


def write_gguf(path, kind: str, kinds: dict[str, str] | None = None):
    """A one-layer Llama GGUF whose linears are `kind`, or kinds[name] for those `kinds` names (attn_q, ffn_down,
    ...): gguf.quants.quantize where gguf writes the type, else random blocks (zeros for a type we do not decode)."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from tokenizers import pre_tokenizers

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet())[:VOCAB])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([1] * VOCAB)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def linear(rows, cols, k):
        if k in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
            return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, T[k])
        if k in GGUF_BITS:
            return random_gguf_blocks(k, rows, cols, rng)
        n, size = gguf.GGML_QUANT_SIZES[T[k]]
        return np.zeros((rows, cols // n * size), np.uint8)

    # fp16 values, as an F16 embedding (the artifact stores every float tensor at 16 bits)
    w.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float16).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(HIDDEN, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(HIDDEN, np.float32))
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    for name, (rows, cols) in shapes.items():
        k = (kinds or {}).get(name, kind)
        w.add_tensor(f"blk.0.{name}.weight", linear(rows, cols, k), raw_dtype=T[k])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_import_matches_transformers_reading(kind, tmp_path, capsys):
    """The import checks every layer against transformers' reading of the file (gguf.quants, q/k rows
    un-permuted as transformers does) and refuses to write on any difference."""
    src = write_gguf(tmp_path / "tiny.gguf", kind)
    rc, _, err = run_cli(capsys, "import", src, "--out", tmp_path / "art")
    assert rc == 0, err
    config = json.loads((tmp_path / "art" / "config.json").read_text())
    assert config["quant"]["gguf_types"] == {kind: 7} and config["quant"]["group_size"] == 32
    assert config["quant"]["bits"] == 4 and config["quant"]["sym"] == (kind == "Q4_0")


def test_gguf_import_evaluates_as_the_gguf(tmp_path, capsys):
    """Q4_K (two-level scales, float32 in the record): the artifact's perplexity is the GGUF's own, to the last bit
    (its embedding and norms hold fp16 values, which the artifact's 16-bit floats keep exactly)."""
    src = write_gguf(tmp_path / "tiny.gguf", "Q4_K")
    assert run_cli(capsys, "import", src, "--out", tmp_path / "art")[0] == 0
    _, out_art, _ = run_cli(capsys, "eval", tmp_path / "art", *EVAL_ARGS)
    _, out_gguf, _ = run_cli(capsys, "eval", src, *EVAL_ARGS)
    assert json.loads(out_art)["ppl"] == json.loads(out_gguf)["ppl"]


# a Q4_K_M-like mix: 4-bit Q4_K beside 5-, 6- and 8-bit layers
MIXED = {"attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q5_1", "attn_output": "Q4_K", "ffn_gate": "Q5_K",
         "ffn_up": "Q8_0", "ffn_down": "Q6_K"}


def test_mixed_type_gguf_imports_each_layer_at_its_bits_and_evaluates_as_the_gguf(tmp_path, capsys):
    """Every linear at its own type's bits, dequantizing to transformers' reading of the file (gguf.quants, q/k rows
    un-permuted) bit for bit, loaded back from the artifact; the summary names the type mix and the bytes; the
    artifact's perplexity is the GGUF's own."""
    src = write_gguf(tmp_path / "mixed.gguf", "Q4_K", MIXED)
    rc, _, err = run_cli(capsys, "import", src, "--out", tmp_path / "art")
    assert rc == 0, err
    summary = next(line for line in err.splitlines() if line.startswith("imported"))
    assert summary.startswith("imported 7 gguf linears (Q4_K ×2, ") and "Q6_K ×1" in summary, summary
    assert "bytes in the checkpoint" in summary and "(4-bit ×2, 5-bit ×3, 6-bit ×1, 8-bit ×1)" in summary, summary
    config = json.loads((tmp_path / "art" / "config.json").read_text())
    assert config["quant"]["gguf_types"] == {"Q4_K": 2, "Q5_0": 1, "Q5_1": 1, "Q5_K": 1, "Q8_0": 1, "Q6_K": 1}
    assert config["quant"]["bits"] is None and config["quant"]["group_size"] is None

    reference = quantizable_linears(load_float_model(str(src), torch.device("cpu"), torch.float32).model)
    imported = quantizable_linears(load_artifact(tmp_path / "art", torch.device("cpu"), torch.float32).model)
    for name, linear in imported.items():
        kind = MIXED[{"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                      "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}[name.split(".")[-1]]]
        assert linear.bits == GGUF_BITS[kind], name
        assert_bitwise_equal(linear.qweight.dequantize(), reference[name].weight.float())

    _, out_art, _ = run_cli(capsys, "eval", tmp_path / "art", *EVAL_ARGS)
    _, out_gguf, _ = run_cli(capsys, "eval", src, *EVAL_ARGS)
    assert json.loads(out_art)["ppl"] == json.loads(out_gguf)["ppl"]


def test_mixed_type_artifact_serves_on_cpu_through_the_dense_path(tmp_path, capsys):
    """The engine (what `spear serve` runs) on CPU: no 5/6/8-bit or offset layer takes the int4 kernel, each serves
    dense from its record, and greedy decoding is transformers' generate on the artifact."""
    from spear.api import load
    from spear.layer import SpearLinear
    from spear.runtime.engine import EngineConfig, build_engine
    from spear.runtime.requests import SamplingParams

    src = write_gguf(tmp_path / "mixed.gguf", "Q4_K", MIXED)
    assert run_cli(capsys, "import", src, "--out", tmp_path / "art")[0] == 0
    served = load(str(tmp_path / "art"), torch.device("cpu"), torch.float32, serving=True)
    engine = build_engine(served.model, served.tokenizer, EngineConfig(max_model_len=128, num_kv_blocks=16))
    linears = [m for m in served.model.modules() if isinstance(m, SpearLinear)]
    assert len(linears) == 7 and all(m.cpu_w4 is None and m.weight_hat is not None for m in linears)
    ids = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("a", ids, SamplingParams(max_tokens=8, temperature=0))
    got = []
    while engine.has_unfinished():
        for out in engine.step():
            got += out.new_token_ids
    dense = load(str(tmp_path / "art"), torch.device("cpu"), torch.float32)
    expected = dense.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert got == expected[0, len(ids):].tolist()


def test_gguf_with_a_type_we_do_not_decode_is_refused_naming_its_type_mix(tmp_path, capsys, monkeypatch):
    """One line, exit 2, before transformers reads the file, naming every linear type, not just the first."""
    from spear.quant import importer

    monkeypatch.setattr(importer, "load_float_model", lambda *a, **k: pytest.fail("read the file before refusing"))
    src = write_gguf(tmp_path / "iq.gguf", "Q4_K", {"attn_k": "Q3_K", "ffn_up": "IQ4_NL", "ffn_down": "Q6_K"})
    rc, _, err = run_cli(capsys, "import", src, "--out", tmp_path / "art")
    assert_clean_error(rc, err, "its linears are Q4_K ×4, Q3_K ×1, IQ4_NL ×1, Q6_K ×1;")
    assert "not IQ4_NL, Q3_K" in err
    assert not (tmp_path / "art").exists()


def test_gguf_import_refuses_a_layer_that_differs_from_transformers_reading(tmp_path, monkeypatch):
    """Without the q/k row order llama.cpp stores, attn_q differs from transformers' reading: refused, none written."""
    from spear.errors import SpearError
    from spear.quant import importer

    src = write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    monkeypatch.setattr(importer, "_row_order", lambda processor, name, rows, names: torch.arange(rows))
    with pytest.raises(SpearError, match=r"blk.0.attn_q.weight \(Q4_0\) does not dequantize to transformers' reading"):
        importer.import_checkpoint(str(src), tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_gguf_q4_0_import_exports_to_vllm_and_q4_1_is_refused(tmp_path, capsys):
    """Q4_0 (W = d (q − 8), fp16 d) is compressed-tensors' symmetric W4A16 at group 32: it exports, every layer
    checked by the library's decompressor; Q4_1's float offsets have no integer zero point: one line, exit 2."""
    for kind in ("Q4_0", "Q4_1"):
        src = write_gguf(tmp_path / f"{kind}.gguf", kind)
        assert run_cli(capsys, "import", src, "--out", tmp_path / kind)[0] == 0
        rc, _, err = run_cli(capsys, "export-vllm", tmp_path / kind, "--out", tmp_path / f"{kind}-vllm")
        if kind == "Q4_0":
            assert rc == 0, err
            config = json.loads((tmp_path / "Q4_0-vllm" / "config.json").read_text())
            weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
            assert weights["symmetric"] and weights["group_size"] == 32 and weights["num_bits"] == 4
        else:
            assert_clean_error(rc, err, "offsets")
            assert not (tmp_path / "Q4_1-vllm").exists()
