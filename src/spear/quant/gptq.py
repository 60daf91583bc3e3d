"""GPTQ (Frantar et al. 2023): quantize a weight column by column, spreading each
column's rounding error over the columns not yet quantized, weighted by the inverse
Hessian of the layer's inputs. Follows the IST-DASLab reference (`gptq.py`).

    H = 2/n Σ x xᵀ                           Hessian of ‖W X − Ŵ X‖² w.r.t. one row of W
    err_q = (w_q − quant(w_q)) / [H⁻¹]_qq      (eq. 2)
    W_:,F −= err_q [H⁻¹]_q,F                   (eq. 2, F = the columns not yet quantized)

with H⁻¹ read off the upper Cholesky factor of (H + λI)⁻¹ (Step 3) and the updates
applied lazily, one block of columns at a time (Step 2, eq. 4).

Grids: per-channel, the grid of each row is fitted once on the whole W. With groups,
the grid of each group is fitted on the *updated* weights when the sweep reaches the
group's first column (blocks are aligned to groups so those weights are final). With
act-order, columns are swept by descending diag(H); groups then stay the contiguous
original-order groups the record stores, with grids fitted up front on the original
weights (the reference's `static_groups`).

Act-order is QuantSettings' default. SmolLM2-135M W4 per-channel, 64x256 self-sampled
calibration, first 4 windows (WikiText-2 / PTB ppl): RTN 56.2 / 102.3, GPTQ 48.5 / 91.8,
GPTQ + act-order 42.8 / 77.0. Position 0 (the BOS attention sink, with massive activations:
up to 99.9% of tr H of layer 11's down_proj) must stay in H: dropping it gave 65.6 / 115.2.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.errors import SpearError
from spear.models.layerwise import (
    LayerInputs, capture_layer_inputs, decoder_layers, layer_linears, module_name, observe_inputs, run_layer,
)
from spear.quant.pipeline import QuantSettings, replace_with_quantized
from spear.record import QuantConfig, QuantizedWeight, fit_grid, quantize_to_codes

CALIB_BATCH = 8  # calibration sequences per forward pass


class Hessian:
    """Running H = 2/n Σ x xᵀ [in, in] (float32) over the rows x of a linear layer's inputs."""

    def __init__(self, columns: int, device: torch.device):
        self.H = torch.zeros(columns, columns, device=device, dtype=torch.float32)
        self.n = 0

    def add_batch(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [rows, in]
        rows = x.shape[0]
        self.H *= self.n / (self.n + rows)
        self.n += rows
        x = math.sqrt(2 / self.n) * x
        self.H += x.T @ x


def inverse_hessian_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + λI)⁻¹, λ = damp · mean(diag H) (Step 3).

    When H + λI is not positive definite, retry with a larger dampening before giving up."""
    if damp < 0:
        raise SpearError(f"GPTQ dampening must be >= 0, got {damp}")
    mean_diag = torch.diag(H).mean()
    eye = torch.eye(H.shape[0], device=H.device, dtype=H.dtype)
    damps = [damp] + [max(damp, 0.01) * 10**k for k in (1, 2, 3)]
    for d in damps:
        L, info = torch.linalg.cholesky_ex(H + d * mean_diag * eye)
        if info == 0:
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if info == 0:
                return U
    raise SpearError(
        f"GPTQ: the input Hessian is not positive definite even with dampening {damps[-1]:g}; "
        f"the calibration activations may hold inf/NaN, try other calibration data or RTN"
    )


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    H: torch.Tensor,
    cfg: QuantConfig,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    clip: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Quantize weight [out, in] given the Hessian H [in, in] of its inputs. `clip` [out]: each row's grid is
    fitted to its weights scaled by that factor (its range shrunk, the largest weights clipped); None: 1."""
    W = weight.detach().float().clone()
    out_f, in_f = W.shape
    g = cfg.group_size_for(in_f)
    H = H.to(W.device, torch.float32).clone()

    dead = torch.diag(H) == 0  # inputs that are always zero: their weights do not matter
    H[dead, dead] = 1
    W[:, dead] = 0

    scale = torch.zeros(out_f, in_f // g, device=W.device)
    zero = torch.zeros_like(scale)
    shrink = 1 if clip is None else clip.to(W.device, torch.float32)[:, None]
    static = act_order or g == in_f
    if static:
        for j in range(in_f // g):
            scale[:, j], zero[:, j] = fit_grid(shrink * W[:, j * g : (j + 1) * g], cfg)
    else:
        block_size = max(block_size // g, 1) * g  # each group inside one block

    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(in_f, device=W.device)
    W, H = W[:, perm], H[perm][:, perm]
    group = (perm // g).tolist()  # group of the column swept at each position

    Hinv = inverse_hessian_cholesky(H, damp)
    codes = torch.zeros_like(W)
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if not static and col % g == 0:
                scale[:, col // g], zero[:, col // g] = fit_grid(shrink * W1[:, i : i + g], cfg)
            s, z = scale[:, group[col]], zero[:, group[col]]
            w = W1[:, i]
            codes[:, col] = quantize_to_codes(w, s, z, cfg)
            q = (codes[:, col] - z) * s  # exactly what QuantizedWeight.dequantize gives
            err = (w - q) / Hinv1[i, i]  # eq. 2
            W1[:, i:] -= err[:, None] @ Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]  # lazy batch update (eq. 4)

    codes = codes[:, torch.argsort(perm)]
    return QuantizedWeight.from_float_codes(codes, scale, zero, cfg)


@torch.no_grad()
def gptq_quantize_model(
    model: nn.Module, settings: QuantSettings, calib_ids: torch.Tensor
) -> dict[str, QuantizedWeight]:
    """Quantize every decoder linear in place, layer by layer; each layer sees the outputs
    of the already-quantized layers before it. Returns the records by module name."""
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    inputs = capture_layer_inputs(model, list(calib_ids.split(CALIB_BATCH)))
    records = {}
    for i, layer in enumerate(tqdm(layers, desc="GPTQ", unit="layer")):
        records |= gptq_quantize_layer(layer, f"{prefix}.{i}", inputs, settings)
        inputs = run_layer(layer, inputs)
    return records


@torch.no_grad()
def gptq_quantize_layer(layer: nn.Module, name: str, inputs: LayerInputs, settings: QuantSettings
                        ) -> dict[str, QuantizedWeight]:
    """GPTQ on one decoder layer (`name`, its full name) in place: each linear's Hessian from `inputs`, the layer's
    inputs, and its nn.Linear replaced by a SpearLinear of the record. Returns the records by full name."""
    linears = layer_linears(layer)
    hessians = {n: Hessian(m.in_features, m.weight.device) for n, m in linears.items()}
    observe_inputs(layer, inputs, [(m, hessians[n].add_batch) for n, m in linears.items()])
    records = {}
    for n, m in linears.items():
        full = f"{name}.{n}"
        try:
            records[full] = gptq_quantize(m.weight, hessians.pop(n).H, settings.quant, settings.gptq_damp,
                                          settings.gptq_block_size, settings.gptq_act_order)
        except SpearError as e:
            raise SpearError(f"{full}: {e}") from None
        replace_with_quantized(layer, n, records[full])
    return records
