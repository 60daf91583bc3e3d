"""SLO-aware against static prefill chunks under Poisson load, per EC density (issue 6, item 4).

    python bench/slo_experiment.py --json bench/results/slo_experiment.json     # H200: about 3 minutes
    python bench/slo_experiment.py --tiny --json /tmp/slo_experiment.json       # CPU: end-to-end check

For each EC density (W4 RTN per-channel + gated rank-32 ECs on that share of the linears,
random weights in Llama-2-7B shapes) a model is built on the device, its latency table is
profiled (spear.runtime.latency, the default grid), and the same seeded workload is served
once per policy: static chunks of 512/256/128/64 tokens, and the SLO-aware policy at each
ITL SLO. In-process driver, no HTTP: a simulated client adds requests to the engine at
their Poisson arrival times (real time) between `engine.step()` calls, and stamps each
token when its step returns; TTFT counts from the scheduled arrival. Metrics as in
bench/serve.py (TTFT, ITL, TPOT percentiles, SLO attainment, throughput). The JSON is
rewritten after every run; `--time-limit` stops starting new runs. One PNG beside it: ITL
over time per density and policy, and P99 ITL per run against the SLOs.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from common import refuse_real_shapes_on_cpu, write_json
from decode import MODELS, NoText, synchronize
from fixtures import random_model
from serve import RequestRecord, percentiles, sample_lengths, summarize

from spear.record import QuantConfig
from spear.runtime.engine import Engine, EngineConfig, make_runner
from spear.runtime.latency import default_grid, profile
from spear.runtime.requests import SamplingParams
from spear.runtime.scheduler import StaticChunkPolicy
from spear.runtime.slo import SLOPolicy

DENSITIES = {"w4+ec15": 0.15, "w4+ec38": 0.38, "w4+ec60": 0.60}


@dataclass(frozen=True)
class Workload:
    arrivals: list[float]  # seconds since the run's start
    prompts: list[list[int]]
    output_tokens: list[int]


def make_workload(args, vocab: int) -> Workload:
    """Poisson arrivals, ShareGPT-like lognormal lengths, random prompt tokens: seeded, the same for every run."""
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    inputs = sample_lengths(rng, n, args.input_median, args.input_sigma, 4, args.max_input)
    outputs = sample_lengths(rng, n, args.output_median, args.output_sigma, 2, args.max_output)
    gaps = rng.exponential(1 / args.rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]
    prompts = [rng.integers(3, vocab, int(k)).tolist() for k in inputs]
    return Workload([float(a) for a in arrivals], prompts, [int(o) for o in outputs])


def drive(engine: Engine, work: Workload) -> tuple[list[RequestRecord], list[tuple], float]:
    """Serve the workload in real time; returns per-request records, per-step stats and the makespan."""
    records = [RequestRecord(a, len(p), o) for a, p, o in zip(work.arrivals, work.prompts, work.output_tokens)]
    steps = []  # (end time, seconds, decodes, prefill tokens)
    t0 = time.perf_counter()
    added = 0
    while added < len(records) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while added < len(records) and work.arrivals[added] <= now:
            params = SamplingParams(max_tokens=work.output_tokens[added], temperature=0, ignore_eos=True)
            engine.add_request(str(added), work.prompts[added], params)
            added += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, work.arrivals[added] - now))
            continue
        outputs = engine.step()
        end = time.perf_counter() - t0
        stats = engine.last_step
        steps.append((end, stats.seconds, stats.num_decodes, stats.num_prefill_tokens))
        for out in outputs:
            record = records[int(out.request_id)]
            record.chunk_times += [end] * len(out.new_token_ids)
            record.completion_tokens = out.completion_tokens
    return records, steps, time.perf_counter() - t0


def step_summary(steps: list[tuple]) -> dict:
    mixed = [s for s in steps if s[2] and s[3]]  # decodes beside a prefill chunk: the steps a policy sizes
    return {"steps": len(steps), "mixed_steps": len(mixed),
            "mean_mixed_chunk": float(np.mean([s[3] for s in mixed])) if mixed else None,
            "step_ms": percentiles([s[1] for s in steps]), "mixed_step_ms": percentiles([s[1] for s in mixed]),
            "trace": {"columns": ["end_s", "ms", "decodes", "prefill_tokens"],
                      "rows": [(round(e, 4), round(1e3 * t, 2), d, p) for e, t, d, p in steps]}}


def plot(runs: list[dict], slos: list[float], path: Path) -> None:
    """One PNG: ITL over time per density (rows) and policy (columns); below, P99 ITL per run against the SLOs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    densities = list(dict.fromkeys(r["density"] for r in runs))
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    fig = plt.figure(figsize=(3 * len(policies), 2.6 * len(densities) + 3.5))
    top, bottom = fig.subfigures(2, 1, height_ratios=[2.6 * len(densities), 3.5])
    axes = top.subplots(len(densities), len(policies), sharex=True, sharey=True, squeeze=False)
    for r in runs:
        ax = axes[densities.index(r["density"])][policies.index(r["policy"])]
        times = [t for q in r["requests"] for t in q["chunk_times"][1:]]
        gaps = [1e3 * g for q in r["requests"] for g in np.diff(q["chunk_times"])]
        ax.scatter(times, gaps, s=1, alpha=0.3)
        for slo in slos:
            ax.axhline(slo, color="red", linestyle="--", linewidth=0.8)
        ax.set_title(f"{r['density']} {r['policy']}", fontsize=8)
        ax.set_yscale("log")
    for ax in axes[-1]:
        ax.set_xlabel("time (s)")
    for row in axes:
        row[0].set_ylabel("ITL (ms)")

    ax = bottom.subplots()
    width = 0.8 / len(policies)
    top = 3 * max(slos)  # the scale that shows the SLO lines; taller bars are cut there and labelled
    for k, policy in enumerate(policies):
        p99 = [next((r["summary"]["itl_ms"]["p99"] for r in runs if r["density"] == d and r["policy"] == policy), 0)
               for d in densities]
        x = np.arange(len(densities)) + k * width
        ax.bar(x, np.minimum(p99, top), width, label=policy)
        for xi, value in zip(x, p99):
            if value > top:
                ax.text(xi, top, f"{value:.0f}", ha="center", va="bottom", fontsize=7)
    for slo in slos:
        ax.axhline(slo, color="red", linestyle="--", linewidth=0.8)
    ax.set_ylim(0, top * 1.1)
    ax.set_xticks(np.arange(len(densities)) + 0.4 - width / 2, densities)
    ax.set(ylabel="P99 ITL (ms)", title=f"P99 inter-token latency (dashed: ITL SLOs; bars over {top:g} ms cut, labelled)")
    ax.legend(fontsize=7, ncol=len(policies))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_table(runs: list[dict]) -> None:
    print(f"\n{'density':<8} {'policy':<10} {'ITL p50':>8} {'ITL p99':>8} {'TTFT mean':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>8} {'ITL<=SLO':>8} {'req/s':>6} {'tok/s':>7} {'chunk':>6}")
    for r in runs:
        s = r["summary"]
        attained = s["slo_attainment_itl"]
        chunk = r["steps"]["mean_mixed_chunk"]
        print(f"{r['density']:<8} {r['policy']:<10} {s['itl_ms']['p50']:>8.2f} {s['itl_ms']['p99']:>8.2f} "
              f"{s['ttft_ms']['mean']:>9.1f} {s['ttft_ms']['p99']:>9.1f} {s['tpot_ms']['p50']:>8.2f} "
              f"{'-' if attained is None else f'{100 * attained:.1f}%':>8} {s['request_throughput']:>6.2f} "
              f"{s['output_token_throughput']:>7.0f} {'-' if chunk is None else f'{chunk:.0f}':>6}")


def graph_tokens(flag: list[int] | None) -> tuple[int, ...] | None:
    """--mixed-graph-tokens as EngineConfig.mixed_graph_tokens: absent, the engine's default; no values or 0, off."""
    return None if flag is None else tuple(t for t in flag if t > 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--densities", nargs="+", choices=sorted(DENSITIES), default=list(DENSITIES))
    p.add_argument("--static-chunks", type=int, nargs="+", default=None, help="default: 512 256 128 64")
    p.add_argument("--itl-slos-ms", type=float, nargs="+", default=None, help="default: 16 22")
    p.add_argument("--num-requests", type=int, default=None, help="default: 48")
    p.add_argument("--rate", type=float, default=None, help="requests/s (Poisson); default 16")
    p.add_argument("--input-median", type=float, default=None, help="prompt tokens, lognormal median (default 160)")
    p.add_argument("--input-sigma", type=float, default=1.0)
    p.add_argument("--output-median", type=float, default=None, help="output tokens, lognormal median (default 90)")
    p.add_argument("--output-sigma", type=float, default=0.8)
    p.add_argument("--max-input", type=int, default=None, help="default 1024")
    p.add_argument("--max-output", type=int, default=None, help="default 256")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--rank", type=int, default=32, help="EC rank")
    p.add_argument("--min-chunk", type=int, default=16, help="SLO policy: the fallback chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=185.0, help="seconds after which no new run starts")
    p.add_argument("--mixed-graph-tokens", type=int, nargs="*", default=None,
                   help="token buckets for mixed steps as CUDA-graph pieces (EngineConfig.mixed_graph_tokens); "
                        "default: the engine's (on CUDA 256 ... 1024: steps of up to EngineConfig.row_graph_tokens = 128 "
                        "replay a whole-step graph); none or 0: larger mixed steps run eagerly")
    p.add_argument("--tiny", action="store_true", help="a tiny model, short runs (CPU end-to-end check)")
    p.add_argument("--json", default="bench/results/slo_experiment.json")
    args = p.parse_args()
    tiny = args.tiny
    refuse_real_shapes_on_cpu("slo_experiment.py", ["tiny" if tiny else "llama2-7b"])
    defaults = {"static_chunks": [64, 32, 16] if tiny else [512, 256, 128, 64],
                "itl_slos_ms": [12.0, 20.0] if tiny else [16.0, 22.0], "num_requests": 12 if tiny else 48,
                "rate": 40.0 if tiny else 16.0, "input_median": 24 if tiny else 160,
                "output_median": 8 if tiny else 90, "max_input": 96 if tiny else 1024, "max_output": 16 if tiny else 256}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    start = time.perf_counter()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model_args = MODELS["tiny" if tiny else "llama2-7b"]
    quant = QuantConfig(bits=4, group_size=-1)
    base = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_input + args.max_output,
                        mixed_graph_tokens=graph_tokens(args.mixed_graph_tokens))
    work = make_workload(args, model_args.vocab)
    warmup = Workload(work.arrivals[:8], work.prompts[:8], [min(o, 32) for o in work.output_tokens[:8]])
    policies = [(f"static{c}", None, StaticChunkPolicy(c)) for c in args.static_chunks]
    slo_max_chunk = max(args.static_chunks)
    runs, tables, skipped = [], {}, []
    json_config = {k: v for k, v in vars(args).items() if k != "json"}

    def save() -> None:
        write_json(args.json, {
            "driver": "in-process: a simulated Poisson client calls engine.add_request / engine.step in real time (no HTTP)",
            "model": "tiny" if tiny else "llama2-7b", "dtype": str(dtype), "quant": quant.to_dict(),
            "ec": {"rank": args.rank, "gate_hidden": 8}, "config": json_config,
            "workload": {"prompt_tokens": int(sum(map(len, work.prompts))), "output_tokens": sum(work.output_tokens),
                         "last_arrival_s": work.arrivals[-1]},
            "latency_tables": tables, "runs": runs, "skipped": skipped, "elapsed_s": time.perf_counter() - start,
        })

    for density in args.densities:
        if time.perf_counter() - start > args.time_limit:
            skipped.append(density)
            continue
        t = time.perf_counter()
        model = random_model(model_args, quant, DENSITIES[density], args.rank, dtype, device)
        runner = make_runner(model, base)
        synchronize(device)
        build_s = time.perf_counter() - t
        t = time.perf_counter()
        grid = ([1, 4, 8, 16, 32], [0, 16, 32, 64]) if tiny else default_grid(base.max_num_seqs, runner.max_model_len)
        table = profile(runner, *grid, repeats=3 if tiny else 5)
        tables[density] = {**table.to_dict(), "build_s": build_s, "profile_s": time.perf_counter() - t}
        print(f"{density}: built in {build_s:.1f} s, profiled in {tables[density]['profile_s']:.1f} s\n{table.format()}",
              flush=True)
        runs_here = policies + [(f"slo{s:g}ms", s, SLOPolicy(table, s, args.min_chunk, slo_max_chunk))
                                for s in args.itl_slos_ms]
        # Warm-up (not recorded): the first steps of a process compile Triton kernel specializations.
        drive(Engine(runner, NoText(), replace(base, policy=StaticChunkPolicy(slo_max_chunk))), warmup)
        engine = None
        for name, slo, policy in runs_here:
            if time.perf_counter() - start > args.time_limit:
                skipped.append(f"{density} {name}")
                continue
            engine = Engine(runner, NoText(), replace(base, policy=policy))
            records, steps, makespan = drive(engine, work)
            summary = summarize(records, makespan, (slo or min(args.itl_slos_ms)) / 1e3)
            itls = [g for r in records for g in r.itls]
            summary["itl_attainment_by_slo"] = {f"{s:g}": float(np.mean([g <= s / 1e3 for g in itls])) for s in args.itl_slos_ms}
            run = {"density": density, "policy": name, "itl_slo_ms": slo, "summary": summary, "steps": step_summary(steps),
                   "requests": [{**asdict(r), "chunk_times": [round(c, 5) for c in r.chunk_times]} for r in records]}
            if isinstance(policy, SLOPolicy):
                run["final_correction"] = policy.correction
            runs.append(run)
            save()
            print(f"{density} {name:<10} ITL p99 {summary['itl_ms']['p99']:7.2f} ms  TTFT mean {summary['ttft_ms']['mean']:8.1f} ms  "
                  f"mixed chunk {run['steps']['mean_mixed_chunk'] or 0:5.0f}  ({time.perf_counter() - start:.0f} s)", flush=True)
        del model, runner, engine  # free the weights, KV cache and graphs before the next density
        if device.type == "cuda":
            torch.cuda.empty_cache()
    save()
    if runs:
        plot_path = Path(args.json).with_suffix(".png")
        plot(runs, args.itl_slos_ms, plot_path)
        print(f"wrote {args.json} and {plot_path}", file=sys.stderr)
    if skipped:
        print(f"skipped (--time-limit {args.time_limit:g} s): {', '.join(skipped)}", file=sys.stderr)
    print_table(runs)


if __name__ == "__main__":
    main()
