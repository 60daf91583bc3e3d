"""AWQ (Lin et al. 2024): activation-aware weight quantization. Follows the reference
(mit-han-lab/llm-awq, `auto_scale.py`, `auto_clip.py`).

Input channels with large activations matter most. For linears reading the same input x,
produced by a previous op (a norm or a linear), AWQ scales those channels up before
rounding and folds the inverse into the previous op, so the float model is unchanged:

    y = W x = (W diag(s)) (diag(s)⁻¹ x)   →   Q(W diag(s)) (x / s)

    s* = argmin_s ‖Q(W diag(s)) (diag(s)⁻¹ X) − W X‖          (eq. 4)
    s = mean|x|^α, normalised by sqrt(max s · min s)           (eq. 5; α on a grid in [0, 1))

α is chosen by the MSE of a module's outputs on the calibration activations, float vs
with Q(W diag(s)) diag(s)⁻¹ in place: the attention block for q/k/v, the MLP for
gate/up, the linear itself for o_proj and down_proj (as the reference). Then the clip
search: shrink each (row, group)'s max |w| by a ratio on a grid, chosen by the MSE of
that group's partial outputs (q/k are skipped, as in the reference). Finally the layer
is rounded to nearest, and its outputs feed the next layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.errors import SpearError
from spear.models.layerwise import (
    LayerInputs, capture_layer_inputs, decoder_layers, layer_linears, module_name, observe_inputs, run_layer,
)
from spear.quant.pipeline import QuantSettings, replace_with_quantized
from spear.record import QuantConfig, QuantizedWeight, rtn_quantize

CALIB_BATCH = 8  # calibration sequences per forward pass
CLIP_GRID = 20  # clip ratios 1, 0.95, ..., 0.55
CLIP_MAX_SHRINK = 0.5
CLIP_TOKENS = 512  # calibration tokens the clip search looks at (evenly spaced)

LLAMA_LINEARS = {f"self_attn.{p}_proj" for p in "qkvo"} | {f"mlp.{p}_proj" for p in ("gate", "up", "down")}
LLAMA_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


@dataclass
class ScaleGroup:
    """Linears reading one input, the op producing it, and the module whose output judges a scale."""

    prev: nn.Module  # norm or linear: its output channels are divided by s
    linears: list[nn.Linear]  # their input channels are multiplied by s
    inspect: nn.Module  # the search compares this module's outputs
    takes_kwargs: bool  # inspect is the attention block: it needs the layer's kwargs


def check_awq_layout(layer: nn.Module) -> None:
    """SpearError unless the layer has the Llama/Qwen2/Mistral modules AWQ scales (names only: works on meta)."""
    children = {name for name, _ in layer.named_children()}
    linears = set(layer_linears(layer))
    if children != LLAMA_CHILDREN or linears != LLAMA_LINEARS:
        raise SpearError(
            f"AWQ does not know the layer layout of {type(layer).__name__} "
            f"(modules: {', '.join(sorted(linears | children))}); use --method gptq or rtn"
        )


def scale_groups(layer: nn.Module) -> list[ScaleGroup]:
    """The layer's scale groups (Llama/Qwen2/Mistral layout), or SpearError for another layout."""
    check_awq_layout(layer)
    attn, mlp = layer.self_attn, layer.mlp
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if not _scales_with_weight(norm):
            raise SpearError(
                f"AWQ cannot fold scales into {type(norm).__name__}: its output is not proportional "
                f"to its weight; use --method gptq or rtn"
            )
    groups = [ScaleGroup(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], attn, True)]
    if attn.v_proj.out_features == attn.o_proj.in_features:  # not under grouped-query attention
        groups.append(ScaleGroup(attn.v_proj, [attn.o_proj], attn.o_proj, False))
    groups.append(ScaleGroup(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], mlp, False))
    groups.append(ScaleGroup(mlp.up_proj, [mlp.down_proj], mlp.down_proj, False))
    return groups


@torch.no_grad()
def _scales_with_weight(norm: nn.Module) -> bool:
    """Whether norm(x) doubles when its weight (and bias) double: true of RMSNorm/LayerNorm, not (1 + w) norms."""
    params = [p for p in (getattr(norm, "weight", None), getattr(norm, "bias", None)) if p is not None]
    if not params:
        return False
    x = torch.randn(2, params[0].shape[0], device=params[0].device, dtype=params[0].dtype)
    y = norm(x).float()
    for p in params:
        p.mul_(2)
    y2 = norm(x).float()
    for p in params:
        p.div_(2)
    return torch.allclose(y2, 2 * y, rtol=1e-2, atol=1e-3)


@torch.no_grad()
def fold_scale(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """prev's output channels /= s, the linears' input channels *= s: the float function is unchanged."""
    shape = (-1,) + (1,) * (prev.weight.dim() - 1)
    prev.weight.div_(s.view(shape).to(prev.weight.dtype))
    if getattr(prev, "bias", None) is not None:
        prev.bias.div_(s.to(prev.bias.dtype))
    for linear in linears:
        linear.weight.mul_(s.to(linear.weight.dtype))


@torch.no_grad()
def search_scale(
    group: ScaleGroup, xs: list[torch.Tensor], kwargs: list[dict], cfg: QuantConfig, n_grid: int
) -> torch.Tensor:
    """The per-input-channel scale s [in] with the lowest output MSE over α ∈ {0, 1/n, ..., (n-1)/n}."""
    x_mean = sum(x.reshape(-1, x.shape[-1]).abs().float().sum(0) for x in xs) / sum(x[..., 0].numel() for x in xs)

    def outputs() -> list[torch.Tensor]:
        out = [group.inspect(x, **kw) if group.takes_kwargs else group.inspect(x) for x, kw in zip(xs, kwargs)]
        return [y[0] if isinstance(y, tuple) else y for y in out]

    reference = outputs()
    originals = [linear.weight.clone() for linear in group.linears]
    best_err, best_s = float("inf"), None
    for i in range(n_grid):
        s = x_mean.pow(i / n_grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        for linear, W in zip(group.linears, originals):
            linear.weight.copy_(rtn_quantize(W.float() * s, cfg).dequantize() / s)
        err = sum((y.float() - r.float()).pow(2).sum().item() for y, r in zip(outputs(), reference))
        if err < best_err:
            best_err, best_s = err, s
    for linear, W in zip(group.linears, originals):
        linear.weight.copy_(W)
    return best_s


@torch.no_grad()
def search_clip(weight: torch.Tensor, xs: list[torch.Tensor], cfg: QuantConfig) -> torch.Tensor:
    """The clip value [out, groups] per (row, group) of weight [out, in], by MSE of the group's partial outputs."""
    out_f, in_f = weight.shape
    g = cfg.group_size_for(in_f)
    X = torch.cat([x.reshape(-1, in_f) for x in xs])
    X = X[:: max(1, X.shape[0] // CLIP_TOKENS)].float().reshape(-1, in_f // g, g)  # [T, G, g]
    Wg = weight.float().reshape(out_f, in_f // g, g)  # [out, G, g]
    best = Wg.abs().amax(-1)  # [out, G]
    rows = max(1, 2**26 // (X.shape[0] * X.shape[1]))  # keep [rows, T, G] near 256 MB
    for r in range(0, out_f, rows):
        W = Wg[r : r + rows]
        org_max = best[r : r + rows].clone()
        ref = torch.einsum("ogk,tgk->otg", W, X)
        min_err = torch.full_like(org_max, float("inf"))
        for i in range(int(CLIP_MAX_SHRINK * CLIP_GRID)):
            c = org_max * (1 - i / CLIP_GRID)
            Wc = torch.clamp(W, -c[..., None], c[..., None])
            Q = rtn_quantize(Wc.reshape(-1, in_f), cfg).dequantize().reshape(W.shape)
            err = (torch.einsum("ogk,tgk->otg", Q, X) - ref).pow(2).mean(1)  # [rows, G]
            better = err < min_err
            min_err[better] = err[better]
            best[r : r + rows][better] = c[better]
    return best


@torch.no_grad()
def awq_scale_layer(layer: nn.Module, inputs: LayerInputs, cfg: QuantConfig, n_grid: int, clip: bool = True) -> None:
    """Search and fold the AWQ scales of one decoder layer, then clip its weights; nothing is quantized."""
    groups = scale_groups(layer)
    feats: list[list[torch.Tensor]] = [[] for _ in groups]  # per group: its input, per batch
    observe_inputs(layer, inputs, [(group.linears[0], f.append) for group, f in zip(groups, feats)])

    for group, xs in zip(groups, feats):
        s = search_scale(group, xs, inputs.kwargs, cfg, n_grid)
        fold_scale(group.prev, group.linears, s)
        xs[:] = [x / s.to(x.dtype) for x in xs]

    if clip:
        skip = (layer.self_attn.q_proj, layer.self_attn.k_proj)  # q·k is hard to judge per linear
        for group, xs in zip(groups, feats):
            for linear in group.linears:
                if not any(linear is m for m in skip):
                    c = search_clip(linear.weight, xs, cfg)  # [out, G]
                    g = cfg.group_size_for(linear.in_features)
                    c = c.repeat_interleave(g, dim=1).to(linear.weight.dtype)
                    linear.weight.copy_(torch.clamp(linear.weight, -c, c))


@torch.no_grad()
def awq_quantize_model(
    model: nn.Module, settings: QuantSettings, calib_ids: torch.Tensor, clip: bool = True
) -> dict[str, QuantizedWeight]:
    """Quantize every decoder linear in place, layer by layer: AWQ scales (and clipping),
    then RTN. Norm weights change in place. Returns the records by module name."""
    layers = decoder_layers(model)
    for layer in layers:
        scale_groups(layer)  # fail before any work on an unknown layout
    prefix = module_name(model, layers)
    inputs = capture_layer_inputs(model, list(calib_ids.split(CALIB_BATCH)))
    records = {}
    for i, layer in enumerate(tqdm(layers, desc="AWQ", unit="layer")):
        records |= awq_quantize_layer(layer, f"{prefix}.{i}", inputs, settings, clip)
        inputs = run_layer(layer, inputs)
    return records


@torch.no_grad()
def awq_quantize_layer(layer: nn.Module, name: str, inputs: LayerInputs, settings: QuantSettings,
                       clip: bool = True) -> dict[str, QuantizedWeight]:
    """AWQ on one decoder layer (`name`, its full name) in place: its scales searched on `inputs` and folded (its
    norms change), its weights clipped, then each nn.Linear replaced by a SpearLinear of its RTN record. Returns
    the records by full name."""
    awq_scale_layer(layer, inputs, settings.quant, settings.awq_grid, clip)
    records = {}
    for n, m in layer_linears(layer).items():
        records[f"{name}.{n}"] = rtn_quantize(m.weight, settings.quant)
        replace_with_quantized(layer, n, records[f"{name}.{n}"])
    return records
