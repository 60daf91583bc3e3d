"""Shared by the server tests: uvicorn in a background thread, and a scripted stand-in for the engine."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from spear.errors import SpearError
from spear.runtime.requests import RequestOutput, SamplingParams
from spear.server.guard import GuardConfig, uvicorn_config

CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def templated_byte_tokenizer():
    """conftest's byte tokenizer with a minimal chat template."""
    from conftest import make_byte_tokenizer

    tok = make_byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


@contextmanager
def running_server(app, guard: GuardConfig = GuardConfig()):
    """Serve `app` as `spear serve` does (behind its guard) on a free loopback port for the duration of the block;
    yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", guard, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class ScriptedEngine:
    """The engine's interface with a fixed script: request tokens count up from the prompt's last id, one per step.

    `gate` (set by default) holds every step while cleared; each request holds one KV block per 4 tokens.
    """

    block_size = 4
    num_preemptions = 0

    def __init__(self, tokenizer, max_model_len: int = 64, kv_blocks_total: int = 1024, step_delay: float = 0.0,
                 max_num_seqs: int = 1024):
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.kv_blocks_total = kv_blocks_total
        self.step_delay = step_delay
        self.gate = threading.Event()
        self.gate.set()
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.aborted: list[str] = []
        self.num_waiting = 0

    @staticmethod
    def expected_ids(prompt_ids: list[int], max_tokens: int, vocab: int = 256) -> list[int]:
        return [(prompt_ids[-1] + 1 + k) % vocab for k in range(max_tokens)]

    @property
    def num_running(self) -> int:
        return len(self.requests)

    @property
    def kv_blocks_used(self) -> int:
        return sum(-(-(len(p) + len(g)) // self.block_size) for p, _, g in self.requests.values())

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if len(prompt_token_ids) >= self.max_model_len:
            raise SpearError(f"prompt of {len(prompt_token_ids)} tokens exceeds the context")
        self.requests[request_id] = (prompt_token_ids, params, [])

    def abort(self, request_id: str) -> None:
        del self.requests[request_id]
        self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.gate.wait()
        time.sleep(self.step_delay)
        outputs = []
        for rid, (prompt, params, generated) in list(self.requests.items()):
            token = self.expected_ids(prompt, len(generated) + 1)[-1]
            generated.append(token)
            finished = len(generated) >= params.max_tokens
            outputs.append(RequestOutput(rid, [token], self.tokenizer.decode([token]), finished,
                                         "length" if finished else None, len(prompt), len(generated)))
            if finished:
                del self.requests[rid]
        return outputs
