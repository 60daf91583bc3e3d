"""The artifact directory: a quantized (and optionally compensated) model, self-contained, at 4-bit size.

    config.json        format, versions, base model, quantization settings, EC plan, each shard's sha256
                       (weights_sha256, checked as the shards load), the transformers config of the base model
    model.safetensors  (or model-0000i-of-0000N.safetensors + model.safetensors.index.json above 5 GB: shards.py)
                       per quantized linear: codes packed at their bits (record.pack_codes: two 4-bit codes a byte),
                       scales, zeros (g_idx, offsets where imported); EC tensors (A, B, alpha, gate); every other
                       floating tensor (embeddings, norms, lm_head, biases) at 16 bits (stored_tensor)
    tokenizer files

Written atomically (temp dir + rename), shard by shard; read back through safetensors only, one tensor at a time
onto the target device into a model skeleton whose parameters were never allocated (models.skeleton; for
serving, models.plain_skeleton).
Format version 1 (codes one a byte, floats as computed, one file) still loads: its codes are packed on the way in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from spear.errors import SpearError, first_line
from spear.layer import ErrorCompensator, SpearLinear, int8_dequantize, int8_quantize
from spear.memory import require
from spear.models.layerwise import set_module
from spear.models.loading import LoadedModel, default_device, default_dtype, read_tokenizer, save_tokenizer
from spear.models.plain_skeleton import plain_skeleton
from spear.models.skeleton import causal_lm_skeleton, tied_parameters
from spear.record import QuantizedWeight, fp16_if_exact, pack_codes
from spear.shards import DEFAULT_MAX_SHARD_BYTES, Sha256Check, ShardReader, ShardWriter, check_sha256
from spear.util import atomic_dir, versions

FORMAT = "spear-artifact"
FORMAT_VERSION = 2  # 2: codes packed at their bits, floats at 16 bits, sharded; 1: one uint8 a code, one file
READABLE_VERSIONS = (1, 2)
RECORD_PARTS = ("codes", "scales", "zeros", "g_idx", "offsets")
STORED_FACTOR_BITS = (16, 8)  # an artifact's EC factors: fp16, or int8 codes with their scales
INT8_FACTOR_DIMS = {"A": 1, "B": 0}  # an 8-bit EC factor's scales run along its rank directions: A's rows, B's columns


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


FP16_MAX = torch.finfo(torch.float16).max


def save_artifact(model: nn.Module, tokenizer, out_dir: str | Path, info: ArtifactInfo,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    quantized, ecs = _spear_modules(model)
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes, metadata={"format": FORMAT})
        tied = tied_parameters(model)
        unstorable = sorted(n for n, ec in ecs.items() if ec.factor_bits not in STORED_FACTOR_BITS)
        if unstorable:  # 4-bit factors: a measurement (BENCHMARKS §2), not an artifact format
            raise SpearError(f"EC factors are stored in 16 or 8 bits; {unstorable[0]} has "
                             f"{ecs[unstorable[0]].factor_bits}-bit factors")
        int8_ecs = {f"{n}.ec" for n, ec in ecs.items() if ec.factor_bits == 8}
        for name, tensor in model.state_dict().items():
            module, _, part = name.rpartition(".")
            if name in tied:  # tied weights (e.g. lm_head = embed_tokens): stored once
                continue
            if module in int8_ecs and part in INT8_FACTOR_DIMS:
                q, scale = int8_quantize(tensor, INT8_FACTOR_DIMS[part])
                writer.add(name, q)
                writer.add(f"{name}_scale", scale)
            else:
                writer.add(name, stored_tensor(name, tensor, quantized))
        sha256 = writer.close()
        config = artifact_config(model.config, info, {n: (m.bits, m.in_features) for n, m in quantized.items()},
                                 {n: (ec.rank, ec.gate_hidden, ec.factor_bits) for n, ec in ecs.items()}, tied,
                                 sha256)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        save_tokenizer(tokenizer, tmp)
    return out_dir


def stored_tensor(name: str, tensor: torch.Tensor, quantized) -> torch.Tensor:
    """A state-dict tensor as the artifact stores it: a record's parts as they are (scales in fp16 where exact),
    every other floating tensor at 16 bits: fp16 (the kernels' dtype), bf16 where a value passes fp16's range."""
    module, _, part = name.rpartition(".")
    if module in quantized and part in RECORD_PARTS:
        return fp16_if_exact(tensor) if part == "scales" else tensor
    if not tensor.is_floating_point() or tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor
    fits = tensor.numel() == 0 or tensor.detach().abs().max() <= FP16_MAX
    return tensor.to(torch.float16 if fits else torch.bfloat16)


@torch.no_grad()
def round_as_stored(model: nn.Module) -> None:
    """Round, in place, every floating tensor the artifact stores at 16 bits to its stored value (the dtype stays),
    and 8-bit EC factors to their int8 values, so that what is evaluated in memory is what the artifact holds and
    serves. Quantizing and calibrating end with it."""
    quantized, ecs = _spear_modules(model)
    for name, tensor in model.state_dict().items():
        stored = stored_tensor(name, tensor, quantized)
        if stored.dtype != tensor.dtype and tensor.is_floating_point():
            tensor.copy_(stored.to(tensor.dtype))
    for ec in ecs.values():
        if ec.factor_bits == 8:
            for part, dim in INT8_FACTOR_DIMS.items():
                factor = getattr(ec, part)
                factor.copy_(int8_dequantize(*int8_quantize(factor, dim), dim).to(factor.dtype))


def read_ec_tensors(reader: ShardReader, config: dict, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every EC tensor of the artifact by its state-dict name, in `dtype`: 8-bit factors (stored as int8 and an fp16
    scale per rank direction) dequantized."""
    int8 = {f"{n}.ec" for n, meta in config["ec_modules"].items() if meta.get("factor_bits", 16) == 8}
    out = {}
    for name in reader.names():
        module, _, part = name.rpartition(".")
        if ".ec." not in name or (module in int8 and part.endswith("_scale")):
            continue
        if module in int8 and part in INT8_FACTOR_DIMS:
            out[name] = int8_dequantize(reader.get(name), reader.get(f"{name}_scale"), INT8_FACTOR_DIMS[part]).to(dtype)
        else:
            out[name] = reader.get(name, dtype)
    return out


def artifact_config(model_config, info: ArtifactInfo, quantized: dict[str, tuple[int, int]],
                    ecs: dict[str, tuple[int, int, int]], tied: dict[str, str], sha256: dict[str, str]) -> dict:
    """config.json: `quantized` maps a linear to (bits, in_features), `ecs` an EC to (rank, gate_hidden, factor bits:
    16 or 8), `sha256` a shard's file name to its sha256 (ShardWriter.close)."""
    model_config = model_config.to_dict()
    model_config.pop("quantization_config", None)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": versions(),
        "base_model": info.base_model,
        "quant": info.quant,
        "calibration": info.calibration,
        "plan": info.plan,
        "quantized_modules": {name: {"bits": b, "in_features": k} for name, (b, k) in quantized.items()},
        "ec_modules": {name: {"rank": r, "gate_hidden": h} | ({} if bits == 16 else {"factor_bits": bits})
                       for name, (r, h, bits) in ecs.items()},
        "tied": tied,
        "weights_sha256": sha256,
        "model_config": model_config,
        **info.extra,
    }


def read_artifact_config(path: str | Path) -> dict:
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise SpearError(f"{path} is not a SPEAR artifact: no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpearError(f"corrupt artifact config {path / 'config.json'}: {first_line(e)}") from None
    if config.get("format") != FORMAT:
        raise SpearError(f"{path} is not a SPEAR artifact (config.json has no format {FORMAT!r})")
    version = config.get("format_version")
    if version not in READABLE_VERSIONS:
        raise SpearError(
            f"artifact {path} has format version {version}, this SPEAR reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}: re-create it with `spear quantize`"
        )
    return config


def read_record_parts(reader: ShardReader, config: dict, name: str) -> tuple[dict[str, torch.Tensor | None], int]:
    """The linear `name`'s record as stored (codes packed at their bits, format 1's packed on the way in; scales,
    zeros; g_idx and offsets or None) and its in_features."""
    bits = config["quantized_modules"][name]["bits"]
    parts = {part: reader.get(f"{name}.{part}") for part in RECORD_PARTS[:3]}
    parts |= {part: reader.get_optional(f"{name}.{part}") for part in RECORD_PARTS[3:]}
    in_features = config["quantized_modules"][name].get("in_features", parts["codes"].shape[1])
    if config["format_version"] == 1:
        parts["codes"] = pack_codes(parts["codes"], bits)
    return parts, in_features


def read_record(reader: ShardReader, config: dict, name: str) -> QuantizedWeight:
    """The quantized-weight record of the linear `name` (codes unpacked)."""
    parts, in_features = read_record_parts(reader, config, name)
    return QuantizedWeight.from_tensors({f"{name}.{p}": t for p, t in parts.items() if t is not None}, name,
                                        config["quantized_modules"][name]["bits"], in_features)


def load_artifact(path: str | Path, device: torch.device | None = None, dtype: torch.dtype | None = None,
                  dense: bool = True, plain: bool | None = None) -> LoadedModel:
    """The artifact's model on `device` in `dtype`, its tensors read one at a time from their shards onto the
    device. `dense=False` leaves each quantized linear without its dequantized copy: the runtime packs it for its
    kernels (serving: SpearLinear.release_for_serving), or PyTorch's path dequantizes it as it runs (evaluation).
    `plain` (default: not `dense`): plain torch modules for the runtime (artifact_parts). Its config, model config,
    tokenizer and chat template are checked before the weights are read (artifact_parts); its shards against the
    sha256 config.json records while they are (artifacts written before it recorded one are not)."""
    path = Path(path)
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    plain = not dense if plain is None else plain
    config, model, tokenizer = artifact_parts(path, dtype, plain=plain)
    require(load_bytes(path, config, dtype, dense or (plain and device.type != "cuda")), device, f"loading {path}",
            "use a machine with more memory" + (", or serve it on a GPU" if device.type != "cuda" else ""))
    check = Sha256Check(path, config.get("weights_sha256", {}))
    check.start()
    try:
        _read_weights(model, ShardReader(path, device), config, path, dtype, dense)
    except SpearError:
        check.result()  # a shard not as written explains whatever the load met: its error first
        raise
    check.result()
    return LoadedModel(model.to(device).eval(), tokenizer, config["base_model"], path)


# sizes every model config must hold as positive integers, where it has them
MODEL_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")


def artifact_parts(path: Path, dtype: torch.dtype, plain: bool = False) -> tuple[dict, nn.Module, object]:
    """The artifact's config, its model's skeleton (parameters on meta) and its tokenizer (chat template rendered
    once); SpearError, one line naming the file, where one of them cannot be had. `plain` (serving): the skeleton in
    plain torch modules where the runtime serves the family (models.plain_skeleton), transformers' elsewhere."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = read_artifact_config(path)
    model_config = dict(config.get("model_config") or {})
    model_type = model_config.pop("model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise SpearError(f"unsupported architecture {model_type!r} in {path}: not a causal language model")
    fix = "; restore it, or re-create the artifact"
    for key in MODEL_SIZES:
        value = model_config.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise SpearError(f"bad model_config in {path / 'config.json'}: {key} is {value!r}, not a positive "
                             f"integer{fix}")
    try:
        hf_config = AutoConfig.for_model(model_type, **model_config)
        model = plain_skeleton(hf_config, dtype) if plain else None
        model = model if model is not None else causal_lm_skeleton(hf_config, dtype)
    except Exception as e:  # transformers' validation errors, torch's for impossible sizes: their types vary
        raise SpearError(f"bad model_config in {path / 'config.json'}: {' '.join(str(e).split())}{fix}") from None
    _check_shapes(path, config, model)
    return config, model, read_tokenizer(path)


def _check_shapes(path: Path, config: dict, model: nn.Module) -> None:
    """Each stored tensor's shape, from the shards' headers, against the skeleton's (a record's codes against its
    linear's weight); names the skeleton lacks are left to the load's missing and unexpected tensors."""
    reader, expected, quantized = ShardReader(path), model.state_dict(), config["quantized_modules"]
    for name in reader.names():
        stored, (module, _, part) = reader.entry(name).shape, name.rpartition(".")
        if module in quantized and part in RECORD_PARTS:
            if part != "codes":
                continue
            stored, name = (stored[0], quantized[module].get("in_features", stored[1])), f"{module}.weight"
        if name in expected and tuple(expected[name].shape) != stored:
            raise SpearError(f"corrupt artifact {path}: {name} is {list(stored)} in its weights but "
                             f"{list(expected[name].shape)} by config.json's model_config; restore it, or re-create "
                             "the artifact")


def _read_weights(model: nn.Module, reader: ShardReader, config: dict, path: Path, dtype: torch.dtype,
                  dense: bool) -> None:
    """Fill the skeleton `model` from the artifact's shards: each record into a SpearLinear, the rest in place."""
    read = set()
    try:
        for name, meta in config["quantized_modules"].items():
            parts, in_features = read_record_parts(reader, config, name)
            bias = reader.get(f"{name}.bias", dtype) if model.get_submodule(name).bias is not None else None
            set_module(model, name, SpearLinear.from_packed(**parts, bits=meta["bits"], in_features=in_features,
                                                            bias=bias, dtype=dtype, dense=dense))
            read |= {f"{name}.{part}" for part in (*RECORD_PARTS, "bias")}
        for name, meta in config["ec_modules"].items():
            layer = model.get_submodule(name)
            layer.ec = ErrorCompensator(layer.in_features, layer.out_features, meta["rank"], meta["gate_hidden"],
                                        factor_bits=meta.get("factor_bits", 16))
        # ECs train and run their PyTorch path in float32; everything else in the compute dtype
        rest = read_ec_tensors(reader, config)
    except (KeyError, AttributeError, RuntimeError, SpearError) as e:
        raise SpearError(f"corrupt artifact {path}: {first_line(e)}") from None
    read |= {n for n in reader.names() if ".ec." in n}
    rest |= {n: reader.get(n, dtype) for n in reader.names() if n not in read}
    try:
        result = model.load_state_dict(rest, strict=False, assign=True)
    except RuntimeError as e:
        raise SpearError(f"corrupt artifact {path}: {first_line(e)}") from None
    missing = set(result.missing_keys) - set(config["tied"]) - {n for n in result.missing_keys if n in read}
    if missing or result.unexpected_keys:
        raise SpearError(
            f"corrupt artifact {path}: {len(missing)} missing and {len(result.unexpected_keys)} unexpected tensors"
        )
    model.tie_weights()
    if any(p.is_meta for p in model.parameters()):
        raise SpearError(f"corrupt artifact {path}: some parameters have no tensor in it")


@dataclass
class Verified:
    """What verify_artifact found sound: the config, model config, tokenizer and chat template, and the shards
    (none where the artifact records no sha256)."""

    path: Path
    shards: int
    bytes: int

    def summary(self) -> str:
        if not self.shards:
            return (f"{self.path}: config and tokenizer load; weights not checked: no sha256 recorded (written before "
                    "SPEAR recorded them; re-create it to record them)")
        return (f"ok: {self.path}: {self.shards} shard{'s' * (self.shards > 1)}, {self.bytes / 1e9:.2f} GB, sha256 as "
                "recorded; config and tokenizer load")


def verify_artifact(path: str | Path) -> Verified:
    """Check the artifact at `path` as load_artifact does, without loading its weights: config, model config,
    tokenizer and chat template, and every shard against the sha256 its config.json records."""
    path = Path(path)
    config, _, _ = artifact_parts(path, torch.float16)
    sha256 = config.get("weights_sha256", {})
    check_sha256(path, sha256)
    return Verified(path, len(sha256), sum((path / name).stat().st_size for name in sha256))


def load_bytes(path: Path, config: dict, dtype: torch.dtype, dense: bool) -> int:
    """What load_artifact holds: the records at their bits, every other tensor in `dtype` (ECs in float32), and with
    `dense` a dequantized copy of each quantized weight in `dtype` (evaluation, calibration, CPU serving)."""
    reader, size = ShardReader(path), torch.finfo(dtype).bits // 8
    quantized = config["quantized_modules"]
    total = 0
    for name in reader.names():
        entry, module = reader.entry(name), name.rpartition(".")[0]
        if module in quantized:  # a record's part as stored; beside its codes, a dense copy
            total += entry.end - entry.begin
            if dense and name.endswith(".codes"):
                total += entry.shape[0] * quantized[module].get("in_features", entry.shape[1]) * size
        else:
            total += entry.numel * (4 if ".ec." in name else size)
    return total


def _spear_modules(model: nn.Module) -> tuple[dict[str, SpearLinear], dict[str, ErrorCompensator]]:
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, SpearLinear)}
    return quantized, {n: m.ec for n, m in quantized.items() if m.ec is not None}
