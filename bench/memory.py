"""Wall time and peak RSS of each SPEAR command on random-weight Llama checkpoints in real shapes.

    python bench/memory.py --shape 0.5b 1.2b smollm2 \
        --steps quantize_rtn quantize_gptq compensate eval serve export load \
        --json bench/results/memory/memory_cpu.json --workdir /tmp/spear-memory

A shape's checkpoint is an HF directory written tensor by tensor (never a whole model in memory): random fp16
weights (std 0.02), norms at one, in safetensors shards of at most --shard-mb with a model.safetensors.index.json,
and the default model's tokenizer (its vocabulary, 49,152, is below every shape's, so its ids fit). `smollm2` is the
default model itself. Each step runs `spear ...` as a process of its own (STEP_ARGS below holds its flags); its
peak RSS is the larger of the process tree's RSS summed every 50 ms and the kernel's high-water mark (wait4's
ru_maxrss, the largest single process). Steps on the 4-bit artifact use the one `quantize_rtn` wrote (kept in
--workdir across calls); `compensate` works on a copy of it, `export` on that copy where it exists.

    serve   `spear serve ART [--serve-args]`: RSS once /health answers and --settle-s have passed (idle), and after
            one completion of --tokens tokens (ignore_eos, greedy); then SIGTERM (its rc is the stop's, -15)
    load    `spear.api.load(ART, serving=True)` (as `spear serve` reads it: no dense copies) three times in a process
            of its own, the artifact read once beforehand (page cache): artifact bytes / seconds of the faster of the
            last two (the first imports the model's modules too)

The issue's targets (GB = 1e9 bytes), checked per shape where the steps ran:
    artifact bytes            ≤ 1.05 × served 4-bit bytes (served_bytes)
    serve idle RSS            ≤ artifact bytes + the KV cache it allocated (its "KV cache:" line) + 0.6 GB
    quantize --method rtn     ≤ served 4-bit bytes + one decoder layer in float32 + 1 GB
    load read rate            ≥ 0.5 GB/s
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json  # noqa: E402

GB = 1e9
POLL_S = 0.05
GPU_POLL_S = 0.25  # nvidia-smi takes ~20 ms a query

# LlamaConfig fields of each shape. 0.5b: Qwen2.5-0.5B's shape (its q/k/v biases left out), 1.2b: Llama-3.2-1B's
# (its llama3 RoPE scaling left out); both tie lm_head to the embeddings. 8b: Llama-3-8B's. tiny (the test's) and 8b
# do not tie.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=False),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                 rope_theta=1e6, rms_norm_eps=1e-6),
    "1.2b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True,
                 rope_theta=5e5, rms_norm_eps=1e-5),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
               rope_theta=5e5, rms_norm_eps=1e-5),
}
DEFAULT_MODEL = "smollm2"

# The flags of each step, after `spear COMMAND ARTIFACT`. GPTQ and compensate at `spear run --quick`'s calibration
# (16 self-samples of 128 tokens, 16 KL steps, one refit round); --quick's shorter sensitivity pass has no flag of
# `spear compensate`.
QUANT = ["--bits", "4", "--group-size", "-1"]
QUICK_CALIB = ["--calib-samples", "16", "--calib-len", "128"]
WIKI_VALID = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2-raw" / "wiki.valid.tokens.txt"
STEP_ARGS = {
    "quantize_rtn": ["--method", "rtn", *QUANT],
    "quantize_gptq": ["--method", "gptq", *QUANT, *QUICK_CALIB],
    # GPTQ on real text: the float model is never loaded whole (quant.streaming)
    "quantize_gptq_file": ["--method", "gptq", *QUANT, *QUICK_CALIB, "--calib-file", str(WIKI_VALID)],
    # AWQ and OmniQuant walk the checkpoint the same way (OmniQuant at 2 epochs: memory, not quality)
    "quantize_awq_file": ["--method", "awq", *QUANT, *QUICK_CALIB, "--calib-file", str(WIKI_VALID)],
    "quantize_omniquant_file": ["--method", "omniquant", *QUANT, *QUICK_CALIB, "--calib-file", str(WIKI_VALID),
                                "--omniquant-epochs", "2"],
    "compensate": ["--budget", "1%", *QUICK_CALIB, "--steps", "16", "--refit-rounds", "1"],
    "eval": ["--max-windows", "1", "--json"],
}
STEPS = ("quantize_rtn", "quantize_gptq", "quantize_gptq_file", "quantize_awq_file", "quantize_omniquant_file",
         "compensate", "eval", "serve", "export", "load")
LOAD_SCRIPT = """import gc, json, sys, time, torch
from spear import api
seconds = []
for _ in range(3):
    start = time.perf_counter()
    lm = api.load(sys.argv[1], torch.device(sys.argv[2]), serving=True)
    seconds.append(time.perf_counter() - start)
    del lm
    gc.collect()
print(json.dumps({"first_load_s": seconds[0], "load_s": min(seconds[1:])}))"""


# ---- the checkpoint -------------------------------------------------------------------------------------------

def llama_config(shape: str, tokenizer_dir: Path):
    """The LlamaConfig of `shape` in fp16, its BOS and EOS ids those of the tokenizer in `tokenizer_dir`."""
    from transformers import LlamaConfig

    special = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    ids = {f"{k}_id": vocab[special[k]] for k in ("bos_token", "eos_token") if isinstance(special.get(k), str)}
    return LlamaConfig(**SHAPES[shape], dtype="float16", **ids)


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint of `config` (an HF config as a dict), by its name, in file order."""
    d, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config.get("head_dim") or d // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
        shapes |= {p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q)}
        shapes |= {p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                   p + "mlp.down_proj.weight": (d, inter)}
    shapes["model.norm.weight"] = (d,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, d)
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def param_count(config: dict) -> int:
    return sum(_numel(s) for s in tensor_shapes(config).values())


def layer_param_count(config: dict) -> int:
    """Parameters of one decoder layer."""
    return sum(_numel(s) for n, s in tensor_shapes(config).items() if n.startswith("model.layers.0."))


def served_bytes(config: dict, bits: int = 4, group_size: int = -1) -> int:
    """Bytes of the model as a 4-bit server holds it (QuantizedWeight.nbytes_packed): each decoder linear [out, in]
    as codes packed at `bits` per weight, and per (row, group) an fp16 scale and a `bits`-bit zero; everything else
    (embeddings, an untied lm_head, norms) in fp16."""
    total = 0
    for name, shape in tensor_shapes(config).items():
        if name.startswith("model.layers.") and len(shape) == 2:
            out_f, in_f = shape
            groups = out_f * (in_f // (in_f if group_size == -1 else group_size))
            total += (out_f * in_f * bits + 7) // 8 + 2 * groups + (groups * bits + 7) // 8
        else:
            total += 2 * _numel(shape)
    return total


def kv_bytes(config: dict, blocks: int, dtype_bytes: int, block_size: int = 16) -> int:
    """Bytes of a paged KV cache of `blocks` blocks (runtime.kv_cache.KVCache): K and V of every layer."""
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * blocks * block_size * config["num_key_value_heads"] * hd * dtype_bytes


def served_kv(config: dict, serve_out: Path) -> dict:
    """The KV cache `spear serve` allocated, from its "KV cache: N blocks, T tokens (SIZE, DTYPE)" line (N blocks
    handed out, and the null block); {} where it printed none."""
    match = re.search(r"KV cache: (\d+) blocks, (\d+) tokens \([^,]*, (\w+)\)", serve_out.read_text())
    if match is None:
        return {}
    blocks, tokens = int(match[1]) + 1, int(match[2])
    return {"kv_blocks": blocks, "kv_tokens": tokens,
            "kv_bytes": kv_bytes(config, blocks, getattr(torch, match[3]).itemsize, tokens // (blocks - 1))}


def served_startup(serve_out: Path) -> dict:
    """`spear serve`'s own seconds by stage, from its "ready in T s (load A s, kernels B s, ...)" line; {} without."""
    match = re.search(r"ready in [\d.]+ s \((.*)\)", serve_out.read_text())
    if match is None:
        return {}
    stages = (part.rsplit(" ", 2) for part in match[1].split(", "))
    return {"startup_s": {name.replace(" ", "_"): float(seconds) for name, seconds, _ in stages}}


def default_tokenizer_dir() -> Path:
    """The default model's HF directory (its GGUF converted once, cached): where its tokenizer files are."""
    from spear.models.loading import _gguf_as_hf_dir, resolve_model_path

    return _gguf_as_hf_dir(resolve_model_path(DEFAULT_MODEL))


def build_checkpoint(shape: str, out: Path, tokenizer_dir: Path, shard_mb: float = 500, seed: int = 0,
                     device: str = "cpu") -> Path:
    """A random-weight Llama HF directory of `shape` at `out`: config, fp16 safetensors shards of at most
    `shard_mb` MB with their index, the tokenizer files of `tokenizer_dir`. Each tensor is drawn (on `device`: a
    GPU draws an 8B model's 16 GB in seconds), written with its shard and dropped: the memory used is one shard."""
    from safetensors.torch import save_file

    config = llama_config(shape, tokenizer_dir)
    shapes = tensor_shapes(config.to_dict())
    shards, size = [[]], 0
    for name, s in shapes.items():
        nbytes = 2 * _numel(s)
        if shards[-1] and size + nbytes > shard_mb * 1e6:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator(device).manual_seed(seed)
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _random_tensor(n, shapes[n], gen) for n in names}
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
        del tensors
    index = {"metadata": {"total_size": 2 * param_count(config.to_dict())}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(tmp)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name.startswith("special_tokens") or f.name == "chat_template.jinja":
            shutil.copy(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.float16)
    w = torch.randn(shape, generator=gen, dtype=torch.float16, device=gen.device).mul_(0.02)
    return w.masked_fill_(w == 0, 0.02).cpu()  # no exact zeros (an fp16 draw below 3e-8 rounds to one)


def dir_bytes(path: Path) -> int:
    """Bytes of the safetensors files under `path` (0 where there is none)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*.safetensors"))


# ---- measuring a process --------------------------------------------------------------------------------------

def tree_rss(proc: psutil.Process) -> int:
    """RSS of a process and its descendants, summed."""
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def rss_split(pid: int) -> dict[str, int]:
    """Anonymous and file-backed RSS of one process (/proc/PID/status): the weights read into memory show as
    anonymous, the mmapped files the page cache holds as file."""
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return fields


def gpu_used_bytes() -> int | None:
    """Memory in use on the first GPU (nvidia-smi), None where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return int(out.stdout.split()[0]) * 2**20 if out.returncode == 0 and out.stdout.strip() else None


class Watch:
    """A child process started in its own session, its tree's RSS sampled every POLL_S on a thread; with `gpu`, the
    GPU's memory in use too (every GPU_POLL_S, less what was in use before the start: the process's own)."""

    def __init__(self, cmd: list[str], log: Path, gpu: bool = False):
        self.gpu_base = gpu_used_bytes() if gpu else None
        self.gpu_peak = 0
        self._next_gpu = 0.0
        self.out, self.err = open(log.with_suffix(".out"), "w"), open(log.with_suffix(".err"), "w")
        self.start = time.perf_counter()
        self.popen = subprocess.Popen(cmd, stdout=self.out, stderr=self.err, start_new_session=True)
        self.proc = psutil.Process(self.popen.pid)
        self.peak = 0
        self.status, self.usage, self.end = None, None, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.proc))
            if self.gpu_base is not None and time.perf_counter() >= self._next_gpu:
                self.gpu_peak = max(self.gpu_peak, (gpu_used_bytes() or 0) - self.gpu_base)
                self._next_gpu = time.perf_counter() + GPU_POLL_S
            self._stop.wait(POLL_S)

    def rss(self) -> int:
        return tree_rss(self.proc)

    def done(self) -> bool:
        """Reaped (with the kernel's resource usage) once it has exited."""
        if self.status is None:
            pid, status, usage = os.wait4(self.popen.pid, os.WNOHANG)
            if pid:
                self.status, self.usage, self.end = status, usage, time.perf_counter()
        return self.status is not None

    def wait(self, timeout: float) -> bool:
        """True if it exited within `timeout` seconds, else False (still running)."""
        deadline = time.perf_counter() + timeout
        while not self.done():
            if time.perf_counter() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    def stop(self, sig: int = signal.SIGTERM, grace: float = 30) -> None:
        if not self.done():
            os.killpg(self.popen.pid, sig)
            if not self.wait(grace):
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.wait(grace)

    def result(self) -> dict:
        """rc (-N: ended by signal N), wall seconds, peak RSS, and the last line of its stderr where it failed."""
        self._stop.set()
        self._thread.join()
        self.out.close()
        self.err.close()
        rc = os.waitstatus_to_exitcode(self.status) if self.status is not None else None
        self.popen.returncode = rc
        maxrss = self.usage.ru_maxrss * 1024 if self.usage is not None else 0
        row = {"rc": rc, "wall_s": round((self.end or time.perf_counter()) - self.start, 2),
               "peak_rss_bytes": max(self.peak, maxrss), "polled_peak_rss_bytes": self.peak,
               "kernel_maxrss_bytes": maxrss}
        if self.gpu_base is not None:
            row["peak_gpu_bytes"] = self.gpu_peak
        if rc != 0:
            row["error"] = last_line(Path(self.err.name))
        return row


def last_line(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def spear(*args: str) -> list[str]:
    return [sys.executable, "-m", "spear.cli", *args]


def measure(cmd: list[str], log: Path, timeout: float, gpu: bool = False) -> dict:
    """Run `cmd` to its end (killed after `timeout` s): its wall time and peak RSS (and GPU memory, with `gpu`)."""
    watch = Watch(cmd, log, gpu)
    if not watch.wait(timeout):
        watch.stop(signal.SIGKILL)
        row = watch.result()
        row["error"] = f"timed out after {timeout:g} s"
        return row
    return watch.result()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_serve(artifact: Path, config: dict, log: Path, timeout: float, settle_s: float, tokens: int,
                  serve_args: list[str], gpu: bool = False) -> dict:
    """`spear serve`: seconds to /health, idle RSS, RSS after one completion of `tokens` tokens, the KV cache's
    bytes."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    watch = Watch(spear("serve", str(artifact), "--port", str(port), *serve_args), log, gpu)
    extra = {}
    try:
        deadline = time.perf_counter() + timeout
        while not _healthy(url):
            if watch.done() or time.perf_counter() > deadline:
                break
            time.sleep(0.5)
        else:
            extra["ready_s"] = round(time.perf_counter() - watch.start, 2)
            time.sleep(settle_s)
            extra["idle_rss_bytes"] = watch.rss()
            if gpu:
                extra["idle_gpu_bytes"] = (gpu_used_bytes() or 0) - watch.gpu_base
            extra |= served_kv(config, log.with_suffix(".out")) | served_startup(log.with_suffix(".out"))
            extra |= {f"idle_{k.lower()}_bytes": v for k, v in rss_split(watch.popen.pid).items()}
            body = {"prompt": "The history of", "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
            start = time.perf_counter()
            reply = _post(f"{url}/v1/completions", body, timeout)
            extra["generate_s"] = round(time.perf_counter() - start, 2)
            extra["completion_tokens"] = reply["usage"]["completion_tokens"]
            extra["after_rss_bytes"] = watch.rss()
    except (OSError, ValueError, KeyError) as e:
        extra["error"] = f"{type(e).__name__}: {e}"
    served, exited = "idle_rss_bytes" in extra, watch.done()
    watch.stop(signal.SIGTERM if served else signal.SIGKILL)
    row = watch.result() | extra
    if served and "error" not in extra:
        row.pop("error", None)  # the exit status is the stop's
    elif not served and not exited:
        row["error"] = f"no answer on /health within {timeout:g} s"
    elif not served:
        row.setdefault("error", "exited before answering /health")
    return row


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def measure_load(artifact: Path, log: Path, timeout: float, device: str) -> dict:
    """`spear.api.load` of the artifact, its files read once beforehand (page cache): seconds of the faster of the
    last two of three loads in one process (the first imports the model's modules too), artifact bytes / those
    seconds."""
    for f in artifact.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass
    row = measure([sys.executable, "-c", LOAD_SCRIPT, str(artifact), device], log, timeout)
    if row["rc"] == 0:
        row |= {k: round(v, 3) for k, v in json.loads(last_line(log.with_suffix(".out"))).items()}
        row["read_gb_s"] = round(dir_bytes(artifact) / row["load_s"] / GB, 3)
    return row


# ---- one shape, its steps -------------------------------------------------------------------------------------

def prepare(shape: str, workdir: Path, shard_mb: float, build_device: str = "cpu",
            tokenizer_dir: Path | None = None) -> tuple[str, dict, dict]:
    """The model spec the steps are given, its HF config as a dict, and what the row records of it."""
    if shape == DEFAULT_MODEL:
        from spear.models.loading import resolve_model_path

        hf_dir = default_tokenizer_dir()
        return DEFAULT_MODEL, json.loads((hf_dir / "config.json").read_text()), {
            "checkpoint": DEFAULT_MODEL, "gguf_bytes": resolve_model_path(DEFAULT_MODEL).stat().st_size,
            "checkpoint_bytes": dir_bytes(hf_dir)}
    ckpt = workdir / shape / "checkpoint"
    info = {}
    if not (ckpt / "model.safetensors.index.json").is_file():
        start = time.perf_counter()
        build_checkpoint(shape, ckpt, tokenizer_dir or default_tokenizer_dir(), shard_mb, device=build_device)
        info["build_s"] = round(time.perf_counter() - start, 1)
    config = json.loads((ckpt / "config.json").read_text())
    return str(ckpt.resolve()), config, info | {"checkpoint": str(ckpt), "checkpoint_bytes": dir_bytes(ckpt),
                                                "shards": len(list(ckpt.glob("*.safetensors")))}


def run_step(step: str, spec: str, config: dict, folder: Path, args) -> dict:
    """One measured step of the model `spec` (its HF config `config`); its row (command, rc, wall_s, peak_rss_bytes,
    and what the step adds)."""
    log = folder / "logs" / step
    log.parent.mkdir(parents=True, exist_ok=True)
    rtn, comp, device = folder / "rtn", folder / "compensated", ["--device", args.device]
    gpu = args.device.startswith("cuda")
    served = comp if args.serve_compensated and (comp / "config.json").is_file() else rtn
    needs = {"compensate": rtn, "eval": rtn, "serve": served, "load": served, "export": comp if comp.is_dir() else rtn}
    if step in needs and not (needs[step] / "config.json").is_file():
        return {"step": step, "skipped": f"needs {needs[step].name}: run quantize_rtn first"}
    if step.startswith("quantize"):
        out = folder / step.removeprefix("quantize_")
        cmd = spear("quantize", spec, "--out", str(out), *STEP_ARGS[step], *device)
    elif step == "compensate":
        out = comp
        shutil.rmtree(comp, ignore_errors=True)
        shutil.copytree(rtn, comp)
        flags = shlex.split(args.compensate_args) if args.compensate_args else STEP_ARGS[step]
        cmd = spear("compensate", str(comp), *flags, *device)
    elif step == "eval":
        cmd = spear("eval", str(rtn), *STEP_ARGS[step], *device)
    elif step == "export":
        out = folder / "vllm"
        cmd = spear("export-vllm", str(needs[step]), "--out", str(out))
    elif step == "serve":
        serve_args = [*device, *shlex.split(args.serve_args)]
        row = measure_serve(served, config, log, args.timeout, args.settle_s, args.tokens, serve_args, gpu)
        return {"step": step, "command": " ".join(["spear serve", str(served), *serve_args]), **row}
    elif step == "load":
        return {"step": step, "command": f"spear.api.load({served})",
                **measure_load(served, log, args.timeout, args.device)}
    else:
        raise ValueError(step)
    row = {"step": step, "command": " ".join(["spear", *cmd[3:]]), **measure(cmd, log, args.timeout, gpu)}
    if step == "export":
        row["export_bytes"] = dir_bytes(out)
    if step == "compensate":
        row["stages"] = stage_lines(log.with_suffix(".err"))  # there even where the run was cut
    if step == "compensate" and row["rc"] == 0:
        row |= compensation_record(out)
    elif step != "eval":
        row["artifact_bytes"] = dir_bytes(out)
    elif row["rc"] == 0:
        row["ppl"] = json.loads(last_line(log.with_suffix(".out")))["ppl"]
    return row


def stage_lines(err: Path) -> list[dict]:
    """The stages a command finished, from its "spear: STAGE done in S s[, GPU peak G GiB]" lines (util.stage_done)."""
    pattern = re.compile(r"^spear: (.+?) done in ([0-9.]+) s(?:, GPU peak ([0-9.]+) GiB)?$")
    found = (pattern.match(ln.strip()) for ln in err.read_text(errors="replace").replace("\r", "\n").splitlines())
    return [{"stage": m[1], "seconds": float(m[2]), **({"gpu_peak_gib": float(m[3])} if m[3] else {})}
            for m in found if m]


def compensation_record(artifact: Path) -> dict:
    """What `spear compensate` wrote of its run into the artifact's config.json: seconds per stage, the plan's
    modules and EC bytes, and the calibration's steps, precision and KL."""
    summary = json.loads((artifact / "config.json").read_text()).get("compensation") or {}
    calib = summary.get("calibration") or {}
    return {"stage_s": {k: round(v, 2) for k, v in summary.get("seconds", {}).items()},
            "ec_modules": summary.get("modules"), "ec_memory_pct": summary.get("ec_memory_pct"),
            "calibration": {k: calib.get(k) for k in ("steps", "precision", "initial_train_kl", "final_train_kl",
                                                      "initial_heldout_kl", "final_heldout_kl", "seconds")}}


def targets(record: dict, rows: dict[str, dict], folder: Path) -> list[dict]:
    """The issue's targets that this shape's rows measure: value, limit, pass."""
    served, layer = record["served_bytes"], record["layer_fp32_bytes"]
    rtn, serve = rows.get("quantize_rtn", {}), rows.get("serve", {})
    art = rtn.get("artifact_bytes") or dir_bytes(folder / "rtn")
    out = []
    if art:
        out.append(("artifact bytes ≤ 1.05 × served 4-bit bytes", art, 1.05 * served))
    if rtn.get("rc") == 0:
        out.append(("quantize rtn peak RSS ≤ 4-bit + fp32 layer + 1 GB", rtn["peak_rss_bytes"], served + layer + GB))
    if art and "idle_rss_bytes" in serve and "kv_bytes" in serve:
        out.append(("serve idle RSS ≤ artifact + KV + 0.6 GB", serve["idle_rss_bytes"], art + serve["kv_bytes"] + 0.6 * GB))
    if "read_gb_s" in rows.get("load", {}):
        out.append(("load read rate ≥ 0.5 GB/s", rows["load"]["read_gb_s"] * GB, 0.5 * GB))
    return [{"target": name, "value": int(v), "limit": int(lim),
             "pass": bool(v >= lim if "≥" in name else v <= lim)} for name, v, lim in out]


def run_shape(shape: str, args, saved=lambda record: None) -> dict:
    """One shape's steps; `saved(record)` after each, so that a run cut short keeps what it measured."""
    folder = Path(args.workdir) / shape
    folder.mkdir(parents=True, exist_ok=True)
    build_device = "cuda" if args.device.startswith("cuda") else "cpu"
    tokenizer_dir = Path(args.tokenizer_dir) if args.tokenizer_dir else None
    spec, config, info = prepare(shape, Path(args.workdir), args.shard_mb, build_device, tokenizer_dir)
    record = {"shape": shape, **info, "params": param_count(config), "served_bytes": served_bytes(config),
              "layer_fp32_bytes": 4 * layer_param_count(config), "steps": []}
    rows = {}
    for step in [s for s in STEPS if s in args.steps]:
        print(f"[{shape}] {step} ...", file=sys.stderr, flush=True)
        rows[step] = run_step(step, spec, config, folder, args)
        record["steps"].append(rows[step])
        print(f"[{shape}] {step}: {_brief(rows[step])}", file=sys.stderr, flush=True)
        saved(record)
    record["targets"] = targets(record, rows, folder)
    return record


def _brief(row: dict) -> str:
    if "skipped" in row:
        return f"skipped ({row['skipped']})"
    text = f"rc {row['rc']}, {row['wall_s']:.1f} s, peak {row['peak_rss_bytes'] / GB:.2f} GB"
    return text + (f": {row['error']}" if "error" in row else "")


def table(shapes: list[dict]) -> str:
    lines = [f"{'shape':<8} {'step':<14} {'rc':>4} {'wall s':>8} {'peak GB':>8}  notes"]
    for rec in shapes:
        for row in rec["steps"]:
            if "skipped" in row:
                lines.append(f"{rec['shape']:<8} {row['step']:<14} {'-':>4} {'-':>8} {'-':>8}  {row['skipped']}")
                continue
            notes = [f"{k.removesuffix('_bytes')} {row[k] / GB:.3f} GB" for k in
                     ("artifact_bytes", "export_bytes", "idle_rss_bytes", "after_rss_bytes", "kv_bytes") if k in row]
            notes += [f"{k.removesuffix('_bytes')} {row[k] / GB:.2f} GB" for k in ("peak_gpu_bytes", "idle_gpu_bytes")
                      if k in row]
            notes += [f"{k} {row[k]}" for k in ("ppl", "ready_s", "generate_s", "load_s", "read_gb_s", "stage_s")
                      if k in row]
            notes += [f"error: {row['error']}"] if "error" in row else []
            lines.append(f"{rec['shape']:<8} {row['step']:<14} {str(row['rc']):>4} {row['wall_s']:>8.1f} "
                         f"{row['peak_rss_bytes'] / GB:>8.2f}  {', '.join(notes)}")
        lines.append(f"{rec['shape']}: params {rec['params'] / 1e9:.3f} B, checkpoint {rec['checkpoint_bytes'] / GB:.3f} "
                     f"GB, served 4-bit {rec['served_bytes'] / GB:.3f} GB")
        for t in rec["targets"]:
            lines.append(f"  {'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {t['value'] / GB:.3f} vs {t['limit'] / GB:.3f}")
    return "\n".join(lines)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]).stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs="+", default=["0.5b"], choices=[*SHAPES, DEFAULT_MODEL])
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    p.add_argument("--json", required=True)
    p.add_argument("--workdir", default="/tmp/spear-memory", help="checkpoints, artifacts and logs (kept)")
    p.add_argument("--shard-mb", type=float, default=500, help="largest checkpoint shard (MB)")
    p.add_argument("--device", default="cpu", help="--device of every command (default cpu)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds each command may take")
    p.add_argument("--settle-s", type=float, default=5, help="serve: seconds after /health before the idle RSS")
    p.add_argument("--tokens", type=int, default=64, help="serve: tokens of the one completion")
    p.add_argument("--serve-args", default="", help='serve: more options, as "--max-num-seqs 4 --max-model-len 1024"')
    p.add_argument("--tokenizer-dir", default=None,
                   help="tokenizer files for the random checkpoints (default: the default model's, from its GGUF)")
    p.add_argument("--serve-compensated", action="store_true",
                   help="serve and load the compensated artifact where compensate wrote one (default: the W4 one)")
    p.add_argument("--compensate-args", default="",
                   help=f'compensate: its flags instead of "{" ".join(STEP_ARGS["compensate"])}"'.replace("%", "%%"))
    args = p.parse_args()
    # the checkout as the run starts: its commit (the provenance's, written at the end) and its tracked files that
    # differ from it, what else the figures ran
    os.environ.setdefault("SPEAR_COMMIT", git("rev-parse", "HEAD").strip())
    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    records = []
    def save(partial: dict | None = None) -> None:
        write_json(args.json, {"args": vars(args), "modified_files": dirty, "shapes": records + [partial] * bool(partial)})

    for shape in args.shape:
        records.append(run_shape(shape, args, save))
        save()
    print(table(records))


if __name__ == "__main__":
    main()
