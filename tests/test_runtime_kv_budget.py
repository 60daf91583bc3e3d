"""The KV cache sized by memory: blocks from a byte budget, a one-line error when one sequence does not fit,
admission by free blocks, recompute preemption that changes no output, its counter, half-precision caches on CPU."""

from __future__ import annotations

import asyncio
import logging
import re

import httpx
import pytest
import torch
from server_harness import running_server

from spear.api import load
from spear.cli import main
from spear.errors import SpearError
from spear.runtime.engine import (
    CPU_KV_CACHE_MEMORY,
    Engine,
    EngineConfig,
    build_engine,
    kv_block_bytes,
    kv_cache_blocks,
    kv_cache_summary,
    make_runner,
)
from spear.runtime.model import build_runtime_model
from spear.runtime.requests import SamplingParams
from spear.server.app import build_app
from spear.server.async_engine import AsyncEngine
from spear.server.launch import parse_memory

CPU = torch.device("cpu")
# The tiny model's block (tests/conftest.py): K and V × 2 layers × 16 tokens × 2 KV heads × head dim 16 × 4 bytes
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir), CPU, torch.float32)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str]]:
    """Each request's streamed token ids and text, checking that nothing comes after its last output."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    ids, text, done = {rid: [] for rid in requests}, dict.fromkeys(requests, ""), set()
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in done, "an output after the last"
            ids[out.request_id] += out.new_token_ids
            text[out.request_id] += out.new_text
            if out.finished:
                done.add(out.request_id)
    return {rid: (ids[rid], text[rid]) for rid in requests}


def test_blocks_from_the_budget(tiny):
    model = build_runtime_model(tiny.model)
    assert kv_block_bytes(model, 16) == BLOCK_BYTES
    runner = make_runner(model, EngineConfig(max_model_len=128, kv_cache_memory=100 * BLOCK_BYTES + 5))
    assert runner.cache.num_blocks == 100 and runner.cache.nbytes == 100 * BLOCK_BYTES
    assert kv_cache_summary(runner) == "KV cache: 99 blocks, 1584 tokens (0.78 MiB, float32): 12 sequences of 128 tokens"
    # a CPU's default budget, but no more blocks than max_num_seqs sequences of the context could use
    assert kv_cache_blocks(model, EngineConfig(max_model_len=128)) == 256 * 8 + 1
    assert kv_cache_blocks(model, EngineConfig(max_model_len=128, max_num_seqs=10**6)) == CPU_KV_CACHE_MEMORY // BLOCK_BYTES
    assert kv_cache_blocks(model, EngineConfig(max_model_len=128, num_kv_blocks=7)) == 7  # explicit blocks win


def test_budget_too_small_for_one_sequence(tiny):
    model = build_runtime_model(tiny.model)
    with pytest.raises(SpearError, match=r"budget of 0.06 MiB holds 112 tokens; one sequence of 128 tokens needs .* "
                                         r"raise --kv-cache-memory .* lower --max-model-len"):
        make_runner(model, EngineConfig(max_model_len=128, kv_cache_memory=8 * BLOCK_BYTES))
    assert make_runner(model, EngineConfig(max_model_len=128, kv_cache_memory=9 * BLOCK_BYTES)).cache.num_blocks == 9


def test_cli_budget_too_small_is_one_line_exit_2(tiny_model_dir, capsys):
    for size, match in (("64KiB", "one sequence of 512 tokens needs"), ("2 parsecs", "as a memory size")):
        rc = main(["serve", str(tiny_model_dir), "--port", "0", "--device", "cpu", "--kv-cache-memory", size])
        err = capsys.readouterr().err
        lines = [line for line in err.strip().splitlines() if line.startswith("spear:")]
        assert rc == 2 and "Traceback" not in err and len(lines) == 1 and match in lines[0], err


def test_parse_memory():
    assert parse_memory("1073741824") == 2**30
    assert parse_memory("2GiB") == 2 * 2**30 and parse_memory("512 MiB") == 512 * 2**20
    assert parse_memory("1.5GB") == 1_500_000_000 and parse_memory("64kib") == 65536
    for bad in ("", "GiB", "-1GiB", "1.5 parsecs", "1e9"):
        with pytest.raises(SpearError, match="memory size"):
            parse_memory(bad)


def test_admission_by_free_blocks(tiny):
    """Requests are admitted on the blocks of their prompt, not of their whole length (max_tokens)."""
    engine = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=128, num_kv_blocks=9))
    for i in range(4):  # 10 + 100 tokens each: 7 blocks of 8 if reserved up front, 1 running at a time
        engine.add_request(f"r{i}", prompt(10, i), SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    assert engine.num_running == 4 and engine.kv_blocks_used == 4


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_changes_no_output(tiny, overlap, caplog):
    requests = {f"r{i}": (prompt(20 + 7 * i, i), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
                for i in range(5)}
    requests["seeded"] = (prompt(30, 9), SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True))
    big = run(build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=128, overlap=overlap)), requests)
    # 8 blocks (128 tokens): one sequence of the context, about two of these at once
    small = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=128, num_kv_blocks=9, overlap=overlap))
    with caplog.at_level(logging.WARNING, logger="spear.runtime.engine"):
        assert run(small, requests) == big
    assert small.num_preemptions > 3 and small.kv_blocks_used == 0
    warnings = [r.getMessage() for r in caplog.records if "preempted request" in r.getMessage()]
    assert len(warnings) == small.num_preemptions
    assert re.search(r"preempted request \w+, its \d+ blocks freed, its \d+ tokens to be recomputed", warnings[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_kv_cache_on_cpu(tiny_model_dir, dtype):
    lm = load(str(tiny_model_dir), CPU, dtype)
    big = build_engine(lm.model, lm.tokenizer, EngineConfig(max_model_len=128))
    assert big.runner.cache.k.dtype == dtype and kv_block_bytes(big.runner.model, 16) == BLOCK_BYTES // 2
    requests = {f"r{i}": (prompt(20 + 7 * i, i), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
                for i in range(4)}
    got = run(big, requests)
    ids = requests["r0"][0]
    hf = lm.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(ids):]
    assert got["r0"][0][:8] == hf.tolist()
    small = build_engine(lm.model, lm.tokenizer, EngineConfig(max_model_len=128, num_kv_blocks=9))
    assert run(small, requests) == got and small.num_preemptions > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_model_over_a_half_precision_kv_cache(tiny, dtype):
    """--kv-cache-dtype on a CPU: the same budget holds twice the blocks, K and V are stored rounded and read back in
    float32, and the logits stay within the rounding of the cached keys and values."""
    from types import SimpleNamespace

    from spear.runtime.engine import kv_cache_dtype
    from spear.runtime.kv_cache import Batch, Chunk

    model = build_runtime_model(tiny.model)
    budget = EngineConfig(max_model_len=64, kv_cache_memory=20 * BLOCK_BYTES)
    assert kv_cache_blocks(model, budget) == 20
    half = EngineConfig(max_model_len=64, kv_cache_memory=20 * BLOCK_BYTES, kv_cache_dtype=dtype)
    assert kv_cache_blocks(model, half) == 40 and kv_block_bytes(model, 16, dtype) == BLOCK_BYTES // 2
    runners = {"full": make_runner(model, budget), "half": make_runner(model, half)}
    assert runners["half"].cache.k.dtype == dtype and runners["full"].cache.k.dtype == torch.float32
    ids = prompt(40)
    logits = {}
    for name, runner in runners.items():
        with torch.inference_mode():
            prefill = model(Batch.build([Chunk(ids[:39], 0, [1, 2, 3])], 16, CPU), runner.cache)
            decode = model(Batch.build([Chunk(ids[39:], 39, [1, 2, 3])], 16, CPU), runner.cache)
        logits[name] = torch.cat([prefill, decode])
    assert logits["half"].dtype == torch.float32
    err = ((logits["half"] - logits["full"]).norm(dim=-1) / logits["full"].norm(dim=-1)).max()
    assert 0 < err < 2e-2  # the cache is rounded, and no more than that
    with pytest.raises(SpearError, match="in the model's dtype"):
        kv_cache_dtype(SimpleNamespace(dtype=torch.float32, device=torch.device("cuda")), half)


def test_cli_kv_cache_dtype_is_checked(capsys):
    from spear.server.launch import ServeConfig

    with pytest.raises(SpearError, match="--kv-cache-dtype must be one of"):
        ServeConfig(kv_cache_dtype="int8")
    with pytest.raises(SystemExit) as info:
        main(["serve", "smollm2", "--kv-cache-dtype", "fp8"])
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_preemptions_counted_in_metrics(tiny):
    engine = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=128, num_kv_blocks=9))
    async_engine = AsyncEngine(engine)
    body = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}

    with running_server(build_app(async_engine, tiny.tokenizer, "tiny", engine.max_model_len)) as url:
        async def all_at_once() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as client:
                answers = await asyncio.gather(*(client.post(f"{url}/v1/completions", json={**body, "prompt": "x" * n})
                                                 for n in range(20, 60, 8)))
            return [a.status_code for a in answers]

        assert asyncio.run(all_at_once()) == [200] * 5
        metrics = httpx.get(f"{url}/metrics").text
    counted = float(re.search(r"^spear_num_preemptions_total (\S+)$", metrics, re.M).group(1))
    assert counted == engine.num_preemptions > 0
