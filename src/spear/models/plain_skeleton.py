"""The skeleton of a served model in plain torch modules, under transformers' parameter names
(model.layers.N.self_attn.q_proj.weight, ...), for the families the serving runtime runs.

`spear serve` reads an artifact into this instead of transformers' own model classes, whose forward it never calls
(the runtime, runtime.model.build_runtime_model, reuses only their parameters): importing them (modeling_utils brings
torch._dynamo) takes ~140 MB of RSS alone, and a served 0.5B / 1.2B model idles 65 MB lower without them
(BENCHMARKS §8). The tensor names and shapes are transformers' for each family, checked by the artifact's strict
load (a name missing or left over is an error); tests compare the runtime built on it with transformers' logits.
"""

from __future__ import annotations

import torch
from torch import nn

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")


class Norm(nn.Module):
    """An RMSNorm's weight (the runtime computes the norm)."""

    def __init__(self, size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device="meta"))


class ScaledEmbedding(nn.Embedding):
    """Gemma's embedding: the looked-up rows times √hidden, rounded to the table's dtype first (as transformers'
    Gemma3TextScaledWordEmbedding)."""

    def __init__(self, vocab: int, dim: int, _weight: torch.Tensor):
        super().__init__(vocab, dim, _weight=_weight)
        self.register_buffer("embed_scale", torch.tensor(dim**0.5), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


def _linear(n_in: int, n_out: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias, dtype=dtype, device="meta")


QK_NORM_FAMILIES = ("qwen3", "gemma3_text")  # an RMSNorm over each head's q and k


def attention_sizes(config) -> tuple[int, int, int]:
    """(heads, key-value heads, head dim) of an HF config, with transformers' defaults where one is not given."""
    heads = config.num_attention_heads
    return (heads, getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads)


def qkv_bias(config) -> bool:
    """Whether q, k and v have biases: attention_bias, or always in Qwen2 (whose o has none)."""
    return bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"


def _attention(config, dtype: torch.dtype) -> nn.Module:
    family, dim = config.model_type, config.hidden_size
    heads, kv_heads, head_dim = attention_sizes(config)
    q, kv = heads * head_dim, kv_heads * head_dim
    bias = bool(getattr(config, "attention_bias", False))
    a = nn.Module()
    if family == "phi3":  # q|k|v as one linear
        a.qkv_proj = _linear(dim, q + 2 * kv, False, dtype)
    else:
        a.q_proj, a.k_proj, a.v_proj = (_linear(dim, n, qkv_bias(config), dtype) for n in (q, kv, kv))
    a.o_proj = _linear(q, dim, bias and family not in ("qwen2", "phi3"), dtype)
    if family in QK_NORM_FAMILIES:
        a.q_norm, a.k_norm = Norm(head_dim, dtype), Norm(head_dim, dtype)
    return a


def _mlp(config, dtype: torch.dtype) -> nn.Module:
    dim, inter = config.hidden_size, config.intermediate_size
    bias = bool(getattr(config, "mlp_bias", False))
    m = nn.Module()
    if config.model_type == "phi3":  # gate|up as one linear
        m.gate_up_proj = _linear(dim, 2 * inter, False, dtype)
    else:
        m.gate_proj, m.up_proj = _linear(dim, inter, bias, dtype), _linear(dim, inter, bias, dtype)
    m.down_proj = _linear(inter, dim, bias and config.model_type != "phi3", dtype)
    return m


def _layer(config, dtype: torch.dtype) -> nn.Module:
    layer = nn.Module()
    layer.self_attn, layer.mlp = _attention(config, dtype), _mlp(config, dtype)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.model_type == "gemma3_text":
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for name in norms:
        setattr(layer, name, Norm(config.hidden_size, dtype))
    return layer


class PlainCausalLM(nn.Module):
    """What the runtime and the engine read of a transformers causal LM: config, generation_config, model.embed_tokens,
    model.layers, model.norm, lm_head, device and dtype."""

    def __init__(self, config, dtype: torch.dtype):
        from transformers import GenerationConfig

        super().__init__()
        self.config = config
        self.generation_config = GenerationConfig.from_model_config(config)
        embed = ScaledEmbedding if config.model_type == "gemma3_text" else nn.Embedding
        self.model = nn.Module()
        table = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device="meta")
        self.model.embed_tokens = embed(config.vocab_size, config.hidden_size, _weight=table)  # _weight: no init
        self.model.layers = nn.ModuleList(_layer(config, dtype) for _ in range(config.num_hidden_layers))
        self.model.norm = Norm(config.hidden_size, dtype)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype)

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight


def plain_skeleton(config, dtype: torch.dtype) -> PlainCausalLM | None:
    """The plain skeleton of `config`'s model, its parameters on meta and tied where the config ties them; None for
    a family the runtime does not serve (transformers' skeleton then, and the runtime's own error)."""
    if config.model_type not in FAMILIES:
        return None
    model = PlainCausalLM(config, dtype)
    model.tie_weights()
    return model
