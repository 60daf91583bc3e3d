"""Decode throughput of the serving engine on random weights in real model shapes (issue 5, item 6).

    python bench/decode.py --json bench/results/decode.json                    # H200: the full grid
    python bench/decode.py --tiny --json /tmp/decode.json                      # CPU: end-to-end check
    python bench/decode.py --tp 2 --json bench/results/decode_tp2.json         # 2 GPUs: the engine over TP ranks

For each model shape and setting (fp16; W4 RTN; W4 + gated rank-r ECs on a fraction of
the linear modules) a random model is built on the device, then for each batch size B
the engine serves B requests of `--prompt-tokens` random tokens and `--new-tokens`
greedy tokens (ignore_eos), prefilling them in one step. ms/token is the median time of
a decode step (every sequence gains one token per step); tokens/s = B / that time.
The floor is the weight bytes one decode step must read (W4: packed codes, fp16 scales,
ECs; plus the fp16 LM head) over the bandwidth of a large device-to-device copy measured
in the same run (bytes read + written per second); KV-cache reads are not in the floor.

With `--tp N` the ranks are started here (spear.runtime.tp.launch: one GPU each, or gloo
processes on CPU); each builds the same random model and shards it, rank 0 runs the engine
and the others follow its steps (spear.runtime.tp_serve), as `spear serve --tp N` does; on GPUs the
row-parallel W4 layers reduce by `--tp-reduction` (p2p by default, as in `spear serve`). The
weight bytes and the floor are then one rank's shard.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from common import copy_bandwidth, refuse_real_shapes_on_cpu, write_json
from shapes import MODELS
from fixtures import random_model

from spear.record import QuantConfig
from spear.runtime.engine import Engine, EngineConfig, make_runner
from spear.kernels.w4 import decode_tune_rows
from spear.runtime.model import Transformer
from spear.runtime.requests import SamplingParams
from spear.runtime.scheduler import StaticChunkPolicy
from spear.runtime.tp import launch
from spear.runtime.tp_serve import StepChannel, follow, shard_for_serving

EC_FRACTIONS = {"w4": 0.0, "w4+ec15": 0.15, "w4+ec38": 0.38, "w4+ec60": 0.60}


class NoText:
    """The engine's tokenizer for token-only benchmarks: no EOS, no text."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def weight_bytes(model: Transformer) -> int:
    """Bytes of weights one decode step reads: linears as served (ECs included), norms, the LM head (one rank's under TP)."""

    def nbytes(norm: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in norm.parameters())

    total = model.head.nbytes() + nbytes(model.norm)
    for layer in model.layers:
        a, f = layer.attention, layer.feed_forward
        total += sum(m.nbytes() for m in (a.wq, a.wk, a.wv, a.wo, f.w_gate, f.w_up, f.w_down))  # LinearMethod.nbytes
        total += nbytes(layer.attention_norm) + nbytes(layer.ffn_norm)
    return total


def measure(model: Transformer, batch: int, prompt_tokens: int, new_tokens: int, cuda_graphs: bool,
            channel: StepChannel | None = None, overlap: bool = False) -> dict | None:
    """The row of one batch size; under TP (`channel`) rank 0's, and None on the other ranks. With `overlap`, a
    step's time is its launch and the previous step's tokens (EngineConfig.overlap): in a steady decode, the
    period of the GPU's steps."""
    config = EngineConfig(max_num_seqs=batch, max_model_len=prompt_tokens + new_tokens,
                          policy=StaticChunkPolicy(batch * prompt_tokens), cuda_graphs=cuda_graphs, overlap=overlap)
    start = time.perf_counter()
    runner = make_runner(model, config)
    if channel is not None and dist.get_rank() > 0:
        follow(runner, channel)
        return None
    if channel is not None:
        runner.on_step = channel.send
    engine = Engine(runner, NoText(), config)
    setup_seconds = time.perf_counter() - start
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), torch.randint(model.args.vocab, (prompt_tokens,), generator=gen).tolist(), params)
    decode_steps, prefill_seconds, generated = [], 0.0, 0
    while engine.has_unfinished():
        launched = engine.num_steps
        generated += sum(len(o.new_token_ids) for o in engine.step())
        if engine.num_steps == launched:  # overlapped: the last call only read the step in flight
            continue
        stats = engine.last_step
        if stats.num_prefill_tokens:
            prefill_seconds += stats.seconds
        elif stats.num_decodes == batch:
            decode_steps.append(stats.seconds)
    if channel is not None:
        channel.send(None)
    assert generated == batch * new_tokens, "every request generates new_tokens tokens"
    step = statistics.median(decode_steps)
    return {"batch": batch, "ms_per_token": 1e3 * step, "tokens_per_s": batch / step,
            "mean_step_ms": 1e3 * statistics.fmean(decode_steps), "decode_steps": len(decode_steps),
            "prefill_ms": 1e3 * prefill_seconds, "setup_s": setup_seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None, help="default: llama2-7b llama3-8b")
    p.add_argument("--settings", nargs="+", choices=["fp16", *EC_FRACTIONS], default=["fp16", *EC_FRACTIONS])
    p.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 8 32")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default: 128")
    p.add_argument("--new-tokens", type=int, default=None, help="default: 256")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=-1, help="-1: per-channel (default)")
    p.add_argument("--rank", type=int, default=32, help="EC rank")
    p.add_argument("--ec-bits", type=int, choices=[16, 8], default=8,
                   help="EC factors in int8 (the default, as spear compensate stores them) or fp16")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a tiny model with short runs (CPU end-to-end check)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, started here (default 1)")
    p.add_argument("--tp-reduction", choices=["p2p", "symmetric", "collective"], default="p2p",
                   help="how the row-parallel W4 layers reduce on GPUs (spear.runtime.tp.set_reduction; default p2p)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap the engine's host work with the GPU step, as spear serve does (EngineConfig.overlap; "
                        "default: on, off with --tp, where it is not supported)")
    p.add_argument("--json", default="bench/results/decode.json")
    args = p.parse_args()
    args.models = args.models or (["tiny"] if args.tiny else ["llama2-7b", "llama3-8b"])
    refuse_real_shapes_on_cpu("decode.py", args.models)
    if args.tp < 1:
        p.error(f"--tp must be at least 1, got {args.tp}")
    if args.overlap and args.tp > 1:
        p.error("--overlap is not supported with --tp")
    if args.overlap is None:
        args.overlap = args.tp == 1
    if args.tp == 1:
        run(args)
    else:
        launch(run, args.tp, args)


def run(args: argparse.Namespace) -> None:
    """The grid on this process; under TP on every rank, rank 0 recording the rows."""
    channel = StepChannel() if args.tp > 1 else None
    rank = 0 if channel is None else dist.get_rank()
    small = args.tiny
    batches = args.batches or ([1, 4] if small else [1, 8, 32])
    prompt_tokens = args.prompt_tokens or (16 if small else 128)
    new_tokens = args.new_tokens or (16 if small else 256)

    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    quant = QuantConfig(bits=args.bits, group_size=args.group_size)
    bandwidth = max(copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20)).values())
    if rank == 0:
        print(f"{device} copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)", flush=True)
    rows = []

    def save() -> None:
        write_json(args.json, {
            "dtype": str(dtype), "quant": quant.to_dict(), "ec": {"rank": args.rank, "gate_hidden": 8, "factor_bits": args.ec_bits},
            "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "cuda_graphs": not args.no_cuda_graphs, "tp": args.tp,
            "overlap": args.overlap,
            "tp_reduction": args.tp_reduction if args.tp > 1 and device.type == "cuda" else "collective",
            "copy_bandwidth_bytes_per_s": bandwidth, "rows": rows,
        })

    for name in args.models:
        for setting in args.settings:
            start = time.perf_counter()
            fraction = EC_FRACTIONS.get(setting)
            model = random_model(MODELS[name], None if fraction is None else quant, fraction or 0.0, args.rank, dtype, device,
                                 kernels=channel is None, tune_rows=decode_tune_rows(max(batches)),
                                 factor_bits=args.ec_bits)
            if channel is not None:  # shard, then pack for the kernels; decode steps reduce by --tp-reduction
                shard_for_serving(model, args.tp_reduction, max(batches))
            synchronize(device)
            build_seconds = time.perf_counter() - start
            nbytes = weight_bytes(model)
            label = setting if fraction is not None or dtype == torch.float16 else "fp32"
            for batch in batches:
                measured = measure(model, batch, prompt_tokens, new_tokens, not args.no_cuda_graphs, channel, args.overlap)
                if measured is None:
                    continue
                row = {"model": name, "setting": label, "weight_bytes": nbytes, "build_s": build_seconds,
                       "floor_ms_per_token": 1e3 * nbytes / bandwidth, **measured}
                rows.append(row)
                print(f"{name:<10} {label:<8} B={batch:<3} {row['ms_per_token']:8.2f} ms/token "
                      f"{row['tokens_per_s']:9.1f} tok/s  floor {row['floor_ms_per_token']:6.2f} ms", flush=True)
                save()  # after every row, so a cut-short run keeps what it measured
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if rank > 0:
        return
    save()
    print(f"\n{'model':<10} {'setting':<8} {'batch':>5} {'ms/token':>9} {'tok/s':>9} {'floor ms':>9} {'GB read':>8}")
    for r in rows:
        print(f"{r['model']:<10} {r['setting']:<8} {r['batch']:>5} {r['ms_per_token']:>9.2f} {r['tokens_per_s']:>9.1f} "
              f"{r['floor_ms_per_token']:>9.3f} {r['weight_bytes'] / 1e9:>8.3f}")


if __name__ == "__main__":
    main()
