"""`spear serve --engine-process` on a CPU (spear.server.engine_process): the same tokens and errors as the engine
in process, and no process left behind however the server ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
import torch
from server_harness import wait_until
from test_server_faults import children, interrupted_stream, start_server, stop

from spear.errors import SpearError
from spear.runtime.requests import SamplingParams
from spear.server.engine_process import EngineProcess
from spear.server.launch import ServeConfig, load_engine

CONFIG = ServeConfig(max_model_len=64, max_num_seqs=4)
CPU = torch.device("cpu")


def run(engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    """Every request's tokens, the requests admitted together and stepped until done."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    local, _, _ = load_engine(str(tiny_model_dir), CONFIG, CPU, threads=1)
    remote = EngineProcess(str(tiny_model_dir), CONFIG, CPU, threads=1)
    yield local, remote
    remote.close()


def test_the_engine_process_steps_as_the_engine_in_process(engines):
    local, remote = engines
    assert (remote.max_model_len, remote.max_num_seqs, remote.kv_blocks_total) == \
        (local.max_model_len, local.max_num_seqs, local.kv_blocks_total)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]]
    for params in (SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)):
        expected = run(local, prompts, params)
        assert run(remote, prompts, params) == expected
        assert all(len(t) == 12 for t in expected.values())
    assert remote.num_running == remote.num_waiting == remote.kv_blocks_used == 0


def test_the_engine_process_raises_the_engines_errors_and_goes_on(engines):
    _, remote = engines
    with pytest.raises(SpearError, match="the context is 64"):
        remote.add_request("long", list(range(100)), SamplingParams())
    remote.add_request("a", [1, 2], SamplingParams(max_tokens=30, ignore_eos=True))
    with pytest.raises(SpearError, match="already in use"):
        remote.add_request("a", [1, 2], SamplingParams())
    remote.step()
    assert remote.num_running == 1 and remote.kv_blocks_used > 0
    remote.abort("a")
    assert [(o.request_id, o.finish_reason) for o in remote.step()] == [("a", "abort")]
    assert not remote.has_unfinished() and remote.kv_blocks_used == 0


def engine_children(pid: int) -> list[int]:
    """The processes `pid` spawned through multiprocessing (its resource tracker aside)."""
    def spawned(child: int) -> bool:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                return b"spawn_main" in f.read()
        except FileNotFoundError:
            return False

    return [child for child in children(pid) if spawned(child)]


def engine_child(server: subprocess.Popen) -> int:
    (pid,) = engine_children(server.pid)
    return pid


def test_a_load_error_is_raised_in_the_server_and_no_process_stays(tmp_path):
    before = engine_children(os.getpid())
    with pytest.raises(SpearError, match="model not found"):
        EngineProcess(str(tmp_path / "nothing"), CONFIG, CPU, threads=1)
    assert engine_children(os.getpid()) == before


def test_serve_on_a_cpu_runs_the_engine_in_a_child_that_ends_with_it(tiny_model_dir):
    proc, url = start_server(str(tiny_model_dir), "--engine-process", "--max-model-len", "64")
    try:
        child = engine_child(proc)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not os.path.exists(f"/proc/{child}")
        assert "Traceback" not in proc.stderr.read()
    finally:
        stop(proc)


def test_a_killed_engine_process_ends_streams_with_an_error_and_the_server_exits(tiny_model_dir):
    proc, url = start_server(str(tiny_model_dir), "--engine-process", "--max-model-len", "512")
    try:
        child = engine_child(proc)
        rest = interrupted_stream(url, lambda: os.kill(child, signal.SIGKILL))
        error = json.loads(rest[-1][6:])["error"]
        assert error["type"] == "server_error" and "the engine process was killed by SIGKILL" in error["message"]
        assert proc.wait(timeout=30) == 2
        assert "spear: error: the server stopped: the engine process was killed by SIGKILL\n" in proc.stderr.read()
    finally:
        stop(proc)


def test_the_engine_process_ends_when_the_server_is_killed(tiny_model_dir):
    proc, url = start_server(str(tiny_model_dir), "--engine-process", "--max-model-len", "64")
    try:
        child = engine_child(proc)
        proc.kill()
        proc.wait()
        wait_until(lambda: not os.path.exists(f"/proc/{child}") or _zombie(child), timeout=30)
    finally:
        stop(proc)


def _zombie(pid: int) -> bool:
    """Ended, but not yet reaped by init (its parent died first)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_serve_keeps_the_engine_in_process_unless_asked(tiny_model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "spear.cli", "serve", str(tiny_model_dir), "--port", "0",
                             "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert "http://" in proc.stdout.readline()
        assert engine_children(proc.pid) == []
    finally:
        stop(proc)
