"""`spear export-vllm`: a (compensated) artifact as a model directory vLLM serves.

    config.json                    the transformers config + quantization_config: compressed-tensors
                                   pack-quantized W4A16 (what llm-compressor writes), with a "spear" entry
                                   naming the EC file and each EC's rank and gate width
    model.safetensors              the 4-bit linears as compressed-tensors tensors (weight_packed,
                                   weight_scale, weight_shape, weight_zero_point when asymmetric) and
                                   every other tensor as the artifact stores it
    model.safetensors.index.json   lists model.safetensors only, so stock vLLM and transformers skip the ECs
    spear_ec.safetensors           the ECs under the artifact's names: <linear>.ec.A, .ec.B, .ec.alpha,
                                   .ec.gate.{0,2}.{weight,bias}
    static_lora/                   the ECs without their gate as a PEFT LoRA adapter (lora_B @ lora_A =
                                   alpha B A, every rank zero-padded to the largest), for stock vLLM's --enable-lora
    tokenizer files

Stock vLLM serves the directory as plain W4; with the spear-vllm plugin (plugins/spear_vllm) installed it
adds the adaptive ECs. Every linear is packed with the compressed-tensors library and checked against its
decompressor: the weights it decompresses to are our record's dequantized weights bit for bit (float32 and
the stored fp16 scales' dtype).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from spear.artifact import RECORD_PARTS, read_artifact_config, read_ec_tensors, read_record
from spear.errors import SpearError, require_module
from spear.models.loading import save_tokenizer
from spear.record import QuantizedWeight
from spear.shards import ShardReader
from spear.util import atomic_dir, versions

BITS = 4  # vLLM's W4A16 (compressed-tensors uint4b8 / uint4 with zero points)
EC_FILE = "spear_ec.safetensors"
LORA_DIR = "static_lora"
SPEAR_KEY = "spear"  # the quantization_config entry the plugin looks for
SPEAR_KEY_VERSION = 1


@dataclass
class VllmExport:
    out_dir: Path
    quantized: int  # linears written as compressed-tensors W4A16
    ec_modules: int
    lora_rank: int  # the static adapter's rank (0: no ECs, no adapter)
    symmetric: bool
    group_size: int  # -1: per-channel


def export_vllm(artifact_dir: str | Path, out_dir: str | Path) -> VllmExport:
    """Write the vLLM model directory of the artifact `artifact_dir` to `out_dir` (atomically)."""
    require_module("compressed_tensors", "spear export-vllm")  # the vllm extra: pip install -e ".[vllm]"
    artifact_dir, out_dir = Path(artifact_dir), Path(out_dir)
    config = read_artifact_config(artifact_dir)
    if out_dir.resolve() == artifact_dir.resolve():
        raise SpearError(f"--out {out_dir} is the artifact itself; give the export a directory of its own")
    reader = ShardReader(artifact_dir)
    records = {name: _record(reader, config, name) for name in config["quantized_modules"]}
    if not records:
        raise SpearError(f"{artifact_dir} has no quantized linears to export")
    scheme = _scheme(records)
    model = {}
    for name, record in records.items():
        model |= {f"{name}.{k}": v for k, v in pack_compressed_tensors(record, scheme).items()}
    # 8-bit EC factors as the fp16 the plugin's kernels and the static LoRA read
    ecs = {k: v.half().contiguous() for k, v in read_ec_tensors(reader, config).items()}
    owned = {k for k in reader.names() if ".ec." in k} | {f"{name}.{part}" for name in records for part in RECORD_PARTS}
    model |= {k: reader.get(k) for k in reader.names() if k not in owned}
    ec_modules = config["ec_modules"]
    hf_config = _hf_config(config, scheme, ec_modules)
    lora = static_lora(ecs, ec_modules)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(artifact_dir)
    with atomic_dir(out_dir) as tmp:
        save_file({k: v.contiguous() for k, v in model.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in sorted(model)}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if ecs:
            save_file(ecs, str(tmp / EC_FILE), metadata={"format": "pt"})
        if lora is not None:
            _write_lora(tmp / LORA_DIR, lora, config)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, default=str))
        save_tokenizer(tokenizer, tmp)
    rank = 0 if lora is None else lora[1]
    return VllmExport(out_dir, len(records), len(ec_modules), rank, scheme.symmetric, scheme.group_size)


@dataclass(frozen=True)
class Scheme:
    """The one compressed-tensors weight scheme of every exported linear."""

    symmetric: bool  # every zero point is 2^(b-1): no zero points stored
    group_size: int  # -1: per-channel

    def args(self):
        from compressed_tensors.quantization import QuantizationArgs

        grouped = self.group_size != -1
        return QuantizationArgs(num_bits=BITS, type="int", symmetric=self.symmetric,
                                strategy="group" if grouped else "channel",
                                group_size=self.group_size if grouped else None)

    def compressed_tensors(self):
        from compressed_tensors.quantization import QuantizationScheme

        return QuantizationScheme(targets=["Linear"], weights=self.args())


def _record(reader: ShardReader, config: dict, name: str) -> QuantizedWeight:
    record = read_record(reader, config, name)
    if record.bits != BITS:
        raise SpearError(f"{name} is {record.bits}-bit; vLLM's compressed-tensors W4A16 takes 4-bit linears")
    if not record.standard_form:
        raise SpearError(f"{name} has act-order g_idx, offsets or float32 scales (an imported GGUF or GPTQ layer), "
                         "which compressed-tensors W4A16 cannot hold; export artifacts of `spear quantize`")
    return record


def _scheme(records: dict[str, QuantizedWeight]) -> Scheme:
    sizes = {-1 if r.group_size == r.shape[1] else r.group_size for r in records.values()}
    if len(sizes) != 1:
        raise SpearError(f"the linears have group sizes {sorted(sizes)}; the export writes one compressed-tensors "
                         "scheme for all of them")
    half = 2 ** (BITS - 1)
    symmetric = all(bool((r.zeros == half).all()) for r in records.values())
    return Scheme(symmetric, sizes.pop())


def pack_compressed_tensors(record: QuantizedWeight, scheme: Scheme) -> dict[str, torch.Tensor]:
    """One linear as compressed-tensors pack-quantized tensors, checked against the library's decompressor.

    The library stores codes as signed v = q - 2^(b-1) and zero points as zp = z - 2^(b-1): W = (v - zp) s = (q - z) s.
    """
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized import pack_to_int32

    half = 2 ** (BITS - 1)
    out = {"weight_packed": pack_to_int32((record.codes.to(torch.int16) - half).to(torch.int8), BITS),
           "weight_scale": record.scales.contiguous(),
           "weight_shape": torch.tensor(list(record.shape))}
    if not scheme.symmetric:
        zp = (record.zeros.to(torch.int16) - half).to(torch.int8)
        out["weight_zero_point"] = pack_to_int32(zp, BITS, packed_dim=0).contiguous()
    ct = scheme.compressed_tensors()
    for dtype in (torch.float32, record.scales.dtype):
        state = out | {"weight_scale": out["weight_scale"].to(dtype)}
        weight = PackedQuantizationCompressor.decompress(state, ct)["weight"]
        if weight.dtype != dtype or not torch.equal(weight, record.dequantize(dtype)):
            raise SpearError("compressed-tensors decompresses a packed layer to other weights than ours "
                             f"({dtype}); the installed compressed-tensors may read pack-quantized differently")
    return out


def _hf_config(config: dict, scheme: Scheme, ec_modules: dict) -> dict:
    from compressed_tensors.quantization import QuantizationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    hf = dict(config["model_config"])
    hf.pop("torch_dtype", None)
    hf["dtype"] = "float16"  # the scales' dtype, kept exact; vLLM-CPU's W4A16 kernel has no float32
    if not hf.get("architectures"):
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf.get("model_type"))
        if arch is None:
            raise SpearError(f"no causal-LM architecture for model type {hf.get('model_type')!r}")
        hf["architectures"] = [arch]
    qc = QuantizationConfig(config_groups={"group_0": scheme.compressed_tensors()}, format="pack-quantized",
                            quant_method="compressed-tensors", quantization_status="compressed",
                            ignore=["lm_head"]).model_dump(mode="json")
    if ec_modules:
        qc[SPEAR_KEY] = {"version": SPEAR_KEY_VERSION, "ec_file": EC_FILE, "ec_modules": ec_modules,
                         "base_model": config["base_model"], "versions": versions()}
    return hf | {"quantization_config": qc}


def static_lora(ecs: dict[str, torch.Tensor], ec_modules: dict) -> tuple[dict[str, torch.Tensor], int] | None:
    """The ECs without their gate as PEFT LoRA tensors: lora_A = A, lora_B = alpha B, zero-padded to one rank.

    With lora_alpha = r (scaling 1), lora_B @ lora_A = alpha B A, the EC's static product (exact for gate-off
    ECs; an adaptive EC's gate gamma(u) is left out).
    """
    if not ec_modules:
        return None
    rank = max(meta["rank"] for meta in ec_modules.values())
    lora = {}
    for name in ec_modules:
        # in float32: the product alpha B of the stored fp16 tensors, exact
        a, b, alpha = (ecs[f"{name}.ec.{k}"].float() for k in ("A", "B", "alpha"))
        r = a.shape[0]
        prefix = f"base_model.model.{name}"
        lora[f"{prefix}.lora_A.weight"] = torch.cat([a, a.new_zeros(rank - r, a.shape[1])]).contiguous()
        lora[f"{prefix}.lora_B.weight"] = torch.cat([alpha * b, b.new_zeros(b.shape[0], rank - r)], 1).contiguous()
    return lora, rank


def _write_lora(path: Path, lora: tuple[dict[str, torch.Tensor], int], config: dict) -> None:
    tensors, rank = lora
    targets = sorted({k.split(".")[-3] for k in tensors})
    adapter = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
               "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
               "base_model_name_or_path": config["base_model"], "inference_mode": True}
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(adapter, indent=2))
