"""Tensor parallelism on CPU over gloo: the sharded model's logits equal the single-process model's.

Each rank builds the same random model, computes the single-process reference itself,
shards a second copy and runs the same prefill + greedy decode steps: greedy tokens must
be identical and logits equal up to float32 summation order. The EC case puts gated and
static ECs (with B scaled up, so that they move the logits) on every linear layer, half of them with
int8 factors, so the column- and row-parallel EC paths are both exercised in both forms.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fixtures import random_model

from spear.errors import SpearError
from spear.layer import SpearLinear
from spear.record import QuantConfig
from spear.runtime.kv_cache import Batch, Chunk, KVCache
from spear.runtime.model import ModelArgs, Transformer
from spear.runtime.tp import RowParallelLinear, apply_tp, launch, set_reduction

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 8
PROMPTS = ([5, 17, 99, 3, 250, 41, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
DECODE_STEPS = 3
# Tests that hand CPU tensors to the Triton kernels: the interpreter's (CI's); on a GPU host CUDA launches refuse them
# (the GPU's own TP paths: bench/tp_decode.py on two GPUs)
interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="CPU tensors into Triton kernels: run under TRITON_INTERPRET=1")


def tiny_args(world: int) -> ModelArgs:
    """Heads (2 per rank, KV 1 per rank) and group-16 shards that split over `world` ranks."""
    return ModelArgs(dim=32 * world, intermediate=64 * world, n_heads=2 * world, n_kv_heads=world, head_dim=16,
                     n_layers=2, vocab=256)


def build(args: ModelArgs, setting: str) -> Transformer:
    if setting == "fp32":
        return random_model(args, dtype=torch.float32, seed=1, kernels=False)
    if setting == "w4":
        return random_model(args, QuantConfig(group_size=-1), dtype=torch.float32, seed=1, kernels=False)
    model = random_model(args, QuantConfig(group_size=16), ec_fraction=1.0, rank=8, dtype=torch.float32, seed=1, kernels=False)
    for i, lin in enumerate(m for m in model.modules() if isinstance(m, SpearLinear)):
        lin.ec.B.mul_(30)
        if i % 2:
            lin.ec.gate = None  # static EC (LoRC-style) on every other layer
        lin.ec.factor_bits = 8 if i % 4 >= 2 else 16  # gated and static, fp16 and int8 factors
    return model


def greedy(model: Transformer) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill both prompts in one step, then DECODE_STEPS greedy steps: logits [steps + 1, 2, vocab], tokens."""
    args = model.args
    cache = KVCache(args.n_layers, 8, BLOCK, args.n_kv_heads, args.head_dim, torch.float32, torch.device("cpu"))
    tables = [[1, 2, 3], [4, 5, 6]]
    chunks = [Chunk(list(p), 0, t) for p, t in zip(PROMPTS, tables)]
    logits, tokens = [], []
    with torch.inference_mode():
        for step in range(DECODE_STEPS + 1):
            logits.append(model(Batch.build(chunks, BLOCK, cache.device), cache))
            tokens.append(logits[-1].argmax(-1).tolist())
            chunks = [Chunk([tok], len(p) + step, t) for tok, p, t in zip(tokens[-1], PROMPTS, tables)]
    return torch.stack(logits), tokens


def check_rank() -> None:
    """On every rank: TP == single process for float, W4 per-channel and W4 g16 + ECs."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    args = tiny_args(world)
    for setting in ("fp32", "w4", "w4+ec"):
        ref_logits, ref_tokens = greedy(build(args, setting))
        model = apply_tp(build(args, setting))
        assert model.args.n_kv_heads == 1 and model.layers[0].attention.n_heads == 2
        logits, tokens = greedy(model)
        assert tokens == ref_tokens, (setting, dist.get_rank())
        err = (logits - ref_logits).abs().max().item()  # not assert_close: under dist it imports DTensor (seconds)
        assert err < 1e-4, f"{setting}: logits differ by {err:.3g}"
        gathered = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(gathered, logits)
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"{setting}: ranks disagree"
    without_ec = random_model(args, QuantConfig(group_size=16), dtype=torch.float32, seed=1, kernels=False)
    moved = (greedy(build(args, "w4+ec"))[0] - greedy(without_ec)[0]).abs().max()
    assert moved > 0.05, f"the ECs barely change the logits ({moved:.3g}): the EC paths would go untested"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_tp_matches_single_process(world, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    launch(check_rank, world, cuda=False)  # gloo ranks on the CPU, whatever GPUs the host has


def test_shape_errors():
    with pytest.raises(SpearError, match="attention heads do not split over 3 ranks"):
        apply_tp(build(tiny_args(2), "w4"), rank=0, world=3)
    model = build(ModelArgs(dim=64, intermediate=128, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=1, vocab=64), "w4+ec")
    with pytest.raises(SpearError, match="groups of 16 do not align"):
        RowParallelLinear(model.layers[0].feed_forward.w_down, rank=0, world=16)
    with pytest.raises(SpearError, match="needs CUDA"):
        set_reduction(model, "symmetric")


def test_ec_epilogue_kernel_matches_reference():
    """In place on fp16 y (the collective path), B in fp16 or int8 with a scale a column, and from strided float32
    [y | u] rows into fp16 with the bias (the symmetric path), gated, static and without an EC."""
    from spear.kernels.ec_epilogue import ec_epilogue
    from spear.kernels.pack import dequantize_factor
    from spear.kernels.reference import ec_epilogue_ref

    gen = torch.Generator().manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def randn(*shape, dtype=torch.float16):
        return torch.randn(shape, generator=gen).to(device, dtype)

    for M, N, r, h, gated in ((1, 200, 32, 8, True), (5, 64, 12, 20, True), (3, 130, 32, 0, False)):
        y, u, B = randn(M, N), randn(M, r), randn(N, r) * 0.1
        gate = (randn(h, r), randn(h), randn(r, h), randn(r)) if gated else ()
        expected = ec_epilogue_ref(y, u, B, *gate)
        torch.testing.assert_close(ec_epilogue(y.clone(), u, B, *gate, block_n=64), expected, atol=2e-3, rtol=2e-3)
        codes = torch.randint(-127, 128, (N, r), generator=gen, dtype=torch.int8).to(device)  # int8 B, a scale a column
        scale = (torch.rand(r, generator=gen) * 1e-3).to(device)
        expected = ec_epilogue_ref(y, u, codes, *gate, b_scale=scale)
        torch.testing.assert_close(expected, ec_epilogue_ref(y, u, dequantize_factor(codes, scale, 0), *gate))
        got = ec_epilogue(y.clone(), u, codes, *gate, block_n=64, b_scale=scale)
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
        rows, bias = randn(M, N + r + 3, dtype=torch.float32), randn(N)  # a row stride past N + r
        for ec in (True, False):
            u_view = rows[:, N:N + r] if ec else None
            expected = ec_epilogue_ref(rows[:, :N], u_view, B, *gate, bias=bias, dtype=torch.float16)
            out = torch.full((M, N), float("nan"), dtype=torch.float16, device=device)
            got = ec_epilogue(rows[:, :N], u_view, B if ec else None, *(gate if ec else ()), bias=bias, out=out)
            torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


def ec_layer(bits: int, alpha: float = 0.37) -> SpearLinear:
    """w_down of a one-layer W4 + EC model (64 × 128, a gated EC of rank 8, B scaled up), its factors in `bits`,
    alpha away from 1 (folded into B or b_scale)."""
    args = ModelArgs(dim=64, intermediate=128, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=1, vocab=64)
    lin = build(args, "w4+ec").layers[0].feed_forward.w_down
    lin.ec.factor_bits = bits
    lin.ec.alpha.data.fill_(alpha)
    return lin


@pytest.mark.parametrize("bits", [16, 8])
def test_rank_space_ec_holds_the_packed_factors(bits):
    """RankSpaceEC takes its factors from kernels.pack (served_factors, dequantize_factor): in fp16 the packed EC's
    A and alpha·B bit for bit (alpha folded the same way: into B, or into b_scale beside int8 codes), in float32
    the float layer's factors; A split by columns; the W4 kernels' packing of A (packed_a) a view of what it holds."""
    from spear.kernels.pack import pack_ec
    from spear.runtime.tp import RankSpaceEC

    lin = ec_layer(bits)
    r, k = lin.ec.rank, lin.in_features
    packed = pack_ec(lin.ec)
    whole = RankSpaceEC(lin.ec, 0, 1, torch.float16)
    assert torch.equal(whole.dense_A(torch.float16), packed.dense_A()[:r])
    assert torch.equal(whole.dense_B(torch.float16), packed.dense_B()[:, :r])
    assert torch.equal(whole.B, packed.B[:, :r]) and (bits == 16 or torch.equal(whole.b_scale, packed.b_scale[:r]))
    A, B = (t.detach() for t in lin.ec.factors())
    shards = [RankSpaceEC(lin.ec, rank, 2, torch.float32) for rank in (0, 1)]
    assert torch.equal(torch.cat([s.dense_A(torch.float32) for s in shards], dim=1), A)
    torch.testing.assert_close(shards[0].dense_B(torch.float32), lin.ec.alpha.detach() * B, rtol=1e-6, atol=0)
    assert all((s.A.dtype == torch.int8) == (bits == 8) for s in shards)
    if bits == 8:
        assert shards[0].A.shape == (16, k // 2)  # rank 8 padded to the kernels' 16: zero codes, scale 0
        assert not (shards[0].A[r:].any() or shards[0].a_scale[r:].any())
        assert shards[0].packed_a().A.data_ptr() == shards[0].A.data_ptr()


def test_column_shards_keep_int8_ec_codes_and_scales():
    """A column shard of an 8-bit EC keeps it int8 (ShardEC): A's codes and row scales, its rows of B's codes with
    B's column scales over all rows; packed (use_kernels) they are the unsharded packing's rows and b_scale, bit for
    bit. The shards' float forward is the unsharded layer's rows; their kernels (TRITON_INTERPRET) the reference."""
    from spear.kernels.pack import pack_ec, pack_w4
    from spear.kernels.reference import w4_linear_ref
    from spear.runtime.tp import column_shard

    args = ModelArgs(dim=64, intermediate=128, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=1, vocab=64)
    model = random_model(args, QuantConfig(group_size=32), ec_fraction=1.0, rank=8, dtype=torch.float32, seed=1, kernels=False)
    lin = model.layers[0].feed_forward.w_gate  # 128 × 64, a gated EC of rank 8; groups of 32 (the kernels' smallest)
    lin.ec.B.data.mul_(30)
    lin.ec.factor_bits = 8
    lin.ec.alpha.data.fill_(0.37)
    lin.bias = torch.nn.Parameter(torch.randn(lin.out_features))
    packed = pack_ec(lin.ec)
    x = torch.randn(3, lin.in_features, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        expected = lin(x)
        shards = [column_shard(lin, rank, 2) for rank in (0, 1)]
        assert all(s.ec.A.dtype == s.ec.B.dtype == torch.int8 and s.ec.B.shape == (64, 8) for s in shards)
        assert shards[0].ec.nbytes() == 8 * 64 + 64 * 8 + 2 * 2 * 8 + 2 * (8 * 8 + 8 + 8 * 8 + 8 + 1)
        torch.testing.assert_close(torch.cat([s(x) for s in shards], dim=-1), expected, rtol=1e-6, atol=1e-6)
        assert all(s.use_kernels() for s in shards)
        for rank, s in enumerate(shards):
            assert s.packed_ec.int8 and torch.equal(s.packed_ec.B, packed.B[64 * rank : 64 * (rank + 1)])
            assert torch.equal(s.packed_ec.b_scale, packed.b_scale) and torch.equal(s.packed_ec.A, packed.A)
        x16 = x.half()
        got = torch.cat([s(x16) for s in shards], dim=-1)
        ref = w4_linear_ref(x16, pack_w4(lin.qweight), packed, lin.bias.half())
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-3, atol=2e-3)


@interpreter_only
@pytest.mark.parametrize("bits", [16, 8])
def test_symmetric_path_equals_the_unsharded_layer(bits):
    """SymmetricReduce over two shards of a W4 + gated-EC row-parallel layer with a bias, in one process: the
    all-reduce stand-in adds rank 1's staged [y_r | u_r] rows to rank 0's, whose output is then the whole layer's
    as the epilogue kernel's specification gives it (ec_epilogue_ref on the unsharded layer's y and u: int8 B
    dequantized to fp16, as the W4 kernels take it), and, fp16 B's rounding apart, the float32 layer's."""
    from spear.kernels.reference import ec_epilogue_ref
    from spear.runtime.tp import SymmetricReduce, epilogue_weights

    lin = ec_layer(bits)
    assert lin.ec is not None and lin.ec.gate is not None
    lin.bias = torch.nn.Parameter(torch.randn(lin.out_features))
    x = torch.randn(3, lin.in_features, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = lin(x)
        u = x @ lin.ec.factors()[0].t()
        shards = [RowParallelLinear(lin, rank, 2) for rank in (0, 1)]
        width = lin.out_features + lin.ec.rank
        staged = {}
        shards[1].reduce = SymmetricReduce(torch.empty(4 * width), lambda flat: staged.setdefault(1, flat.clone()))
        shards[0].reduce = SymmetricReduce(torch.full((4 * width,), float("nan")), lambda flat: flat + staged[1])
        half = lin.in_features // 2
        shards[1](x[:, half:])
        got = shards[0](x[:, :half])
        spec = ec_epilogue_ref(x @ lin.weight_hat.t(), u, **epilogue_weights(shards[0].ec), bias=lin.bias)
    torch.testing.assert_close(got, spec, atol=1e-5, rtol=1e-5)
    tol = 1e-4 if bits == 16 else 1e-3  # int8: B's fp16 rounding (the W4 kernels' operand), alone
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def p2p_shards(lin, world: int, max_rows: int):
    """`world` row-parallel shards of lin, packed, each with a PeerReduce over buffers in this process (ranks
    simulated in turn under TRITON_INTERPRET): (shards, each rank's slots, each rank's signals). The EC's rank 8
    pads to 16 u columns."""
    from spear.kernels.pack import pack_w4
    from spear.kernels.w4 import PeerRows
    from spear.runtime.tp import PeerReduce

    width = lin.out_features + 16
    shards = [RowParallelLinear(lin, rank, world) for rank in range(world)]
    slots = [torch.full((world, max_rows, width), float("nan")) for _ in range(world)]
    signals = [torch.zeros(world, dtype=torch.int32) for _ in range(world)]
    for rank, shard in enumerate(shards):
        shard.base.packed = pack_w4(shard.base.qweight)
        rows = torch.tensor([slots[p].data_ptr() + 4 * rank * max_rows * width for p in range(world)])
        own = torch.tensor([signals[p].data_ptr() + 4 * rank for p in range(world)])
        shard.reduce = PeerReduce(slots[rank], signals[rank], torch.zeros(2, dtype=torch.int32),
                                  PeerRows(rows, own, width), max_rows)
    return shards, slots, signals


@interpreter_only
@pytest.mark.parametrize("bits", [16, 8])
def test_p2p_path_two_ranks_in_one_process_equal_the_unsharded_layer(bits):
    """PeerReduce with two simulated ranks (TRITON_INTERPRET): each rank's W4 launch writes its [y_r | u_r] rows into
    its slot of both ranks' buffers and signals both; then each rank's epilogue sums the slots. Twice, so the
    epoch advances and the kernel's counters are left clean; both ranks agree bit for bit. An 8-bit EC's A and B
    stay int8 on each rank (its columns of A, B replicated) and the kernels read them so."""
    args = ModelArgs(dim=64, intermediate=128, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=1, vocab=64)
    model = random_model(args, QuantConfig(group_size=32), ec_fraction=1.0, rank=8, dtype=torch.float32, seed=1, kernels=False)
    lin = model.layers[0].feed_forward.w_down  # 64 × 128, a gated EC; groups of 32 (the kernels' smallest)
    lin.ec.B.mul_(30)
    lin.ec.factor_bits = bits
    lin.bias = torch.nn.Parameter(torch.randn(lin.out_features))
    world, max_rows = 2, 4
    shards, slots, signals = p2p_shards(lin, world, max_rows)
    assert all((s.ec.A.dtype == torch.int8) == (bits == 8) and s.ec.packed_a().int8 == (bits == 8) for s in shards)
    gen = torch.Generator().manual_seed(3)
    half = lin.in_features // 2
    for call in (1, 2):
        x = torch.randn(3, lin.in_features, generator=gen).half()
        with torch.inference_mode():
            expected = lin(x.float())
            for rank, shard in enumerate(shards):
                shard.reduce.send(shard, x[:, rank * half:(rank + 1) * half])
            assert all(s.tolist() == [call, call] for s in signals)
            got = [shard.reduce.receive(shard, 3) for shard in shards]
        assert torch.equal(got[0], got[1]), "the ranks disagree"
        torch.testing.assert_close(got[0].float(), expected, atol=2e-2, rtol=2e-2)
        assert [shard.reduce.state.tolist() for shard in shards] == [[call, 0]] * world


@interpreter_only
def test_p2p_epilogue_folds_the_next_norm_on_both_ranks():
    """PeerReduce.receive_add_norm (the p2p epilogue with the next add + RMSNorm folded in, kernels.norm_fold): two
    simulated ranks (TRITON_INTERPRET) give the same h, h ⊙ w and Σ h² partials bit for bit, and h and the norm
    they imply match ops.add_rms_norm over the unsharded layer's output."""
    from spear.kernels.ops import add_rms_norm_ref
    from spear.runtime.tp import PEER_BLOCK_N

    args = ModelArgs(dim=192, intermediate=128, n_heads=4, n_kv_heads=2, head_dim=48, n_layers=1, vocab=64)
    model = random_model(args, QuantConfig(group_size=32), ec_fraction=1.0, rank=8, dtype=torch.float32, seed=2, kernels=False)
    lin = model.layers[0].feed_forward.w_down  # 192 × 128: two epilogue blocks of columns, the second partial
    world, max_rows = 2, 4
    shards, slots, signals = p2p_shards(lin, world, max_rows)
    assert not any(shard.folds_norm(3) for shard in shards)  # built without options' fold_norm_tp
    for shard in shards:
        shard.fold_norm = True  # as set_reduction sets it with fold_norm_tp
    assert all(shard.folds_norm(3) for shard in shards) and not shards[0].folds_norm(max_rows + 1)
    gen = torch.Generator().manual_seed(5)
    half = lin.in_features // 2
    x = torch.randn(3, lin.in_features, generator=gen).half()
    residual = (torch.randn(3, lin.out_features, generator=gen) * 3).half()
    norm_w = (1 + torch.rand(lin.out_features, generator=gen)).half()
    with torch.inference_mode():
        normed, h = add_rms_norm_ref(lin(x.float()).half(), norm_w, 1e-5, residual)
        for rank, shard in enumerate(shards):
            shard.reduce.send(shard, x[:, rank * half:(rank + 1) * half])
        got = [shard.reduce.receive_add_norm(shard, 3, residual, norm_w, 1e-5) for shard in shards]
    for field in ("h", "hw", "ssq"):
        assert torch.equal(getattr(got[0], field), getattr(got[1], field)), f"the ranks disagree on {field}"
    folded = got[0]
    assert folded.ssq.shape == (3, -(-lin.out_features // PEER_BLOCK_N))
    torch.testing.assert_close(folded.h.float(), h.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(folded.ssq.sum(1), folded.h.float().pow(2).sum(1), rtol=1e-5, atol=0)
    rstd = torch.rsqrt(folded.ssq.sum(1, keepdim=True) / lin.out_features + 1e-5)
    torch.testing.assert_close((folded.hw.float() * rstd), normed.float(), atol=3e-2, rtol=2e-2)


@interpreter_only
def test_tp_decode_bench_tiny_runs_end_to_end(tmp_path):
    out = tmp_path / "tp_decode.json"
    cmd = [sys.executable, str(ROOT / "bench" / "tp_decode.py"), "--tiny", "--batches", "2", "--json", str(out)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert "commit" in result["provenance"] and "errors" not in result
    assert [(r["tp"], r["setting"], r["reduce"]) for r in rows] == [
        (1, "fp32", "-"), (1, "w4", "-"), (1, "w4+ec", "-"),
        (2, "fp32", "collective"), (2, "w4", "collective"), (2, "w4+ec", "collective")]
    assert all(r["repeat_identical"] and r["ranks_identical"] and r["ms_per_token"] > 0 for r in rows)
    assert all(r["max_abs_diff_vs_tp1"] < 1e-4 for r in rows if r["tp"] == 2)
    assert "ms/token" in proc.stdout.splitlines()[-7]
