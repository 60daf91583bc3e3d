"""4-bit weights on a CPU (issues 50 and 53): each linear of SmolLM2-135M and Llama-3.2-1B, timed five ways at M rows.

    python bench/cpu_w4.py --json bench/results/cpu_w4.json [--models smollm2-135m llama3.2-1b] [--rows 1 8 128]

    dense_fp32   F.linear on the float32 dequantized weight (what SpearLinear runs on a CPU today)
    dense_bf16   F.linear on a bfloat16 copy, x cast to bfloat16 and the result back
    int4_fp32    PyTorch's CPU int4 matmul computing in float32 (spear.kernels.cpu_w4.cpu_w4_linear)
    int4_bf16    the same computing in bfloat16, x cast to bfloat16 and the result back
    scratch      nibble-packed codes dequantized into one shared float32 scratch, then F.linear (scratch_linear)
Every path takes float32 x [M, K] and returns float32 y, as a float32 model would call it; each is first checked
against x @ W_hatᵀ. Weights are random in the real shapes, quantized per-channel unless --group says otherwise.
A 64 MB buffer (twice the dev box's L3; a round of five writes 320 MB, over the Xeon's 300 MB) is written before every
timed call, so the weight comes from memory as it does in a forward pass over the whole model. Paths are timed in
interleaved rounds (one call each a round), median and min kept; a path slower than --slow-s a call stops after
5 rounds. The whole-model estimate is the sum over a
layer's seven linears (q, k, v, o, gate, up, down, not fused) times the layers: it leaves out attention, norms,
embeddings and the LM head. The load average is recorded: on a shared machine other processes inflate the times,
two threads far more than one (a parallel region waits for the thread the scheduler parked).

Results: bench/results/cpu_w4_epyc-avx2_t1*.json (the 2-core AMD EPYC dev box, one thread: two were swamped by other
jobs), cpu_w4_xeon-as-avx2_t2.json (the H200 host's Xeon, `taskset -c 0,1`, with ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 so that every path takes its AVX2 code) and
cpu_w4_xeon-avx512_t2.json (the same, native AVX-512 and AMX).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from common import write_json

from spear.kernels.cpu_w4 import Scratch, cpu_w4_linear, pack_cpu_w4, pack_nibbles, scratch_linear
from spear.record import QuantConfig, rtn_quantize

# hidden, intermediate, query heads, kv heads, head_dim, layers
MODELS = {"smollm2-135m": (576, 1536, 9, 3, 64, 30), "llama3.2-1b": (2048, 8192, 32, 8, 64, 16)}
PATHS = ("dense_fp32", "dense_bf16", "int4_fp32", "int4_bf16", "scratch")
FLUSH_BYTES = 64 << 20


def layer_linears(model: str) -> dict[str, tuple[int, int]]:
    """(N = out, K = in) of each linear of a layer."""
    hidden, inter, heads, kv_heads, head_dim, _ = MODELS[model]
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q),
            "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}


def build(n: int, k: int, cfg: QuantConfig, scratch: Scratch) -> tuple[dict, dict[str, int], torch.Tensor]:
    """The five paths over one random weight as callables x -> y, the bytes each holds for it, and W_hat."""
    record = rtn_quantize(torch.randn(n, k) * k**-0.5, cfg)
    w32 = record.dequantize()
    w16 = w32.bfloat16()
    p32, p16, nib = pack_cpu_w4(record, torch.float32), pack_cpu_w4(record, torch.bfloat16), pack_nibbles(record)
    paths = {
        "dense_fp32": lambda x: F.linear(x, w32),
        "dense_bf16": lambda x: F.linear(x.bfloat16(), w16).float(),
        "int4_fp32": lambda x: cpu_w4_linear(x, p32),
        "int4_bf16": lambda x: cpu_w4_linear(x, p16),
        "scratch": lambda x: scratch_linear(x, nib, scratch),
    }
    nbytes = {"dense_fp32": w32.nbytes, "dense_bf16": w16.nbytes, "int4_fp32": p32.nbytes(),
              "int4_bf16": p16.nbytes(), "scratch": nib.nbytes()}
    return paths, nbytes, w32


def time_paths(paths: dict, x: torch.Tensor, rounds: int, slow_s: float, flush: torch.Tensor) -> dict[str, dict]:
    """Median and min ms a call of each path, in interleaved rounds, the caches flushed before each call."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for f in paths.values():
        f(x)
    for r in range(rounds):
        for name, f in paths.items():
            if r >= 5 and times[name][0] > slow_s * 1e3:
                continue
            flush.add_(1)
            start = time.perf_counter()
            f(x)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"ms": statistics.median(t), "min_ms": min(t), "n": len(t)} for name, t in times.items()}


def check(paths: dict, w32: torch.Tensor, k: int) -> dict[str, float]:
    """Each path's max |y - x W_hatᵀ| relative to max |x W_hatᵀ| (float64 reference), at 8 rows."""
    x = torch.randn(8, k)
    ref = x.double() @ w32.double().t()
    return {name: ((f(x).double() - ref).abs().max() / ref.abs().max()).item() for name, f in paths.items()}


def estimate(rows: list[dict], linears: dict, layers: int, m: int, stat: str) -> dict[str, dict]:
    """Per path: the layer's linears at m rows summed (ms), times the layers, and the tokens a second that gives."""
    layer_ms = {name: sum(next(r["timings"][name][stat] for r in rows if (r["N"], r["K"], r["M"]) == (n, k, m))
                          for n, k in linears.values()) for name in PATHS}
    return {name: {"layer_ms": ms, "model_ms": ms * layers, "tokens_per_s": m * 1e3 / (ms * layers)}
            for name, ms in layer_ms.items()}


def cpu_info() -> dict:
    name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    isa = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
           if k in os.environ}  # set to time a wider CPU's AVX2 code paths
    return {"cpu": name, "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "cores": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)), "loadavg": os.getloadavg(),
            "isa_env": isa}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8, 128])
    p.add_argument("--group", type=int, default=-1, help="quantization group size (-1: per-channel)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--slow-s", type=float, default=0.25)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = QuantConfig(bits=4, group_size=args.group, sym=True)
    flush = torch.zeros(FLUSH_BYTES // 4)
    shapes = {shape for m in args.models for shape in layer_linears(m).values()}
    scratch = Scratch(max(n * k for n, k in shapes))
    info = cpu_info()
    print(f"{info['cpu']} ({info['capability']}), {args.threads} threads, torch {torch.__version__}, "
          f"load average {info['loadavg'][0]:.2f}", flush=True)
    print(f"{'N×K':>11} {'M':>4} " + " ".join(f"{name:>11}" for name in PATHS) + "   ms a call (median)", flush=True)
    rows = []
    for n, k in sorted(shapes):
        paths, nbytes, w32 = build(n, k, cfg, scratch)
        err = check(paths, w32, k)
        for m in args.rows:
            t = time_paths(paths, torch.randn(m, k), args.rounds, args.slow_s, flush)
            rows.append({"N": n, "K": k, "M": m, "timings": t, "bytes": nbytes, "rel_err": err})
            print(f"{f'{n}×{k}':>11} {m:>4} " + " ".join(f"{t[name]['ms']:11.3f}" for name in PATHS), flush=True)
        del paths, w32
    models = {}
    for model in args.models:
        layers = MODELS[model][-1]
        linears = layer_linears(model)
        weights = sum(n * k for n, k in linears.values())
        scratch_bytes = 5 * max(n * k for n, k in linears.values())  # the scratch's uint8 codes and float32 weight
        bytes_per_weight = {name: sum(next(r["bytes"][name] for r in rows if (r["N"], r["K"]) == (n, k))
                                      for n, k in linears.values()) / weights for name in PATHS}
        models[model] = {"layers": layers, "linears": linears, "weights_per_layer": weights,
                         "bytes_per_weight": bytes_per_weight, "scratch_bytes": scratch_bytes,
                         "rows": {m: estimate(rows, linears, layers, m, "ms") for m in args.rows},
                         "rows_from_min": {m: estimate(rows, linears, layers, m, "min_ms") for m in args.rows}}
        for key, stat in (("rows", "median"), ("rows_from_min", "min")):
            print(f"\n{model}: {layers} layers, linears only, from the {stat} (ms a forward / tokens a second)")
            print(f"{'M':>4} " + " ".join(f"{name:>19}" for name in PATHS))
            for m, res in models[model][key].items():
                print(f"{m:>4} " + " ".join(f"{res[name]['model_ms']:9.1f} / {res[name]['tokens_per_s']:7.1f}"
                                             for name in PATHS))
        print("bytes/weight " + " ".join(f"{name} {b:.3f}" for name, b in bytes_per_weight.items())
              + f"  (+ one scratch of {scratch_bytes / 1e6:.1f} MB)")
    info["loadavg_end"] = os.getloadavg()
    write_json(args.json, {"machine": info, "config": vars(args), "rows": rows, "models": models})


if __name__ == "__main__":
    main()
