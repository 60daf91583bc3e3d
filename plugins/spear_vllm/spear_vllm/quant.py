"""The "spear" quantization method of vLLM: compressed-tensors W4A16 plus the adaptive ECs.

`spear export-vllm` writes a compressed-tensors pack-quantized checkpoint whose quantization_config has a
"spear" entry (the EC file, each EC's rank and gate width). SpearConfig claims such checkpoints
(override_quantization_method), so plain `vllm serve DIR` takes this method once the plugin is installed;
`--quantization compressed-tensors` serves the same directory without the ECs.

Each linear keeps vLLM's own compressed-tensors method (its W4A16 kernel: Marlin on CUDA, the WNA16 kernel on
CPU) for y = Q(W) x + b, and this method adds the EC term (spear_vllm.ec) after it. The EC tensors are not
vLLM parameters: they are read from the EC file after the base weights are loaded, sharded for the layer's
tensor-parallel rank, and kept as buffers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    LinearMethodBase,
    QKVParallelLinear,
    RowParallelLinear,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
    CompressedTensorsLinearMethod,
)

from spear_vllm.ec import FusedEC, Shard, rank_shards, shard_ec

NAME = "spear"
SPEAR_KEY = "spear"  # the quantization_config entry spear's export writes
SPEAR_KEY_VERSION = 1


@register_quantization_config(NAME)
class SpearConfig(CompressedTensorsConfig):
    """compressed-tensors' config, plus the ECs named in the checkpoint's "spear" entry."""

    spear: dict[str, Any]
    ec_names: dict[str, str]  # vLLM module name → the checkpoint's (HF) name, under which the EC file stores it
    model_dir: Path | None = None

    def get_name(self) -> str:
        return NAME

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "SpearConfig":
        spear = config.get(SPEAR_KEY)
        if not isinstance(spear, dict) or spear.get("version") != SPEAR_KEY_VERSION:
            raise ValueError(f"quantization_config.{SPEAR_KEY} must be a version {SPEAR_KEY_VERSION} entry of "
                             "`spear export-vllm`; re-export the artifact with this plugin's SPEAR")
        self = super().from_config({k: v for k, v in config.items() if k != SPEAR_KEY})
        self.spear = spear
        self.ec_names = {name: name for name in spear["ec_modules"]}
        return self

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        """Claim compressed-tensors checkpoints that carry spear's ECs, unless another method was asked for."""
        if hf_quant_cfg.get("quant_method") == "compressed-tensors" and SPEAR_KEY in hf_quant_cfg:
            return NAME if user_quant in (None, NAME) else None
        return None

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        path = Path(model_name)
        if not (path / self.spear["ec_file"]).is_file():
            raise ValueError(f"{path} has no {self.spear['ec_file']}: serve a local directory written by "
                             "`spear export-vllm` (or pass --quantization compressed-tensors for W4 without ECs)")
        self.model_dir = path

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        super().apply_vllm_mapper(hf_to_vllm_mapper)
        self.ec_names = {hf_to_vllm_mapper._map_name(hf) or hf: hf for hf in self.spear["ec_modules"]}

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        method = super().get_quant_method(layer, prefix)
        if not isinstance(layer, LinearBase) or not isinstance(method, CompressedTensorsLinearMethod):
            return method
        parts = self.part_names(prefix)
        if not any(p in self.ec_names for p in parts):
            return method
        return SpearLinearMethod(self, method, parts)

    def part_names(self, prefix: str) -> list[str]:
        """The checkpoint linears a vLLM linear fuses, in output order (q, k, v for qkv_proj), or itself."""
        base, _, last = prefix.rpartition(".")
        fused = self.packed_modules_mapping.get(last)
        return [f"{base}.{p}" if base else p for p in fused] if fused else [prefix]

    def read_ec(self, name: str) -> dict[str, torch.Tensor] | None:
        """The EC of the vLLM-named linear `name` from the EC file (None: it has none)."""
        from safetensors import safe_open

        hf = self.ec_names.get(name)
        if hf is None:
            return None
        with safe_open(str(self.model_dir / self.spear["ec_file"]), framework="pt") as f:
            keys = [k for k in f.keys() if k.startswith(f"{hf}.ec.")]
            return {k.removeprefix(f"{hf}.ec."): f.get_tensor(k) for k in keys}


@register_weight_loader_v2_supported_method
class SpearLinearMethod(LinearMethodBase):
    """compressed-tensors' W4A16 method of a linear, followed by the linear's EC term."""

    def __init__(self, config: SpearConfig, base: CompressedTensorsLinearMethod, parts: list[str]):
        self.config = config
        self.base = base
        self.parts = parts

    def create_weights(self, layer: torch.nn.Module, *args, **kwargs) -> None:
        self.base.create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.base.process_weights_after_loading(layer)
        shards = _shards(layer)
        parts = [None if (t := self.config.read_ec(name)) is None else shard_ec(t, s)
                 for name, s in zip(self.parts, shards)]
        row_parallel = isinstance(layer, RowParallelLinear) and layer.tp_size > 1
        device = next(p.device for p in layer.parameters())
        layer.spear_ec = FusedEC(parts, [s.rows[1] - s.rows[0] for s in shards], layer.params_dtype,
                                 reduce=tensor_model_parallel_all_reduce if row_parallel else None,
                                 adds=layer.tp_rank == 0 or not row_parallel).to(device)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.base.apply(layer, x, bias)
        ec = layer.spear_ec(x)
        return y if ec is None else y + ec


def _shards(layer: LinearBase) -> list[Shard]:
    """Each fused part's rows and input columns on the layer's rank."""
    rank, widths = layer.tp_rank, layer.output_partition_sizes
    if isinstance(layer, RowParallelLinear):
        return rank_shards("row", rank, widths, layer.input_size_per_partition)
    if isinstance(layer, QKVParallelLinear):
        return rank_shards("qkv", rank, widths, layer.input_size, layer.num_kv_head_replicas)
    kind = "column" if isinstance(layer, ColumnParallelLinear) else "replicated"
    return rank_shards(kind, rank, widths, layer.input_size)
