"""A served model holds what it serves: no dense copy and no record beside the kernels' packing (issue 50)."""

import dataclasses

import pytest
import torch

from spear import api
from spear.kernels import options
from spear.kernels.cpu_w4 import CPU_W4_MAX_ROWS, has_int4_op
from spear.layer import ErrorCompensator, SpearLinear
from spear.quant.pipeline import QuantSettings
from spear.record import QuantConfig
from spear.runtime.engine import EngineConfig, make_runner
from spear.runtime.kv_cache import Batch, Chunk
from spear.runtime.linear import FusedCPULinear
from spear.runtime.model import build_runtime_model, held_bytes

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not has_int4_op(), reason="this PyTorch has no CPU int4 matmul")


@pytest.fixture
def cpu_w4(monkeypatch):
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, cpu_w4=True))


@pytest.fixture(scope="module")
def artifact(tiny_model_dir, tmp_path_factory):
    return api.quantize(str(tiny_model_dir), QuantSettings("rtn", QuantConfig(4, -1)), tmp_path_factory.mktemp("a") / "art")


def add_ecs(model: torch.nn.Module, gen: torch.Generator) -> int:
    """Random ECs of rank 4 on every other SpearLinear (float32; int8 factors on every second one, gated on every
    second pair); returns the bytes of their float32 parameters, alpha apart (what ServedEC holds of them)."""
    held = 0
    for i, m in enumerate(mod for mod in model.modules() if isinstance(mod, SpearLinear)):
        if i % 2:
            continue
        m.ec = ErrorCompensator(m.in_features, m.out_features, 4, gate_hidden=8 if i % 8 < 4 else 0,
                                factor_bits=8 if i % 4 else 16)
        with torch.no_grad():
            for p in m.ec.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        held += sum(p.nbytes for name, p in m.ec.named_parameters() if name != "alpha")
    return held


def test_served_model_holds_the_packed_bytes_embeddings_norms_and_kv(artifact, cpu_w4):
    """Every tensor the runtime model and its KV cache hold, counted: the int4 packing and nibble codes of each
    linear, one shared scratch, each EC once as the CPU path reads it (float32, ServedEC: no EC module beside it),
    the float embeddings and norms, the KV cache; no dense copy, no record."""
    hf = api.load(str(artifact), CPU, serving=True).model
    ec_bytes = add_ecs(hf, torch.Generator().manual_seed(0))
    model = build_runtime_model(hf)
    linears = [m for m in model.modules() if isinstance(m, SpearLinear)]
    assert len(linears) == 14 and all(m.cpu_w4 is not None and m.codes is None for m in linears)
    assert sum(m.has_ec for m in linears) == 7 and all(m.ec is None for m in linears)
    held = held_bytes(model)
    assert held["dense"] == 0 and held["codes"] == 0
    scratch = linears[0].cpu_scratch
    assert all(m.cpu_scratch is scratch for m in linears)
    # the scratch path reads the int4 kernel's codes (one copy of them); only its float32 scales are its own
    assert all(m.cpu_nibbles.codes.data_ptr() == m.cpu_w4.weight.data_ptr() for m in linears)
    packed = sum(m.cpu_w4.nbytes() + m.cpu_nibbles.scales.nbytes + m.cpu_nibbles.offsets.nbytes
                 for m in linears) + scratch.nbytes()
    # q/k/v and gate/up stacked (FusedCPULinear): the parts' codes are views of the stack's, its scales its own
    stacks = [m for m in model.modules() if isinstance(m, FusedCPULinear)]
    assert len(stacks) == 2  # gate/up (k/v's 32 rows are not whole blocks of the packing: q/k/v stay apart)
    assert held["packed"] == packed + sum(m.cpu_w4.scales_and_zeros.nbytes for m in stacks) + ec_bytes
    weights = sum(m.out_features * m.in_features for m in linears)
    assert packed - scratch.nbytes() <= 0.7 * weights  # 0.5 bytes a weight and the scales, against 4 dense
    # the embedding and head: float32, or a CompactTable's values (and scales) where they hold every value; tied: once
    held_tables = [t for m in (model.embed, model.head) for t in
                   ([m.table.values, m.table.scales] if hasattr(m, "table") else [m.weight]) if t is not None]
    tables = {t.data_ptr(): t for t in held_tables}
    norms = [p for n, p in hf.named_parameters() if "norm" in n]
    assert held["other"] == sum(t.nbytes for t in [*tables.values(), *norms]) + model.rope.inv_freq.nbytes
    runner = make_runner(model, EngineConfig(max_num_seqs=2, max_model_len=64, num_kv_blocks=9))
    assert runner.cache.k.nbytes + runner.cache.v.nbytes == 2 * 2 * 9 * 16 * 2 * 16 * 4  # K, V: layers, blocks, ...


def test_cpu_int4_path_matches_the_dense_path(artifact, cpu_w4):
    """Decode steps (≤ CPU_W4_MAX_ROWS rows) through the int4 kernel in bfloat16, prefill through the scratch path
    in float32: the logits of the dense float32 path within bfloat16's error, and prefill's to float32's."""
    dense = build_runtime_model(api.load(str(artifact), CPU).model, kernels=False)
    served = build_runtime_model(api.load(str(artifact), CPU, serving=True).model)
    ids = torch.randint(0, 256, (CPU_W4_MAX_ROWS + 8,)).tolist()

    def logits(model, chunks):
        runner = make_runner(model, EngineConfig(max_num_seqs=1, max_model_len=64, num_kv_blocks=8))
        start, outs = 0, []
        for n in chunks:
            outs.append(model(Batch.build([Chunk(ids[start:start + n], start, [1, 2, 3])], 16, CPU), runner.cache)[0])
            start += n
        return torch.stack(outs)

    prefill = [len(ids)]  # one step of more than CPU_W4_MAX_ROWS rows: the scratch path
    assert torch.allclose(logits(served, prefill), logits(dense, prefill), rtol=1e-5, atol=1e-5)
    steps = [4, 1, 1, 1]  # short steps: the int4 kernel
    ref, out = logits(dense, steps), logits(served, steps)
    assert ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 2e-2


def _tables(table: torch.Tensor, scale: float | None = None) -> torch.nn.Module:
    """A model's embedding and tied head over `table`, as the runtime model holds them (model.embed, model.head)."""
    from spear.runtime.linear import DenseLinear

    holder = torch.nn.Module()
    holder.embed = torch.nn.Embedding.from_pretrained(table, freeze=True)
    if scale is not None:  # Gemma's scaled embedding: forward multiplies by its embed_scale
        holder.embed.register_buffer("embed_scale", torch.tensor(scale), persistent=False)
        holder.embed.forward = lambda ids, e=holder.embed: torch.nn.Embedding.forward(e, ids) * e.embed_scale
    holder.head = DenseLinear(holder.embed.weight, None)
    return holder


def _q8_0(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """A table as a Q8_0 GGUF's dequantizes: int8 codes times an fp16 scale per block of 32 (amax / 127, rounded)."""
    w = torch.randn(*shape, generator=gen).view(shape[0], -1, 32)
    d = (w.abs().amax(-1, keepdim=True) / 127).half().float()
    w[:3, :2] = 0  # all-zero blocks
    return ((w / d.clamp(min=1e-8)).round().clamp(-127, 127) * d).view(shape)


@pytest.mark.parametrize("form,scale,held", [("q8_0", None, 1000 * 64 + 1000 * 2 * 2), ("fp16", None, 1000 * 64 * 2),
                                             ("fp16", 8.0, 1000 * 64 * 2), ("bf16", None, 1000 * 64 * 2)])
def test_tables_held_compactly_give_the_same_numbers_bit_for_bit(form, scale, held, monkeypatch):
    """A checkpoint's Q8_0 (or fp16, bf16) embedding, upcast to float32 on loading, is held in its own form again:
    lookups and the head's logits (a block of rows at a time through the float32 scratch) are those of the float32
    tables, bit for bit; a tied head shares the embedding's table."""
    from spear.runtime import tables

    monkeypatch.setattr(tables, "SCRATCH_WEIGHTS", 128 * 64)  # 128 rows a block: 8 blocks, the last one short
    gen = torch.Generator().manual_seed(0)
    table = {"q8_0": lambda: _q8_0((1000, 64), gen), "fp16": lambda: torch.randn(1000, 64, generator=gen).half().float(),
             "bf16": lambda: (torch.randn(1000, 64, generator=gen) * 1e6).bfloat16().float()}[form]()  # 1e6: not fp16
    model = _tables(table, scale)
    ids, x = torch.randint(0, 1000, (2, 7), generator=gen), torch.randn(3, 5, 64, generator=gen)
    want_embed, want_logits = model.embed(ids), model.head(x)
    assert tables.hold_tables_compact(model) == 1000 * 64 * 4 - held
    assert model.embed.table is model.head.table and model.head.nbytes() == held
    assert model.embed.table.values.dtype == {"q8_0": torch.int8, "fp16": torch.float16, "bf16": torch.bfloat16}[form]
    assert torch.equal(model.embed(ids), want_embed) and torch.equal(model.head(x), want_logits)


def test_tables_that_fewer_bytes_would_round_stay_float32():
    from spear.runtime.tables import hold_tables_compact

    model = _tables(torch.randn(300, 64))
    embed = model.embed
    assert hold_tables_compact(model) == 0 and model.embed is embed and model.head.weight.dtype == torch.float32
