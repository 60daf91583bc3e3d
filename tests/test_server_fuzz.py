"""Schemathesis against the server's own OpenAPI schema, over real HTTP (through the guard): valid and invalid
bodies generated per route; every answer is never a 5xx or a hang, and conforms to the schema: a status documented
for its route, a documented content type, a body valid against the documented schema.

The CI run is bounded (scripted engine); `python -m pytest -m fuzz tests/test_server_fuzz.py` runs the long one
on the real (tiny) engine, ≥ 500 generated requests a route and mode."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_harness import CHAT_TEMPLATE, ScriptedEngine, running_server, templated_byte_tokenizer

from spear.server.app import build_app
from spear.server.async_engine import AsyncEngine
from spear.server.guard import GuardConfig

CONFORMANCE = [status_code_conformance, content_type_conformance, response_schema_conformance,
               response_headers_conformance]


def fuzz(app, examples: int) -> dict[str, dict[int, int]]:
    """Status counts per 'MODE METHOD PATH'; asserts on every response."""
    schema = schemathesis.openapi.from_dict(app.openapi())
    counts: dict[str, dict[int, int]] = {}
    with running_server(app) as url, httpx.Client(timeout=60) as client:
        for op in [result.ok() for result in schema.get_all_operations()]:
            post = op.method.upper() == "POST"
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if post else (GenerationMode.POSITIVE,):
                n = examples if post or "{" in op.path else 5  # a GET without parameters: nothing to vary
                checks = (not_a_server_error, *CONFORMANCE)
                if mode is GenerationMode.NEGATIVE:  # a body the schema forbids is refused, never served
                    checks += (negative_data_rejection,)
                seen = counts.setdefault(f"{mode.value} {op.label}", {})

                @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode))
                def one(case):
                    status = answer(client, url, case, checks).status_code
                    seen[status] = seen.get(status, 0) + 1

                one()
        assert client.get(f"{url}/health").status_code == 200
    return counts


def answer(client: httpx.Client, url: str, case, checks=(not_a_server_error, *CONFORMANCE)) -> httpx.Response:
    """Send `case` and check its answer: by default never a 5xx, and conforming to the schema."""
    kw = case.as_transport_kwargs(base_url=url)
    r = client.request(kw["method"], kw["url"], headers=kw.get("headers"), params=kw.get("params"), json=kw.get("json"))
    case.validate_response(r, checks=list(checks), headers=kw.get("headers"), transport_kwargs=kw)
    if r.headers["content-type"].startswith("text/event-stream"):  # the schema checks each event, not their order
        assert r.text.startswith("data: ") and r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    return r


def test_fuzzed_requests_conform_to_the_schema():
    tokenizer = templated_byte_tokenizer()
    app = build_app(AsyncEngine(ScriptedEngine(tokenizer, max_model_len=64)), tokenizer, "tiny", 64)
    counts = fuzz(app, examples=60)
    posts = sum(sum(c.values()) for label, c in counts.items() if "POST" in label)
    assert posts >= 150, counts


def test_each_kind_of_answer_conforms_to_the_schema():
    """The answers a fuzz may seldom reach (streams with logprobs and usage, the guard's refusals, a stopped
    engine), checked as the fuzz checks its own."""
    tokenizer = templated_byte_tokenizer()
    engine = AsyncEngine(ScriptedEngine(tokenizer))
    app = build_app(engine, tokenizer, "tiny", 64)
    ops = {result.ok().label: result.ok() for result in schemathesis.openapi.from_dict(app.openapi()).get_all_operations()}
    completions, chat = ops["POST /v1/completions"], ops["POST /v1/chat/completions"]
    hi = [{"role": "user", "content": "hi"}]
    usage = {"stream_options": {"include_usage": True}}
    cases = [
        (completions.Case(body={"prompt": "hi", "max_tokens": 3, "logprobs": 2}), 200),
        (completions.Case(body={"prompt": "hi", "max_tokens": 3, "logprobs": 2, "stream": True, **usage}), 200),
        (chat.Case(body={"messages": hi, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}), 200),
        (chat.Case(body={"messages": hi, "max_tokens": 3, "logprobs": True, "stream": True, **usage}), 200),
        (completions.Case(body={"prompt": "hi", "model": "gpt-9"}), 404),
        (completions.Case(body={"prompt": "hi", "temperature": -1}), 400),
        (completions.Case(body={"prompt": "x" * 2000}), 413),
        (completions.Case(body={"prompt": "hi"}, headers={"content-type": "text/plain"}), 415),
        (completions.Case(body={"prompt": "hi"}, headers={"authorization": "Bearer wrong"}), 401),
        (completions.Case(body={"prompt": "hi"}, headers={"host": "evil.example"}), 421),
        (ops["GET /v1/models"].Case(), 200),
        (ops["GET /v1/models/{model}"].Case(path_parameters={"model": "tiny"}), 200),
        (ops["GET /v1/models/{model}"].Case(path_parameters={"model": "gpt-9"}), 404),
        (ops["GET /health"].Case(), 200),
        (ops["GET /metrics"].Case(), 200),
    ]
    guard = GuardConfig(max_body_bytes=1000, api_key="k")
    with running_server(app, guard) as url, httpx.Client(headers={"authorization": "Bearer k"}, timeout=30) as client:
        for case, status in cases:
            assert answer(client, url, case).status_code == status, case
        engine.shutdown()
        assert answer(client, url, completions.Case(body={"prompt": "hi"}), CONFORMANCE).status_code == 503
        assert answer(client, url, ops["GET /health"].Case(), CONFORMANCE).status_code == 503


def test_schema_documents_errors_streams_and_metrics_as_sent():
    tokenizer = templated_byte_tokenizer()
    spec = build_app(AsyncEngine(ScriptedEngine(tokenizer)), tokenizer, "tiny", 64).openapi()
    completions = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert set(completions) == {"200", "400", "401", "404", "413", "415", "421", "429", "500", "503"}
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert completions["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "ValidationError" not in spec["components"]["schemas"]
    assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert {"200", "503"} <= set(spec["paths"]["/health"]["get"]["responses"])


def test_a_method_a_route_lacks_is_405_with_an_error_body():
    tokenizer = templated_byte_tokenizer()
    app = build_app(AsyncEngine(ScriptedEngine(tokenizer)), tokenizer, "tiny", 64)
    paths = {path.replace("{model}", "tiny"): set(ops) for path, ops in app.openapi()["paths"].items()}
    with running_server(app) as url:
        for path, documented in paths.items():
            for method in {"get", "post", "put", "patch", "delete"} - documented:
                r = httpx.request(method, f"{url}{path}", content=b"x", headers={"content-type": "text/plain"})
                assert r.status_code == 405, (method, path, r.status_code)
                assert r.json()["error"]["message"] and documented <= set(r.headers["allow"].lower().split(", "))


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
