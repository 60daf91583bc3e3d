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
