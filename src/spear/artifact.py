"""The artifact directory: a quantized (and optionally compensated) model, self-contained.

    config.json        format, versions, base model, quantization settings, EC plan,
                       the transformers config of the base model
    model.safetensors  codes / scales / zeros of every quantized linear, EC tensors
                       (A, B, alpha, gate), every other parameter in its own dtype
    tokenizer files

Written atomically (temp dir + rename); read back through safetensors only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from spear.errors import SpearError
from spear.layer import ErrorCompensator, SpearLinear
from spear.models.layerwise import set_module
from spear.models.loading import LoadedModel, _first_line, default_device, default_dtype
from spear.record import QuantizedWeight, fp16_if_exact
from spear.util import atomic_dir, versions

FORMAT = "spear-artifact"
FORMAT_VERSION = 1


@dataclass
class ArtifactInfo:
    base_model: str
    quant: dict  # QuantSettings as a dict (method, bits, group size, grid, ...)
    calibration: dict | None = None
    plan: dict | None = None  # the EC plan, once compensated
    extra: dict = field(default_factory=dict)


def is_artifact(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("format") == FORMAT
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def save_artifact(model: nn.Module, tokenizer, out_dir: str | Path, info: ArtifactInfo) -> Path:
    quantized, ecs = _spear_modules(model)
    tensors, tied = {}, {}
    seen: dict[tuple, str] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key in seen:  # tied weights (e.g. lm_head = embed_tokens): store once
            tied[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = tensor.detach().contiguous().cpu()
    for name in quantized:
        tensors[f"{name}.scales"] = fp16_if_exact(tensors[f"{name}.scales"])
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": versions(),
        "base_model": info.base_model,
        "quant": info.quant,
        "calibration": info.calibration,
        "plan": info.plan,
        "quantized_modules": {name: {"bits": m.bits} for name, m in quantized.items()},
        "ec_modules": {name: {"rank": ec.rank, "gate_hidden": ec.gate_hidden} for name, ec in ecs.items()},
        "tied": tied,
        "model_config": model.config.to_dict(),
        **info.extra,
    }
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": FORMAT})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        tokenizer.save_pretrained(tmp)
    return out_dir


def read_artifact_config(path: str | Path) -> dict:
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise SpearError(f"{path} is not a SPEAR artifact: no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpearError(f"corrupt artifact config {path / 'config.json'}: {_first_line(e)}") from None
    if config.get("format") != FORMAT:
        raise SpearError(f"{path} is not a SPEAR artifact (config.json has no format {FORMAT!r})")
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise SpearError(
            f"artifact {path} has format version {version}, this SPEAR reads version {FORMAT_VERSION}: "
            "re-create it with `spear quantize`"
        )
    return config


def read_artifact_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the artifact's model.safetensors, by its state-dict name."""
    path = Path(path)
    try:
        return load_file(str(path / "model.safetensors"))
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise SpearError(f"corrupt or missing weights in {path}: {_first_line(e)}") from None


def load_artifact(path: str | Path, device: torch.device | None = None, dtype: torch.dtype | None = None) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    config = read_artifact_config(path)
    tensors = read_artifact_tensors(path)
    model_config = dict(config["model_config"])
    try:
        hf_config = AutoConfig.for_model(model_config.pop("model_type"), **model_config)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    except (ValueError, KeyError) as e:
        raise SpearError(f"unsupported architecture in {path}: {_first_line(e)}") from None
    try:
        for name, meta in config["quantized_modules"].items():
            old = model.get_submodule(name)
            qweight = QuantizedWeight.from_tensors(tensors, name, meta["bits"])
            set_module(model, name, SpearLinear(qweight, old.bias, dtype=dtype))
        for name, meta in config["ec_modules"].items():
            layer = model.get_submodule(name)
            layer.ec = ErrorCompensator(layer.in_features, layer.out_features, meta["rank"], meta["gate_hidden"])
    except (KeyError, AttributeError, RuntimeError) as e:
        raise SpearError(f"corrupt artifact {path}: {_first_line(e)}") from None
    result = model.load_state_dict(tensors, strict=False)
    missing = set(result.missing_keys) - set(config["tied"])
    if missing or result.unexpected_keys:
        raise SpearError(
            f"corrupt artifact {path}: {len(missing)} missing and {len(result.unexpected_keys)} unexpected tensors"
        )
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(model.to(device).eval(), tokenizer, config["base_model"], path)


def _spear_modules(model: nn.Module) -> tuple[dict[str, SpearLinear], dict[str, ErrorCompensator]]:
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, SpearLinear)}
    return quantized, {n: m.ec for n, m in quantized.items() if m.ec is not None}
