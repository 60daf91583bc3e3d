"""The server end to end on the real engine: the official openai client, errors, disconnects, 64 clients."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from server_harness import CHAT_TEMPLATE, running_server, wait_until

from spear.cli import main
from spear.models import load_float_model
from spear.runtime.engine import EngineConfig, build_engine
from spear.server.app import build_app
from spear.server.async_engine import AsyncEngine



@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    lm = load_float_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)
    lm.tokenizer.chat_template = CHAT_TEMPLATE
    return lm


def tiny_server(lm, **config):
    engine = build_engine(lm.model, lm.tokenizer, EngineConfig(max_model_len=128, max_num_seqs=8, **config))
    async_engine = AsyncEngine(engine)
    return async_engine, running_server(build_app(async_engine, lm.tokenizer, "tiny", engine.max_model_len))


def test_openai_client_streams_what_it_returns_whole(tiny):
    _, server = tiny_server(tiny)
    with server as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        args = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
        whole = client.completions.create(**args)
        assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args))
        assert streamed == whole.choices[0].text

        messages = [{"role": "user", "content": "hello there"}]
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
        assert chunks[-1].usage.model_dump() == chat.usage.model_dump()

        seeded = dict(args, temperature=1.0, seed=7)
        assert client.completions.create(**seeded).choices[0].text == client.completions.create(**seeded).choices[0].text


def test_openai_parameters_through_the_official_client(tiny):
    """logprobs (completions and chat, whole and streamed), echo, logit_bias, penalties, seed among other requests."""
    _, server = tiny_server(tiny)
    with server as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        args = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0,
                "extra_body": {"ignore_eos": True}}
        whole = client.completions.create(logprobs=2, **args).choices[0]
        lp = whole.logprobs
        assert "".join(lp.tokens) == whole.text and lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(6)]
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert logprob <= 0 and top[token] == logprob == max(top.values())  # greedy: the most likely
            assert len(top) <= 3  # the two most likely, and the sampled token's (one of them here)
        streamed = [c.choices[0] for c in client.completions.create(stream=True, logprobs=2, **args)]
        assert sum((c.logprobs.token_logprobs for c in streamed if c.logprobs), []) == pytest.approx(lp.token_logprobs)

        messages = [{"role": "user", "content": "hello there"}]
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3).choices[0]
        content = chat.logprobs.content
        assert "".join(c.token for c in content) == chat.message.content and len(content) == 5
        assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob for c in content)
        assert bytes(content[0].bytes).decode() == content[0].token
        assert client.chat.completions.create(model="tiny", messages=messages, max_tokens=2).choices[0].logprobs is None

        echoed = client.completions.create(echo=True, **args).choices[0].text
        assert echoed == "The quick brown fox" + whole.text
        assert "".join(c.choices[0].text for c in client.completions.create(stream=True, echo=True, **args)) == echoed

        token = tiny.tokenizer("Z", add_special_tokens=False).input_ids[0]
        biased = client.completions.create(logit_bias={str(token): 100}, logprobs=0, **args).choices[0]
        assert biased.text == "Z" * 6 and biased.logprobs.token_logprobs != lp.token_logprobs  # raw model logprobs
        repeats = dict(args, prompt="aaaa", max_tokens=12)
        plain = client.completions.create(**repeats).choices[0].text
        penalized = client.completions.create(presence_penalty=2, frequency_penalty=2, **repeats).choices[0].text
        assert len(set(penalized)) > len(set(plain))

        seeded = dict(args, temperature=1.0, seed=11, max_tokens=10)
        alone = client.completions.create(**seeded).choices[0].text

        async def among_others() -> str:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as ac:
                others = [ac.completions.create(**dict(seeded, seed=None, prompt=f"other {i}")) for i in range(4)]
                answers = await asyncio.gather(ac.completions.create(**seeded), *others)
                return answers[0].choices[0].text

        assert asyncio.run(among_others()) == alone
        assert client.completions.create(**dict(seeded, seed=12)).choices[0].text != alone


def test_prompt_longer_than_context_is_400(tiny):
    _, server = tiny_server(tiny)
    with server as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="x" * 200, max_tokens=4)
        assert e.value.body["code"] == "context_length_exceeded" and "128" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "y" * 200}])


def test_extreme_sampling_values_never_fail_other_streams(tiny):
    """Values that once raised inside a batched step and failed every stream in it: now each is either a 400 or a
    normal answer, and the greedy streams around them finish with the text they have alone."""
    async_engine, server = tiny_server(tiny, overlap=True)
    greedy = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    hostile = [{"top_k": 2**63, "temperature": 1}, {"top_p": 1e-50}, {"top_p": 5e-324}, {"temperature": 1e-50},
               {"temperature": 1e-40}, {"seed": 2**64}, {"seed": -2**63 - 1}]
    with server as url:
        alone = httpx.post(f"{url}/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"]

        async def mixed():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                streams = [client.post("/v1/completions", json=greedy) for _ in range(3)]
                bad = [client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, **h}) for h in hostile]
                return await asyncio.gather(*streams, *bad)

        answers = asyncio.run(mixed())
    assert [r.json()["choices"][0]["text"] for r in answers[:3]] == [alone] * 3
    assert [r.status_code for r in answers[3:]] == [200] * 5 + [400] * 2
    assert async_engine.stats.kv_blocks_used == 0


@pytest.mark.parametrize("overlap", [False, True])  # True: spear serve's default (EngineConfig.overlap)
def test_disconnect_mid_stream_frees_kv_blocks(tiny, overlap):
    async_engine, server = tiny_server(tiny, overlap=overlap)
    step = async_engine.engine.step

    def slow_step():  # 100 tokens take over a second: the client is surely gone before the end
        time.sleep(0.01)
        return step()

    async_engine.engine.step = slow_step
    body = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with server as url:
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert next(line for line in r.iter_lines() if line.startswith("data:"))
            assert async_engine.stats.kv_blocks_used > 0
        wait_until(lambda: async_engine.stats.kv_blocks_used == 0 and async_engine.stats.num_running == 0)
        assert async_engine.engine.kv_blocks_used == 0
        assert async_engine.engine.num_steps < 100  # aborted, not run to its end


def test_64_concurrent_streams_match_unstreamed_greedy(smollm2):
    # overlapped steps, as spear serve runs them (ServeConfig.overlap)
    engine = build_engine(smollm2.model, smollm2.tokenizer, EngineConfig(max_model_len=256, overlap=True))
    async_engine = AsyncEngine(engine)
    prompts = [f"Fact number {i}: the {['sun', 'sea', 'moon', 'wind'][i % 4]} is" for i in range(64)]
    args = {"model": "smollm2", "max_tokens": 8, "temperature": 0}

    with running_server(build_app(async_engine, smollm2.tokenizer, "smollm2", engine.max_model_len)) as url:
        async def run_all(stream: bool) -> list[str]:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as client:
                async def one(prompt: str) -> str:
                    if not stream:
                        return (await client.completions.create(prompt=prompt, **args)).choices[0].text
                    return "".join([c.choices[0].text async for c in await client.completions.create(
                        prompt=prompt, stream=True, **args)])
                return await asyncio.gather(*(one(p) for p in prompts))

        whole = asyncio.run(run_all(stream=False))
        streamed = asyncio.run(run_all(stream=True))
        alone = asyncio.run(_one_at_a_time(url, prompts[:3], args))
        metrics = httpx.get(f"{url}/metrics").text
    assert streamed == whole
    assert alone == whole[:3]
    assert len(set(whole)) > 8  # the answers depend on the prompts: no cross-talk between requests
    assert async_engine.stats.kv_blocks_used == 0
    assert "spear_time_to_first_token_seconds_count 131.0" in metrics


async def _one_at_a_time(url: str, prompts: list[str], args: dict) -> list[str]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        return [(await client.completions.create(prompt=p, **args)).choices[0].text for p in prompts]


def test_cli_serve(tiny_model_dir, capsys):
    assert main(["serve", "/no/such/model", "--port", "0"]) == 2
    assert "model not found" in capsys.readouterr().err
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "spear.cli", "serve", str(tiny_model_dir), "--port", "0",
                             "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        url = re.search(r"(http://\S+)/v1", line).group(1)
        wait_until(lambda: _healthy(url), timeout=30)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False


def test_serve_overlaps_steps_on_one_gpu_only():
    from spear.server.launch import ServeConfig, _engine_config

    gpu = torch.device("cuda")  # the config only reads the device's type
    assert _engine_config(ServeConfig(), gpu).overlap
    assert not _engine_config(ServeConfig(overlap=False), gpu).overlap
    assert not _engine_config(ServeConfig(tp=2), gpu).overlap  # the TP step channel needs every token on the host
    # a CPU's forward is the host's own work: overlapped, each token would only be handed out one step late
    assert not _engine_config(ServeConfig(), torch.device("cpu")).overlap
