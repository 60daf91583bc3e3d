"""Shared by the benchmark scripts: the provenance block every results JSON carries, and the copy bandwidth
that GPU figures are read against."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch



def provenance() -> dict:
    # The device machine's copy of the tree may carry a stale .git: pass SPEAR_COMMIT=$(git rev-parse HEAD).
    commit = os.environ.get("SPEAR_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    if not torch.cuda.is_available():  # CPU figures follow the vector unit (AVX2 and AVX-512 kernels differ)
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        info["cpu_cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        import triton

        info["triton"] = triton.__version__
        if torch.cuda.is_available():  # programmatic dependent launch (kernels.pdl): on unless SPEAR_PDL=0
            from spear.kernels.pdl import uses_pdl, w4_launch

            info["pdl"] = uses_pdl(torch.empty(0, device="cuda"))
            info["pdl_w4"] = dataclasses.asdict(w4_launch())
    except ImportError:
        pass
    knobs = {k: v for k, v in sorted(os.environ.items())
             if k.startswith(("SPEAR_", "NCCL_")) and k not in ("SPEAR_COMMIT", "SPEAR_CACHE")}
    if knobs:  # the run's kernel, model and NCCL switches (SPEAR_FOLD_NORM, NCCL_PROTO, ...), where any is set
        info["env"] = knobs
    import transformers

    info["transformers"] = transformers.__version__
    return info


def write_json(path: str | Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"provenance": provenance(), **payload}, indent=2))
    tmp.rename(path)


def sync() -> None:
    """Drain the GPU's queue, where there is one."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> tuple[object, float]:
    """fn's result and its wall seconds, the GPU's queue drained before and after."""
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> dict[str, float]:
    """A large device-to-device copy, bytes read + written per second, each way it can be measured:
    `memcpy` (copies timed on the host around a sync; any device) and, on CUDA, `kernel_graph` (an
    elementwise copy kernel, dst = src · 1, replayed in a CUDA graph). A copy captured in a graph becomes
    a memcpy node on a copy engine (2.7 TB/s on the H200 against 4.2), so it is not one of the ways.
    The reference for "% of copy bandwidth" is the largest."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync()
    ways = {"memcpy": 2 * nbytes * reps / (time.perf_counter() - start)}
    if device.type == "cuda":
        from spear.kernels.timing import time_in_graph

        ways["kernel_graph"] = 2 * nbytes / (time_in_graph([lambda: torch.mul(src, 1, out=dst)], reps=reps) * 1e-6)
    return ways


def refuse_real_shapes_on_cpu(script: str, models: list[str]) -> None:
    """Exit 2 with one line when real model shapes are asked for on a machine without a CUDA GPU: built in float32
    there, a 7B model alone would pass a CPU machine's memory. The scripts' --tiny runs anywhere."""
    big = [m for m in models if m != "tiny"]
    if big and not torch.cuda.is_available():
        need = "need" if len(big) > 1 else "needs"
        print(f"{script}: error: {' and '.join(big)} {need} a CUDA GPU; on CPU run --tiny", file=sys.stderr)
        raise SystemExit(2)


def add_self_sample_args(p) -> None:
    """The layer-wise lab scripts' options: the model and its self-sampled inputs (load_self_sampled), --json."""
    p.add_argument("--model", default="smollm2")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--json", type=Path)


def load_self_sampled(args):
    """(the float model on the CPU in float32, its --sequences × --seq-len self-sampled calibration ids)."""
    from spear.api import model_key
    from spear.data.calibration import CalibConfig, calibration_ids
    from spear.models import load_float_model

    lm = load_float_model(args.model, device=torch.device("cpu"), dtype=torch.float32)
    cfg = CalibConfig(num_sequences=args.sequences, seq_len=args.seq_len, batch_size=args.sequences)
    return lm, calibration_ids(lm.model, lm.tokenizer, cfg, model_key(args.model))
