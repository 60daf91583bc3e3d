"""Fused q/k/v and gate/up launches (kernels.pack.concat_w4 / concat_ec, runtime.linear.FusedLinear) against
the separate layers (on the GPU where there is one; on CPU through TRITON_INTERPRET=1, set in conftest).

The fused weight stacks the parts' rows and the fused EC is block-diagonal, so one launch must give
the concatenation of the separate outputs up to fp16 rounding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fixtures import random_model
from test_kernels import DEVICE, SEED, assert_close, random_ec

from spear.errors import SpearError
from spear.kernels import options
from spear.kernels.pack import concat_ec, concat_w4, pack_ec, pack_w4
from spear.kernels.reference import w4_linear_ref
from spear.kernels.w4 import w4_linear
from spear.layer import SpearLinear
from spear.record import QuantConfig, rtn_quantize
from spear.runtime.kv_cache import Batch, Chunk, KVCache
from spear.runtime.linear import DenseLinear, FusedDenseLinear, FusedLinear
from spear.runtime.model import ModelArgs, Transformer, fuse_projections

K = 128
SIZES = [128, 64, 64]  # q, k, v-like: out sizes must be multiples of 64


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


# (rank, gate_hidden[, factor bits: 16 unless given]) per part; None: no EC; gate_hidden 0: ungated
EC_CASES = {
    "gated-ranks": [(8, 8), (16, 4), (24, 20)],
    "some-none": [(8, 8), None, (12, 8)],
    "gated-ungated": [(8, 0), (16, 8), None],
    "ungated": [(8, 0), None, (4, 0)],
    "none": [None, None, None],
    "int8": [(8, 8, 8), None, (12, 0, 8)],  # int8 codes block-diagonal, scales concatenated
    "int8-fp16": [(8, 8, 8), (16, 4), (12, 0, 8)],  # a mix: fp16, the int8 parts dequantized
}


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", EC_CASES)
def test_fused_launch_equals_separate_layers(case, bias, m, gen):
    specs = EC_CASES[case]
    group = 32 if case == "gated-ranks" else -1
    parts = [pack_w4(rtn_quantize(torch.randn(n, K, generator=gen), QuantConfig(4, group))).to(DEVICE) for n in SIZES]
    ecs = [None if s is None else pack_ec(random_ec(n, K, s[0], gen, s[1], s[2] if len(s) > 2 else 16)).to(DEVICE)
           for n, s in zip(SIZES, specs)]
    biases = [(torch.randn(n, generator=gen) * 0.1).half().to(DEVICE) if bias and i != 1 else None
              for i, n in enumerate(SIZES)]
    x = torch.randn(m, K, generator=gen).half().to(DEVICE)

    fused_w, fused_ec = concat_w4(parts), concat_ec(ecs, SIZES, K, DEVICE)
    fused_bias = None
    if bias:  # the second part has no bias: zeros there
        fused_bias = torch.cat([torch.zeros(n, dtype=torch.float16, device=DEVICE) if b is None else b
                                for b, n in zip(biases, SIZES)])
    y = w4_linear(x, fused_w, fused_ec, fused_bias)
    ref = torch.cat([w4_linear_ref(x, w, ec, b) for w, ec, b in zip(parts, ecs, biases)], dim=1)
    assert y.shape == (m, sum(SIZES))
    assert_close(y, ref, f"{case}, bias={bias}, M={m}")

    if all(s is None for s in specs):
        assert fused_ec is None
    else:
        R, H = fused_ec.padded_rank, fused_ec.W1.shape[0]
        assert fused_ec.gated == any(s is not None and s[1] > 0 for s in specs)
        assert fused_ec.rank == sum(s[0] for s in specs if s is not None)
        assert fused_ec.int8 == all(s is None or len(s) > 2 for s in specs)
        assert fused_ec.A.dtype == (torch.int8 if fused_ec.int8 else torch.float16)
        assert R >= 16 and R & (R - 1) == 0 and H >= 16 and H & (H - 1) == 0
        assert_close(w4_linear_ref(x, fused_w, fused_ec, fused_bias), ref, f"{case}: fused reference", rtol=1e-3)


def test_concat_w4_rejects_mismatched_parts(gen):
    a = pack_w4(rtn_quantize(torch.randn(64, K, generator=gen), QuantConfig(4, 32)))
    b = pack_w4(rtn_quantize(torch.randn(64, K, generator=gen), QuantConfig(4, 64)))
    c = pack_w4(rtn_quantize(torch.randn(64, 2 * K, generator=gen), QuantConfig(4, 32)))
    for other in (b, c):
        with pytest.raises(SpearError, match="cannot concatenate"):
            concat_w4([a, other])


def new_cache(model) -> KVCache:
    a = model.args
    return KVCache(a.n_layers, 8, 16, a.n_kv_heads, a.head_dim, model.dtype, model.device)


@torch.no_grad()
def logits(model, ids: list[int], prefill: int) -> torch.Tensor:
    """Logits after a prefill of `prefill` tokens, then after each decode step: [1 + steps, vocab]."""
    cache, table = new_cache(model), [2, 0, 5]
    out = [model(Batch.build([Chunk(ids[:prefill], 0, table)], 16, DEVICE), cache)[0]]
    for pos in range(prefill, len(ids)):
        out.append(model(Batch.build([Chunk([ids[pos]], pos, table)], 16, DEVICE), cache)[0])
    return torch.stack(out).float()


def test_fused_model_matches_separate_layers(gen):
    args = ModelArgs(dim=128, intermediate=192, n_heads=4, n_kv_heads=2, head_dim=32, n_layers=2, vocab=64,
                     attention_bias=True)
    model = random_model(args, QuantConfig(4, -1), ec_fraction=0.5, rank=8, device=DEVICE, kernels=False,
                         seed=SEED % 1000)
    first = model.layers[0].attention
    assert first.wq.ec is None and first.wk.ec is not None and first.wv.ec is None  # ECs on every other linear
    first.wq.ec = random_ec(first.wq.out_features, args.dim, 4, gen, gate_hidden=0).to(DEVICE)  # ungated beside gated
    first.wv.bias = None  # a part without a bias
    ids = torch.randint(0, args.vocab, (7,), generator=gen).tolist()
    ref = logits(model, ids, prefill=5)

    linears = [m for m in model.modules() if isinstance(m, SpearLinear)]
    assert all(m.use_kernels() for m in linears)  # use_kernels(model) is CUDA-only: pack each one here
    qweight = first.wq.packed.qweight
    assert fuse_projections(model) == 2 * args.n_layers
    fused = first.wqkv
    assert isinstance(fused, FusedLinear) and fused.sizes == [128, 64, 64]
    assert fused.packed_ec is not None and fused.packed_ec.gated
    assert first.wq.packed.qweight.data_ptr() == fused.packed.qweight.data_ptr()  # a view: held once
    assert torch.equal(first.wq.packed.qweight, qweight)
    assert torch.equal(first.wv.packed.qweight, fused.packed.qweight[192:])

    out = logits(model, ids, prefill=5)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, f"fused vs separate logits: {err:.2e}; seed {SEED}"


def int8_ec_model() -> tuple[Transformer, list[SpearLinear]]:
    """A one-layer W4 model with a gated EC of rank 8 on every linear, int8 factors but on v (q|k|v stacks in fp16,
    gate|up in int8), unpacked; and its SpearLinears."""
    args = ModelArgs(dim=128, intermediate=192, n_heads=4, n_kv_heads=2, head_dim=32, n_layers=1, vocab=64)
    model = random_model(args, QuantConfig(4, -1), ec_fraction=1.0, rank=8, device=DEVICE, kernels=False,
                         seed=SEED % 1000)
    linears = [m for m in model.modules() if isinstance(m, SpearLinear)]
    for m in linears:
        m.ec.factor_bits = 16 if m is model.layers[0].attention.wv else 8
    return model, linears


def test_a_model_with_int8_ecs_serves_int8_factors(gen):
    """ECs stored in 8 bits stay int8 where the model is served: each packed layer's EC, and a fused launch's where
    every part's is int8 (gate|up; q|k|v with an fp16 part beside: fp16), a byte a factor entry in what the model
    holds (runtime.model.held_bytes); the logits those of the unpacked model."""
    from spear.runtime.model import held_bytes

    model, linears = int8_ec_model()
    a, f, args = model.layers[0].attention, model.layers[0].feed_forward, model.args
    ids = torch.randint(0, args.vocab, (6,), generator=gen).tolist()
    ref = logits(model, ids, prefill=5)

    assert all(m.use_kernels() for m in linears)
    assert all(m.packed_ec.int8 == (m.ec.factor_bits == 8) for m in linears)
    down = f.w_down.packed_ec
    R, H, n, k = down.padded_rank, down.W1.shape[0], args.dim, args.intermediate
    assert down.A.dtype == down.B.dtype == torch.int8
    assert down.nbytes() == R * k + n * R + 2 * 4 * R + 2 * (2 * H * R + H + R)  # codes, float32 scales, fp16 gate
    assert held_bytes(model)["packed"] == sum(m.packed.nbytes() + m.packed_ec.nbytes() for m in linears)
    assert fuse_projections(model) == 2
    assert f.w_gate_up.packed_ec.int8 and f.w_gate_up.packed_ec.B.dtype == torch.int8
    assert not a.wqkv.packed_ec.int8 and a.wqkv.packed_ec.A.dtype == torch.float16
    out = logits(model, ids, prefill=5)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, f"int8 ECs served vs unpacked logits: {err:.2e}; seed {SEED}"


def test_a_served_model_holds_each_ec_once(gen):
    """Served as on CUDA (each layer packed and released: use_kernels(drop_dense=True); q/k/v and gate/up stacked),
    every EC is held once, as the W4 kernels read it: no EC module beside a packed EC (has_ec and nbytes still count
    it), and a stacked launch's parts point at the stacked EC (their rows of B), as they do at the stacked weight.
    A part's EC so re-pointed is still its own function (the reference)."""
    from spear.layer import ErrorCompensator
    from spear.runtime.model import held_bytes

    model, linears = int8_ec_model()
    a, f = model.layers[0].attention, model.layers[0].feed_forward
    nbytes = [m.nbytes() for m in linears]
    assert all(m.use_kernels(drop_dense=True) for m in linears)
    assert all(m.ec is None and m.has_ec for m in linears) and [m.nbytes() for m in linears] == nbytes
    assert not any(isinstance(m, ErrorCompensator) for m in model.modules())
    parts = [a.wq, a.wk, a.wv, f.w_gate, f.w_up]
    x = torch.randn(3, model.args.dim, generator=gen).half().to(DEVICE)
    alone = [w4_linear_ref(x, m.packed, m.packed_ec) for m in parts]
    assert fuse_projections(model) == 2
    for m, stack, y in zip(parts, [a.wqkv] * 3 + [f.w_gate_up] * 2, alone):
        assert m.packed_ec.B.untyped_storage().data_ptr() == stack.packed_ec.B.untyped_storage().data_ptr()
        torch.testing.assert_close(w4_linear_ref(x, m.packed, m.packed_ec), y)
    launches = [a.wqkv, a.wo, f.w_gate_up, f.w_down]
    assert held_bytes(model)["packed"] == sum(m.packed.nbytes() + m.packed_ec.nbytes() for m in launches)


def test_checkpoint_fused_projections_become_one_w4_launch(gen):
    """Phi-3's qkv_proj and gate_up_proj, one linear each in the checkpoint (runtime.linear.SplitLinear), become the
    model's fused W4 launches over their one part (EC included, gate|up's activation from the epilogue on decode
    steps): the same logits as the unpacked reference."""
    from conftest import make_tiny_family

    from spear.layer import ErrorCompensator
    from spear.quant.pipeline import QuantSettings, quantize_model
    from spear.runtime.linear import SplitLinear
    from spear.runtime.model import build_runtime_model

    hf = make_tiny_family("phi3", hidden_size=128, intermediate_size=192, tie_word_embeddings=False)
    quantize_model(hf, QuantSettings("rtn", QuantConfig(4, -1)))
    qkv = hf.model.layers[0].self_attn.qkv_proj
    qkv.ec = ErrorCompensator(qkv.in_features, qkv.out_features, 8, gate_hidden=8)
    for t in (qkv.ec.A, qkv.ec.B, qkv.ec.gate[2].weight):
        torch.nn.init.normal_(t, std=0.1, generator=gen)
    model = build_runtime_model(hf.half().to(DEVICE), kernels=False)
    first = model.layers[0].attention
    assert isinstance(first.wqkv, SplitLinear) and first.wq is None
    ids = torch.randint(0, model.args.vocab, (7,), generator=gen).tolist()
    ref = logits(model, ids, prefill=5)

    assert all(m.use_kernels() for m in model.modules() if isinstance(m, SpearLinear))
    assert fuse_projections(model) == 2 * model.args.n_layers
    assert isinstance(first.wqkv, FusedLinear) and first.wqkv.sizes == [128, 64, 64]
    assert first.wqkv.packed_ec is not None and model.layers[0].feed_forward.w_gate_up.sizes == [192, 192]
    out = logits(model, ids, prefill=5)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, f"fused vs unpacked logits: {err:.2e}; seed {SEED}"


def test_fused_float_model_matches_separate_layers(gen):
    """A float model's q/k/v and gate/up as one GEMM each (FusedDenseLinear): the same logits as the separate
    linears, through prefill and decode steps."""
    from spear.runtime.model import use_dense_kernels

    args = ModelArgs(dim=128, intermediate=192, n_heads=4, n_kv_heads=2, head_dim=32, n_layers=2, vocab=64,
                     attention_bias=True)
    model = random_model(args, dtype=torch.float32, device=DEVICE, kernels=False, seed=SEED % 1000)
    first = model.layers[0].attention
    first.wk.bias = None  # a part without a bias: zeros in the stacked one
    ids = torch.randint(0, args.vocab, (7,), generator=gen).tolist()
    ref = logits(model, ids, prefill=5)
    wv = first.wv.weight.clone()

    assert fuse_projections(model) == 2 * args.n_layers
    assert fuse_projections(model) == 0  # fused once
    fused = first.wqkv
    assert isinstance(fused, FusedDenseLinear) and fused.sizes == [128, 64, 64]
    assert isinstance(model.layers[0].feed_forward.w_gate_up, FusedDenseLinear)
    assert first.wv.weight.data_ptr() == fused.weight[192:].data_ptr()  # a view: held once
    assert torch.equal(first.wv.weight, wv) and torch.equal(fused.bias[128:192], torch.zeros(64, device=DEVICE))
    wo = first.wo.weight
    assert use_dense_kernels(model, tune=False) == 4 * args.n_layers  # o and down, beside the two fused
    assert isinstance(first.wo, DenseLinear) and first.wo.weight is wo

    out = logits(model, ids, prefill=5)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, f"fused vs separate float logits: {err:.2e}; seed {SEED}"


def test_stack_keys_keep_mixed_parts_apart(gen):
    """LinearMethod.stack_key: float parts of one input width and dtype stack, others stay separate (a SpearLinear
    beside a float one: neither fusion; an unpacked SpearLinear or a fused launch: none)."""

    def dense(n: int, k: int = K, dtype: torch.dtype = torch.float32) -> DenseLinear:
        return DenseLinear(torch.nn.Parameter(torch.randn(n, k, dtype=dtype)), None)

    assert dense(64).stack_key() == dense(32).stack_key()
    assert dense(64).stack_key() != dense(32, dtype=torch.float64).stack_key()
    assert dense(64).stack_key() != dense(32, 2 * K).stack_key()
    w4 = SpearLinear(rtn_quantize(torch.randn(64, K, generator=gen), QuantConfig(4, -1)))
    assert w4.stack_key() is None  # not packed: runs the reference alone
    assert w4.use_kernels() and w4.stack_key() not in (None, dense(64).stack_key())
    assert FusedDenseLinear([dense(64), dense(32)]).stack_key() is None


@pytest.mark.parametrize("m,block_n,split_k", [(1, 32, 1), (3, 16, 3), (16, 64, 2)])  # GEMV loop, then dot loop
@pytest.mark.parametrize("with_ec,group", [(True, 32), (False, -1), (True, -1)])
def test_swiglu_in_the_epilogue_equals_silu_of_the_fused_output(m, block_n, split_k, with_ec, group, gen):
    """w4_decode(swiglu=True) on stacked [gate; up] gives silu(gate) ⊙ up of the plain launch's halves: each tile
    computes rows of gate and the same rows of up."""
    from spear.kernels.w4 import DecodeConfig, w4_decode

    inter = 128
    parts = [pack_w4(rtn_quantize(torch.randn(inter, K, generator=gen), QuantConfig(4, group))).to(DEVICE)
             for _ in range(2)]
    ecs = [pack_ec(random_ec(inter, K, 8, gen)).to(DEVICE) if with_ec else None for _ in range(2)]
    w, ec = concat_w4(parts), concat_ec(ecs, [inter, inter], K, DEVICE)
    bias = (torch.randn(2 * inter, generator=gen) * 0.1).half().to(DEVICE)
    x = torch.randn(m, K, generator=gen).half().to(DEVICE)
    cfg = DecodeConfig(block_n=block_n, split_k=split_k, gemv_rows=4, block_kw=16)
    act = w4_decode(x, w, ec, bias, cfg, swiglu=True)
    y = w4_linear_ref(x, w, ec, bias).float()
    ref = torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]
    assert act.shape == (m, inter)
    assert_close(act, ref, f"swiglu m={m} block_n={block_n} split_k={split_k} ec={with_ec} group={group}")


def packed_fused_model(n_layers: int):
    """A small random runtime model, ECs on half its linears, packed for the kernels and fused (q/k/v, gate/up)."""
    args = ModelArgs(dim=128, intermediate=192, n_heads=4, n_kv_heads=2, head_dim=32, n_layers=n_layers, vocab=64,
                     attention_bias=True)
    model = random_model(args, QuantConfig(4, -1), ec_fraction=0.5, rank=8, device=DEVICE, kernels=False,
                         seed=SEED % 1000)
    assert all(m.use_kernels() for m in model.modules() if isinstance(m, SpearLinear))
    fuse_projections(model)
    return model


def test_swiglu_in_the_epilogue_keeps_the_model_logits(monkeypatch, gen):
    """The runtime model with options' fuse_swiglu (gate/up's activation from the launch's epilogue, the default) against
    the separate SiLU·up op: the fused launch runs on every decode-sized step (the 5-token prefill included) and
    the logits stay the same. The switch is read when the launches are fused (fuse_projections)."""
    # fold_norm off: test_folded_norms_keep_the_model_logits
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, fuse_swiglu=False, fold_norm=False))
    reference = packed_fused_model(n_layers=2)
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, fuse_swiglu=True))
    model = packed_fused_model(n_layers=2)  # the same weights (one seed)
    ids = torch.randint(0, model.args.vocab, (7,), generator=gen).tolist()
    ref = logits(reference, ids, prefill=5)
    calls = []
    fused = FusedLinear.swiglu
    monkeypatch.setattr(FusedLinear, "swiglu", lambda self, x, **kw: calls.append(x.shape[0]) or fused(self, x, **kw))
    out = logits(model, ids, prefill=5)
    assert calls == [5, 5, 1, 1, 1, 1], f"swiglu launches by rows: {calls}"
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, f"swiglu in the epilogue vs the separate op, logits: {err:.2e}; seed {SEED}"


def test_folded_norms_keep_the_model_logits(monkeypatch, gen):
    """The runtime model with options' fold_norm (each layer's two add + RMSNorm launches folded into the W4 launches
    around them, kernels.w4.FoldedNorm) against the separate norm op: on every decode-sized step, the 5-token
    prefill included, o and down hand a FoldedNorm on (down's to the next layer only: the last layer's goes to
    the final norm) and the logits stay the same. The switch is read when the launches are fused (fuse_projections)."""
    from spear.kernels import w4 as w4_module

    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, fold_norm=False))
    reference = packed_fused_model(n_layers=3)
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, fold_norm=True))
    model = packed_fused_model(n_layers=3)  # the same weights (one seed)
    ids = torch.randint(0, model.args.vocab, (7,), generator=gen).tolist()
    ref = logits(reference, ids, prefill=5)
    folds = []
    add_norm = w4_module.w4_decode_add_norm
    monkeypatch.setattr(w4_module, "w4_decode_add_norm",
                        lambda x, *a, **kw: folds.append(x.shape[0]) or add_norm(x, *a, **kw))
    out = logits(model, ids, prefill=5)
    per_step = 2 * model.args.n_layers - 1  # o in every layer, down in all but the last
    assert folds == [5] * per_step + [1] * per_step * 2, f"folded norms by rows: {folds}"
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, f"folded norms vs the separate op, logits: {err:.2e}; seed {SEED}"


def test_fold_dispatch_takes_row_parallel_layers_only_with_fold_norm_tp(gen):
    """runtime.model._folds_norm asks the producer (LinearMethod.folds_norm) and the consumer
    (LinearMethod.takes_folded_norm: a W4 launch built with options' fold_norm, on a decode step): a packed
    SpearLinear folds; a row-parallel layer (tp.RowParallelLinear) only when built with options' fold_norm_tp as
    well (its fold_norm), and only where its reduction (p2p) takes the rows."""
    from types import SimpleNamespace

    from spear.runtime import model as model_module
    from spear.runtime.tp import CollectiveReduce, PeerReduce, RowParallelLinear

    w4 = SpearLinear(rtn_quantize(torch.randn(64, K, generator=gen), QuantConfig(4, -1)))
    row_parallel = RowParallelLinear(w4, rank=0, world=2)
    row_parallel.reduce = PeerReduce(None, None, None, SimpleNamespace(width=64), max_rows=4)  # 64 = its [y] width
    assert w4.use_kernels()
    consumer = FusedLinear([w4], fold_norm=True)
    x = torch.zeros(2, K // 2, dtype=torch.float16)
    assert model_module._folds_norm(w4, consumer, x)
    assert not model_module._folds_norm(row_parallel, consumer, x)  # built without fold_norm_tp
    row_parallel.fold_norm = True  # as tp.set_reduction sets it from options' fold_norm_tp
    assert model_module._folds_norm(row_parallel, consumer, x)
    assert not model_module._folds_norm(row_parallel, consumer, torch.zeros(5, K // 2, dtype=torch.float16))
    assert not model_module._folds_norm(row_parallel, None, x)  # no fused consumer
    float_consumer = DenseLinear(torch.nn.Parameter(torch.zeros(64, K // 2)), None)
    assert not model_module._folds_norm(row_parallel, float_consumer, x)
    assert not model_module._folds_norm(row_parallel, consumer, x.float())  # not the kernels' dtype
    row_parallel.reduce = CollectiveReduce()
    assert not model_module._folds_norm(row_parallel, consumer, x)
    assert not model_module._folds_norm(w4, FusedLinear([w4], fold_norm=False), x)  # built without options' fold_norm
