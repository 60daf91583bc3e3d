"""The W4 decode kernel under Nsight Compute (hardware counters): what limits a launch at M = 1.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats --metrics "$(python bench/ncu_w4.py \
        --metrics)" --csv --page details --log-file ncu.csv python bench/ncu_w4.py --labels labels.json
    python bench/ncu_w4.py --summarize ncu.csv --labels labels.json --json bench/results/ncu_w4_h200.json

The first command launches, for each Llama-2-7B shape, every decode candidate that can run M = 1 (W4, and W4+EC r32
for the fp16x2 configs) and, as yardsticks, the same bytes as a device copy and the fp16 weight through cuBLAS,
each once between cudaProfilerStart and Stop (compiled and warmed up before), writing the launches' labels in
order. ncu flushes the caches before each profiled launch (its default), so every launch reads HBM. The second
joins ncu's CSV with the labels and keeps the figures that say what bounds a launch: DRAM throughput (% of peak),
duration, achieved occupancy and its limits, issue-slot use, and the top warp stall reasons.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LAB_SHAPES  # noqa: E402

SHAPES = {name: LAB_SHAPES[name] for name in ("7b/qkvo", "7b/gate_up", "7b/down", "7b/gate_up_fused")}
KEEP = {  # ncu metric name → short key
    "Duration": "duration",
    "DRAM Throughput": "dram_pct",
    "Memory Throughput": "memory_pct",
    "Compute (SM) Throughput": "sm_pct",
    "Achieved Occupancy": "occupancy_pct",
    "Theoretical Occupancy": "theoretical_occupancy_pct",
    "Registers Per Thread": "registers",
    "Waves Per SM": "waves",
    "Grid Size": "grid",
    "Block Limit Registers": "block_limit_registers",
    "Block Limit Shared Mem": "block_limit_smem",
    "Issue Slots Busy": "issue_slots_busy_pct",
    "No Eligible": "no_eligible_pct",
    "Active Warps Per Scheduler": "active_warps_per_scheduler",
    "Eligible Warps Per Scheduler": "eligible_warps_per_scheduler",
    "Warp Cycles Per Issued Instruction": "cycles_per_issue",
    "Elapsed Cycles": "elapsed_cycles",
    "SM Active Cycles": "sm_active_cycles",
    "dram__bytes_read.sum": "dram_bytes_read",
    "sm__cycles_active.max": "sm_active_cycles_max",
    "sm__cycles_active.min": "sm_active_cycles_min",
}
STALLS = [f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio" for reason in (
    "long_scoreboard", "short_scoreboard", "wait", "math_pipe_throttle", "not_selected", "selected", "barrier",
    "lg_throttle", "mio_throttle", "dispatch_stall", "no_instruction", "membar", "drain", "branch_resolving",
    "imc_miss", "sleeping", "tex_throttle")]
METRICS = ",".join(STALLS + ["dram__bytes_read.sum", "sm__cycles_active.max", "sm__cycles_active.min"])


def launch(labels_path: str) -> None:
    import torch
    from kernels import random_ec

    from spear.kernels import w4 as w4mod
    from spear.kernels.pack import pack_ec, pack_w4
    from spear.quant.record import QuantConfig, rtn_quantize

    calls, labels = [], []
    for name, (n, k) in SHAPES.items():
        packed = pack_w4(rtn_quantize(torch.randn(n, k, device="cuda", dtype=torch.float16), QuantConfig(4, -1)))
        ec = pack_ec(random_ec(n, k, 32))
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        swiglu = name.endswith("_fused")
        for cfg in w4mod.DECODE_CANDIDATES:
            if not cfg.gemv_rows and not swiglu:
                continue  # the dot loop is M = 16's
            for with_ec in (False, True) if cfg.gemv_f16x2 or swiglu else (False,):
                calls.append(lambda x=x, w=packed, e=ec if with_ec else None, c=cfg, s=swiglu:
                             w4mod.w4_decode(x, w, e, cfg=c, swiglu=s))
                labels.append({"shape": name, "config": dataclasses.asdict(cfg), "ec": with_ec, "kind": "w4"})
        if not swiglu:
            dense = torch.randn(n, k, device="cuda", dtype=torch.float16)
            src = torch.empty(packed.nbytes() // 2, device="cuda", dtype=torch.float16)
            dst = torch.empty_like(src)
            calls += [lambda x=x, d=dense: torch.nn.functional.linear(x, d),
                      lambda s=src, d=dst: torch.mul(s, 1, out=d)]  # one elementwise kernel (a copy_ is a memcpy)
            labels += [{"shape": name, "config": "cublas fp16", "ec": False, "kind": "cublas"},
                       {"shape": name, "config": "copy (W4 bytes)", "ec": False, "kind": "copy"}]
    for call in calls:  # compile and warm up, unprofiled
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:
        call()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    Path(labels_path).write_text(json.dumps(labels))


def _kind(kernel: str) -> str:
    return "w4" if "w4_decode" in kernel else "copy" if "elementwise" in kernel.lower() else "cublas"


def summarize(csv_path: str, labels_path: str) -> list[dict]:
    """One dict per profiled kernel, in launch order, with its launch's label (cuBLAS may launch two kernels for
    one call: consecutive cuBLAS kernels share a label)."""
    labels = json.loads(Path(labels_path).read_text())
    lines = Path(csv_path).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    by_id: dict[str, dict] = defaultdict(dict)
    stalls: dict[str, dict] = defaultdict(dict)
    for row in csv.DictReader(lines[start:]):
        entry = by_id[row["ID"]]
        entry.setdefault("kernel", row["Kernel Name"][:80])
        metric, value = row["Metric Name"], row["Metric Value"].replace(",", "")
        try:
            number = float(value)
        except ValueError:
            number = None
        if metric in KEEP:
            entry[KEEP[metric]] = number if number is not None else value
            if metric == "Duration":
                entry["duration_unit"] = row["Metric Unit"]
        elif metric in STALLS and number is not None:
            stalls[row["ID"]][metric.split("stalled_")[1].split("_per_issue")[0]] = number
    rows, at, previous = [], -1, None
    for kid in sorted(by_id, key=int):
        entry = by_id[kid]
        kind = _kind(entry["kernel"])
        if not (kind == "cublas" and previous == "cublas"):
            at += 1
        previous = kind
        label = labels[at] if at < len(labels) else {"shape": "?", "config": "?", "ec": False, "kind": "?"}
        if label.get("kind") != kind:
            label = {**label, "mismatch": kind}
        rows.append({**label, **entry, "stalls": stalls.get(kid, {})})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--labels")
    p.add_argument("--metrics", action="store_true", help="print the raw metrics to pass to ncu --metrics")
    p.add_argument("--summarize", help="ncu's CSV (--csv --page details) to join with the labels")
    p.add_argument("--json", help="with --summarize: where to write the joined rows")
    args = p.parse_args()
    if args.metrics:
        print(METRICS)
        return
    if not args.summarize:
        launch(args.labels)
        return
    rows = summarize(args.summarize, args.labels)
    for r in rows:
        cfg = r["config"] if isinstance(r["config"], str) else "{block_n}/{num_warps}/{num_stages}/{block_kw}{f}".format(
            **r["config"], f=" f16x2" if r["config"]["gemv_f16x2"] else "")
        print(f"{r['shape']:18s} {cfg:24s} ec={int(r['ec'])} {r.get('duration', 0):8.2f} {r.get('duration_unit', '')} "
              f"dram {r.get('dram_pct', 0):5.1f}% sm {r.get('sm_pct', 0):5.1f}% occ {r.get('occupancy_pct', 0):5.1f}% "
              f"issue {r.get('issue_slots_busy_pct', 0):5.1f}% regs {r.get('registers', 0):.0f} waves {r.get('waves', 0)} "
              + " ".join(f"{k} {v:.1f}" for k, v in sorted(r["stalls"].items(), key=lambda kv: -kv[1])[:4]))
    if args.json:
        from common import write_json
        write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
