"""`spear import`: a pre-quantized checkpoint becomes our artifact, without re-quantizing.

The format is read from the checkpoint itself, as vLLM and transformers do: an HF directory's
`quantization_config.quant_method` (gptq, awq, compressed-tensors with format pack-quantized), or a
GGUF file. Every linear of the decoder layers of an HF directory must be 4-bit; a GGUF's linears may mix
the types of spear.quant.formats.GGUF_BITS (a Q4_K_M file is Q4_K with Q6_K and Q5_0 / Q8_0 layers by design),
each becoming a record of its type's bits; a file with any other type among its linears is refused, naming its
whole type mix, before any work. The other tensors (embeddings, norms, biases, lm_head) are taken as stored.
The decoders (spear.quant.formats) reproduce each format's dequantized weights bit for bit; a GGUF import also
checks every layer against transformers' own reading of the file (gguf.quants) before anything is written.

The float model the checkpoint was quantized from is not in it: `base` names it (an HF directory
or GGUF), the teacher of `spear compensate`; without it the artifact evaluates and serves but
cannot be compensated.

A directory of `spear export-vllm` is compressed-tensors with ECs beside it: its index lists the weights (as
transformers reads it, so the EC file is not among them) and `quantization_config.spear` names the EC file and each
EC's rank and gate width; the ECs come back onto their linears, so export then import gives back the artifact's
records and ECs unchanged.

A command of its own (`spear import`), not an option of `spear quantize`: none of quantize's settings
(method, bits, group size, grid, calibration) apply, the checkpoint fixes them all, as `vllm serve`
reads them from the checkpoint rather than from flags.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from spear.artifact import ArtifactInfo, save_artifact
from spear.errors import SpearError, first_line
from spear.export.vllm import SPEAR_KEY, SPEAR_KEY_VERSION
from spear.layer import ErrorCompensator
from spear.models.layerwise import quantizable_linears
from spear.models.loading import load_float_model, resolve_model_path
from spear.quant.formats import GGUF_BITS, awq_record, compressed_tensors_record, gguf_record, gptq_record
from spear.quant.pipeline import replace_with_quantized
from spear.record import QuantizedWeight

FORMATS = ("gptq", "awq", "compressed-tensors", "gguf")
# tensor names a quantized linear stores instead of `weight`, by format; the first three are required
STORED = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"),
}


def import_checkpoint(src: str, out_dir: str | Path, base: str | None = None) -> Path:
    """Write the artifact of the pre-quantized checkpoint `src` (HF directory or GGUF file) to `out_dir`, and print
    what it imported (import_summary) on stderr."""
    path = resolve_model_path(src)
    if base is not None:
        resolve_model_path(base)
    if path.is_file():
        model, tokenizer, quant, records, source_bytes = _read_gguf(path, src)
    else:
        model, tokenizer, quant, records, source_bytes = _read_hf_dir(path, src)
    types = quant.get("gguf_types", {f"{quant['bits']}-bit": len(records)})
    info = ArtifactInfo(base_model=base, quant=quant, extra={"imported_from": src})
    out = save_artifact(model, tokenizer, out_dir, info)
    print(import_summary(quant["method"], types, records, source_bytes), file=sys.stderr)
    return out


def import_summary(method: str, types: dict[str, int], records: dict[str, QuantizedWeight], source_bytes: int) -> str:
    """One line: the linears' stored types (GGUF: Q4_K, Q6_K, ...; else "4-bit"), most common first, and their bytes
    in the checkpoint; the records' bit widths and bytes (QuantizedWeight.nbytes_packed)."""
    mix = ", ".join(f"{t} ×{n}" for t, n in types.items())
    bits = ", ".join(f"{b}-bit ×{n}" for b, n in sorted(Counter(r.bits for r in records.values()).items()))
    record_bytes = sum(r.nbytes_packed() for r in records.values())
    return (f"imported {len(records)} {method} linears ({mix}): {source_bytes:,} bytes in the checkpoint, "
            f"{record_bytes:,} as records ({bits})")


# --- HF directories: GPTQ, AWQ, compressed-tensors -------------------------------------------

def _read_hf_dir(path: Path, src: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpearError(f"cannot read the config of {src}: {first_line(e)}") from None
    qc = config.pop("quantization_config", None)
    if not isinstance(qc, dict):
        raise SpearError(f"{src} has no quantization_config: not a pre-quantized checkpoint (use spear quantize)")
    fmt, bits, group_size, sym, v1 = _hf_quant_args(qc, src)
    tensors = _load_tensors(path, src)
    try:
        hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    except (ValueError, KeyError) as e:
        raise SpearError(f"unsupported architecture in {src}: {first_line(e)}") from None
    records = {}
    for name, linear in quantizable_linears(model).items():
        missing = [f"{name}.{k}" for k in STORED[fmt][:3] if f"{name}.{k}" not in tensors]
        if missing:
            raise SpearError(f"malformed checkpoint {src}: missing tensor {missing[0]} (every decoder linear must be "
                             f"{bits}-bit {fmt})")
        out_f, in_f = linear.out_features, linear.in_features
        if fmt == "gptq":
            records[name] = gptq_record(name, tensors, out_f, in_f, group_size, v1)
        elif fmt == "awq":
            records[name] = awq_record(name, tensors, out_f, in_f)
        else:
            records[name] = compressed_tensors_record(name, tensors, out_f, in_f)
    stored = {f"{n}.{k}" for n in records for k in STORED[fmt]}
    source_bytes = sum(t.numel() * t.element_size() for k, t in tensors.items() if k in stored)
    _load_float_tensors(model, {k: v for k, v in tensors.items() if k not in stored}, records, src)
    for name, record in records.items():
        replace_with_quantized(model, name, record)
    _attach_ecs(model, records, path, qc, src)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise SpearError(f"cannot load the tokenizer of {src}: {first_line(e)}") from None
    group = _common_group_size(records) if fmt == "compressed-tensors" else group_size
    quant = {"method": fmt, "bits": bits, "group_size": group, "sym": sym, "imported": True}
    return model, tokenizer, quant, records, source_bytes


def _hf_quant_args(qc: dict, src: str) -> tuple[str, int, int, bool | None, bool]:
    """(format, bits, group size, symmetric, GPTQ v1 zero offset) from a quantization_config."""
    method = qc.get("quant_method")
    if method in ("gptq", "awq"):
        bits, group_size = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise SpearError(f"{src}: AWQ version {qc.get('version')!r}; spear import reads the GEMM packing")
        if method == "gptq" and qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
            raise SpearError(f"{src}: GPTQ checkpoint_format {qc['checkpoint_format']!r}; spear import reads gptq "
                             "and gptq_v2")
        if bits != 4:
            raise SpearError(f"{src} is {bits}-bit {method}; spear import takes 4-bit checkpoints")
        if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
            raise SpearError(f"{src}: unreadable {method} group size {group_size!r}")
        sym = qc.get("sym") if method == "gptq" else not qc.get("zero_point", True)
        return method, bits, group_size, sym, qc.get("checkpoint_format", "gptq") == "gptq"
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        formats = {qc.get("format")} | {g.get("format") for g in groups.values() if g.get("format")}
        if formats - {None} != {"pack-quantized"}:
            raise SpearError(f"{src}: compressed-tensors format {sorted(f for f in formats if f)}; "
                             "spear import reads pack-quantized (W4A16)")
        for g in groups.values():
            w = g.get("weights") or {}
            if w.get("num_bits") != 4 or w.get("type", "int") != "int" or g.get("input_activations"):
                raise SpearError(f"{src}: compressed-tensors scheme {w.get('type')}{w.get('num_bits')} with "
                                 f"activations {g.get('input_activations')}; spear import takes W4A16 int")
        syms = {(g.get("weights") or {}).get("symmetric", True) for g in groups.values()}
        return method, 4, -1, syms.pop() if len(syms) == 1 else None, False
    raise SpearError(f"{src}: quant_method {method!r}; spear import reads {', '.join(FORMATS[:3])} and GGUF files")


def _load_tensors(path: Path, src: str) -> dict[str, torch.Tensor]:
    """The checkpoint's weights: the files its model.safetensors.index.json maps them to, as transformers reads it
    (an export-vllm directory's index leaves its EC file out), else every .safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, or no weight_map of files
            raise SpearError(f"cannot read the index {index}: {first_line(e)}") from None
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpearError(f"{src} has no .safetensors files")
    tensors = {}
    for f in files:
        tensors |= _load_file(f)
    return tensors


def _load_file(f: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(f))
    except (SafetensorError, OSError) as e:
        raise SpearError(f"cannot read {f}: {first_line(e)}") from None


def _attach_ecs(model: nn.Module, records: dict[str, QuantizedWeight], path: Path, qc: dict, src: str) -> None:
    """The ECs of an export-vllm directory (spear.export.vllm), from the file its quantization_config.spear entry
    names, onto their quantized linears as the artifact holds them (float32 parameters of the stored values)."""
    spear = qc.get(SPEAR_KEY)
    if spear is None:
        return
    if (not isinstance(spear, dict) or spear.get("version") != SPEAR_KEY_VERSION
            or not isinstance(spear.get("ec_file"), str) or not isinstance(spear.get("ec_modules"), dict)):
        raise SpearError(f"{src}: quantization_config.{SPEAR_KEY} is not a version {SPEAR_KEY_VERSION} entry of "
                         "spear export-vllm; export the artifact again with this SPEAR")
    file = path / spear["ec_file"]
    ecs = _load_file(file)
    for name, meta in spear["ec_modules"].items():
        if name not in records:
            raise SpearError(f"malformed checkpoint {src}: EC {name} is not on a 4-bit decoder linear")
        tensors = {k.removeprefix(f"{name}.ec."): ecs.pop(k) for k in [k for k in ecs if k.startswith(f"{name}.ec.")]}
        layer = model.get_submodule(name)
        try:
            layer.ec = ErrorCompensator(layer.in_features, layer.out_features, meta["rank"], meta["gate_hidden"],
                                        factor_bits=meta.get("factor_bits", 16))
            layer.ec.load_state_dict(tensors)
        except (KeyError, TypeError, RuntimeError) as e:
            raise SpearError(f"malformed EC {name} in {file}: {' '.join(str(e).split())}") from None
    if ecs:
        raise SpearError(f"malformed checkpoint {src}: {file} holds {next(iter(ecs))}, of no EC its "
                         f"quantization_config.{SPEAR_KEY} names")


def _load_float_tensors(model: nn.Module, tensors: dict, records: dict[str, QuantizedWeight], src: str) -> None:
    """Every parameter outside the quantized linears' weights must come from the checkpoint (or be tied)."""
    quantized_weights = {f"{n}.weight" for n in records}
    try:
        result = model.load_state_dict(tensors, strict=False)
    except RuntimeError as e:
        raise SpearError(f"malformed checkpoint {src}: {first_line(e)}") from None
    model.tie_weights()
    loaded = {p.data_ptr() for k, p in model.state_dict().items() if k in tensors}
    state = model.state_dict()
    missing = [k for k in result.missing_keys if k not in quantized_weights and state[k].data_ptr() not in loaded]
    if missing:
        raise SpearError(f"malformed checkpoint {src}: missing tensor {missing[0]}")
    if result.unexpected_keys:
        raise SpearError(f"malformed checkpoint {src}: unexpected tensor {result.unexpected_keys[0]} "
                         "(a quantized module outside the decoder linears?)")


def _common_group_size(records: dict[str, QuantizedWeight]) -> int | None:
    """The artifact config's group size: -1 where every layer is per-channel, the common size, or None (mixed)."""
    sizes = {-1 if r.group_size == r.shape[1] else r.group_size for r in records.values()}
    return sizes.pop() if len(sizes) == 1 else None


# --- GGUF ------------------------------------------------------------------------------------

def _read_gguf(path: Path, src: str):
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise SpearError(f"cannot read the GGUF {src}: {first_line(e)}") from None
    _check_gguf_types(reader, src)
    lm = load_float_model(str(path), torch.device("cpu"), torch.float32)  # transformers' reading: the reference
    model = lm.model
    field = reader.fields.get("general.architecture")
    arch = "" if field is None else bytes(field.parts[-1]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    hf_names = get_gguf_hf_weights_map(model, processor)
    linears = quantizable_linears(model)
    kinds, records, source_bytes = Counter(), {}, 0
    for tensor in reader.tensors:
        name = hf_names.get(tensor.name, "").removesuffix(".weight")
        if name not in linears:
            continue
        linear, kind = linears[name], tensor.tensor_type.name
        record = gguf_record(tensor.name, kind, np.asarray(tensor.data), linear.out_features, linear.in_features)
        record = _permute_rows(record, _row_order(processor, tensor.name, linear.out_features, hf_names))
        if not torch.equal(record.dequantize(), linear.weight.float()):
            raise SpearError(f"{tensor.name} ({kind}) does not dequantize to transformers' reading of {src}")
        records[name] = record
        kinds[kind] += 1
        source_bytes += int(tensor.n_bytes)
    missing = [n for n in linears if n not in records]
    if missing:
        raise SpearError(f"{src} has no quantized tensor for {missing[0]}")
    for name, record in records.items():
        replace_with_quantized(model, name, record)
    bits = {r.bits for r in records.values()}
    quant = {"method": "gguf", "gguf_types": dict(kinds.most_common()), "bits": bits.pop() if len(bits) == 1 else None,
             "group_size": _common_group_size(records), "sym": all(r.offsets is None for r in records.values()),
             "imported": True}
    return model, lm.tokenizer, quant, records, source_bytes


def _check_gguf_types(reader, src: str) -> None:
    """Refuse, before any work, a GGUF whose decoder linears (its 2-D blk.* tensors) hold a type without a decoder,
    naming the whole type mix."""
    kinds = Counter(t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    unknown = sorted(k for k in kinds if k not in GGUF_BITS)
    if unknown:
        mix = ", ".join(f"{k} ×{n}" for k, n in kinds.most_common())
        raise SpearError(f"{src}: its linears are {mix}; spear import decodes {', '.join(GGUF_BITS)}, not "
                         f"{', '.join(unknown)} (llama-quantize makes such files, e.g. Q4_K_M)")


def _row_order(processor, gguf_name: str, rows: int, hf_names: dict) -> torch.Tensor:
    """The file row each model row comes from: transformers' processor applied to the row indices
    (Llama's q/k rows are stored permuted for llama.cpp's rotary layout)."""
    index = np.arange(rows, dtype=np.float64)[:, None]
    out = processor.process(weights=index, name=gguf_name, tensor_key_mapping=hf_names, parsed_parameters={})
    return torch.from_numpy(np.asarray(out.weights)[:, 0].astype(np.int64))


def _permute_rows(record: QuantizedWeight, order: torch.Tensor) -> QuantizedWeight:
    return QuantizedWeight(record.codes[order], record.scales[order], record.zeros[order], record.bits,
                           record.group_size, record.g_idx, None if record.offsets is None else record.offsets[order])
