"""Schemathesis against the server's own OpenAPI schema, over real HTTP (through the guard): valid and invalid
bodies generated per route; every answer is an OpenAI-style success or error, never a 5xx or a hang.

The CI run is bounded (scripted engine); `python -m pytest -m fuzz tests/test_server_fuzz.py` runs the long one
on the real (tiny) engine, ≥ 500 generated requests a route and mode."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from server_harness import CHAT_TEMPLATE, ScriptedEngine, running_server, templated_byte_tokenizer

from spear.server.app import build_app
from spear.server.async_engine import AsyncEngine


def fuzz(app, examples: int) -> dict[str, dict[int, int]]:
    """Status counts per 'MODE METHOD PATH'; asserts on every response."""
    schema = schemathesis.openapi.from_dict(app.openapi())
    counts: dict[str, dict[int, int]] = {}
    with running_server(app) as url, httpx.Client(timeout=60) as client:
        for op in [result.ok() for result in schema.get_all_operations()]:
            post = op.method.upper() == "POST"
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if post else (GenerationMode.POSITIVE,):
                n = examples if post else 5  # a GET here takes no parameters: nothing to vary
                seen = counts.setdefault(f"{mode.value} {op.label}", {})

                @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode))
                def one(case):
                    kw = case.as_transport_kwargs(base_url=url)
                    r = client.request(kw["method"], kw["url"], headers=kw.get("headers"), params=kw.get("params"),
                                       json=kw.get("json"))
                    seen[r.status_code] = seen.get(r.status_code, 0) + 1
                    assert r.status_code < 500, f"{r.status_code} {r.text[:300]} for {kw}"
                    if r.status_code >= 400:
                        error = r.json()["error"]
                        assert set(error) == {"message", "type", "param", "code"} and error["message"]
                    elif post and isinstance(kw.get("json"), dict) and kw["json"].get("stream") is True:
                        assert r.text.startswith("data: ") and r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
                    elif post:
                        assert r.json()["choices"]

                one()
        assert client.get(f"{url}/health").status_code == 200
    return counts


def test_fuzzed_requests_never_get_a_server_error():
    tokenizer = templated_byte_tokenizer()
    app = build_app(AsyncEngine(ScriptedEngine(tokenizer, max_model_len=64)), tokenizer, "tiny", 64)
    counts = fuzz(app, examples=60)
    posts = sum(sum(c.values()) for label, c in counts.items() if "POST" in label)
    assert posts >= 150, counts


@pytest.mark.fuzz
def test_long_fuzz_on_the_real_engine(tiny_model_dir):
    from spear.models import load_float_model
    from spear.runtime.engine import EngineConfig, build_engine

    lm = load_float_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)
    lm.tokenizer.chat_template = CHAT_TEMPLATE
    engine = build_engine(lm.model, lm.tokenizer, EngineConfig(max_model_len=128, max_num_seqs=8))
    counts = fuzz(build_app(AsyncEngine(engine), lm.tokenizer, "tiny", engine.max_model_len), examples=500)
    print(counts)
    assert sum(sum(c.values()) for label, c in counts.items() if "POST" in label) >= 1000
