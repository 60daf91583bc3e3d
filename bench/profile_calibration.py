"""Where the data-free stages' time goes: self-sampling and KL calibration (issue 32: the default 4096-sample,
1500-step calibration must fit the 6-minute `spear run`).

    python bench/profile_calibration.py --model $GGUF --json bench/results/quality/profile_calibration_h200.json
    python bench/profile_calibration.py --samples 8 --len 16 --steps 2 --json /tmp/p.json   # CPU: end-to-end check

Sampling: `--samples` sequences of `--len` tokens through transformers' generate (the sampler before) and through
data.calibration.sample_with_cache (today's: one forward a token, the draws on the device), at several batch sizes;
ms per token step. Calibration: the default model quantized (RTN per-channel), SPEAR's ECs at 1%, then `--steps` KL steps
timed without held-out passes, eager and replayed as a CUDA graph (`--modes`; each from the same EC state: their
final train KLs should agree; `s_per_step_loop` is the loop alone, from the calibration history), one held-out pass timed at several batch sizes, and (--profile-ops) the operators that
take the most time in a few steps.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import sync, timed, write_json  # noqa: E402

from spear.api import model_key  # noqa: E402
from spear.compensate.calibrate import (  # noqa: E402
    CalibrateConfig,
    OnlineTeacher,
    _mean_kl,
    calibrate_ecs,
    ec_state_dict,
    load_ec_state_dict,
)
from spear.compensate.pipeline import CompensateConfig, compensate  # noqa: E402
from spear.data.calibration import CalibConfig, calibration_ids, sample_with_cache  # noqa: E402
from spear.models import load_float_model  # noqa: E402
from spear.quant.pipeline import QuantSettings, quantize_model  # noqa: E402
from spear.record import QuantConfig  # noqa: E402


def generate(model, first: torch.Tensor, length: int, top_p: float) -> torch.Tensor:
    """The sampler before sample_with_cache: transformers' generate, full length, no EOS (min_new_tokens)."""
    new = length - first.shape[1]
    return model.generate(first, attention_mask=torch.ones_like(first), do_sample=True, top_k=0, top_p=top_p,
                          max_new_tokens=new, min_new_tokens=new, pad_token_id=0)


def top_ops(fn, rows: int = 12) -> list[dict]:
    """The operators with the most self time (device time on CUDA, else CPU) while fn runs."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        sync()
    events = prof.key_averages()
    cuda = torch.cuda.is_available()

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    key = device_us if cuda else (lambda e: e.self_cpu_time_total)
    out = [{"op": e.key, "calls": e.count, "self_device_ms": device_us(e) / 1e3 if cuda else None,
            "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in sorted(events, key=key, reverse=True)[:rows]]
    total_cpu = sum(e.self_cpu_time_total for e in events) / 1e3
    total_dev = sum(device_us(e) for e in events) / 1e3 if cuda else None
    print(f"  profile: self CPU {total_cpu:.0f} ms, self device {total_dev} ms")
    for r in out:
        print(f"    {r['op'][:60]:<60} x{r['calls']:<6} dev {r['self_device_ms'] or 0:8.1f} ms  cpu {r['self_cpu_ms']:8.1f} ms")
    return [{"total_self_cpu_ms": total_cpu, "total_self_device_ms": total_dev}] + out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--len", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[128, 256])
    p.add_argument("--loop-batches", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--calib-batches", type=int, nargs="+", default=[8, 16], help="sequences per KL step, timed")
    p.add_argument("--heldout-batches", type=int, nargs="+", default=[8], help="sequences per held-out forward, timed")
    p.add_argument("--no-sampling", action="store_true", help="time the calibration only")
    p.add_argument("--modes", nargs="+", default=["eager", "graph"], choices=["eager", "graph"],
                   help="calibration steps timed eagerly, replayed as a CUDA graph, or both (graph: CUDA only)")
    p.add_argument("--profile-ops", action="store_true", help="also list the calibration step's top operators (slow)")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    result: dict = {"args": vars(args), "sampling": [], "calibration": {}}

    lm = load_float_model(args.model)
    model, tok = lm.model, lm.tokenizer
    device = next(model.parameters()).device
    steps = args.len - 1
    cfg = CalibConfig(args.samples, args.len)
    samplers = {"generate": lambda first, length: generate(model, first, length, cfg.top_p),
                "cache loop": lambda first, length: sample_with_cache(model, first, length, cfg)}
    for name, batches in () if args.no_sampling else (("generate", args.batches), ("cache loop", args.loop_batches)):
        for b in batches:
            first = torch.full((min(b, args.samples), 1), tok.bos_token_id, device=device)
            n_batches = -(-args.samples // len(first))
            _, s = timed(lambda: [samplers[name](first, args.len) for _ in range(n_batches)])
            row = {"sampler": name, "batch": len(first), "seconds": s, "ms_per_step": 1e3 * s / (steps * n_batches)}
            result["sampling"].append(row)
            print(row, flush=True)
    if not args.no_sampling:
        first = torch.full((args.batches[-1], 1), tok.bos_token_id, device=device)
        print("generate, 16 steps:")
        result["sampling_profile_generate"] = top_ops(lambda: samplers["generate"](first, 17))
        first = torch.full((args.loop_batches[-1], 1), tok.bos_token_id, device=device)
        print("cache loop, 16 steps:")
        result["sampling_profile_loop"] = top_ops(lambda: samplers["cache loop"](first, 17))
        write_json(args.json, result)

    ids = calibration_ids(model, tok, CalibConfig(args.calib_samples, 512), model_key(args.model))
    teacher = copy.deepcopy(model)
    quantize_model(model, QuantSettings("rtn", QuantConfig(4, -1)), ids)
    compensate(model, teacher, ids, CompensateConfig(calibrate=CalibrateConfig(steps=1, progress=False)))
    every = max(1, args.steps // 4)  # the loop's time from the history: steps every .. steps, no scoring inside
    cal = CalibrateConfig(steps=args.steps, holdout=0.0, eval_every=every, progress=False)
    result["calibration"] = {"steps": args.steps, "s_per_step": {}, "s_per_step_loop": {}, "final_train_kl": {},
                             "heldout_pass_s": {}}
    graphs = [m == "graph" for m in args.modes if m == "eager" or torch.cuda.is_available()]
    for b in args.calib_batches:  # s_per_step includes the initial and final train-KL passes and the capture
        for graph in graphs:
            state = ec_state_dict(model)
            res, s = timed(lambda: calibrate_ecs(model, teacher, ids, replace(cal, batch_size=b, cuda_graph=graph)))
            load_ec_state_dict(model, state)  # the next run starts where this one did
            key = f"b{b}_{'graph' if graph else 'eager'}"
            result["calibration"]["s_per_step"][key] = s / args.steps
            result["calibration"]["final_train_kl"][key] = res.final_train_kl
            first, last = res.history[0], res.history[-1]
            loop = (last["seconds"] - first["seconds"]) / max(1, last["step"] - first["step"])
            result["calibration"]["s_per_step_loop"][key] = loop
            print(key, f"{s / args.steps:.3f} s/step, {loop:.3f} in the loop, train KL {res.initial_train_kl:.4f} -> "
                  f"{res.final_train_kl:.4f}", flush=True)
    target = OnlineTeacher(teacher, cache_bytes=2**32)
    held = torch.arange(min(128, len(ids)))
    _mean_kl(model, target, ids.to(device), held, 8, 1024)  # fills the teacher cache
    for b in args.heldout_batches:
        _, s = timed(lambda: _mean_kl(model, target, ids.to(device), held, b, 1024))
        result["calibration"]["heldout_pass_s"][b] = s
    result["calibration"]["heldout_rows"] = len(held)
    print(result["calibration"], flush=True)
    if args.profile_ops:
        print("calibration, 3 steps:")
        result["calibration_profile"] = top_ops(lambda: calibrate_ecs(model, teacher, ids, replace(cal, steps=3)))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
