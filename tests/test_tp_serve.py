"""Serving under tensor parallelism on CPU (gloo): rank 0's engine drives the other ranks step by step.

The tiny model's decoder weights are scaled up (x10) so that its greedy continuations depend on
attention and the MLP (at the default init it only repeats the last token, which a broken
shard would too).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import make_byte_tokenizer, make_tiny_llama
from server_harness import running_server, wait_until

from spear import api
from spear.cli import main
from spear.errors import SpearError
from spear.runtime.engine import Engine, EngineConfig, build_engine, make_runner
from spear.runtime.kv_cache import Chunk
from spear.runtime.requests import SamplingParams
from spear.runtime.scheduler import StaticChunkPolicy
from spear.runtime.tp import launch
from spear.runtime.tp_serve import (
    StepChannel,
    _pack,
    _unpack,
    agree_kv_blocks,
    follow,
    leader_engine,
    shard_runtime_model,
)
from spear.server.app import build_app
from spear.server.async_engine import AsyncEngine

PROMPTS = ([5, 17, 99, 3, 250, 41, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [200, 100], [42] * 9, [7, 77, 177])
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def lively_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-x10")
    model = make_tiny_llama()
    with torch.no_grad():
        for p in model.model.layers.parameters():
            if p.dim() == 2:
                p.mul_(10)
    model.save_pretrained(path)
    make_byte_tokenizer().save_pretrained(path)
    return path


def engine_config() -> EngineConfig:
    """Fewer slots than prompts (one waits for freed blocks) and 8-token chunks (prefill beside decodes)."""
    return EngineConfig(max_num_seqs=4, max_model_len=64, block_size=4, policy=StaticChunkPolicy(8))


def greedy(engine: Engine) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), list(prompt), params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def lead_or_follow(model_dir) -> None:
    """Rank 0: greedy tokens of the TP engine == the single-process engine's; other ranks follow."""
    torch.set_num_threads(1)
    lm = api.load(str(model_dir), torch.device("cpu"))
    channel = StepChannel()
    if dist.get_rank() > 0:
        model = shard_runtime_model(lm.model)
        follow(make_runner(model, agree_kv_blocks(model, engine_config(), channel)), channel)
        return
    expected = greedy(build_engine(lm.model, lm.tokenizer, engine_config()))
    try:
        engine = leader_engine(lm.model, lm.tokenizer, engine_config(), channel)
        assert engine.runner.cache.k.shape[3] == 1  # this rank's KV heads: 2 over 2 ranks
        got = greedy(engine)
    finally:
        channel.send(None)
    assert len({tuple(t) for t in expected.values()}) == len(PROMPTS) and len(set(expected["0"])) > 3
    assert got == expected


def test_tp_engine_matches_single_process(lively_model_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    launch(lead_or_follow, 2, lively_model_dir)


def fail_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise SpearError("rank 1 cannot go on")


def test_launch_raises_a_rank_s_spear_error(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(SpearError, match="^rank 1 cannot go on$"):
        launch(fail_on_rank_1, 2)


def test_cli_serve_tp_errors(tiny_model_dir, capsys):
    assert main(["serve", str(tiny_model_dir), "--tp", "0", "--port", "0"]) == 2
    assert capsys.readouterr().err == "spear: error: --tp must be at least 1, got 0\n"
    assert main(["serve", str(tiny_model_dir), "--tp", "2", "--tp-reduction", "nccl", "--port", "0"]) == 2
    assert capsys.readouterr().err == "spear: error: --tp-reduction must be one of collective, symmetric, p2p, got 'nccl'\n"


def test_cli_serve_tp2_answers_as_tp1(lively_model_dir):
    """`spear serve --tp 2` over HTTP gives the same greedy text as the single-process server."""
    requests = [{"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True} for p in ("hello", "the cat sat", "0123")]
    lm = api.load(str(lively_model_dir), torch.device("cpu"))
    engine = build_engine(lm.model, lm.tokenizer, EngineConfig(max_num_seqs=4, max_model_len=64))
    with running_server(build_app(AsyncEngine(engine), lm.tokenizer, "tiny", engine.max_model_len)) as url:
        expected = [httpx.post(f"{url}/v1/completions", json=r).json()["choices"][0]["text"] for r in requests]
    assert len(set(expected)) == len(requests)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "spear.cli", "serve", str(lively_model_dir), "--tp", "2", "--port", "0",
                             "--device", "cpu", "--max-model-len", "64", "--max-num-seqs", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "tensor parallel over 2 ranks" in line, line
        url = re.search(r"(http://\S+)/v1", line).group(1)
        wait_until(lambda: _healthy(url), timeout=60)
        got = [httpx.post(f"{url}/v1/completions", json=r, timeout=60).json()["choices"][0]["text"] for r in requests]
    finally:
        proc.terminate()  # the launcher passes SIGTERM on; rank 0 shuts down and stops rank 1
        assert proc.wait(timeout=60) == 0
    assert got == expected


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False


def test_spear_bench_decode_tp2(tmp_path):
    """`spear bench decode --tp 2` starts its ranks; rank 0 records the rows (one rank's shard bytes)."""
    out = tmp_path / "decode.json"
    cmd = [sys.executable, "-m", "spear.cli", "bench", "decode", "--tiny", "--tp", "2", "--batches", "2",
           "--new-tokens", "4", "--settings", "w4+ec38", "--json", str(out)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["tp"] == 2 and [(r["setting"], r["batch"], r["decode_steps"]) for r in result["rows"]] == [("w4+ec38", 2, 3)]


def channel_steps() -> list:
    """Steps for the channel: small ones, one larger than a slot (SLOT_INTS is cut to 256 in the test), more steps
    than slots (the ring wraps around and rank 0 must wait for the follower), then the stop."""
    steps = [[Chunk([i, i + 1, 2**31 - 1], 7 * i, list(range(i % 5)))] for i in range(20)]
    steps.insert(3, [Chunk(list(range(300)), 0, [9] * 40), Chunk([4], 299, [1, 2])])  # 350 ints: too large
    steps.insert(11, [Chunk([s], s, [s, s + 1]) for s in range(40)])
    return [*steps, None]


def exchange_steps() -> None:
    StepChannel.SLOT_INTS, StepChannel.SLOTS = 256, 4
    channel = StepChannel()
    steps = channel_steps()
    if dist.get_rank() == 0:
        for step in steps:
            channel.send(step)
        return
    got = [channel.receive() for _ in steps]
    if got != steps:
        raise SpearError(f"rank {dist.get_rank()} received other steps than were sent")


def test_step_channel_hands_every_step_over_in_order(monkeypatch):
    """Through the shared-memory ring, the pickled path for a step too large for a slot, and the wrap-around."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    launch(exchange_steps, 3)  # two followers: rank 0 waits for the slower one


def test_step_channel_packing_round_trips():
    for step in channel_steps():
        assert _unpack(np.concatenate([_pack(step), np.zeros(4, np.int32)])) == step


def test_step_channel_wait_ends_when_another_rank_is_gone():
    """A rank waiting on the channel (a follower for a step, rank 0 for a free slot) ends instead of hanging."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    channel = StepChannel.__new__(StepChannel)  # the wait alone: no process group needed
    channel.rank, channel.peers, channel.SPIN_S = 1, [os.getpid(), gone.pid], 0.0
    with pytest.raises(SystemExit, match="another tensor-parallel rank is gone"):
        channel._wait(lambda: False)
