"""RTN from a float checkpoint to an artifact, one decoder layer of float weights in memory at a time.

RTN needs no activations, so the float model is never built: a skeleton on the meta device gives the names and
shapes; each decoder layer's tensors are read from the checkpoint's shards (float32), its linears rounded to their
records, its tensors written to the artifact's shards as they will be stored, and the layer goes back to meta
(GPTQModel's and llm-compressor's sequential onloading, without the forward). Peak memory: one decoder layer in
float32, the embeddings, and one artifact shard being written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.artifact import FORMAT, ArtifactInfo, artifact_config, stored_tensor
from spear.layer import SpearLinear
from spear.models.layerwise import decoder_layers, layer_linears, set_module
from spear.models.skeleton import causal_lm_skeleton, tied_parameters
from spear.quant.pipeline import QuantSettings, check_shapes
from spear.record import rtn_quantize
from spear.shards import DEFAULT_MAX_SHARD_BYTES, ShardReader, ShardWriter
from spear.util import atomic_dir, release_freed_memory

log = logging.getLogger(__name__)


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


@torch.no_grad()
def rtn_quantize_checkpoint(hf_dir: Path, model: nn.Module, tokenizer, settings: QuantSettings, out_dir: Path,
                            info: ArtifactInfo, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Quantize the float checkpoint `hf_dir` (an HF directory of safetensors; `model` its streamable_skeleton) with
    RTN into the artifact `out_dir`, a decoder layer at a time; the artifact holds what save_artifact writes for the
    same model loaded in float32."""
    check_shapes(model, settings.quant)
    reader = ShardReader(hf_dir)
    source = stored_names(model, set(reader.names()))
    tied = tied_parameters(model)
    layers = decoder_layers(model)
    prefix = next(name for name, m in model.named_modules() if m is layers)
    quantized, in_layers = {}, set()
    with atomic_dir(out_dir) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes, metadata={"format": FORMAT})
        for i, layer in enumerate(tqdm(layers, desc="RTN", unit="layer")):
            names = {n: f"{prefix}.{i}.{n}" for n in layer.state_dict()}
            layer.load_state_dict({n: reader.get(source[full], torch.float32) for n, full in names.items()},
                                  assign=True)
            for name, linear in layer_linears(layer).items():
                record = rtn_quantize(linear.weight, settings.quant)
                set_module(layer, name, SpearLinear(record, linear.bias, torch.float32, dense=False))
                quantized[f"{prefix}.{i}.{name}"] = (record.bits, linear.in_features)
            spear_linears = {f"{prefix}.{i}.{n}": m for n, m in layer.named_modules() if isinstance(m, SpearLinear)}
            for name, tensor in layer.state_dict().items():
                full = f"{prefix}.{i}.{name}"
                writer.add(full, stored_tensor(full, tensor, spear_linears))
                in_layers.add(full)
            layers[i] = layer.to("meta")  # the float (and quantized) tensors of this layer go
            release_freed_memory()  # and leave the process, or the heap keeps every layer's floats
        for name in model.state_dict():
            if name not in in_layers and name not in tied:
                writer.add(name, stored_tensor(name, reader.get(source[name]), {}))
        sha256 = writer.close()
        config = artifact_config(model.config, info, quantized, {}, tied, sha256)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        tokenizer.save_pretrained(tmp)
    return out_dir
