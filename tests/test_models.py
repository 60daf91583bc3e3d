"""Loading the embedded default model and the layer-wise walker."""

import torch

from spear.models.layerwise import capture_layer_inputs, decoder_layers, quantizable_linears, run_layer


def test_smollm2_continues_capital_of_france(smollm2):
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = smollm2.model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=smollm2.tokenizer.eos_token_id)
    assert smollm2.tokenizer.decode(out[0, ids.shape[1]:]).startswith(" Paris")
    assert smollm2.model.config.hidden_size == 576 and len(quantizable_linears(smollm2.model)) == 30 * 7


def test_layerwise_walk_reproduces_the_model(tiny_model_dir):
    from spear.models import load_float_model

    model = load_float_model(str(tiny_model_dir), torch.device("cpu"), torch.float32).model
    ids = [torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (1, 16))]
    inputs = capture_layer_inputs(model, ids)
    for layer in decoder_layers(model):
        inputs = run_layer(layer, inputs)
    with torch.no_grad():
        for x, h in zip(ids, inputs.hidden):
            ref = model(x, output_hidden_states=True).hidden_states[-1]
            torch.testing.assert_close(model.model.norm(h), ref)


def test_gguf_conversion_parses_the_file_once(smollm2):
    """_one_gguf_parse: transformers' three opens of one GGUF share a reader inside the block, its 397 requests for
    the architecture's tensor-name map share one map, and gguf's own functions are back after it."""
    import gguf

    from spear.models.loading import _one_gguf_parse, resolve_model_path

    path = resolve_model_path("smollm2")
    original, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _one_gguf_parse():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first and isinstance(first, original)
        llama = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(llama, 30) is gguf.get_tensor_name_map(llama, 30)
    assert gguf.GGUFReader is original and gguf.get_tensor_name_map is name_map


def test_saved_tokenizer_carries_its_added_tokens_and_loads_without_a_python_parse(tmp_path, monkeypatch):
    """save_tokenizer writes tokenizer.json's added tokens into tokenizer_config.json, so that transformers does not
    json-parse tokenizer.json itself on load; the tokenizer read back is the one saved plainly."""
    import json

    from conftest import make_byte_tokenizer

    from spear.models.loading import read_tokenizer, save_tokenizer

    tok = make_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    plain, ours = tmp_path / "plain", tmp_path / "ours"
    tok.save_pretrained(plain)
    save_tokenizer(tok, ours)
    added = json.loads((ours / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert {"<|im_start|>", "<|im_end|>", tok.bos_token, tok.eos_token} == {t["content"] for t in added.values()}
    assert all(t["special"] for t in added.values())

    parsed = []
    real_load = json.load
    monkeypatch.setattr(json, "load", lambda f, *a, **k: parsed.append(getattr(f, "name", "")) or real_load(f, *a, **k))
    a, b = read_tokenizer(plain), read_tokenizer(ours)
    assert any(str(p).endswith("plain/tokenizer.json") for p in parsed)  # what save_tokenizer spares
    assert not any(str(p).endswith("ours/tokenizer.json") for p in parsed)
    text = "<|im_start|>user hi<|im_end|> and more"
    assert a(text).input_ids == b(text).input_ids and a.added_tokens_decoder == b.added_tokens_decoder
    assert a.all_special_tokens == b.all_special_tokens
