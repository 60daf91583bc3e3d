"""The server's own logic against a scripted engine: threading, OpenAI shapes, errors, 429, disconnects."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from server_harness import ScriptedEngine, running_server, templated_byte_tokenizer, wait_until

from spear.runtime.requests import SamplingParams
from spear.server.app import build_app
from spear.server.async_engine import AsyncEngine, QueueFullError

MAX_LEN = 64


@pytest.fixture(scope="module")
def tokenizer():
    return templated_byte_tokenizer()


def scripted_server(tokenizer, max_waiting: int = 256, **engine_kwargs):
    engine = ScriptedEngine(tokenizer, max_model_len=MAX_LEN, **engine_kwargs)
    app = build_app(AsyncEngine(engine, max_waiting=max_waiting), tokenizer, "tiny", MAX_LEN)
    return engine, running_server(app)


def expected_text(tokenizer, prompt_ids, max_tokens):
    return "".join(tokenizer.decode([t]) for t in ScriptedEngine.expected_ids(prompt_ids, max_tokens))


def test_async_engine_streams_and_sleeps_when_idle(tokenizer):
    engine = ScriptedEngine(tokenizer)
    steps = 0
    step = engine.step

    def counted_step():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted_step
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def go():
        outs = [out async for out in async_engine.generate([5, 6, 7], SamplingParams(max_tokens=4))]
        return outs

    try:
        outs = asyncio.run(go())
        assert [o.new_token_ids[0] for o in outs] == [8, 9, 10, 11]
        assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 4
        before = steps
        time.sleep(0.2)
        assert steps == before == 4  # idle: no spinning through step()
        assert async_engine.stats.num_running == 0
    finally:
        async_engine.shutdown()
    assert not async_engine.is_running()


def test_async_engine_queue_bound_and_abort_of_pending(tokenizer):
    engine = ScriptedEngine(tokenizer, max_num_seqs=1)  # one slot: every later request really waits
    engine.gate.clear()  # the engine thread blocks inside its first step
    async_engine = AsyncEngine(engine, max_waiting=2)
    async_engine.start()

    async def go():
        first = async_engine.generate([1, 2], SamplingParams(max_tokens=2))
        await asyncio.to_thread(wait_until, lambda: engine.num_running == 1)
        await asyncio.sleep(0.05)  # the thread is now inside step(), holding its inbox
        second = async_engine.generate([3], SamplingParams(max_tokens=2))
        async_engine.generate([4], SamplingParams(max_tokens=2))
        with pytest.raises(QueueFullError):
            async_engine.generate([5], SamplingParams(max_tokens=2))
        await second.aclose()  # aborted while still in the inbox: never reaches the engine
        async_engine.generate([6], SamplingParams(max_tokens=2))  # room again
        engine.gate.set()
        return [o async for o in first]

    try:
        outs = asyncio.run(go())
        assert outs[-1].finished
        wait_until(lambda: not engine.requests)
        assert engine.aborted == []
    finally:
        engine.gate.set()
        async_engine.shutdown()


def test_openai_client_completions_and_chat(tokenizer):
    _, server = scripted_server(tokenizer)
    with server as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]

        prompt_ids = tokenizer("hello").input_ids
        out = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0)
        assert out.choices[0].text == expected_text(tokenizer, prompt_ids, 5)
        assert out.choices[0].finish_reason == "length"
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), 5)

        chunks = list(client.completions.create(model="tiny", prompt=[10, 20], max_tokens=6, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text(tokenizer, [10, 20], 6)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 6

        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        chat_ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False).input_ids
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        assert reply.choices[0].message.role == "assistant"
        assert reply.choices[0].message.content == expected_text(tokenizer, chat_ids, 4)
        assert reply.usage.prompt_tokens == len(chat_ids)

        stream = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=4,
                                                stream=True)
        deltas = [c.choices[0].delta for c in stream]
        assert deltas[0].role == "assistant"
        assert "".join(d.content or "" for d in deltas) == expected_text(tokenizer, chat_ids, 4)

        metrics = httpx.get(f"{url}/metrics").text
        assert "spear_time_to_first_token_seconds_count 4.0" in metrics
        assert "spear_inter_token_latency_seconds_bucket" in metrics
        assert "spear_kv_blocks_used 0.0" in metrics and "spear_queue_depth 0.0" in metrics
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}


@pytest.mark.parametrize("body, param", [
    ('{"prompt": "hi", "max_tokens": ', None),
    ('[1, 2]', None),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"prompt": "hi", "logprobs": 30}, "logprobs"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": [1, 999]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x" * MAX_LEN}, "prompt"),
    ({"prompt": "x" * 10, "max_tokens": MAX_LEN}, "max_tokens"),
    ({"prompt": "x" * 10, "stream": True, "max_tokens": MAX_LEN}, "max_tokens"),
])
def test_invalid_requests_answer_400_openai_style(tokenizer, body, param):
    _, server = scripted_server(tokenizer)
    with server as url:
        content = body if isinstance(body, str) else json.dumps(body)
        r = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
        assert set(error) == {"message", "type", "param", "code"}


def test_other_errors_are_json(tokenizer):
    _, server = scripted_server(tokenizer)
    with server as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role"
        r = httpx.post(f"{url}/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = httpx.get(f"{url}/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model="tiny", prompt="hi", temperature=-1)


def test_queue_full_answers_429_at_once(tokenizer):
    engine, server = scripted_server(tokenizer, max_waiting=2, max_num_seqs=1)
    engine.gate.clear()
    with server as url, httpx.Client(base_url=url, timeout=30) as client:
        async def flood():
            async with httpx.AsyncClient(base_url=url, timeout=30) as ac:
                first = asyncio.create_task(ac.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}))
                await asyncio.to_thread(wait_until, lambda: engine.num_running == 1)
                await asyncio.sleep(0.05)
                held = [asyncio.create_task(ac.post("/v1/completions", json={"prompt": "b", "max_tokens": 2}))
                        for _ in range(2)]
                await asyncio.sleep(0.3)
                t0 = time.monotonic()
                rejected = await ac.post("/v1/completions", json={"prompt": "c", "max_tokens": 2})
                elapsed = time.monotonic() - t0
                engine.gate.set()
                return rejected, elapsed, [await t for t in [first, *held]]

        rejected, elapsed, done = asyncio.run(flood())
        assert rejected.status_code == 429 and elapsed < 2
        assert rejected.json()["error"]["code"] == "rate_limit_exceeded"
        assert [r.status_code for r in done] == [200, 200, 200]
        assert "spear_requests_rejected_total 1.0" in client.get("/metrics").text


def test_disconnect_mid_stream_aborts(tokenizer):
    engine, server = scripted_server(tokenizer, step_delay=0.02)
    with server as url:
        with httpx.stream("POST", f"{url}/v1/completions",
                          json={"prompt": "hello", "max_tokens": 50, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert engine.kv_blocks_used > 0
        wait_until(lambda: engine.kv_blocks_used == 0, timeout=5)
        assert len(engine.aborted) == 1

        with pytest.raises(httpx.ReadTimeout):  # non-streamed: the client gives up while it generates
            httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 50}, timeout=0.2)
        wait_until(lambda: len(engine.aborted) == 2, timeout=5)
        assert engine.kv_blocks_used == 0


def test_every_served_name_is_served_and_responses_name_the_first(tokenizer):
    app = build_app(AsyncEngine(ScriptedEngine(tokenizer, max_model_len=MAX_LEN)), tokenizer, ("/models/q4", "q4"),
                    MAX_LEN)
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["/models/q4", "q4"]
        assert client.models.retrieve("q4").id == "q4" and client.models.retrieve("/models/q4").id == "/models/q4"
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve("gpt-9")
        assert e.value.body["code"] == "model_not_found"
        for model in ("q4", "/models/q4"):  # as vLLM documents --served-model-name: the first name answers
            assert client.completions.create(model=model, prompt="hi", max_tokens=2).model == "/models/q4"
        reply = client.chat.completions.create(model="q4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.model == "/models/q4"
        with pytest.raises(openai.NotFoundError, match="'/models/q4', 'q4'"):
            client.completions.create(model="q5", prompt="hi", max_tokens=2)


def test_served_model_names_default_to_the_spec_and_its_base_name(capsys):
    from spear.cli import build_parser, main
    from spear.errors import SpearError
    from spear.server.launch import ServeConfig, served_model_names

    assert served_model_names("/tmp/q4", ServeConfig()) == ("/tmp/q4", "q4")
    assert served_model_names("runs/q4/", ServeConfig()) == ("runs/q4/", "q4")
    assert served_model_names("smollm2", ServeConfig()) == ("smollm2",)
    assert served_model_names("/tmp/q4", ServeConfig(served_model_name=("a", "b"))) == ("a", "b")
    with pytest.raises(SpearError, match="--served-model-name"):
        ServeConfig(served_model_name=("a", " "))
    args = build_parser().parse_args(["serve", "/tmp/q4", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"]
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--served-model-name NAME [NAME ...]" in capsys.readouterr().out


def test_an_unexpected_error_is_one_logged_500_on_a_connection_kept_open(tokenizer, caplog):
    import http.client
    import logging

    app = build_app(AsyncEngine(ScriptedEngine(tokenizer, max_model_len=MAX_LEN)), tokenizer, "tiny", MAX_LEN)

    @app.get("/v1/boom")
    async def boom():
        raise RuntimeError("a bug")

    with running_server(app) as url:
        logging.getLogger("uvicorn.error").addHandler(caplog.handler)  # uvicorn's loggers do not propagate
        try:
            conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
            conn.request("GET", "/v1/boom")
            r = conn.getresponse()
            assert r.status == 500 and json.loads(r.read())["error"]["type"] == "server_error"
            sock = conn.sock
            conn.request("GET", "/health")  # the same connection: uvicorn closed it after a re-raised error
            assert conn.getresponse().status == 200 and conn.sock is sock
            conn.close()
        finally:
            logging.getLogger("uvicorn.error").removeHandler(caplog.handler)
    assert [r.levelno for r in caplog.records if r.exc_info] == [logging.ERROR]
