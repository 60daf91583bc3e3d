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
                 kernels: bool = True, tune_rows: tuple[int, ...] | None = None,
                 factor_bits: int = 16) -> Transformer:
    """Random weights (~N(0, 1/in)) in the shapes of `args`, generated on `device`.

    With `quant`, every decoder linear is RTN-quantized to a SpearLinear; gated ECs
    (gate_hidden 8) of rank `rank` with random factors (stored in `factor_bits`) go on `ec_fraction` of them,
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
                lin.ec = _random_ec(lin.in_features, lin.out_features, rank, randn, factor_bits)
    if kernels:
        use_kernels(model, tune_rows=tune_rows)
    return model


def _random_ec(in_f: int, out_f: int, rank: int, randn, factor_bits: int = 16) -> ErrorCompensator:
    ec = ErrorCompensator(in_f, out_f, rank, gate_hidden=8, factor_bits=factor_bits)
    ec.A, ec.B = randn(rank, in_f, std=in_f**-0.5), randn(out_f, rank, std=0.01 * rank**-0.5)
    ec.alpha = nn.Parameter(torch.ones((), dtype=ec.A.dtype, device=ec.A.device), requires_grad=False)
    for layer in (ec.gate[0], ec.gate[2]):
        layer.weight = randn(*layer.weight.shape, std=layer.in_features**-0.5)
        layer.bias = randn(*layer.bias.shape, std=0.01)
    return ec


def hf_config(args: ModelArgs):
    """The transformers Llama config of a runtime shape (random artifacts carry it as any artifact does)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.intermediate,
                       num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                       num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
                       max_position_embeddings=args.max_seq_len, rope_theta=args.rope_theta,
                       rms_norm_eps=args.norm_eps, tie_word_embeddings=args.tie_embeddings, bos_token_id=1,
                       eos_token_id=2)


@torch.no_grad()
def write_random_artifact(args: ModelArgs, out_dir, ec_fraction: float = 0.0, rank: int = 32, seed: int = 0,
                          device: torch.device | str = "cpu", max_shard_bytes: int | None = None):
    """A W4 per-channel artifact of the shape `args` with random codes (every nibble uniform in 0..15, never all
    zeros), fp16 scales ~ in^-½ / 4, zero points 8, fp16 embeddings and LM head, and gated rank-`rank` ECs on
    `ec_fraction` of the linears, written straight to disk a decoder layer at a time: no float weights ever exist,
    so a 70B artifact (35 GB) is written in 35 GB of disk and one shard of host memory. What `spear serve` loads."""
    from pathlib import Path

    from spear.artifact import FORMAT, ArtifactInfo, artifact_config
    from spear.shards import DEFAULT_MAX_SHARD_BYTES, ShardWriter
    from spear.util import atomic_dir

    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * std).half()

    q_out, kv_out = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    shapes = {"self_attn.q_proj": (q_out, args.dim), "self_attn.k_proj": (kv_out, args.dim),
              "self_attn.v_proj": (kv_out, args.dim), "self_attn.o_proj": (args.dim, q_out),
              "mlp.gate_proj": (args.intermediate, args.dim), "mlp.up_proj": (args.intermediate, args.dim),
              "mlp.down_proj": (args.dim, args.intermediate)}
    n_linears = args.n_layers * len(shapes)
    quantized, ecs = {}, {}
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes or DEFAULT_MAX_SHARD_BYTES, metadata={"format": FORMAT})
        writer.add("model.embed_tokens.weight", randn(args.vocab, args.dim, std=1.0))
        for i in range(args.n_layers):
            prefix = f"model.layers.{i}"
            for norm in ("input_layernorm", "post_attention_layernorm"):
                writer.add(f"{prefix}.{norm}.weight", torch.ones(args.dim, dtype=torch.float16))
            for j, (name, (n, k)) in enumerate(shapes.items()):
                full = f"{prefix}.{name}"
                writer.add(f"{full}.codes", torch.randint(0, 256, (n, k // 2), generator=gen, device=device,
                                                          dtype=torch.uint8))
                writer.add(f"{full}.scales", (torch.rand(n, 1, generator=gen, device=device) + 0.5).half() * (k**-0.5 / 4))
                writer.add(f"{full}.zeros", torch.full((n, 1), 8, dtype=torch.uint8))
                quantized[full] = (4, k)
                index = i * len(shapes) + j
                if math.floor((index + 1) * ec_fraction) > math.floor(index * ec_fraction):
                    writer.add(f"{full}.ec.A", randn(rank, k, std=k**-0.5))
                    writer.add(f"{full}.ec.B", randn(n, rank, std=0.01 * rank**-0.5))
                    writer.add(f"{full}.ec.alpha", torch.ones((), dtype=torch.float16))
                    for g, (rows, cols) in ((0, (8, rank)), (2, (rank, 8))):
                        writer.add(f"{full}.ec.gate.{g}.weight", randn(rows, cols, std=cols**-0.5))
                        writer.add(f"{full}.ec.gate.{g}.bias", randn(rows, std=0.01))
                    ecs[full] = (rank, 8, 16)  # 16-bit factors
        writer.add("model.norm.weight", torch.ones(args.dim, dtype=torch.float16))
        if not args.tie_embeddings:
            writer.add("lm_head.weight", randn(args.vocab, args.dim, std=args.dim**-0.5))
        sha256 = writer.close()
        assert len(quantized) == n_linears
        tied = {"lm_head.weight": "model.embed_tokens.weight"} if args.tie_embeddings else {}
        info = ArtifactInfo("random", {"method": "random", "bits": 4, "group_size": -1})
        config = artifact_config(hf_config(args), info, quantized, ecs, tied, sha256)
        (tmp / "config.json").write_text(__import__("json").dumps(config, indent=2, default=str))
        byte_tokenizer().save_pretrained(tmp)
    return out_dir


def byte_tokenizer(vocab: int = 256):
    """A byte-level BPE tokenizer with no merges (every byte one token): random artifacts' tokenizer, no downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[:vocab]
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=alphabet[1], eos_token=alphabet[2])
