"""What a KL step's backward keeps of each decoder layer (issue 50: `spear compensate`'s estimate read ~20% over at
8B), counted from autograd's saved tensors, against the count precision.compensate_bytes makes.

    python bench/activation_bytes.py --shapes smollm2 llama3.2-1b llama3-8b \
        --json bench/results/memory/activation_bytes_cpu.json

A Llama of each shape with --layers decoder layers and a small vocabulary (the logits are counted apart), every linear
RTN-quantized (SpearLinear with its dense copy, as calibration runs it), then ECs of rank --rank on every linear or
on none but the first layer's first (the two ends of any plan: that EC makes every later layer's input require
grad), in each precision calibration uses: float32 (a CPU, or a CUDA student up to 2B
parameters) and bfloat16 (its body in bfloat16, the ECs' masters in float32: precision.bfloat16_student). One
forward of --tokens tokens under a saved-tensors hook: every tensor autograd keeps is attributed to the decoder
layer running when it was saved, once per storage, parameters and buffers left out. The first layer is not counted
(its input, the embedding, does not require grad) nor is the last (the head's chunked KL follows it). Bytes scale with
the tokens (flash attention keeps no T × T matrix), so they are reported per token, per layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import write_json  # noqa: E402

from spear.compensate.init import attach_ec  # noqa: E402
from spear.compensate.precision import layer_activation_values, student_in  # noqa: E402
from spear.layer import SpearLinear  # noqa: E402
from spear.models.layerwise import decoder_layers  # noqa: E402
from spear.quant.pipeline import QuantSettings, quantize_model  # noqa: E402
from spear.record import QuantConfig  # noqa: E402

SHAPES = {  # hidden, intermediate, heads, kv heads (GPU.md's table; SmolLM2-135M's own)
    "smollm2": (576, 1536, 9, 3),
    "llama3.2-1b": (2048, 8192, 32, 8),
    "llama3-8b": (4096, 14336, 32, 8),
}


def estimate_per_token(hidden: int, inter: int, size: int) -> int:
    """precision.compensate_bytes' activations of one layer, a token: (12·hidden + 4·intermediate) values."""
    return layer_activation_values(hidden, inter) * size


def model_of(shape: str, layers: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, heads, kv = SHAPES[shape]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                         num_key_value_heads=kv, num_hidden_layers=layers, vocab_size=vocab,
                         max_position_embeddings=4096, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    quantize_model(model, QuantSettings("rtn", QuantConfig(4, -1)), None)
    return model


def saved_bytes_by_layer(model, tokens: int) -> list[int]:
    """Bytes of the new storages autograd saved while each decoder layer ran, in one forward of `tokens` tokens."""
    layers = list(decoder_layers(model))
    current = [-1]
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda *_: current.__setitem__(0, -1))
    known = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    known |= {m.weight_hat.untyped_storage().data_ptr() for m in model.modules()
              if isinstance(m, SpearLinear) and m.weight_hat is not None}
    by_layer = [0] * len(layers)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if current[0] >= 0 and storage.data_ptr() not in known:
            known.add(storage.data_ptr())
            by_layer[current[0]] += storage.nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(ids).last_hidden_state.float().sum()  # the body: calibration runs the head in chunks
    return by_layer


def saved_with_ecs(model, ranks: dict[str, int], precision: str, tokens: int, gate_hidden: int = 8) -> list[int]:
    """saved_bytes_by_layer with ECs of the given ranks on the named linears, only the ECs trainable, the student in
    `precision` as calibration runs it."""
    masters = []
    linears = {n: m for n, m in model.named_modules() if isinstance(m, SpearLinear)}
    for name, rank in ranks.items():
        m = linears[name]
        attach_ec(m, torch.randn(rank, m.in_features) * 0.01, torch.randn(m.out_features, rank) * 0.01, gate_hidden, 8)
        masters += list(m.ec.parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    for p in masters:
        p.requires_grad_(True)
    with student_in(model, precision, masters):
        return saved_bytes_by_layer(model, tokens)


def measure(shape: str, precision: str, ecs: bool, args) -> dict:
    model = model_of(shape, args.layers, args.vocab)
    linears = [n for n, m in model.named_modules() if isinstance(m, SpearLinear)]
    # none: one EC in the first layer, so every later layer keeps what its input's gradient needs
    by_layer = saved_with_ecs(model, {n: args.rank for n in (linears if ecs else linears[:1])}, precision, args.tokens,
                              args.gate_hidden)
    hidden, inter, _, _ = SHAPES[shape]
    size = 4 if precision == "float32" else 2
    inner = by_layer[1:-1]
    per_token = max(inner) / args.tokens
    return {"shape": shape, "precision": precision, "ecs_on_every_linear": ecs, "by_layer": by_layer,
            "measured_per_token_layer": per_token, "estimate_per_token_layer": estimate_per_token(hidden, inter, size),
            "measured_over_estimate": per_token / estimate_per_token(hidden, inter, size),
            "measured_values": per_token / size, "hidden": hidden, "intermediate": inter}


KINDS = ("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj", "q_proj k_proj v_proj", "gate_proj up_proj")


def increments_by_kind(shape: str, precision: str, ranks: list[int], args) -> list[dict]:
    """Values a token that ECs of one kind (or a group sharing an input) add to an inner decoder layer, against a
    layer without ECs, at each rank: per token as the difference of 512 and 128 tokens, so that the casts of A and
    B (per step, not per token) drop out. What precision.plan_activation_bytes' constants come from."""
    size = 4 if precision == "float32" else 2

    def per_token(kinds: list[str], rank: int) -> float:
        def layer_one(tokens: int) -> int:
            model = model_of(shape, 3, args.vocab)
            linears = [n for n, m in model.named_modules() if isinstance(m, SpearLinear)]
            chosen = {n: rank for n in linears if n.startswith("model.layers.1.") and n.rsplit(".", 1)[1] in kinds}
            return saved_with_ecs(model, {linears[0]: rank, **chosen}, precision, tokens, args.gate_hidden)[1]
        return (layer_one(512) - layer_one(128)) / 384 / size

    hidden, inter, _, _ = SHAPES[shape]
    base = per_token([], ranks[0])
    rows = [{"shape": shape, "precision": precision, "kinds": "none", "values": base, "hidden": hidden, "inter": inter}]
    for rank in ranks:
        for kinds in KINDS:
            rows.append({"shape": shape, "precision": precision, "kinds": kinds, "rank": rank,
                         "increment": per_token(kinds.split(), rank) - base})
            print(f"{shape:12s} {precision:9s} rank {rank:3d} {kinds:22s} +{rows[-1]['increment']:7.1f} values a token",
                  flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["smollm2", "llama3-8b"], choices=sorted(SHAPES))
    p.add_argument("--precisions", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--gate-hidden", type=int, default=8)
    p.add_argument("--by-kind", type=int, nargs="*", default=None, metavar="RANK",
                   help="instead: what ECs of each kind add to a layer, at these ranks (increments_by_kind)")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    if args.by_kind is not None:
        rows = [r for shape in args.shapes for precision in args.precisions
                for r in increments_by_kind(shape, precision, args.by_kind or [4, 16, 64], args)]
        write_json(args.json, {"mode": "by kind", "rows": rows})
        return
    rows = []
    for shape in args.shapes:
        for precision in args.precisions:
            for ecs in (False, True):
                row = measure(shape, precision, ecs, args)
                rows.append(row)
                print(f"{shape:12s} {precision:9s} ECs {'all ' if ecs else 'none'}  "
                      f"{row['measured_values']:8.0f} values a token a layer = "
                      f"{row['measured_values'] / row['hidden']:.2f}·hidden; estimate "
                      f"{row['estimate_per_token_layer'] / (4 if precision == 'float32' else 2):.0f} "
                      f"(measured / estimate {row['measured_over_estimate']:.2f})", flush=True)
                write_json(args.json, {"tokens": args.tokens, "layers": args.layers, "rank": args.rank, "rows": rows})


if __name__ == "__main__":
    main()
