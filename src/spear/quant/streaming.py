"""RTN, GPTQ, AWQ and OmniQuant from a float checkpoint to an artifact, one decoder layer of float weights in memory
at a time.

The float model is never built: a skeleton on the meta device gives the names and shapes; each decoder layer's
tensors are read from the checkpoint's shards (float32), its linears quantized to their records, its tensors written
to the artifact's shards as they will be stored, and the layer goes back to meta (GPTQModel's and llm-compressor's
sequential onloading). RTN needs no activations. The others walk the layers as their whole-model functions do: the
embeddings are filled first, the model's forward runs once over the calibration batches with every decoder layer
standing in as the identity (`_Passthrough`), which captures layer 0's inputs and each layer's own keyword
arguments (masks, rotary embeddings) without its weights; then each layer, once filled, is quantized on its inputs
(GPTQ's Hessians, AWQ's scale and clip searches, OmniQuant's learned clipping against the float layer's outputs) and
run on them to give the next layer's. Same records as the whole-model path (tests/test_artifact_format.py). Peak
memory: one decoder layer in float32, the embeddings, the calibration's hidden states (OmniQuant: the float and the
quantized model's), and one artifact shard being written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.artifact import FORMAT, ArtifactInfo, artifact_config, stored_tensor
from spear.errors import SpearError
from spear.layer import SpearLinear
from spear.models.layerwise import (
    LayerInputs, capture_layer_inputs, decoder_layers, layer_linears, module_name, run_layer, set_module,
)
from spear.models.loading import save_tokenizer
from spear.models.skeleton import causal_lm_skeleton, tied_parameters
from spear.quant.awq import awq_quantize_layer, check_awq_layout
from spear.quant.gptq import CALIB_BATCH, gptq_quantize_layer
from spear.quant.omniquant import omniquant_quantize_layer
from spear.quant.pipeline import QuantSettings, check_shapes
from spear.record import rtn_quantize
from spear.shards import DEFAULT_MAX_SHARD_BYTES, ShardReader, ShardWriter
from spear.util import atomic_dir, release_freed_memory

log = logging.getLogger(__name__)
STREAMED_METHODS = ("rtn", "gptq", "awq", "omniquant")  # every method walks the checkpoint a layer at a time


def float_skeleton(hf_dir: Path) -> nn.Module:
    """The checkpoint's causal LM with its parameters on the meta device (float32 once filled)."""
    from transformers import AutoConfig

    return causal_lm_skeleton(AutoConfig.from_pretrained(hf_dir), torch.float32)


def streamable_skeleton(hf_dir: Path) -> nn.Module | None:
    """The checkpoint's skeleton (float_skeleton) where every tensor of the model is in the checkpoint under its
    state-dict name or a tied alias, so it can be read a layer at a time; None for checkpoints whose names
    transformers converts on load (they take the whole-model path)."""
    try:
        names = set(ShardReader(hf_dir).names())
        skeleton = float_skeleton(hf_dir)
    except Exception as e:  # noqa: BLE001 - any failure here means: use transformers' own loader, which says why
        log.info("quantizing %s through the whole-model loader: %s", hf_dir, e)
        return None
    stored = stored_names(skeleton, names)
    return skeleton if all(n in stored for n in skeleton.state_dict()) else None


def stored_names(model: nn.Module, checkpoint_names: set[str]) -> dict[str, str]:
    """State-dict name -> the checkpoint's name for it: its own, or a tied alias's (a checkpoint stores tied
    weights once, under either name)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    found = {n: n for n in model.state_dict() if n in checkpoint_names}
    for group in groups.values():
        source = next((n for n in group if n in checkpoint_names), None)
        found |= {n: source for n in group if source is not None}
    return found


class _Passthrough(nn.Module):
    """Stands in for a decoder layer whose weights are not loaded: it returns its input, so that the model's forward
    reaches every layer with that layer's own keyword arguments (capture_layer_inputs keeps only layer 0's hidden
    states, and stops before the last layer). It keeps the layer's `attention_type`, which picks its mask."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        if hasattr(layer, "attention_type"):
            self.attention_type = layer.attention_type

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


def capture_inputs_without_layers(model: nn.Module, reader: ShardReader, source: dict[str, str],
                                  batches: list[torch.Tensor], device: torch.device) -> LayerInputs:
    """Layer 0's inputs and every layer's keyword arguments for the skeleton `model`, its decoder layers left on
    meta: only the input embeddings are filled (on `device`), and go back to meta after."""
    embeddings = model.get_input_embeddings()
    name = module_name(model, embeddings)
    embeddings.load_state_dict({"weight": reader.get(source[f"{name}.weight"], torch.float32).to(device)}, assign=True)
    layers = decoder_layers(model)
    kept = list(layers)
    for i, layer in enumerate(kept):
        layers[i] = _Passthrough(layer)
    for module in model.modules():  # RoPE's inverse frequencies and the like: real buffers, built on the CPU
        for key, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta:
                module._buffers[key] = buffer.to(device)
    try:
        return capture_layer_inputs(model, batches)
    finally:
        for i, layer in enumerate(kept):
            layers[i] = layer
        model.get_input_embeddings().to("meta")


@torch.no_grad()
def quantize_checkpoint(hf_dir: Path, model: nn.Module, tokenizer, settings: QuantSettings, out_dir: Path,
                        info: ArtifactInfo, calib_ids: torch.Tensor | None = None, device: torch.device | None = None,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Quantize the float checkpoint `hf_dir` (an HF directory of safetensors; `model` its streamable_skeleton) with
    RTN or GPTQ (with `calib_ids`) into the artifact `out_dir`, a decoder layer at a time on `device` (default the
    CPU); the artifact holds what save_artifact writes for the same model quantized whole in float32."""
    check_shapes(model, settings.quant)
    if settings.method not in STREAMED_METHODS or (settings.method != "rtn") != (calib_ids is not None):
        given = "with" if calib_ids is not None else "without"
        raise SpearError(f"quantize_checkpoint streams RTN without calibration ids and the other methods with them, "
                         f"not {settings.method} {given} them")
    device = device or torch.device("cpu")
    reader = ShardReader(hf_dir)
    source = stored_names(model, set(reader.names()))
    tied = tied_parameters(model)
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    if settings.method == "awq":
        for layer in layers:
            check_awq_layout(layer)  # its module names, before any work (its norms once filled)
    inputs = q_inputs = None
    if calib_ids is not None:
        inputs = capture_inputs_without_layers(model, reader, source, list(calib_ids.split(CALIB_BATCH)), device)
        q_inputs = inputs  # OmniQuant: the quantized model's inputs beside the float model's
    quantized, in_layers = {}, set()
    with atomic_dir(out_dir) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes, metadata={"format": FORMAT})
        for i, layer in enumerate(tqdm(layers, desc=settings.method.upper(), unit="layer")):
            names = {n: f"{prefix}.{i}.{n}" for n in layer.state_dict()}
            layer.load_state_dict({n: reader.get(source[full], torch.float32).to(device) for n, full in names.items()},
                                  assign=True)
            if settings.method == "rtn":
                for name, linear in layer_linears(layer).items():
                    record = rtn_quantize(linear.weight, settings.quant)
                    set_module(layer, name, SpearLinear(record, linear.bias, torch.float32, dense=False))
            elif settings.method == "omniquant":
                _, inputs, q_inputs = omniquant_quantize_layer(layer, f"{prefix}.{i}", inputs, q_inputs, settings)
            else:
                quantize_layer = gptq_quantize_layer if settings.method == "gptq" else awq_quantize_layer
                quantize_layer(layer, f"{prefix}.{i}", inputs, settings)
                inputs = run_layer(layer, inputs)
            spear_linears = {f"{prefix}.{i}.{n}": m for n, m in layer.named_modules() if isinstance(m, SpearLinear)}
            quantized |= {full: (m.bits, m.in_features) for full, m in spear_linears.items()}
            for name, tensor in layer.state_dict().items():
                full = f"{prefix}.{i}.{name}"
                writer.add(full, stored_tensor(full, tensor.cpu(), spear_linears))
                in_layers.add(full)
            layers[i] = layer.to("meta")  # the float (and quantized) tensors of this layer go
            release_freed_memory()  # and leave the process, or the heap keeps every layer's floats
        for name in model.state_dict():
            if name not in in_layers and name not in tied:
                writer.add(name, stored_tensor(name, reader.get(source[name]), {}))
        sha256 = writer.close()
        config = artifact_config(model.config, info, quantized, {}, tied, sha256)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        save_tokenizer(tokenizer, tmp)
    return out_dir
