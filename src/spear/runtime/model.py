"""The runtime's compact Llama-family transformer (Llama, Mistral, Qwen2, Qwen3, SmolLM, Phi-3, Gemma 3) over the
paged KV cache.

Activations are flat over the step's tokens ([T, dim]), so the linear layers see only
real tokens; attention regroups them per sequence (kv_cache.paged_attention). Between the
linears run the fused ops of spear.kernels.ops (Triton on CUDA): add + RMSNorm, RoPE + KV
write, decode attention, SiLU * up. The residual stream is carried beside the sub-layers'
outputs, vLLM-style: each norm first adds the previous sub-layer's output to it.
`build_runtime_model` reuses a transformers model's modules (SpearLinear layers stay the
same objects, ECs included; float linears run as runtime.linear.DenseLinear over their own weights);
bench/fixtures.py builds one of a real shape with random weights. Every linear is a spear.layer.LinearMethod:
the model calls it and asks it what it can fold, never its type, so the kernel a linear runs (float, W4 + EC,
tensor-parallel) is its own choice. On CUDA, q/k/v and gate/up each run as one launch: a W4 launch once packed
for the kernels (FusedLinear), one cuBLAS GEMM over the stacked weights where they are float (FusedDenseLinear),
as gpt-fast's fp16 model does.

The families differ only where ModelArgs says, and each difference is chosen when the model is built, so a Llama
step runs nothing for the others: Phi-3's q|k|v and gate|up come as one linear each from the checkpoint
(runtime.linear.SplitLinear) and may rotate only part of each head (rotary_dim); Gemma 3 (GemmaBlock,
GeluFeedForward) norms by (1 + w), four times a layer, with GELU-tanh, its own softmax scale, sliding-window layers
with their own RoPE base (Attention.window, Attention.inv_freq) and optionally soft-capped logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from spear.errors import SpearError
from spear.kernels import options
from spear.kernels.norm_fold import FoldedNorm
from spear.kernels.ops import add_rms_norm, rope_write_kv, silu_mul
from spear.layer import LinearMethod, SpearLinear
from spear.models.plain_skeleton import FAMILIES, QK_NORM_FAMILIES, attention_sizes, qkv_bias
from spear.runtime.kv_cache import Batch, KVCache, paged_attention
from spear.runtime.linear import DenseLinear, FusedCPULinear, FusedDenseLinear, FusedLinear, SplitLinear
from spear.runtime.tables import hold_tables_compact

# The fusions kernels.options switches (options.OPTIONS), fuse_swiglu and fold_norm read once by fuse_projections
# into the W4 launches it builds (FusedLinear's capabilities):
# - fuse_swiglu: silu(gate) ⊙ up in the gate/up launch's epilogue (FusedLinear.swiglu) on the steps the W4 decode
#   kernel takes, one launch a layer fewer (Llama-2-7B W4 on the H200, ms/token at batch 1 / 8: 2.38 / 4.24 fused,
#   2.40 / 4.31 not). RoPE and the K/V write fused into the q/k/v launch's epilogue were slower at batch 1: removed.
# - fold_norm: the add + RMSNorm between o and gate/up, and between down and the next layer's q/k/v, folded into those
#   W4 decode launches (kernels.norm_fold.FoldedNorm): two launches a layer fewer.
# - fold_norm_tp: the same under tensor parallelism, into the row-parallel layers' p2p epilogue
#   (tp.RowParallelLinear.add_norm): exact on an H200 pair but level in time (±1.5% at TP 2), so off by default.
# - dense_kernels: a float model on CUDA stacks q/k/v and gate/up into one GEMM each (FusedDenseLinear) and runs
#   one-row steps through the fp16 GEMV kernel where it beats cuBLAS (DenseLinear); off, each linear alone on cuBLAS.
# The add + RMSNorm and SiLU·up folded into those one-row GEMVs were slower on the H200 and removed
# (bench/NOTES-kernels.md).

SUPPORTED = FAMILIES  # those that an artifact is served from in plain modules (models.plain_skeleton)
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # transformers' name -> ModelArgs.hidden_act


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    intermediate: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_layers: int
    vocab: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3" | "longrope", "factor": ..., ...}
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q, k, v have biases
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k, before RoPE
    max_seq_len: int = 4096
    rotary_dim: int | None = None  # Phi-3.5 / Phi-4-mini (partial_rotary_factor): RoPE on each head's first dims only
    rope_gain: float = 1.0  # LongRoPE's attention_factor: RoPE's cos and sin scaled by it (as transformers does)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    sliding_window: int | None = None  # a sliding layer's query sees the keys of its last `sliding_window` positions
    layer_types: tuple[str, ...] | None = None  # "sliding_attention" | "full_attention"; None: every layer slides
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' own RoPE base (unscaled)
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    gemma_norms: bool = False  # Gemma 3: RMSNorm by (1 + w); norms after attention and after the MLP too
    final_softcap: float | None = None  # Gemma: logits = c · tanh(logits / c)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to every earlier key)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_hf_config(cls, config) -> ModelArgs:
        model_type = getattr(config, "model_type", None)
        if model_type == "gemma3":
            raise SpearError("the serving runtime runs Gemma 3's text model (Gemma3ForCausalLM, model_type "
                             "gemma3_text), not the multimodal gemma3")
        if model_type not in SUPPORTED:
            raise SpearError(f"the serving runtime supports {', '.join(SUPPORTED)} models, not {model_type!r}")
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise SpearError(f"the serving runtime needs a SwiGLU or GELU-tanh MLP ({', '.join(ACTIVATIONS)}), got {act!r}")
        for what in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if getattr(config, what, None):
                raise SpearError(f"the serving runtime does not run {what} (set in this {model_type} config)")
        heads, kv_heads, head_dim = attention_sizes(config)
        max_len = config.max_position_embeddings
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        local = None
        if "full_attention" in rope:  # Gemma 3: RoPE parameters per layer type
            rope, local = rope["full_attention"], rope.get("sliding_attention") or {}
        rope = dict(rope)
        theta = rope.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
        rotary_dim = int(head_dim * rope.pop("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        rope_type, gain = rope.get("rope_type", rope.get("type", "default")), 1.0
        if rope_type not in ROPE_TYPES:
            raise SpearError(f"RoPE type {rope_type!r} is not supported by the serving runtime ({', '.join(ROPE_TYPES)})")
        if local is not None and local.get("rope_type", "default") != "default":
            raise SpearError(f"the serving runtime's sliding layers take default RoPE, not {local['rope_type']!r}")
        scale = getattr(config, "query_pre_attn_scalar", None)
        scale = None if scale is None else scale**-0.5
        if rope_type == "longrope":  # Phi-3's LongRoPE: within the original context, short_factor's frequencies
            original = rope.get("original_max_position_embeddings") or config.original_max_position_embeddings
            rope["original_max_position_embeddings"], max_len = original, min(max_len, original)
            factor = rope.get("factor") or config.max_position_embeddings / original
            gain = rope.get("attention_factor") or (math.sqrt(1 + math.log(factor) / math.log(original))
                                                    if factor > 1 else 1.0)
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        layer_types = getattr(config, "layer_types", None)
        return cls(
            dim=config.hidden_size, intermediate=config.intermediate_size, n_heads=heads,
            n_kv_heads=kv_heads, head_dim=head_dim,
            n_layers=config.num_hidden_layers, vocab=config.vocab_size, norm_eps=config.rms_norm_eps,
            rope_theta=float(theta), rope_scaling=rope if rope_type != "default" else None,
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=qkv_bias(config),
            qk_norm=model_type in QK_NORM_FAMILIES, max_seq_len=max_len,
            rotary_dim=rotary_dim if rotary_dim < head_dim else None, rope_gain=gain, attn_scale=scale,
            # a window as long as the context changes nothing: none
            sliding_window=window if window is not None and window < max_len else None,
            layer_types=None if layer_types is None else tuple(layer_types),
            rope_local_theta=None if local is None else float(local.get("rope_theta", 10000.0)),
            hidden_act=ACTIVATIONS[act], gemma_norms=model_type == "gemma3_text",
            final_softcap=getattr(config, "final_logit_softcapping", None),
        )


def rope_inv_freq(args: ModelArgs, local: bool = False) -> torch.Tensor:
    """[rotary_dim / 2] float32 inverse frequencies, with linear, llama3 or LongRoPE scaling; `local`: the sliding
    layers' own (args.rope_local_theta, unscaled)."""
    dim = args.rotary_dim or args.head_dim
    theta = args.rope_local_theta if local else args.rope_theta
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    scaling = None if local else args.rope_scaling
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "longrope":  # the context is capped at the original one (ModelArgs), where short_factor applies
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float)
    if kind == "llama3":  # Llama 3.1: keep high frequencies, divide low ones by factor, interpolate between
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Holds RoPE's inverse frequencies (a buffer, so it follows the model's device); ops.rope_write_kv
    rotates by them."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)


class RMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h), h) with h = x + residual (x without one): the normed input and the new residual stream."""
        return add_rms_norm(x, self.weight, self.eps, residual)


def _folds_norm(producer: LinearMethod, consumer: LinearMethod | None, x: torch.Tensor) -> bool:
    """Whether the add + RMSNorm after `producer` (on the step x) folds into its launch (producer.add_norm) and the
    consumer's (kernels.norm_fold.FoldedNorm)."""
    return consumer is not None and consumer.takes_folded_norm(x) and producer.folds_norm(x.shape[0])


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, wq: nn.Module | None, wk: nn.Module | None, wv: nn.Module | None,
                 wo: nn.Module, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                 window: int | None = None, inv_freq: torch.Tensor | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.q_norm, self.k_norm = q_norm, k_norm  # Qwen3's and Gemma 3's per-head norms (args.qk_norm), else None
        # set by fuse_projections, or at build time where the checkpoint has q|k|v as one linear (a SplitLinear)
        self.wqkv: LinearMethod | None = None
        self.window, self.scale = window, args.attn_scale  # a sliding layer's window; the softmax scale (None: D^-½)
        # RoPE by its own frequencies (Gemma 3's sliding layers, unscaled), else by the model's (project's inv_freq)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_gain = args.rope_gain if inv_freq is None else 1.0

    def project(self, x: torch.Tensor | FoldedNorm, inv_freq: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The rotated queries [T, H, D]; the tokens' keys (rotated) and values land in the cache at `slots`.
        `cos_sin`: RoPE's angles where the step holds them (rope_cos_sin)."""
        if self.inv_freq is not None:
            inv_freq = self.inv_freq
        if isinstance(x, FoldedNorm):  # this layer's attention norm, folded into the launch before (Block)
            T = x.h.shape[0]
            q, k, v = self.wqkv(x.hw, rms=x)
        else:
            T = x.shape[0]
            q, k, v = self.wqkv(x) if self.wqkv is not None else (self.wq(x), self.wk(x), self.wv(x))
        q = q.reshape(T, self.n_heads, self.head_dim)  # [T, H, D]
        k = k.reshape(T, self.n_kv_heads, self.head_dim)  # [T, KV, D]
        v = v.view(T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:  # each head's q and k normed over D, before RoPE
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view(k.shape)
        return rope_write_kv(q, k, v, positions, inv_freq, *kv, slots, gain=self.rope_gain, cos_sin=cos_sin)

    def rope_cos_sin(self, inv_freq: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """On a CPU, this layer's RoPE angles for the step, built once for every layer that shares them
        (Batch.rope_cos_sin); None on CUDA, where the kernel computes them."""
        if batch.positions.is_cuda:
            return None
        return batch.rope_cos_sin(inv_freq if self.inv_freq is None else self.inv_freq, self.rope_gain)

    def attend(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], batch: Batch) -> torch.Tensor:
        """The rotated queries [T, H, D] over their sequences' cached keys and values -> [T, H * D]."""
        return paged_attention(q, *kv, batch, self.scale, self.window).reshape(q.shape[0], -1)


class FeedForward(nn.Module):
    def __init__(self, w_gate: nn.Module, w_up: nn.Module, w_down: nn.Module):
        super().__init__()
        self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down
        self.w_gate_up: LinearMethod | None = None  # set by fuse_projections

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w_gate_up
        if gate_up is not None and gate_up.fuses_swiglu(x):
            return self.w_down(gate_up.swiglu(x))
        return self.w_down(silu_mul(*self.gate_up(x)))

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w_gate_up(x) if self.w_gate_up is not None else (self.w_gate(x), self.w_up(x))


class GeluFeedForward(FeedForward):
    """Gemma's GeGLU: w_down(gelu_tanh(gate) ⊙ up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.w_down(F.gelu(gate, approximate="tanh") * up)


class Block(nn.Module):
    def __init__(self, attention: Attention, feed_forward: FeedForward, attention_norm: RMSNorm, ffn_norm: RMSNorm):
        super().__init__()
        self.attention, self.feed_forward = attention, feed_forward
        self.attention_norm, self.ffn_norm = attention_norm, ffn_norm

    def forward(self, x: torch.Tensor | FoldedNorm, residual: torch.Tensor | None, inv_freq: torch.Tensor,
                batch: Batch, kv: tuple[torch.Tensor, torch.Tensor],
                next_block: Block | None = None) -> tuple[torch.Tensor | FoldedNorm, torch.Tensor]:
        """(x, residual) -> (this block's FFN output, the residual stream before it); their sum is the
        block's output, formed by the next norm. The first block gets residual None (x is the stream).
        On decode steps the next block's attention norm may be folded into this block's down launch: the
        output is then that norm's FoldedNorm (and the residual its h)."""
        q, residual = self.before_attention(x, residual, inv_freq, batch.positions, batch.slots, kv,  # residual += x
                                            self.attention.rope_cos_sin(inv_freq, batch))
        return self.after_attention(self.attention.attend(q, kv, batch), residual, next_block)

    # The block in two pieces around attention (runner.MixedStepGraphs captures the pieces in CUDA graphs).
    def before_attention(self, x: torch.Tensor, residual: torch.Tensor | None, inv_freq: torch.Tensor,
                         positions: torch.Tensor, slots: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                         cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (rotated queries [T, H, D], residual); this block's keys and values are cached."""
        if isinstance(x, FoldedNorm):  # the norm is done: x.h is the stream
            return self.attention.project(x, inv_freq, positions, slots, kv, cos_sin), x.h
        h, residual = self.attention_norm(x, residual)
        return self.attention.project(h, inv_freq, positions, slots, kv, cos_sin), residual

    def after_attention(self, attn: torch.Tensor, residual: torch.Tensor,
                        next_block: Block | None = None) -> tuple[torch.Tensor | FoldedNorm, torch.Tensor]:
        """(attention output [T, H * D], residual) -> (FFN output, residual), as forward returns them."""
        ff = self.feed_forward
        gate_up = ff.w_gate_up
        # o -> norm -> gate/up, folded into the W4 decode launches
        if gate_up is not None and gate_up.fuses_swiglu(attn) and _folds_norm(self.attention.wo, gate_up, attn):
            normed = self.attention.wo.add_norm(attn, residual, self.ffn_norm.weight, self.ffn_norm.eps)
            act = gate_up.swiglu(normed.hw, rms=normed)
            if next_block is not None and _folds_norm(ff.w_down, next_block.attention.wqkv, act):
                norm = next_block.attention_norm
                return ff.w_down.add_norm(act, normed.h, norm.weight, norm.eps), normed.h
            return ff.w_down(act), normed.h
        h, residual = self.ffn_norm(self.attention.wo(attn), residual)
        return ff(h), residual


class GemmaBlock(Block):
    """Gemma 3's layer: besides the norms before attention and the MLP, one after each, on the sub-layer's output
    before it joins the residual stream. Nothing folds into the W4 launches here (the order differs)."""

    def __init__(self, attention: Attention, feed_forward: FeedForward, attention_norm: RMSNorm, ffn_norm: RMSNorm,
                 post_attention_norm: RMSNorm, post_ffn_norm: RMSNorm):
        super().__init__(attention, feed_forward, attention_norm, ffn_norm)
        self.post_attention_norm, self.post_ffn_norm = post_attention_norm, post_ffn_norm

    def after_attention(self, attn: torch.Tensor, residual: torch.Tensor,
                        next_block: Block | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out, _ = self.post_attention_norm(self.attention.wo(attn))
        h, residual = self.ffn_norm(out, residual)
        return self.post_ffn_norm(self.feed_forward(h))[0], residual


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, embed: nn.Embedding, layers: list[Block], norm: RMSNorm, head: nn.Module):
        super().__init__()
        self.args = args
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.head = head
        self.rope = RotaryEmbedding(args).to(embed.weight.device)
        self._dtype = embed.weight.dtype  # what it computes in, whatever its tables are held in (hold_tables_compact)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(self, batch: Batch, cache: KVCache) -> torch.Tensor:
        """Logits [B, vocab] at each sequence's last new token; the chunks' K/V land in the cache."""
        x = self.embed(batch.tokens)  # [T, dim]
        residual = None
        for i, layer in enumerate(self.layers):
            next_block = self.layers[i + 1] if i + 1 < len(self.layers) else None
            x, residual = layer(x, residual, self.rope.inv_freq, batch, cache.layer(i), next_block)
        return self.logits(x, residual, batch.last_index)

    def logits(self, x: torch.Tensor, residual: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
        """[B, vocab] at the rows `last_index` of the last block's (x, residual)."""
        h, _ = self.norm(x[last_index], residual[last_index])  # the last FFN's add, fused into the final norm
        if self.args.final_softcap is None:
            return self.head(h)
        return self.args.final_softcap * torch.tanh(self.head(h) / self.args.final_softcap)


def build_runtime_model(hf_model: nn.Module, kernels: bool = True, tune: bool = True) -> Transformer:
    """The runtime model over a transformers Llama-family model's own modules and tensors (Gemma's norms excepted:
    the runtime holds their 1 + w).

    With `kernels` (on CUDA) the 4-bit linears are packed for the Triton kernels, their configs timed with `tune`
    (use_kernels); pass False to shard the model (tp.apply_tp) first."""
    args = ModelArgs.from_hf_config(hf_model.config)
    base = hf_model.model
    D = args.head_dim
    if base.norm.weight.is_cuda and D < 16:  # kernels.ops.paged_decode_attention's dot tiles
        raise SpearError(f"the CUDA attention kernel needs a head_dim of at least 16; this model's is {D}")

    def norm(module: nn.Module) -> RMSNorm:
        if not args.gemma_norms:
            return RMSNorm(module.weight, args.norm_eps)
        one_plus = (1 + module.weight.detach().float()).to(module.weight.dtype)  # Gemma: x̂ · (1 + w)
        return RMSNorm(nn.Parameter(one_plus, requires_grad=False), args.norm_eps)

    local_inv_freq = None if args.rope_local_theta is None else rope_inv_freq(args, local=True).to(base.norm.weight.device)
    layers = []
    for i, layer in enumerate(base.layers):
        a, m = layer.self_attn, layer.mlp
        window = args.window(i)
        attention = Attention(args, *(_linear_method(getattr(a, name)) if hasattr(a, name) else None
                                      for name in ("q_proj", "k_proj", "v_proj")),
                              _linear_method(a.o_proj), *((norm(a.q_norm), norm(a.k_norm)) if args.qk_norm else ()),
                              window=window, inv_freq=None if window is None else local_inv_freq)
        if hasattr(a, "qkv_proj"):  # Phi-3: q|k|v as one linear in the checkpoint
            q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
            attention.wqkv = SplitLinear(_linear_method(a.qkv_proj), [q, kv, kv])
        ffn_class = GeluFeedForward if args.hidden_act == "gelu_tanh" else FeedForward
        ffn = ffn_class(*(_linear_method(getattr(m, name)) if hasattr(m, name) else None
                          for name in ("gate_proj", "up_proj", "down_proj")))
        if hasattr(m, "gate_up_proj"):  # Phi-3: gate|up as one linear
            ffn.w_gate_up = SplitLinear(_linear_method(m.gate_up_proj), [args.intermediate] * 2)
        if args.gemma_norms:
            layers.append(GemmaBlock(attention, ffn, norm(layer.input_layernorm), norm(layer.pre_feedforward_layernorm),
                                     norm(layer.post_attention_layernorm), norm(layer.post_feedforward_layernorm)))
        else:
            layers.append(Block(attention, ffn, norm(layer.input_layernorm), norm(layer.post_attention_layernorm)))
    # Gemma's embedding module scales by √dim itself (transformers' Gemma3TextScaledWordEmbedding)
    model = Transformer(args, base.embed_tokens, layers, norm(base.norm), _linear_method(hf_model.lm_head))
    if kernels:
        use_kernels(model, tune=tune)
    return model


def _linear_method(linear: nn.Module) -> LinearMethod:
    """A transformers model's linear as the runtime runs it: a SpearLinear as it is, a float nn.Linear as a
    DenseLinear over the same parameters."""
    return linear if isinstance(linear, LinearMethod) else DenseLinear(linear.weight, linear.bias)


def _fused_parts(module: nn.Module) -> list[nn.Module]:
    """The linears a fused launch replaced in this Attention or FeedForward (none otherwise)."""
    if isinstance(module, Attention) and module.wqkv is not None:
        return [module.wq, module.wk, module.wv]
    if isinstance(module, FeedForward) and module.w_gate_up is not None:
        return [module.w_gate, module.w_up]
    return []


def fuse_projections(model: Transformer, dense: bool = True) -> int:
    """Run each layer's q/k/v as one launch (attention.wqkv) and gate/up as another (feed_forward.w_gate_up) where
    the parts' stack_keys are equal: one W4 launch over packed parts, on a CPU one int4 matmul over int4-packed ones
    (FusedCPULinear), with `dense` one GEMM over float ones; returns how many fusions. The separate modules stay
    (their weights become views of the fused one). A checkpoint's own fused linear (a SplitLinear: Phi-3) becomes
    the same launch over its one part."""

    def fused(parts: list[LinearMethod], sizes: list[int] | None = None, swiglu: bool = False) -> LinearMethod | None:
        key = parts[0].stack_key()
        if key is None or any(m.stack_key() != key for m in parts[1:]):
            return None
        if key[0] == "w4":  # options read once here: the launch's epilogue fusions
            o = options.OPTIONS
            return FusedLinear(parts, sizes, fuse_swiglu=swiglu and o.fuse_swiglu, fold_norm=o.fold_norm)
        if key[0] == "cpu_w4":
            return FusedCPULinear(parts, sizes)
        return FusedDenseLinear(parts, sizes) if dense else None

    def fuse(current: LinearMethod | None, parts: list[LinearMethod], swiglu: bool = False) -> LinearMethod | None:
        if isinstance(current, SplitLinear):
            return fused([current.linear], current.sizes, swiglu)
        return fused(parts, swiglu=swiglu) if current is None else None

    swiglu = model.args.hidden_act == "silu"  # not Gemma's GeGLU
    count = 0
    for layer in model.layers:
        a, f = layer.attention, layer.feed_forward
        if (qkv := fuse(a.wqkv, [a.wq, a.wk, a.wv])) is not None:
            a.wqkv, count = qkv, count + 1
        if (gate_up := fuse(f.w_gate_up, [f.w_gate, f.w_up], swiglu)) is not None:
            f.w_gate_up, count = gate_up, count + 1
    return count


def use_kernels(model: nn.Module, tune: bool = True, fuse: bool = True,
                tune_rows: tuple[int, ...] | None = None) -> int:
    """Turn the model's 4-bit linears into what serving reads (vLLM's process_weights_after_loading): on CUDA in
    fp16 packed for the Triton W4A16 kernels, on a CPU for PyTorch's int4 kernel and the scratch path
    (SpearLinear.use_cpu_kernels; options' cpu_w4), then every SpearLinear keeps only what its forward reads
    (SpearLinear.release_for_serving: no record, no dense copy beside a packing); returns how many were packed.
    With `fuse` (a Transformer), q/k/v and gate/up become one launch each (fuse_projections): on CUDA float ones
    too, on a CPU the int4-packed ones. With `tune`, time the decode kernel's configs once per distinct weight shape
    and row bucket, fused ones included, and at one row once more per shape and EC rank with the EC (kernels.w4.tune_w4; on a fresh
    machine every candidate is compiled first, in parallel processes: kernels.w4.precompile, 35 s at 8B on an H100). `tune_rows`: only these row counts' buckets
    (default tune_w4's, 1 to 128 rows: kernels.w4.decode_tune_rows gives a decode benchmark's)."""
    linears = [m for m in model.modules() if isinstance(m, SpearLinear) and m.codes is not None]
    packed = []
    if linears and linears[0].scales.is_cuda and linears[0].dtype == torch.float16:
        packed = [m for m in linears if m.use_kernels(drop_dense=True)]  # each released as soon as it is packed
    elif linears and not linears[0].scales.is_cuda and options.OPTIONS.cpu_w4:
        from spear.kernels.cpu_w4 import scratch_for

        scratch = scratch_for([(m.out_features, m.in_features) for m in linears])
        for m in linears:
            m.use_cpu_kernels(scratch)
            m.release_for_serving()  # each released as soon as it is packed, as on CUDA
        if fuse and isinstance(model, Transformer):  # q/k/v and gate/up: one int4 matmul each
            fuse_projections(model, dense=False)
    for m in linears:
        m.release_for_serving()
    if isinstance(model, Transformer) and model.device.type == "cpu" and model.dtype == torch.float32:
        hold_tables_compact(model)  # the embedding and LM head in int8 blocks or 16 bits where that is exact
    if isinstance(model, Transformer) and model.device.type == "cuda":
        # float linears too (on CPU each runs alone through F.linear)
        if fuse:
            fuse_projections(model, dense=options.OPTIONS.dense_kernels)
        if options.OPTIONS.dense_kernels:
            use_dense_kernels(model, tune)
    if not packed:
        return 0
    if tune:
        from spear.kernels.w4 import TUNE_ROWS, tune_w4, untuned_buckets
        from spear.kernels.w4.precompile import compile_job, precompile_w4

        parts = {id(p) for m in model.modules() for p in _fused_parts(m)}  # they no longer launch on their own
        launchers = [m for m in model.modules()
                     if isinstance(m, LinearMethod) and m.packed is not None and id(m) not in parts]
        shapes = {(m.packed.out_features, m.packed.in_features, m.packed.group_size): m.packed for m in launchers}
        with_ec = {}
        for m in launchers:
            if m.packed_ec is not None:
                w, ec = m.packed, m.packed_ec
                with_ec[w.out_features, w.in_features, w.group_size, ec.padded_rank, ec.int8] = (w, ec)
        # W4 at every row bucket, then W4+EC at one row (batch-1 decode: its own pick, kernels.w4._tune_key);
        # seconds a shape on a fresh machine, nothing where the tuning cache has them
        jobs = [(w, tune_rows or TUNE_ROWS, None) for w in shapes.values()]
        jobs += [(w, (1,), ec) for w, ec in with_ec.values()]
        # a fresh machine: every candidate compiled first, in parallel processes (kernels.w4.precompile)
        precompile_w4([compile_job(w, untuned_buckets(w, ms, ec), ec) for w, ms, ec in jobs])
        for w, ms, ec in tqdm(jobs, desc="tuning the W4 kernels", unit="shape", leave=False):
            tune_w4(w, ms, ec=ec)
    return len(packed)


def use_dense_kernels(model: Transformer, tune: bool = True) -> int:
    """With `tune`, time the fp16 GEMV kernel against cuBLAS once per fp16 weight shape of a CUDA model's float decoder
    launches (q/k/v and gate/up once fused, o, down: DenseLinear, which then picks the faster one at one row;
    kernels.f16_gemv.tune_gemv); returns how many float decoder launches there are."""
    launches = [m for layer in model.layers for m in (layer.attention.wqkv, layer.attention.wo,
                                                      layer.feed_forward.w_gate_up, layer.feed_forward.w_down)
                if isinstance(m, DenseLinear)]
    weights = {}  # one per shape: every layer's o has the same, and tune_gemv keys by shape
    for m in launches:
        if m.weight.dtype == torch.float16 and m.weight.is_cuda:
            weights.setdefault(tuple(m.weight.shape), m)
    if tune and weights:
        from spear.kernels.f16_gemv import tune_gemv

        for m in tqdm(weights.values(), desc="tuning the fp16 GEMV", unit="shape", leave=False):
            tune_gemv(m.weight, m.bias)
    return len(launches)


def held_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of every tensor `model` holds, each storage counted once, by kind: "packed" (a kernel's packing: the
    W4 kernels' codes, scales, zeros and packed ECs on CUDA; the CPU int4 kernel's, the nibble codes, the shared
    scratch and the float32 ECs (ServedEC) on a CPU), "codes" (records' packed codes, scales, zeros: what a layer
    keeps until release_for_serving), "dense" (dequantized copies of 4-bit weights), and "other" (embeddings,
    norms, float linears, EC modules, RoPE tables). A served linear holds its packing, or a dense copy where no
    kernel applies, never both, and no "codes"; its EC once, as its forward reads it (no EC module beside a
    packed one)."""
    seen: set[int] = set()
    held = {"packed": 0, "codes": 0, "dense": 0, "other": 0}

    def count(kind: str, tensor: torch.Tensor | None) -> None:
        if tensor is None or tensor.is_meta or tensor.numel() == 0:
            return
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            held[kind] += tensor.untyped_storage().nbytes()

    for module in model.modules():
        for packing in (getattr(module, n, None) for n in ("packed", "packed_ec", "cpu_w4", "cpu_nibbles",
                                                            "cpu_scratch", "cpu_ec")):
            for value in ([] if packing is None else vars(packing).values()):
                for tensor in value if isinstance(value, tuple) else (value,):  # ServedEC's gate: a tuple
                    if isinstance(tensor, torch.Tensor):
                        count("packed", tensor)
        for name, buffer in module.named_buffers(recurse=False):
            kind = {"codes": "codes", "scales": "codes", "zeros": "codes", "g_idx": "codes", "offsets": "codes",
                    "weight_hat": "dense"}.get(name, "other") if isinstance(module, SpearLinear) else "other"
            count(kind, buffer)
        for param in module.parameters(recurse=False):
            count("other", param)
    return held
