"""Faults around `spear serve`: a corrupt artifact, SIGTERM with streams in flight, a tensor-parallel rank that dies.
Each ends in one line or an error event, never a hang."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import httpx
from server_harness import wait_until

from spear.cli import main

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "spear.cli", "serve", *args, "--port", "0", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    line = proc.stdout.readline()
    url = re.search(r"(http://\S+)/v1", line).group(1)
    wait_until(lambda: _healthy(url), timeout=60)
    return proc, url


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []


def ranks(launcher: int) -> list[int]:
    """The tensor-parallel ranks the launcher spawned, in rank order (spawned in order; the resource tracker aside)."""
    def spawned(pid: int) -> bool:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()

    return sorted(pid for pid in children(launcher) if spawned(pid))


def interrupted_stream(url: str, interrupt) -> list[str]:
    """The data lines of a long stream after its first, `interrupt()` called once that first has come."""
    body = {"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        interrupt()
        return [line for line in lines if line.startswith("data:")]


def stop(proc: subprocess.Popen) -> None:
    """Whatever the test left running: the server and its ranks."""
    for pid in children(proc.pid):
        os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_corrupt_artifact_is_one_line_exit_2(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["quantize", str(tiny_model_dir), "--out", str(out), "--device", "cpu"]) == 0
    (out / "model.safetensors").write_bytes(b"\x00" * 64)
    capsys.readouterr()
    assert main(["serve", str(out), "--port", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spear: error: ") and "corrupt" in err and err.count("\n") == 1


def test_sigterm_ends_streams_in_flight_with_an_error_event(tiny_model_dir):
    proc, url = start_server(str(tiny_model_dir), "--max-model-len", "512")
    try:
        rest = interrupted_stream(url, lambda: proc.send_signal(signal.SIGTERM))
        assert json.loads(rest[-1][6:])["error"]["message"] == "the server is shutting down"
        assert len(rest) < 499 and "data: [DONE]" not in rest
        assert proc.wait(timeout=30) == 0  # a stop asked for, cleanly done (uvicorn would re-raise it: 143)
        assert "Traceback" not in proc.stderr.read()
    finally:
        stop(proc)


def test_a_dead_tensor_parallel_rank_gets_503_and_the_server_exits(tiny_model_dir):
    proc, url = start_server(str(tiny_model_dir), "--tp", "2", "--max-model-len", "64", "--max-num-seqs", "4")
    try:
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        follower = ranks(proc.pid)[1]
        os.kill(follower, signal.SIGKILL)
        wait_until(lambda: follower not in children(proc.pid), timeout=10)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert proc.wait(timeout=60) == 2
        # one line from the launcher (rank 0's log has the failed step's cause)
        assert "spear: error: the server stopped: tensor-parallel process 1 terminated with signal SIGKILL\n" in \
            proc.stderr.read()
    finally:
        stop(proc)
