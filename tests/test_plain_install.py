"""The README's install without the extras (`pip install torch==2.13.0 -e .`): every command's --help and a tiny end
to end of every subcommand, in processes that cannot import what only pyproject.toml's extras install (pytest, triton,
openai, httpx, schemathesis, lm-eval, compressed-tensors). An optional dependency a command needs is one line saying
what to install, exit 2."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from spear.cli import BENCH_SUITES, build_parser

ROOT = Path(__file__).resolve().parents[1]

# sitecustomize.py of the processes below: the import system's PathFinder, blind to the extras' packages
SITECUSTOMIZE = '''
import os
import sys
from importlib.machinery import PathFinder

HIDDEN = set(os.environ["SPEAR_TEST_UNINSTALLED"].split(","))
assert not HIDDEN & set(sys.modules), "imported before sitecustomize"


class PlainInstall(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] in HIDDEN else super().find_spec(name, path, target)


sys.meta_path[sys.meta_path.index(PathFinder)] = PlainInstall
'''

# every command the README gives, each with --help, run in one process: [(argv, exit code, stdout, stderr)]
HELP_ALL = '''
import contextlib, io, json, sys
from spear.cli import lm_eval_main, main

results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if argv[0] == "spear-lm-eval":
                sys.argv = argv
                rc = lm_eval_main()
            else:
                rc = main(argv)
        except SystemExit as e:
            rc = 0 if e.code is None else e.code
        except BaseException as e:  # what a user would see as a traceback
            rc, err = "traceback", io.StringIO(f"{type(e).__name__}: {e}")
    results.append((argv, rc, out.getvalue(), err.getvalue()))
print(json.dumps(results))
'''


def extra_modules() -> dict[str, set[str]]:
    """pyproject.toml's extras: name → the top-level modules of its packages."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    modules = {name: {re.match(r"[\w.-]+", r).group().replace("-", "_").lower() for r in reqs}
               for name, reqs in extras.items()}
    for module in set().union(*modules.values()):  # a package whose module has another name would stay importable
        assert importlib.util.find_spec(module) is not None, f"{module}: not the module of an installed extra"
    return modules


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """plain(*argv, extras=()): `spear ARGV` as installed with only those extras, as a finished process."""
    site = tmp_path_factory.mktemp("plain-site")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    modules = extra_modules()

    def env(extras: tuple[str, ...] = ()) -> dict[str, str]:
        hidden = set().union(*modules.values()) - set().union(*(modules[e] for e in extras))
        environ = {k: v for k, v in os.environ.items() if k not in ("SPEAR_CPU_W4", "TRITON_INTERPRET")}
        path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
        return {**environ, "PYTHONPATH": path, "SPEAR_TEST_UNINSTALLED": ",".join(sorted(hidden)),
                "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # no GPU: CUDA builds of torch bring triton

    def run(*argv, extras: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "spear.cli", *map(str, argv)], capture_output=True, text=True,
                              env=env(extras), timeout=300)

    run.env = env
    return run


def subcommands() -> list[str]:
    return sorted(next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices)


def needs_line(err: str) -> re.Match | None:
    """The one line of a missing optional dependency: `spear...: error: X needs PKG: pip install 'REQ'`."""
    lines = err.strip().splitlines()
    pattern = r"spear(?:-lm-eval)?: error: .+ needs ([\w.-]+): pip install '[^']+'"
    return re.fullmatch(pattern, lines[0]) if len(lines) == 1 else None


def test_every_command_helps_on_a_plain_install(plain):
    commands = ([["--help"]] + [[c, "--help"] for c in subcommands()] + [["bench", s, "--help"] for s in BENCH_SUITES]
                + [["spear-lm-eval", "--help"]])
    proc = subprocess.run([sys.executable, "-c", HELP_ALL, json.dumps(commands)], capture_output=True, text=True,
                          env=plain.env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = {" ".join(argv): (rc, out, err) for argv, rc, out, err in json.loads(proc.stdout.splitlines()[-1])}
    extras = extra_modules()
    for command, (rc, out, err) in results.items():
        if rc == 0:
            assert out.startswith("usage:"), (command, out)
        else:  # a suite or tool of an extra's package: which one, in one line
            assert rc == 2 and needs_line(err), (command, rc, err)
            assert needs_line(err).group(1).replace("-", "_") in set().union(*extras.values()), (command, err)
    for command in ["--help", *(f"{c} --help" for c in subcommands())]:
        assert results[command][0] == 0, (command, results[command])  # the README's commands need no extra
    assert needs_line(results["spear-lm-eval --help"][2]).group(1) == "lm-eval"


def test_every_subcommand_end_to_end_on_a_plain_install(plain, tiny_model_dir, tmp_path):
    """The cheapest real run of each on a tiny model; export-vllm needs the vllm extra. bench: its suites' imports are
    test_every_command_helps_on_a_plain_install's, their runs tests/test_tp.py's and tests/test_bench_suites.py's."""
    def ok(*argv, extras=()):
        proc = plain(*argv, extras=extras)
        assert proc.returncode == 0, (argv, proc.stderr[-3000:])
        return proc

    covered = {"bench"}
    art, ec = tmp_path / "art", tmp_path / "ec"
    ok("quantize", tiny_model_dir, "--group-size", "32", "--out", art, "--device", "cpu")
    covered.add("quantize")
    assert ok("verify", art).stdout.strip()
    covered.add("verify")
    ppl = json.loads(ok("eval", art, "--seqlen", "64", "--max-windows", "2", "--device", "cpu", "--json").stdout)
    assert ppl["windows"] == 2 and ppl["ppl"] > 0
    covered.add("eval")
    shutil.copytree(art, ec)
    ok("compensate", ec, "--budget", "50%", "--steps", "1", "--calib-samples", "2", "--calib-len", "16",
       "--device", "cpu")
    ecs = json.loads((ec / "config.json").read_text())["ec_modules"]
    assert any(name.endswith(("o_proj", "down_proj")) for name in ecs)  # row-parallel under --tp: the epilogue's
    covered.add("compensate")

    refused = plain("export-vllm", art, "--out", tmp_path / "v")
    assert refused.returncode == 2 and needs_line(refused.stderr).group(1) == "compressed-tensors", refused.stderr
    assert not (tmp_path / "v").exists()
    ok("export-vllm", art, "--out", tmp_path / "v", extras=("vllm",))  # README: pip install -e ".[vllm]"
    covered.add("export-vllm")
    ok("import", tmp_path / "v", "--out", tmp_path / "imported", "--base", tiny_model_dir)  # compressed-tensors W4A16
    assert (tmp_path / "imported" / "config.json").exists()
    covered.add("import")

    table = json.loads(ok("profile", art, "--batch-sizes", "1", "--prefill-tokens", "0", "--out",
                          tmp_path / "latency.json", "--json").stdout)
    assert table["device"] == "cpu"
    covered.add("profile")
    report = json.loads(ok("run", tiny_model_dir, "--quick", "--seqlen", "64", "--out", tmp_path / "run",
                           "--device", "cpu", "--json").stdout)
    assert report["w4_ppl"] > 0
    covered.add("run")

    # two gloo ranks on CPU, the ECs' epilogue on each (its reference: no triton)
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "spear.cli", "serve", str(ec), "--tp", "2", "--port", "0",
                                 "--device", "cpu"], stdout=subprocess.PIPE, stderr=stderr, text=True, env=plain.env())
    try:
        url = re.search(r"(http://\S+)/v1", proc.stdout.readline())
        assert url, log.read_text()[-3000:]
        body = json.dumps({"prompt": "hi", "max_tokens": 3, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"{url.group(1)}/v1/completions", body, {"Content-Type": "application/json"})
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(request, timeout=60) as r:
                    assert json.load(r)["usage"]["completion_tokens"] == 3
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, "the server did not answer"
                time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    covered.add("serve")
    assert covered == set(subcommands()), f"give {set(subcommands()) - covered} an end to end here"
