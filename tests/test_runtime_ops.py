"""The runtime's fused ops: Triton kernels against their PyTorch references (CPU: TRITON_INTERPRET=1, set in conftest).

Inputs are drawn fresh each run (the seed is in every failure message); cache pools are
poisoned with NaN, so a slot written by mistake, or a key read past a sequence's end, shows.
"""

from __future__ import annotations

import os

import pytest
import torch
from fixtures import random_model

from spear.runtime import model as model_module
from spear.kernels import ops
from spear.runtime.kv_cache import NULL_BLOCK, Batch, Chunk, KVCache
from spear.runtime.model import ModelArgs, rope_inv_freq

SEED = int.from_bytes(os.urandom(4), "little")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-5}


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(DEVICE, dtype)


def assert_close(got: torch.Tensor, ref: torch.Tensor, what: str, tol: float | None = None) -> None:
    tol = TOL[ref.dtype] if tol is None else tol
    assert (got.dtype, got.shape) == (ref.dtype, ref.shape), f"{what}: {got.dtype}{list(got.shape)} vs {ref.dtype}"
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol, equal_nan=True, msg=lambda m: f"{what}; seed {SEED}\n{m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_add_rms_norm_matches_reference(dtype, gen):
    for dim in (64, 576, 8192):  # 576: SmolLM2, not a power of two
        x, residual = randn(3, dim, gen=gen, dtype=dtype), randn(3, dim, gen=gen, dtype=dtype)
        weight = (1 + torch.rand(dim, generator=gen)).to(DEVICE, dtype)
        for r in (None, residual):
            y, h = ops.add_rms_norm(x, weight, 1e-5, r, use_triton=True)
            y_ref, h_ref = ops.add_rms_norm_ref(x, weight, 1e-5, r)
            what = f"add_rms_norm dim={dim} {dtype} residual={r is not None}"
            assert_close(h, h_ref, what + " (h)")
            assert_close(y, y_ref, what + " (y)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_silu_mul_matches_reference(dtype, gen):
    for shape in ((3, 1000), (1, 1536), (5, 7)):
        gate, up = randn(*shape, gen=gen, dtype=dtype) * 4, randn(*shape, gen=gen, dtype=dtype)
        assert_close(ops.silu_mul(gate, up, use_triton=True), ops.silu_mul_ref(gate, up), f"silu_mul {shape} {dtype}")
    gate, up = randn(3, 2 * 576, gen=gen, dtype=dtype).split(576, dim=-1)  # row-strided halves of a gate|up output
    assert_close(ops.silu_mul(gate, up, use_triton=True), ops.silu_mul_ref(gate, up), f"silu_mul strided {dtype}")


def nan_pools(num_blocks: int, block_size: int, kv: int, d: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.full((num_blocks, block_size, kv, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (6, 2, 32), (8, 2, 80)])  # GQA 1, 3, 4; D 80: odd
@pytest.mark.parametrize("fused", [False, True])  # q, k, v as row-strided views of one q|k|v GEMM output
def test_rope_write_kv_matches_reference(dtype, heads, kv_heads, head_dim, fused, gen):
    T, num_blocks, block_size = 3, 5, 4
    if fused:
        qkv = randn(T, (heads + 2 * kv_heads) * head_dim, gen=gen, dtype=dtype)
        q, k, v = (part.view(T, -1, head_dim) for part in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                      kv_heads * head_dim], dim=-1))
    else:
        q, k, v = (randn(T, n, head_dim, gen=gen, dtype=dtype) for n in (heads, kv_heads, kv_heads))
    positions = torch.tensor([0, 7, 3000], device=DEVICE)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    inv_freq = rope_inv_freq(ModelArgs(dim=heads * head_dim, intermediate=1, n_heads=heads, n_kv_heads=kv_heads,
                                       head_dim=head_dim, n_layers=1, vocab=1, rope_theta=500000.0,
                                       rope_scaling=rope)).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T].to(DEVICE)
    k_pool, v_pool = nan_pools(num_blocks, block_size, kv_heads, head_dim, dtype)
    k_ref, v_ref = nan_pools(num_blocks, block_size, kv_heads, head_dim, dtype)
    q_rot = ops.rope_write_kv(q, k, v, positions, inv_freq, k_pool, v_pool, slots, use_triton=True)
    q_ref = ops.rope_write_kv_ref(q, k, v, positions, inv_freq, k_ref, v_ref, slots)
    what = f"rope_write_kv H={heads} KV={kv_heads} D={head_dim} {dtype}"
    assert_close(q_rot, q_ref, what + " (q)")
    assert_close(k_pool, k_ref, what + " (k pool)")  # NaN where nothing was written
    assert_close(v_pool, v_ref, what + " (v pool)", tol=0.0)  # v is copied as it is
    assert k_pool.isnan().sum() == k_pool.numel() - T * kv_heads * head_dim


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rope_write_kv_partial_rotary_and_gain_match_reference(dtype, gen):
    """Phi-3.5's partial rotary (the first 48 of 96 dims rotate, the rest pass) and LongRoPE's gain on cos and sin."""
    T, heads, kv_heads, head_dim, num_blocks, block_size = 3, 6, 2, 96, 5, 4
    q, k, v = (randn(T, n, head_dim, gen=gen, dtype=dtype) for n in (heads, kv_heads, kv_heads))
    positions = torch.tensor([0, 7, 3000], device=DEVICE)
    inv_freq = rope_inv_freq(ModelArgs(dim=heads * head_dim, intermediate=1, n_heads=heads, n_kv_heads=kv_heads,
                                       head_dim=head_dim, n_layers=1, vocab=1, rotary_dim=48)).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T].to(DEVICE)
    k_pool, v_pool = nan_pools(num_blocks, block_size, kv_heads, head_dim, dtype)
    k_ref, v_ref = nan_pools(num_blocks, block_size, kv_heads, head_dim, dtype)
    q_rot = ops.rope_write_kv(q, k, v, positions, inv_freq, k_pool, v_pool, slots, gain=1.07, use_triton=True)
    q_ref = ops.rope_write_kv_ref(q, k, v, positions, inv_freq, k_ref, v_ref, slots, gain=1.07)
    assert_close(q_rot, q_ref, f"partial rope {dtype} (q)")
    assert_close(q_rot[..., 48:], q[..., 48:], "partial rope: the tail passes", tol=0.0)
    assert_close(k_pool, k_ref, f"partial rope {dtype} (k pool)")
    assert_close(v_pool, v_ref, f"partial rope {dtype} (v pool)", tol=0.0)


def random_cache(seq_lens: list[int], width: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 gen: torch.Generator):
    """Block tables [B, width] over distinct random blocks (padded with block 0) and pools holding random keys
    and values at each sequence's first seq_len positions: NaN elsewhere in the kernel's pools, 0 in the reference's."""
    num_blocks = 1 + len(seq_lens) * width
    ids = (1 + torch.randperm(num_blocks - 1, generator=gen)).view(len(seq_lens), width)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for b, n in enumerate(seq_lens):
        n_blocks = -(-n // block_size)
        ids[b, n_blocks:] = 0
        for p in range(n):
            used[ids[b, p // block_size], p % block_size] = True
    pools, ref_pools = [], []
    for _ in range(2):
        x = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        pools.append(x.masked_fill(~used[..., None, None], float("nan")).to(DEVICE))
        ref_pools.append(x.masked_fill(~used[..., None, None], 0).to(DEVICE))
    return ids.to(DEVICE), pools, ref_pools


@pytest.mark.parametrize("window", [None, 20])  # a sliding-window layer: keys of the last 20 positions only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2), (4, 1)])  # GQA 1, 3, 4
def test_paged_decode_attention_matches_reference(dtype, heads, kv_heads, window, gen):
    """Lengths 1, a block, a block and a bit, the full table; the keys in 1, 3 (not a power of two: the
    combine's padding) and 16 splits (more than the longest row has steps: empty splits), and the default."""
    block_size, width, head_dim = 16, 5, 32
    seq_lens = [1, 16, 37, 80]
    tables, (k_pool, v_pool), (k_ref, v_ref) = random_cache(seq_lens, width, block_size, kv_heads, head_dim, dtype, gen)
    q = randn(len(seq_lens), heads, head_dim, gen=gen, dtype=dtype)
    lens = torch.tensor(seq_lens, device=DEVICE)
    ref = ops.paged_decode_attention_ref(q, k_ref, v_ref, tables, lens, window=window)
    for splits in (1, 3, 16, None):
        out = ops.paged_decode_attention(q, k_pool, v_pool, tables, lens, use_triton=True, splits=splits, block_n=16,
                                         window=window)
        assert_close(out, ref, f"decode attention H={heads} KV={kv_heads} {dtype} splits={splits} window={window}")


@pytest.mark.parametrize("head_dim", [64, 96, 80])  # 96: Phi-3's, padded to 128 in the kernel; 80 to 128 as well
def test_paged_decode_attention_head_dim_block_size_and_scale(head_dim, gen):
    block_size, width = 8, 6
    seq_lens = [48, 9, 30]
    kv_heads, dtype = 2, torch.float16
    tables, (k_pool, v_pool), (k_ref, v_ref) = random_cache(seq_lens, width, block_size, kv_heads, head_dim, dtype, gen)
    q = randn(len(seq_lens), 8 + 3, head_dim, gen=gen, dtype=dtype)[:, :8]  # rows strided, as a q|k|v output's q
    lens = torch.tensor(seq_lens, device=DEVICE, dtype=torch.int32)
    out = ops.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.3, use_triton=True, splits=4, block_n=16)
    assert_close(out, ops.paged_decode_attention_ref(q, k_ref, v_ref, tables, lens, 0.3), f"decode attention D={head_dim} bs=8")
    out = ops.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.3, use_triton=True, splits=1, block_n=16)
    assert_close(out, ops.paged_decode_attention_ref(q, k_ref, v_ref, tables, lens, 0.3), f"D={head_dim} one split")


@pytest.mark.parametrize("window", [None, 12])  # with a sliding window each row of a tile has its own first key
@pytest.mark.parametrize("splits", [1, 3])  # 1: the split kernel writes the output, no combine launch
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])  # MHA (16 rows a tile) and GQA 3 (4 rows a tile)
def test_paged_attention_tiles_of_prefill_rows_match_reference(heads, kv_heads, splits, window, gen):
    """A mixed step's tokens as rows: two prompts' chunks (rows at consecutive positions, grouped into tiles of
    one sequence) and two decodes (tiles of one row), then padding tiles; each row sees keys up to its own
    position, across splits that start past some rows of a tile."""
    block_size, width, head_dim, dtype = 8, 6, 32, torch.float16
    seq_lens = [45, 20, 7, 30]  # the sequences' lengths after this step
    new = [29, 20, 1, 1]  # this step's tokens of each: a later chunk, a whole prompt, two decodes
    tables, (k_pool, v_pool), (k_ref, v_ref) = random_cache(seq_lens, width, block_size, kv_heads, head_dim, dtype, gen)
    rows = [(s, pos) for s, (n, k) in enumerate(zip(seq_lens, new)) for pos in range(n - k, n)]
    tile_rows = ops.attention_tile_rows(heads // kv_heads)
    tiles, first = [], 0
    for k in new:
        for lo in range(0, k, tile_rows):
            tiles.append((first + lo, min(tile_rows, k - lo)))
        first += k
    tiles += [(0, 0)] * 3
    row_tables = tables[[s for s, _ in rows]]  # each cut to the blocks its row uses, as kv_cache.Batch cuts them
    used = torch.tensor([pos // block_size + 1 for _, pos in rows], device=DEVICE)
    row_tables = row_tables.masked_fill(torch.arange(width, device=DEVICE) >= used[:, None], 0)
    lens = torch.tensor([pos + 1 for _, pos in rows], device=DEVICE)
    q = randn(len(rows), heads, head_dim, gen=gen, dtype=dtype)
    ref = ops.paged_decode_attention_ref(q, k_ref, v_ref, row_tables, lens, window=window)
    out = ops.paged_decode_attention(q, k_pool, v_pool, row_tables, lens, use_triton=True, splits=splits, block_n=16,
                                     tiles=torch.tensor(tiles, device=DEVICE), tile_rows=tile_rows, window=window)
    assert_close(out, ref, f"tiled attention H={heads} KV={kv_heads} splits={splits} window={window}")


def test_model_steps_with_kernels_match_references(monkeypatch, gen):
    """The ops as the model wires them: prefill, mixed steps (a one-token prefill piece among decodes, then a longer
    chunk beside them), then a decode step, with every op forced to Triton or to PyTorch."""
    args = ModelArgs(dim=64, intermediate=96, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2, vocab=100)
    model = random_model(args, dtype=torch.float32, device=DEVICE, seed=SEED % 1000)
    prompts, tables = [[5, 17, 3, 9, 11], [42, 7], [8, 6, 2]], [[3, 1], [2, 4], [5, 6]]

    def run(triton: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(ops, "_triton", lambda use_triton, x: triton)
        cache = KVCache(args.n_layers, 7, 4, args.n_kv_heads, args.head_dim, torch.float32, DEVICE)
        decodes = [[Chunk([1 + i], len(p) + i, t) for p, t in zip(prompts[:2], tables)] for i in range(3)]
        steps = [[Chunk(p, 0, t) for p, t in zip(prompts[:2], tables)],
                 decodes[0] + [Chunk(prompts[2][:1], 0, tables[2])], decodes[1] + [Chunk(prompts[2][1:], 1, tables[2])],
                 decodes[2] + [Chunk([4], 3, tables[2])]]
        batches = [Batch.build(chunks, 4, DEVICE) for chunks in steps]
        assert [b.decode for b in batches] == [False, True, False, True]
        with torch.inference_mode():
            return [model(b, cache) for b in batches]  # [B, vocab] each

    for i, (got, ref) in enumerate(zip(run(True), run(False))):
        assert_close(got, ref, f"model logits of step {i}, kernels vs references", tol=1e-4)


def test_cpu_steps_build_rope_angles_and_decode_masks_once_with_the_same_logits(monkeypatch):
    """On a CPU a step builds RoPE's angles and the decode rows' key mask once for every layer (Batch.rope_cos_sin,
    Batch.decode_mask): the logits of a prefill, a mixed and a decode step equal bit for bit those of every layer
    building its own."""
    from spear.runtime.model import Attention

    args = ModelArgs(dim=64, intermediate=96, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=3, vocab=100,
                     rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = random_model(args, dtype=torch.float32, device=torch.device("cpu"), seed=3)
    tables = [[3, 1], [2, 4], [5, 6]]
    steps = [[Chunk([5, 17, 3, 9, 11], 0, tables[0]), Chunk([42, 7], 0, tables[1])],
             [Chunk([1], 5, tables[0]), Chunk([2], 2, tables[1]), Chunk([8, 6, 2], 0, tables[2])],
             [Chunk([3], 6, tables[0]), Chunk([4], 3, tables[1]), Chunk([9], 3, tables[2])]]

    def run() -> list[torch.Tensor]:
        cache = KVCache(args.n_layers, 7, 4, args.n_kv_heads, args.head_dim, torch.float32, torch.device("cpu"))
        with torch.inference_mode():
            return [model(Batch.build(chunks, 4, torch.device("cpu")), cache) for chunks in steps]

    from spear.runtime import kv_cache

    built = []
    monkeypatch.setattr(kv_cache, "rope_cos_sin", lambda *a: built.append(a) or ops.rope_cos_sin(*a))
    once = run()
    assert len(built) == len(steps)  # once a step, for every layer
    monkeypatch.setattr(Attention, "rope_cos_sin", lambda self, inv_freq, batch: None)  # each layer its own
    monkeypatch.setattr(Batch, "decode_mask", lambda self, keys, window: None)
    each = run()
    assert all(torch.equal(a, b) for a, b in zip(once, each))


def test_mixed_step_as_tiled_token_rows_matches_the_chunked_step(monkeypatch, gen):
    """runner.token_rows with attention tiles: a mixed step (a decode, a prompt's later chunk crossing a block
    boundary, a new prompt) as one-token rows in padded static shapes, through the Triton kernels, gives the
    logits and the cached K/V of the chunked step through the references."""
    from spear.runtime.runner import token_rows

    args = ModelArgs(dim=64, intermediate=96, n_heads=4, n_kv_heads=4, head_dim=16, n_layers=2, vocab=100)
    model = random_model(args, dtype=torch.float32, device=DEVICE, seed=SEED % 1000)
    tables = [[3, 1, 7, 4], [2], [5, 6]]
    prompts = [torch.randint(0, 100, (n,), generator=gen).tolist() for n in (27, 3, 6)]
    cache = KVCache(args.n_layers, 8, 8, args.n_kv_heads, args.head_dim, torch.float32, DEVICE)
    step = [Chunk([7], 3, tables[1]), Chunk(prompts[0][5:], 5, tables[0]), Chunk(prompts[2], 0, tables[2])]

    def forward(triton: bool, batch: Batch) -> torch.Tensor:
        monkeypatch.setattr(ops, "_triton", lambda use_triton, x: triton)
        with torch.inference_mode():
            return model(batch, cache)

    forward(False, Batch.build([Chunk(prompts[0][:5], 0, tables[0]), Chunk(prompts[1], 0, tables[1])], 8, DEVICE))
    k, v = cache.k.clone(), cache.v.clone()
    chunked = forward(False, Batch.build(step, 8, DEVICE))
    chunked_kv = cache.k.clone(), cache.v.clone()
    cache.k.copy_(k)
    cache.v.copy_(v)
    rows, last = token_rows(step)
    tile_rows = ops.attention_tile_rows(1)
    padded = Batch.build(rows + [Chunk([0], 0, [])] * (32 - len(rows)), 8, DEVICE, 4, tile_rows, tile_slots=9)
    assert padded.tiles[:, 1].tolist() == [1, 16, 6, 6, 3, 0, 0, 0, 0]  # decode, chunk 16 + 6, prompt, padding
    tiled = forward(True, padded)
    assert_close(tiled[last], chunked, "mixed step as tiled token rows vs chunked", tol=1e-4)
    for got, ref in zip((cache.k, cache.v), chunked_kv):  # the step's keys and values cached alike (block 0: padding's)
        assert_close(got[:, NULL_BLOCK + 1:], ref[:, NULL_BLOCK + 1:], "the step's K/V in the cache", tol=1e-4)


def test_decode_splits_fill_the_gpu_and_follow_the_table():
    """Few rows: many splits (the GPU's programs come from the keys); many rows: one; never more than the
    table's BLOCK_N steps or MAX_SPLITS; a power of two where the table is long."""
    cpu = torch.device("cpu")  # 4 "SMs"
    assert ops.decode_splits(1, 4096, 64, cpu) == min(ops.MAX_SPLITS, 4 * ops.ATTENTION_PROGRAMS_PER_SM)
    assert ops.decode_splits(1, 100, 64, cpu) == 2  # two steps of keys at most
    assert ops.decode_splits(10_000, 4096, 64, cpu) == 1
    assert all(s & (s - 1) == 0 for s in (ops.decode_splits(n, 4096, 64, cpu) for n in range(1, 40)))
