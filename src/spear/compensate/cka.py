"""Per-module sensitivity: how much quantizing one linear layer alone moves the final hidden states.

    damage(m) = 1 − CKA(H_fp, H_m)

H_fp: final hidden states (after the final norm) of the float model, [tokens, d];
H_m: the same with only module m's weight replaced by its dequantized Ŵ. CKA is linear
CKA (Kornblith et al. 2019, eq. 2 with a linear kernel):

    CKA(X, Y) = ‖Yᵀ X‖_F² / (‖Xᵀ X‖_F ‖Yᵀ Y‖_F),   X, Y column-centred.

Only the layers from m's decoder layer on are re-run: the float inputs of every decoder
layer are computed once and kept.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.errors import SpearError
from spear.models.layerwise import (
    LayerInputs, capture_layer_inputs, check_replay, decoder_layers, final_norm, layer_linears, module_name,
    run_layer,
)


def linear_cka(X: torch.Tensor, Y: torch.Tensor) -> float:
    """Linear CKA of X [n, dx] and Y [n, dy], in float64; picks the cheaper of the two equal forms."""
    if X.shape[0] != Y.shape[0]:
        raise SpearError(f"CKA needs the same number of rows, got {X.shape[0]} and {Y.shape[0]}")
    X = X.double() - X.double().mean(0)
    Y = Y.double() - Y.double().mean(0)
    if X.shape[0] >= max(X.shape[1], Y.shape[1]):  # feature space, O(n d²)
        num = (Y.t() @ X).square().sum()
        den = torch.linalg.norm(X.t() @ X) * torch.linalg.norm(Y.t() @ Y)
    else:  # sample space (centred Gram matrices), O(n² d)
        Kx, Ky = X @ X.t(), Y @ Y.t()
        num = (Kx * Ky).sum()
        den = torch.linalg.norm(Kx) * torch.linalg.norm(Ky)
    if den == 0:
        raise SpearError("CKA is undefined for a constant input (zero variance after centring)")
    return float(num / den)


@dataclass(frozen=True)
class SensitivityConfig:
    # 512 tokens: on SmolLM2 the damage ranking from two disjoint 512-token sets agrees to Spearman 0.975
    num_sequences: int = 4  # the first sequences of the calibration ids
    seq_len: int = 128  # their first tokens
    batch_size: int = 4


@dataclass
class ModuleDamage:
    name: str
    layer: int
    type: str  # q_proj, ..., down_proj: the last part of the name
    damage: float  # 1 − CKA


@dataclass
class SensitivityTable:
    entries: list[ModuleDamage]
    tokens: int  # tokens the CKA was measured on
    seconds: float = 0.0
    meta: dict = field(default_factory=dict)  # e.g. the quantization config used

    def damages(self) -> dict[str, float]:
        return {e.name: e.damage for e in self.entries}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "SensitivityTable":
        d = json.loads(text)
        return cls([ModuleDamage(**e) for e in d["entries"]], d["tokens"], d["seconds"], d["meta"])

    def save_heatmap(self, path: str | Path, title: str = "Per-module damage, 1 − CKA of final hidden states") -> None:
        """PNG heat map: decoder layers (rows) × module types (columns), log colour scale."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm

        types = list(dict.fromkeys(e.type for e in self.entries))
        n_layers = max(e.layer for e in self.entries) + 1
        grid = torch.full((n_layers, len(types)), float("nan"), dtype=torch.float64)
        for e in self.entries:
            grid[e.layer, types.index(e.type)] = e.damage
        positive = grid[grid > 0]
        norm = LogNorm(vmin=float(positive.min()), vmax=float(positive.max())) if len(positive) else None
        fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(types), 1.5 + 0.22 * n_layers))
        im = ax.imshow(grid.clamp(min=1e-12).numpy(), aspect="auto", cmap="magma", norm=norm, interpolation="nearest")
        ax.set_xticks(range(len(types)), types, rotation=30, ha="right")
        ax.set_yticks(range(n_layers))
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("module")
        ax.set_ylabel("decoder layer")
        ax.set_title(f"{title}\n({self.tokens} tokens)", fontsize=10)
        fig.colorbar(im, ax=ax, label="damage (log scale)")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


@torch.no_grad()
def module_sensitivity(
    model: nn.Module,
    w_hat: Mapping[str, torch.Tensor],
    calib_ids: torch.Tensor,
    cfg: SensitivityConfig = SensitivityConfig(),
) -> SensitivityTable:
    """Damage of each module named in `w_hat` (name → dequantized weight Ŵ) of the float `model`."""
    start = time.perf_counter()
    layers = decoder_layers(model)
    where = {}  # module name → (decoder layer index, nn.Linear)
    prefix = module_name(model, layers)
    for i, layer in enumerate(layers):
        for rel, m in layer_linears(layer).items():
            where[f"{prefix}.{i}.{rel}"] = (i, m)
    missing = [n for n in w_hat if n not in where]
    if missing:
        raise SpearError(f"not linear layers of the decoder stack: {', '.join(missing[:3])}")
    names = [n for n in where if n in w_hat]  # model order

    ids = calib_ids[: cfg.num_sequences, : cfg.seq_len]
    batches = list(ids.split(cfg.batch_size))
    norm = final_norm(model)
    inputs = [capture_layer_inputs(model, batches)]  # inputs[i]: float inputs of layer i
    for layer in layers:
        inputs.append(run_layer(layer, inputs[-1]))
    check_replay(model, batches, inputs[-1])
    H_fp = _final_hidden(norm, inputs[-1])

    entries = []
    for name in tqdm(names, desc="sensitivity (1 - CKA)", unit="module"):
        i, linear = where[name]
        W = linear.weight.data
        linear.weight.data = w_hat[name].to(device=W.device, dtype=W.dtype)
        try:
            h = inputs[i]
            for layer in layers[i:]:
                h = run_layer(layer, h)
        finally:
            linear.weight.data = W
        damage = 1.0 - linear_cka(H_fp, _final_hidden(norm, h))
        entries.append(ModuleDamage(name, i, name.rsplit(".", 1)[-1], damage))
    return SensitivityTable(entries, tokens=ids.numel(), seconds=time.perf_counter() - start)


def _final_hidden(norm: nn.Module, h: LayerInputs) -> torch.Tensor:
    """Final-norm output over all batches, [tokens, d]."""
    return torch.cat([norm(x).reshape(-1, x.shape[-1]) for x in h.hidden])
