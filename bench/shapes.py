"""The model shapes the benchmarks time, in one table: Llama-2-7B, -13B, -70B and Llama-3-8B as the runtime's
ModelArgs, and the (N = out, K = in) of their linears derived from them. Weights are random in these shapes
(bench/fixtures.py): no checkpoint is needed."""

from __future__ import annotations

from spear.runtime.model import ModelArgs

MODELS = {
    "llama2-7b": ModelArgs(dim=4096, intermediate=11008, n_heads=32, n_kv_heads=32, head_dim=128, n_layers=32,
                           vocab=32000, max_seq_len=4096),
    "llama3-8b": ModelArgs(dim=4096, intermediate=14336, n_heads=32, n_kv_heads=8, head_dim=128, n_layers=32,
                           vocab=128256, rope_theta=500000.0, max_seq_len=8192),
    "llama2-13b": ModelArgs(dim=5120, intermediate=13824, n_heads=40, n_kv_heads=40, head_dim=128, n_layers=40,
                            vocab=32000, max_seq_len=4096),
    "llama2-70b": ModelArgs(dim=8192, intermediate=28672, n_heads=64, n_kv_heads=8, head_dim=128, n_layers=80,
                            vocab=32000, max_seq_len=4096),
    "tiny": ModelArgs(dim=64, intermediate=128, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2, vocab=256),
}
SHORT = {"7b": "llama2-7b", "8b": "llama3-8b", "13b": "llama2-13b", "70b": "llama2-70b"}  # the kernel benches' names


def linears(short: str) -> dict[str, tuple[int, int]]:
    """Each distinct weight of a layer of `short` ("7b", ...), (N, K): q/o and k/v apart where grouped-query
    attention makes them differ ("qkvo" where it does not), gate and up as one shape."""
    a = MODELS[SHORT[short]]
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    out = {"qkvo": (a.dim, a.dim)} if q == kv == a.dim else {"q_o": (q, a.dim), "k_v": (kv, a.dim)}
    return {**out, "gate_up": (a.intermediate, a.dim), "down": (a.dim, a.intermediate)}


def launches(short: str) -> dict[str, tuple[int, int]]:
    """The runtime's four weight launches of a layer at one row, (N, K): q|k|v and gate|up stacked."""
    a = MODELS[SHORT[short]]
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    return {"qkv": (q + 2 * kv, a.dim), "o": (a.dim, q), "gate_up": (2 * a.intermediate, a.dim),
            "down": (a.dim, a.intermediate)}
