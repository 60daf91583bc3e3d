"""Benchmark and test fixtures: runtime models of a real shape with random weights (no checkpoint needed).

Imported by the bench scripts (bench/ is their sys.path) and by the tests (which put bench/ on it).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from spear.layer import ErrorCompensator, SpearLinear
from spear.record import QuantConfig, rtn_quantize
from spear.runtime.linear import DenseLinear
from spear.runtime.model import Attention, Block, FeedForward, ModelArgs, RMSNorm, Transformer, use_kernels


@torch.no_grad()
def random_model(args: ModelArgs, quant: QuantConfig | None = None, ec_fraction: float = 0.0, rank: int = 32,
                 dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu", seed: int = 0,
                 kernels: bool = True, tune_rows: tuple[int, ...] | None = None) -> Transformer:
    """Random weights (~N(0, 1/in)) in the shapes of `args`, generated on `device`.

    With `quant`, every decoder linear is RTN-quantized to a SpearLinear; gated ECs
    (gate_hidden 8) of rank `rank` with random factors go on `ec_fraction` of them,
    spread evenly over the depth. With `kernels` (on CUDA) the 4-bit linears are packed for the
    Triton kernels and their dense copies freed (their configs tuned at `tune_rows`, use_kernels); pass False to
    shard the model (tp.apply_tp) first.
    """
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape: int, std: float) -> nn.Parameter:
        return nn.Parameter(torch.randn(shape, generator=gen, device=device, dtype=dtype) * std, requires_grad=False)

    def float_linear(in_f: int, out_f: int, bias: bool = False) -> DenseLinear:
        return DenseLinear(randn(out_f, in_f, std=in_f**-0.5), randn(out_f, std=0.02) if bias else None)

    def linear(in_f: int, out_f: int, bias: bool = False) -> DenseLinear | SpearLinear:
        lin = float_linear(in_f, out_f, bias)
        return lin if quant is None else SpearLinear(rtn_quantize(lin.weight, quant), lin.bias, dtype)

    def norm() -> RMSNorm:
        return RMSNorm(nn.Parameter(torch.ones(args.dim, device=device, dtype=dtype), requires_grad=False), args.norm_eps)

    q_out, kv_out = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    layers = []
    for _ in range(args.n_layers):
        attention = Attention(args, linear(args.dim, q_out, args.attention_bias), linear(args.dim, kv_out, args.attention_bias),
                              linear(args.dim, kv_out, args.attention_bias), linear(q_out, args.dim))
        ffn = FeedForward(linear(args.dim, args.intermediate), linear(args.dim, args.intermediate),
                          linear(args.intermediate, args.dim))
        layers.append(Block(attention, ffn, norm(), norm()))

    embed = nn.Embedding(args.vocab, args.dim, _weight=randn(args.vocab, args.dim, std=1.0), _freeze=True)
    head = float_linear(args.dim, args.vocab)
    if args.tie_embeddings:
        head.weight = embed.weight
    model = Transformer(args, embed, layers, norm(), head).eval()
    if quant is not None and ec_fraction > 0:
        spear_linears = [m for m in model.modules() if isinstance(m, SpearLinear)]
        for i, lin in enumerate(spear_linears):
            if math.floor((i + 1) * ec_fraction) > math.floor(i * ec_fraction):  # evenly spread, floor(n * fraction) in all
                lin.ec = _random_ec(lin.in_features, lin.out_features, rank, randn)
    if kernels:
        use_kernels(model, tune_rows=tune_rows)
    return model


def _random_ec(in_f: int, out_f: int, rank: int, randn) -> ErrorCompensator:
    ec = ErrorCompensator(in_f, out_f, rank, gate_hidden=8)
    ec.A, ec.B = randn(rank, in_f, std=in_f**-0.5), randn(out_f, rank, std=0.01 * rank**-0.5)
    ec.alpha = nn.Parameter(torch.ones((), dtype=ec.A.dtype, device=ec.A.device), requires_grad=False)
    for layer in (ec.gate[0], ec.gate[2]):
        layer.weight = randn(*layer.weight.shape, std=layer.in_features**-0.5)
        layer.bias = randn(*layer.bias.shape, std=0.01)
    return ec
