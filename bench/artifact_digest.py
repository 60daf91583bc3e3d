"""What checking an artifact's shards against their recorded sha256 costs: load seconds with and without the check.

    python bench/artifact_digest.py --json bench/results/artifact_digest_cpu.json     # Qwen2.5-1.5B's shape, 1.1 GB
    python bench/artifact_digest.py --shape tiny --json /tmp/digest.json              # a quick check

A random W4 per-channel artifact in the shape (fixtures.write_random_artifact, tied embeddings in fp16) is written
once; a twin of it (its shards hard-linked) records no sha256, as artifacts written before the check do. Both are
loaded as `spear serve` loads them (api.load(serving=True), page cache warm), alternately --repeats times after a
warm-up load of each: with the check, a thread hashes the shards while the loader reads their tensors. The other
way, the whole check before the load, is timed beside them. Also recorded: one file_sha256 pass over the shards
(what `spear verify` costs) and the write's seconds with the sha256 ShardWriter now takes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import write_json
from fixtures import write_random_artifact

from spear import api
from spear.runtime.model import ModelArgs
from spear.shards import check_sha256, file_sha256, safetensors_bytes

# Qwen2.5-1.5B's shape (its q/k/v biases left out): 0.66 GB of 4-bit codes, 0.47 GB of tied fp16 embeddings
SHAPES = {
    "qwen2.5-1.5b": ModelArgs(dim=1536, intermediate=8960, n_heads=12, n_kv_heads=2, head_dim=128, n_layers=28,
                              vocab=151936, rope_theta=1e6, tie_embeddings=True, max_seq_len=32768),
    "tiny": ModelArgs(dim=64, intermediate=128, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2, vocab=256),
}


def unchecked_twin(artifact: Path, twin: Path) -> Path:
    """`artifact` as an artifact written before sha256s were recorded: its files hard-linked, its config without."""
    shutil.rmtree(twin, ignore_errors=True)
    twin.mkdir()
    for file in artifact.iterdir():
        os.link(file, twin / file.name)
    config = json.loads((artifact / "config.json").read_text())
    del config["weights_sha256"]
    (twin / "config.json").unlink()
    (twin / "config.json").write_text(json.dumps(config, indent=2))
    return twin


def load_seconds(path: Path) -> float:
    start = time.perf_counter()
    lm = api.load(str(path), torch.device("cpu"), serving=True)
    seconds = time.perf_counter() - start
    del lm
    gc.collect()
    return seconds


def measure(shape: str, workdir: Path, repeats: int) -> dict:
    artifact = workdir / f"{shape}-w4"
    start = time.perf_counter()
    write_random_artifact(SHAPES[shape], artifact)
    write_s = time.perf_counter() - start
    twin = unchecked_twin(artifact, workdir / f"{shape}-w4-unchecked")
    sha256 = json.loads((artifact / "config.json").read_text())["weights_sha256"]
    shards = sorted(sha256)
    size = safetensors_bytes(artifact)
    hash_s = []
    for _ in range(repeats):  # also warms the page cache
        start = time.perf_counter()
        for name in shards:
            file_sha256(artifact / name)
        hash_s.append(time.perf_counter() - start)
    load_seconds(artifact), load_seconds(twin)  # warm-up: imports, first allocations
    checked, unchecked, hash_then_load = [], [], []
    for _ in range(repeats):
        unchecked.append(load_seconds(twin))
        checked.append(load_seconds(artifact))
        start = time.perf_counter()  # the other way: the whole check first, then the load
        check_sha256(artifact, sha256)
        hash_then_load.append(time.perf_counter() - start + load_seconds(twin))
    load, with_check = min(unchecked), min(checked)
    return {
        "shape": shape, "artifact_bytes": size, "shards": len(shards), "write_s": round(write_s, 3),
        "sha256_s": [round(s, 3) for s in hash_s], "sha256_gb_s": round(size / min(hash_s) / 1e9, 3),
        "load_unchecked_s": [round(s, 3) for s in unchecked], "load_checked_s": [round(s, 3) for s in checked],
        "load_unchecked_min_s": round(load, 3), "load_checked_min_s": round(with_check, 3),
        "load_unchecked_median_s": round(statistics.median(unchecked), 3),
        "load_checked_median_s": round(statistics.median(checked), 3),
        "check_cost_min_pct": round(100 * (with_check / load - 1), 1),
        "check_cost_median_pct": round(100 * (statistics.median(checked) / statistics.median(unchecked) - 1), 1),
        "hash_then_load_s": [round(s, 3) for s in hash_then_load],
        "hash_then_load_cost_min_pct": round(100 * (min(hash_then_load) / load - 1), 1),
        "hash_then_load_cost_median_pct": round(
            100 * (statistics.median(hash_then_load) / statistics.median(unchecked) - 1), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=list(SHAPES))
    p.add_argument("--repeats", type=int, default=5, help="loads of each artifact, alternating (default 5)")
    p.add_argument("--workdir", default=None, help="where the artifacts go (default: a temporary directory, removed)")
    p.add_argument("--json", default="bench/results/artifact_digest_cpu.json")
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="spear-digest-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    try:
        row = measure(args.shape, workdir, args.repeats)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    # other processes on the machine move these figures: the 1-minute load average before and after
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], capture_output=True).returncode != 0
    row |= {"uncommitted_changes": dirty, "cpu_threads": torch.get_num_threads(), "openssl": ssl.OPENSSL_VERSION,
            "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    print(f"{row['shape']}: {row['artifact_bytes'] / 1e9:.2f} GB in {row['shards']} shard(s); sha256 "
          f"{row['sha256_gb_s']:.2f} GB/s; load {row['load_unchecked_min_s']:.2f} s unchecked, "
          f"{row['load_checked_min_s']:.2f} s checked (min; {row['check_cost_min_pct']:+.0f}%, median "
          f"{row['check_cost_median_pct']:+.0f}%); the check before the load instead: min "
          f"{row['hash_then_load_cost_min_pct']:+.0f}%, median {row['hash_then_load_cost_median_pct']:+.0f}%")
    write_json(args.json, {"artifact_digest": row})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
