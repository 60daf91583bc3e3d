"""OmniQuant's learnable weight clipping (Shao et al. 2024, LWC), weight-only. Follows the reference
(OpenGVLab/OmniQuant, `quantize/omniquant.py`, `quantize/quantizer.py`) as `--wbits 4 --abits 16 --lwc` runs it.

Each (row, group) of a weight learns how far to clip its range before rounding (eq. 2):

    h = (γ max(W) − β min(W)) / (2^N − 1),   z = −⌊β min(W) / h⌉,   W_q = clamp(⌊W / h⌉ + z, 0, 2^N − 1)
    γ = σ(γ'), β = σ(β')        (symmetric grids: the range ±γ max|W|, β unused)

and γ', β' of one decoder layer F at a time are trained to match the float layer (eq. 1):

    min ‖F(W, X_fp) − F(Q(W; γ, β), X_q)‖²

with X_fp the float model's inputs to the layer and X_q the already-quantized layers' outputs, ⌊·⌉ passed through
by the straight-through estimator, AdamW at lr 1e-2 and γ' = β' = 4 at the start (σ(4) ≈ 0.98, as the reference).
Then W is clipped to its learned range and rounded by RTN (record.rtn_quantize): the record holds the grid that
RTN fits to the clipped weights, which is LWC's grid. LET (the learnable equivalent transformation) is the
reference's weight-activation half and is not used for weight-only quantization.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize
from tqdm.auto import tqdm

from spear.models.layerwise import (
    LayerInputs, capture_layer_inputs, decoder_layers, layer_linears, module_name, run_layer,
)
from spear.quant.pipeline import QuantSettings, replace_with_quantized
from spear.record import QuantConfig, QuantizedWeight, rtn_quantize

CALIB_BATCH = 8  # calibration sequences per forward pass (and per training step)
INIT_LOGIT = 4.0  # γ' = β' at the start: σ(4) ≈ 0.982, the reference's init


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """⌊x⌉ forward, identity backward."""
    return x + (torch.round(x) - x).detach()


class ClippedFakeQuant(nn.Module):
    """The parametrization W → Q(W; γ, β) of one linear's weight: eq. 2 dequantized, differentiable in γ', β'."""

    def __init__(self, weight: torch.Tensor, cfg: QuantConfig):
        super().__init__()
        out_f, in_f = weight.shape
        self.cfg, self.group = cfg, cfg.group_size_for(in_f)
        shape = (out_f * (in_f // self.group), 1)
        self.gamma_logit = nn.Parameter(torch.full(shape, INIT_LOGIT, device=weight.device))
        self.beta_logit = nn.Parameter(torch.full(shape, INIT_LOGIT, device=weight.device))

    def bounds(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The learned clip range (low, high) per (row, group) of w [rows·groups, g] (float32)."""
        gamma, beta = torch.sigmoid(self.gamma_logit), torch.sigmoid(self.beta_logit)
        if self.cfg.sym:
            high = gamma * w.abs().amax(1, keepdim=True)
            return -high, high
        return beta * w.amin(1, keepdim=True).clamp(max=0), gamma * w.amax(1, keepdim=True).clamp(min=0)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        w = weight.float().reshape(-1, self.group)
        low, high = self.bounds(w)
        if cfg.sym:  # record.fit_grid's symmetric grids, from the clipped max |w|
            half = 2 ** (cfg.bits - 1)
            h = high / (half - 1) if cfg.sym_grid == "absmax" else 2 * high / cfg.max_code
            z = torch.full_like(h, float(half))
        else:
            h = (high - low) / cfg.max_code
            z = _round_ste(-low / h.clamp(min=1e-12)).clamp(0, cfg.max_code)
        h = h.clamp(min=1e-12)
        q = torch.clamp(_round_ste(w / h) + z, 0, cfg.max_code)
        return ((q - z) * h).reshape(weight.shape).to(weight.dtype)

    @torch.no_grad()
    def clipped(self, weight: torch.Tensor) -> torch.Tensor:
        """W clamped to its learned range: what RTN then rounds."""
        w = weight.float().reshape(-1, self.group)
        low, high = self.bounds(w)
        return torch.minimum(torch.maximum(w, low), high).reshape(weight.shape).to(weight.dtype)


def _float32(value):
    """Floating tensors (in tuples, lists and dicts too) in float32: the layer trains in float32 whatever its dtype
    (a float16 attention mask beside float32 queries is refused by scaled_dot_product_attention)."""
    if torch.is_tensor(value):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_float32(v) for v in value)
    if isinstance(value, dict):
        return {k: _float32(v) for k, v in value.items()}
    return value


def train_layer_clipping(layer: nn.Module, q_inputs: LayerInputs, target: list[torch.Tensor], cfg: QuantConfig,
                         epochs: int, lr: float) -> dict[str, torch.Tensor]:
    """Learn the clip ranges of every linear of `layer` so that F(Q(W), X_q) matches `target` = F(W, X_fp) (eq. 1);
    returns the clipped float weights by name."""
    linears = layer_linears(layer)
    dtype = next(layer.parameters()).dtype
    layer.float()
    frozen = [(p, p.requires_grad) for p in layer.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    quants = {}
    try:
        for name, m in linears.items():
            quants[name] = ClippedFakeQuant(m.weight, cfg)
            parametrize.register_parametrization(m, "weight", quants[name])
        params = [p for q in quants.values() for p in q.parameters()]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        with torch.enable_grad():
            for _ in range(epochs):
                for (h, kw), y in zip(q_inputs, target):
                    out = layer(h.float(), **_float32(kw))
                    out = out[0] if isinstance(out, tuple) else out
                    loss = torch.nn.functional.mse_loss(out, y.float())
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
    finally:
        clipped = {}
        for name, m in linears.items():
            if name in quants:
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)
                clipped[name] = quants[name].clipped(m.weight)
        for p, requires in frozen:
            p.requires_grad_(requires)
        layer.to(dtype)
    return clipped


@torch.no_grad()
def omniquant_quantize_model(model: nn.Module, settings: QuantSettings, calib_ids: torch.Tensor) -> dict[str, QuantizedWeight]:
    """Quantize every decoder linear in place, layer by layer: learn each layer's clipping (LWC), then round.
    Returns the records by module name."""
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    fp_inputs = capture_layer_inputs(model, list(calib_ids.split(CALIB_BATCH)))
    q_inputs = fp_inputs
    records = {}
    for i, layer in enumerate(tqdm(layers, desc="OmniQuant LWC", unit="layer")):
        layer_records, fp_inputs, q_inputs = omniquant_quantize_layer(layer, f"{prefix}.{i}", fp_inputs, q_inputs,
                                                                      settings)
        records |= layer_records
    return records


@torch.no_grad()
def omniquant_quantize_layer(layer: nn.Module, name: str, fp_inputs: LayerInputs, q_inputs: LayerInputs,
                             settings: QuantSettings) -> tuple[dict[str, QuantizedWeight], LayerInputs, LayerInputs]:
    """OmniQuant's LWC on one decoder layer (`name`, its full name) in place: the float layer's outputs on the float
    inputs are the target, the clipping is learned on the quantized model's inputs, each nn.Linear is replaced by a
    SpearLinear of its RTN record of the clipped weight. Returns the records by full name and the next layer's
    float and quantized inputs."""
    fp_next = run_layer(layer, fp_inputs)  # F(W, X_fp): the target, and the next layer's float inputs
    clipped = train_layer_clipping(layer, q_inputs, fp_next.hidden, settings.quant, settings.omniquant_epochs,
                                   settings.omniquant_lr)
    records = {}
    for n in layer_linears(layer):
        records[f"{name}.{n}"] = rtn_quantize(clipped[n], settings.quant)
        replace_with_quantized(layer, n, records[f"{name}.{n}"])
    return records, fp_next, run_layer(layer, q_inputs)
