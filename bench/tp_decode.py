"""Decode ms/token under tensor parallelism, random weights in Llama-2 shapes (issue 7, item 5).

    python bench/tp_decode.py --json bench/results/tp_decode.json        # 2 GPUs: the full grid, ~3 min
    python bench/tp_decode.py --layers 2 --json /tmp/tp_decode.json      # GPU smoke test (not a figure)
    python bench/tp_decode.py --tiny --json /tmp/tp_decode.json          # CPU: gloo end to end

For each TP size the ranks are started fresh (spear.runtime.tp.launch: NCCL, or gloo on
CPU). For each model and setting each rank builds the same random model (W4: RTN
per-channel; W4+EC: gated rank-32 ECs on 38% of the linears), shards it, packs it for the
kernels, prefills `batch` prompts of `--context` tokens in one step, then times a decode
step (every sequence gains one token): captured in a CUDA graph and replayed `--iters`
times between CUDA events (eager on CPU or with --eager), the same fixed count on every
rank. ms/token is the mean step time. At TP > 1 the row-parallel layers reduce through
NCCL ("collective", the baseline: one all-reduce of y, a separate one of the EC's u; gloo on
CPU), through symmetric memory ("symmetric": [y | u] staged by the W4 kernel, one one-shot
all-reduce, one epilogue kernel), or peer to peer ("p2p": the W4 kernel's epilogue writes [y_r | u_r]
into every rank's buffer and signals; one epilogue kernel waits, sums, gates; no collective call), and
"p2p+fold": p2p with the next add + RMSNorm folded into that epilogue and the next W4 launch (set here per row,
whatever SPEAR_FOLD_NORM_TP says). `--settings` and `--reductions` narrow the grid; `--reductions none ...` adds
rows with no reduction at all (timing only, wrong logits: what TP's kernels cost without the communication).

Checks in every row: `repeat_identical` (the step re-run on the same inputs gives the same
logits bit for bit), `ranks_identical` (every rank's logits are the same bits),
`max_abs_diff_vs_tp1` (logits against the TP=1 run of the same model, setting and batch),
and `max_abs_diff_vs_collective` for the symmetric and p2p rows (when collective ran). `--time-limit` stops starting new runs;
the JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from common import refuse_real_shapes_on_cpu, write_json
from shapes import MODELS
from fixtures import random_model
from torch.multiprocessing.spawn import ProcessException

from spear.record import QuantConfig
from spear.runtime.kv_cache import Batch, Chunk, KVCache, cdiv
from spear.runtime.model import ModelArgs, Transformer, use_kernels
from spear.runtime.runner import DecodeGraph
from spear.runtime.tp import CollectiveReduce, RowParallelLinear, apply_tp, launch, set_reduction

EC_FRACTION, EC_RANK = 0.38, 32
BLOCK = 16


def runs(world: int, cuda: bool) -> list[tuple[str, float | None, list[str]]]:
    """(setting, EC fraction or None for float, reductions) in order; symmetric, then p2p, after collective (CUDA,
    TP > 1). p2p last: its kernels wait on signals from the peers, so a fault there stalls until --time-limit's
    caller kills the run, and the rows before it are already in the JSON. "p2p+fold" is p2p with the next add +
    RMSNorm folded into its epilogue (runtime.model.FOLD_NORM_TP), timed right after p2p on the same model."""
    float_name = "fp16" if cuda else "fp32"
    if world == 1:
        return [(float_name, None, ["-"]), ("w4", 0.0, ["-"]), ("w4+ec", EC_FRACTION, ["-"])]
    symm = ["symmetric", "p2p", "p2p+fold"] if cuda else []
    return [(float_name, None, ["none", "collective"]), ("w4", 0.0, ["none", "collective", *symm]),
            ("w4+ec", EC_FRACTION, ["none", "collective", *symm])]


class SkippedReduce(CollectiveReduce):
    """The "none" rows (timing only): the row-parallel layers keep their rank's partial sums, so a step costs what
    TP's kernels cost without any reduction; its logits are wrong."""

    def __call__(self, y: torch.Tensor, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return y, u


def go_on(deadline: float) -> bool:
    """Rank 0's clock decides for every rank (their decisions must match, or collectives hang)."""
    flag = [time.time() < deadline]
    dist.broadcast_object_list(flag, src=0)
    return flag[0]


def build(args: ModelArgs, fraction: float | None, dtype: torch.dtype, device: torch.device) -> Transformer:
    quant = None if fraction is None else QuantConfig(bits=4, group_size=-1)
    model = random_model(args, quant, fraction or 0.0, EC_RANK, dtype, device, kernels=False)
    if dist.get_world_size() > 1:
        apply_tp(model)
    use_kernels(model)
    return model


def decode_step(model: Transformer, batch: int, context: int, iters: int, eager: bool) -> tuple[float, str, torch.Tensor, bool]:
    """Prefill, then time the decode step: (ms per step, mode, logits [batch, vocab], repeat_identical)."""
    args, device = model.args, model.device
    width = cdiv(context + 1, BLOCK)
    cache = KVCache(args.n_layers, batch * width + 1, BLOCK, args.n_kv_heads, args.head_dim, model.dtype, device)
    tables = [list(range(1 + b * width, 1 + (b + 1) * width)) for b in range(batch)]
    prompts = torch.randint(args.vocab, (batch, context), generator=torch.Generator().manual_seed(batch)).tolist()
    with torch.inference_mode():
        first = model(Batch.build([Chunk(p, 0, t) for p, t in zip(prompts, tables)], BLOCK, device), cache).argmax(-1)
        inputs = Batch.build([Chunk([int(tok)], context, t) for tok, t in zip(first, tables)], BLOCK, device)
        mode, step = "eager", lambda: model(inputs, cache)
        if device.type == "cuda" and not eager:
            try:
                graph = DecodeGraph(model, cache, batch, width, 1, batch, None)  # one row a tile: a decode step
            except RuntimeError as e:  # every rank fails alike; time eagerly rather than lose the row
                print(f"rank {dist.get_rank()}: CUDA-graph capture failed, timing eagerly: {e}", flush=True)
                return decode_step(model, batch, context, iters, eager=True)
            graph.inputs.copy_(inputs)

            def step() -> torch.Tensor:
                graph.graph.replay()
                return graph.logits

            mode = "cuda-graph"
        outs = [step().clone() for _ in range(5)]  # warm-up, and the repeat check
        identical = all(torch.equal(o, outs[0]) for o in outs)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                step()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / iters
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            ms = 1e3 * (time.perf_counter() - t0) / iters
        identical = identical and torch.equal(step(), outs[0])  # still the same bits after the timed steps
    return ms, mode, outs[0], identical


def worker(opts: dict, header: dict, prior_rows: list[dict], logits_dir: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.float16 if cuda else torch.float32
    if not cuda:
        torch.set_num_threads(1)
    rows = list(prior_rows)
    for name in opts["models"]:
        args = dataclasses.replace(MODELS[name], n_layers=opts["layers"] or MODELS[name].n_layers)
        for setting, fraction, reductions in runs(world, cuda):
            wanted = opts["reductions"] or [r for r in reductions if r != "none"]  # "none" only when asked for
            reductions = [r for r in reductions if r == "-" or r in wanted]
            if (opts["settings"] and setting not in opts["settings"]) or not reductions:
                continue
            if not go_on(opts["deadline"]):
                return
            start = time.perf_counter()
            model = build(args, fraction, dtype, device)
            build_s = time.perf_counter() - start
            current = None
            for reduction in reductions:
                base_reduction = reduction.removesuffix("+fold")
                if reduction != "-" and base_reduction != current:
                    set_reduction(model, "collective" if reduction == "none" else base_reduction, max(opts["batches"]))
                    current = base_reduction
                    if reduction == "none":  # the layers' own reduce, in place of the all-reduces
                        for m in model.modules():
                            if isinstance(m, RowParallelLinear):
                                m.reduce = SkippedReduce()
                for m in model.modules():  # p2p and p2p+fold share the reduction: only the fold switches
                    if isinstance(m, RowParallelLinear):
                        m.fold_norm = reduction.endswith("+fold")
                for batch in opts["batches"]:
                    if not go_on(opts["deadline"]):
                        return
                    ms, mode, logits, identical = decode_step(model, batch, opts["context"], opts["iters"], opts["eager"])
                    gathered = [torch.empty_like(logits) for _ in range(world)]
                    dist.all_gather(gathered, logits)
                    row = {"model": name, "layers": args.n_layers, "tp": world, "setting": setting, "reduce": reduction,
                           "batch": batch, "ms_per_token": ms, "tokens_per_s": 1e3 * batch / ms, "mode": mode,
                           "iters": opts["iters"], "build_s": build_s, "repeat_identical": identical,
                           "ranks_identical": all(torch.equal(g, gathered[0]) for g in gathered)}
                    key = Path(logits_dir) / f"{name}-{setting}-{batch}"
                    if reduction == "none":
                        row["timing_only"] = True  # the ranks' partials are never summed: wrong logits
                    elif world == 1:
                        torch.save(logits.cpu(), f"{key}.pt")
                    elif Path(f"{key}.pt").exists():
                        row["max_abs_diff_vs_tp1"] = (logits.cpu().float() - torch.load(f"{key}.pt").float()).abs().max().item()
                    if reduction == "collective":
                        torch.save(logits.cpu(), f"{key}-collective-{rank}.pt")
                    elif reduction != "-" and Path(f"{key}-collective-{rank}.pt").exists():
                        baseline = torch.load(f"{key}-collective-{rank}.pt").float()
                        row["max_abs_diff_vs_collective"] = (logits.cpu().float() - baseline).abs().max().item()
                    rows.append(row)
                    if rank == 0:
                        print(f"{name:<10} tp={world} {setting:<6} {reduction:<10} B={batch:<3} {ms:8.3f} ms/token "
                              f"{mode:<10} identical: repeat {identical} ranks {row['ranks_identical']}", flush=True)
                        write_json(opts["json"], {**header, "rows": rows})
            del model
            if cuda:
                torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes, one launch each (default 1 2)")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None, help="default: llama2-13b llama2-7b")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 16")
    p.add_argument("--settings", nargs="+", choices=["fp16", "fp32", "w4", "w4+ec"], default=None,
                   help="only these settings (default: all)")
    p.add_argument("--reductions", nargs="+", choices=["none", "collective", "symmetric", "p2p", "p2p+fold"],
                   default=None,
                   help="only these TP > 1 reductions (default: all; symmetric and p2p compare with collective, "
                        "so keep it for max_abs_diff_vs_collective)")
    p.add_argument("--layers", type=int, default=None, help="fewer decoder layers (smoke tests only, not a figure)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens before the timed step (default 128)")
    p.add_argument("--iters", type=int, default=None, help="timed decode steps, the same on every rank (default 50)")
    p.add_argument("--eager", action="store_true", help="time eager steps instead of CUDA-graph replays")
    p.add_argument("--time-limit", type=float, default=150.0, help="seconds after which no new run starts")
    p.add_argument("--tiny", action="store_true", help="a tiny model with short runs (CPU end-to-end check)")
    p.add_argument("--json", default="bench/results/tp_decode.json")
    a = p.parse_args()
    opts = {"models": a.models or (["tiny"] if a.tiny else ["llama2-13b", "llama2-7b"]),
            "batches": a.batches or ([1, 2] if a.tiny else [1, 16]), "layers": a.layers,
            "context": a.context or (8 if a.tiny else 128), "iters": a.iters or (3 if a.tiny else 50),
            "eager": a.eager, "settings": a.settings, "reductions": a.reductions,
            "deadline": time.time() + a.time_limit, "json": a.json}
    if a.layers is None:  # with --layers a few layers of a real shape fit a CPU machine (smoke tests)
        refuse_real_shapes_on_cpu("tp_decode.py", opts["models"])
    header = {"quant": QuantConfig(bits=4, group_size=-1).to_dict(),
              "ec": {"fraction": EC_FRACTION, "rank": EC_RANK, "gate_hidden": 8},
              **{k: opts[k] for k in ("context", "iters", "layers")}, "time_limit_s": a.time_limit,
              "ms_per_token": "mean decode-step time (every sequence gains one token per step)"}
    rows: list[dict] = []
    write_json(a.json, {**header, "rows": rows})
    with tempfile.TemporaryDirectory() as logits_dir:
        for world in a.tp:
            if time.time() >= opts["deadline"]:
                break
            try:
                launch(worker, world, opts, header, rows, logits_dir)
            except ProcessException as e:  # keep the rows measured so far and go on with the next TP size
                header.setdefault("errors", []).append(f"tp={world}: {type(e).__name__}: {e}")
                print(f"tp={world} failed: {e}", flush=True)
            rows = json.loads(Path(a.json).read_text())["rows"]
            write_json(a.json, {**header, "rows": rows})
    print(f"\n{'model':<10} {'layers':>6} {'tp':>3} {'setting':<7} {'reduce':<10} {'batch':>5} {'ms/token':>9} "
          f"{'tok/s':>9} {'mode':<10} {'bit-identical':>13} {'diff vs tp1':>11}")
    for r in rows:
        diff = r.get("max_abs_diff_vs_tp1")
        print(f"{r['model']:<10} {r['layers']:>6} {r['tp']:>3} {r['setting']:<7} {r['reduce']:<10} {r['batch']:>5} "
              f"{r['ms_per_token']:>9.3f} {r['tokens_per_s']:>9.1f} {r['mode']:<10} "
              f"{r['repeat_identical'] and r['ranks_identical']!s:>13} {'' if diff is None else f'{diff:.3g}':>11}")


if __name__ == "__main__":
    main()
