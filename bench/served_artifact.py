"""What `spear serve` holds and how fast it decodes, on a random W4 artifact in a real shape read from disk.

    python bench/served_artifact.py --models llama2-70b --json bench/results/served_artifact.json   # one H200
    python bench/served_artifact.py --tiny --json /tmp/served.json                                  # CPU check

For each model and setting (W4 per-channel; W4 + gated rank-32 ECs on 38% of the linears) the artifact is written
straight at 4 bits (fixtures.write_random_artifact: no float weights ever exist), then loaded as `spear serve`
loads it (api.load(serving=True): a meta skeleton filled tensor by tensor onto the device, then build_runtime_model:
packed for the kernels, records and dense copies released). Recorded: the artifact's bytes and write time, the
load and build seconds, the bytes the runtime model holds by kind (runtime.model.held_bytes) against the bytes a
decode step reads (decode.weight_bytes), the device memory allocated after the build and at its peak, and the
decode ms a token at each batch through the serving engine (decode.measure). With --compare-fixture the same shape
is also built in memory (fixtures.random_model, as bench/decode.py does) and timed in the same call, where it fits:
the layout served and the layout benchmarked must be the same, and so must their speed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import copy_bandwidth, refuse_real_shapes_on_cpu, write_json
from decode import EC_FRACTIONS, measure, weight_bytes
from fixtures import random_model, write_random_artifact
from shapes import MODELS

from spear import api
from spear.kernels.w4 import decode_tune_rows
from spear.record import QuantConfig
from spear.runtime.model import build_runtime_model, held_bytes
from spear.shards import safetensors_bytes

EC_RANK = 32


def device_memory(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    return {"allocated": torch.cuda.memory_allocated(device), "peak": torch.cuda.max_memory_allocated(device)}


def served_row(name: str, setting: str, workdir: Path, device: torch.device, batches: list[int], prompt: int,
               new: int, bandwidth: float) -> list[dict]:
    args = MODELS[name]
    fraction = EC_FRACTIONS[setting]
    path = workdir / f"{name}-{setting}"
    start = time.perf_counter()
    write_random_artifact(args, path, fraction, EC_RANK, device=device)
    write_seconds = time.perf_counter() - start
    artifact_bytes = safetensors_bytes(path)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    lm = api.load(str(path), device, serving=True)
    load_seconds = time.perf_counter() - start
    model = build_runtime_model(lm.model)  # as build_engine (spear serve) builds it: packed, tuned, released
    del lm
    build_seconds = time.perf_counter() - start - load_seconds
    held, memory = held_bytes(model), device_memory(device)
    base = {"model": name, "setting": setting, "path": "artifact", "artifact_bytes": artifact_bytes,
            "write_s": write_seconds, "load_s": load_seconds, "load_gb_per_s": artifact_bytes / load_seconds / 1e9,
            "build_s": build_seconds, "held_bytes": held, "weight_bytes": weight_bytes(model),
            "device_memory_after_build": memory}
    rows = []
    for batch in batches:
        measured = measure(model, batch, prompt, new, cuda_graphs=device.type == "cuda", overlap=True)
        rows.append(base | measured | {"floor_ms_per_token": 1e3 * base["weight_bytes"] / bandwidth,
                                       "device_memory_peak": device_memory(device).get("peak")})
    del model
    shutil.rmtree(path, ignore_errors=True)
    return rows


def fixture_rows(name: str, setting: str, device: torch.device, dtype: torch.dtype, batches: list[int], prompt: int,
                 new: int) -> list[dict]:
    fraction = EC_FRACTIONS[setting]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    model = random_model(MODELS[name], QuantConfig(4, -1), fraction, EC_RANK, dtype, device,
                         tune_rows=decode_tune_rows(max(batches)))
    base = {"model": name, "setting": setting, "path": "fixture", "build_s": time.perf_counter() - start,
            "held_bytes": held_bytes(model), "weight_bytes": weight_bytes(model),
            "device_memory_after_build": device_memory(device)}
    rows = [base | measure(model, b, prompt, new, cuda_graphs=device.type == "cuda", overlap=True) for b in batches]
    del model
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None, help="default: llama2-70b")
    p.add_argument("--settings", nargs="+", choices=["w4", "w4+ec38"], default=["w4", "w4+ec38"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--compare-fixture", nargs="*", default=[], metavar="MODEL",
                   help="models also built in memory by fixtures.random_model and timed in the same call")
    p.add_argument("--workdir", default=None, help="where the artifacts are written (default: a temp dir)")
    p.add_argument("--tiny", action="store_true", help="the tiny shape with short runs (CPU end-to-end check)")
    p.add_argument("--json", default="bench/results/served_artifact.json")
    args = p.parse_args()
    models = args.models or (["tiny"] if args.tiny else ["llama2-70b"])
    refuse_real_shapes_on_cpu("served_artifact.py", models + args.compare_fixture)
    if args.tiny:
        args.prompt_tokens, args.new_tokens, args.batches = 16, 8, [1, 4]
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    bandwidth = max(copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20)).values())
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="spear-served-"))
    rows = []

    def save() -> None:
        write_json(args.json, {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                               "ec": {"rank": EC_RANK, "gate_hidden": 8}, "copy_bandwidth_bytes_per_s": bandwidth,
                               "rows": rows})

    for name in models:
        for setting in args.settings:
            for row in served_row(name, setting, workdir, device, args.batches, args.prompt_tokens, args.new_tokens,
                                  bandwidth):
                rows.append(row)
                held = row["held_bytes"]
                print(f"{name:<10} {setting:<8} artifact B={row['batch']:<3} {row['ms_per_token']:8.2f} ms/token  "
                      f"held packed {held['packed'] / 1e9:.2f} GB dense {held['dense'] / 1e9:.2f} GB "
                      f"codes {held['codes'] / 1e9:.2f} GB other {held['other'] / 1e9:.2f} GB  "
                      f"load {row['load_s']:.1f} s ({row['load_gb_per_s']:.2f} GB/s)", flush=True)
                save()
    for name in args.compare_fixture:
        for setting in args.settings:
            for row in fixture_rows(name, setting, device, dtype, args.batches, args.prompt_tokens, args.new_tokens):
                rows.append(row)
                print(f"{name:<10} {setting:<8} fixture  B={row['batch']:<3} {row['ms_per_token']:8.2f} ms/token",
                      flush=True)
                save()
    save()
    print(f"\n{'model':<10} {'setting':<8} {'path':<9} {'batch':>5} {'ms/token':>9} {'held GB':>8} {'read GB':>8}")
    for r in rows:
        print(f"{r['model']:<10} {r['setting']:<8} {r['path']:<9} {r['batch']:>5} {r['ms_per_token']:>9.2f} "
              f"{sum(r['held_bytes'].values()) / 1e9:>8.2f} {r['weight_bytes'] / 1e9:>8.2f}")


if __name__ == "__main__":
    main()
