"""Seconds a KL step and peak GPU memory of calibration, by the frozen student's precision and activation
checkpointing, on a compensated artifact (issue 50: calibration at 8B on one H200).

    python bench/calibration_memory.py --artifact /tmp/spear-memory/8b/compensated \
        --variants bfloat16 bfloat16+ckpt float32 --steps 20 --json bench/results/memory/calibration_memory_h200_8b.json

The artifact's ECs (as `spear compensate` wrote them) train against its float base model on random token ids (the
step's cost does not depend on the tokens) for --steps steps, at the default batch (8 sequences of --len tokens), each
variant from the same EC state, without held-out passes. Per variant: seconds a step (the loop's, from the
calibration's own clock, over the steps after the first: the first captures the CUDA graph), peak GPU memory
allocated during the calibration (torch.cuda.max_memory_allocated, less what was allocated before it), the
plan-aware count of a step's activations the calibration printed (precision.plan_activation_bytes), and the train KL
after the steps (the variants should agree closely: same data, same steps).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import write_json  # noqa: E402

from spear.artifact import load_artifact, read_artifact_config  # noqa: E402
from spear.compensate.calibrate import CalibrateConfig, calibrate_ecs, ec_state_dict, load_ec_state_dict  # noqa: E402
from spear.models.loading import load_float_model  # noqa: E402

GB = 1e9


def parse_variant(text: str) -> tuple[str, bool]:
    """'bfloat16+ckpt' -> ('bfloat16', True)."""
    precision, _, extra = text.partition("+")
    if extra not in ("", "ckpt"):
        raise SystemExit(f"variant {text!r}: PRECISION or PRECISION+ckpt")
    return precision, extra == "ckpt"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", required=True, help="a compensated artifact (spear compensate's output)")
    p.add_argument("--variants", nargs="+", default=["bfloat16", "bfloat16+ckpt", "float32"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--len", type=int, default=512, help="tokens a sequence")
    p.add_argument("--sequences", type=int, default=64, help="random calibration sequences")
    p.add_argument("--json", required=True)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    start = time.perf_counter()
    student = load_artifact(args.artifact, device).model
    config = read_artifact_config(args.artifact)
    teacher = load_float_model(config["base_model"], device, next(student.parameters()).dtype).model
    load_s = time.perf_counter() - start
    state = ec_state_dict(student)
    vocab = teacher.config.vocab_size
    ids = torch.randint(0, vocab, (args.sequences, args.len), generator=torch.Generator().manual_seed(0))
    cfg = CalibrateConfig(steps=args.steps, holdout=0.0, eval_every=5, max_holdout=8, progress=False)

    rows = []
    for variant in args.variants:
        precision, ckpt = parse_variant(variant)
        load_ec_state_dict(student, state)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        try:
            result = calibrate_ecs(student, teacher, ids, replace(cfg, precision=precision, checkpoint_layers=ckpt))
        except torch.cuda.OutOfMemoryError as e:
            rows.append({"variant": variant, "error": f"out of memory: {str(e).splitlines()[0][:160]}"})
            print(rows[-1], flush=True)
            continue
        first, last = result.history[0], result.history[-1]  # steps 5 and --steps: the capture is before the first
        s_per_step = (last["seconds"] - first["seconds"]) / max(last["step"] - first["step"], 1)
        rows.append({"variant": variant, "precision": result.precision, "checkpoint_layers": ckpt,
                     "steps": result.steps, "seconds": round(result.seconds, 2),
                     "s_per_step": round(s_per_step, 4),
                     "peak_gpu_bytes": torch.cuda.max_memory_allocated() - base if cuda else 0,
                     "plan_activation_bytes": result.activation_bytes,
                     "initial_train_kl": result.initial_train_kl, "final_train_kl": result.final_train_kl})
        print(rows[-1], flush=True)
    load_ec_state_dict(student, state)

    params = sum(p.numel() for p in teacher.parameters())
    write_json(args.json, {"args": vars(args), "artifact": str(args.artifact), "params": params,
                           "load_s": round(load_s, 1), "held_before_bytes": base, "rows": rows})
    print(f"{'variant':<16} {'s/step':>8} {'peak GB':>8} {'KL after':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<16} {r['error']}")
        else:
            print(f"{r['variant']:<16} {r['s_per_step']:>8.3f} {r['peak_gpu_bytes'] / GB:>8.1f} {r['final_train_kl']:>10.5f}")


if __name__ == "__main__":
    main()
