"""Per-module input statistics of the float model, for the closed-form EC inits.

For each linear layer with inputs x (one row per token):
    R_xx = E[x xᵀ]        (in×in, float64)   QERA / EoRA whitening
    s    = E[|x|]          (in, float64)      LQER channel scales
Modules that read the same tensor (q, k, v; gate, up) share one InputStats object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.models.layerwise import (
    LayerInputs, capture_layer_inputs, decoder_layers, layer_linears, module_name, quantizable_linears,
)


@dataclass
class InputStats:
    sum_xx: torch.Tensor  # [in, in] float64, Σ x xᵀ
    sum_abs: torch.Tensor  # [in] float64, Σ |x|
    tokens: int = 0
    _sqrt: torch.Tensor | None = field(default=None, repr=False)  # R_xx^{1/2}, computed once

    @classmethod
    def zeros(cls, in_features: int, device: torch.device | str = "cpu") -> "InputStats":
        return cls(
            torch.zeros(in_features, in_features, dtype=torch.float64, device=device),
            torch.zeros(in_features, dtype=torch.float64, device=device),
        )

    def update(self, x: torch.Tensor) -> None:
        """Accumulate inputs x [..., in]."""
        x = x.detach().reshape(-1, x.shape[-1]).double()  # [T, in]
        self.sum_xx.addmm_(x.t(), x)
        self.sum_abs.add_(x.abs().sum(0))
        self.tokens += x.shape[0]
        self._sqrt = None

    @property
    def r_xx(self) -> torch.Tensor:
        """R_xx = E[x xᵀ], [in, in] float64."""
        return self.sum_xx / max(self.tokens, 1)

    def r_xx_sqrt(self) -> torch.Tensor:
        """R_xx^{1/2} (symmetric PSD square root), computed once and shared by the modules reading x."""
        if self._sqrt is None:
            self._sqrt = sqrtm_psd(self.r_xx)
        return self._sqrt

    @property
    def mean_abs(self) -> torch.Tensor:
        """E|x| per input channel, [in] float64."""
        return self.sum_abs / max(self.tokens, 1)


def sqrtm_psd(R: torch.Tensor) -> torch.Tensor:
    """Symmetric square root of a PSD matrix via eigh; negative (round-off) eigenvalues clamp to 0."""
    R = R.double()
    lam, Q = torch.linalg.eigh((R + R.t()) / 2)
    return (Q * lam.clamp(min=0).sqrt()) @ Q.t()


def _stats_hooks(linears: dict[str, nn.Module], stats: dict[str, InputStats],
                 seen: list[tuple[torch.Tensor, InputStats]]) -> list:
    """Forward pre-hooks that accumulate each named linear's inputs into `stats`; a module reading a tensor already
    counted in this batch (`seen`, cleared by the caller after each batch) shares its InputStats."""

    def hook(name: str):
        def fn(_module, args):
            x = args[0]
            for t, st in seen:
                if t is x:
                    stats.setdefault(name, st)
                    return
            st = stats.setdefault(name, InputStats.zeros(x.shape[-1], x.device))
            st.update(x)
            seen.append((x, st))

        return fn

    return [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]


@torch.no_grad()
def collect_input_stats(
    model: nn.Module, calib_ids: torch.Tensor, names: list[str] | None = None, batch_size: int = 8
) -> dict[str, InputStats]:
    """Run the float model on calib_ids [N, L] and return the input statistics of each named linear
    (default: every quantizable linear). Modules fed the same tensor share one InputStats."""
    linears = quantizable_linears(model)
    names = list(linears) if names is None else names
    stats: dict[str, InputStats] = {}
    seen: list[tuple[torch.Tensor, InputStats]] = []  # this batch's inputs, held so ids stay unique
    handles = _stats_hooks({n: linears[n] for n in names}, stats, seen)
    try:
        for ids in tqdm(calib_ids.split(batch_size), desc="input statistics", unit="batch"):
            model.base_model(input_ids=ids.to(model.device), use_cache=False)
            seen.clear()
    finally:
        for h in handles:
            h.remove()
    return stats


@torch.no_grad()
def walk_input_stats(
    model: nn.Module, calib_ids: torch.Tensor, names: list[str], batch_size: int = 8
) -> Iterator[dict[str, InputStats]]:
    """collect_input_stats a decoder layer at a time (models.layerwise): yields each layer's statistics of its
    named linears, dropped when the caller moves on. The walk holds one layer's inputs for every batch and one
    layer's statistics, not the whole model's: an 8B model's float64 R_xx take ~65 GB together, ~2 GB a layer."""
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    wanted = set(names)
    inputs = capture_layer_inputs(model, list(calib_ids.split(batch_size)))
    for i, layer in enumerate(tqdm(layers, desc="input statistics", unit="layer")):
        linears = {f"{prefix}.{i}.{rel}": m for rel, m in layer_linears(layer).items()}
        stats: dict[str, InputStats] = {}
        seen: list[tuple[torch.Tensor, InputStats]] = []
        handles = _stats_hooks({n: m for n, m in linears.items() if n in wanted}, stats, seen)
        outputs = []
        try:
            for h, kw in inputs:
                y = layer(h, **kw)
                outputs.append(y[0] if isinstance(y, tuple) else y)
                seen.clear()
        finally:
            for handle in handles:
                handle.remove()
        inputs = LayerInputs(outputs, inputs.layer_kwargs, i + 1)
        yield stats
