"""Seconds of one refit rounding in real shapes, plain against clipped, RTN and GPTQ: what the refit's default
rounds (three, each row's clipping chosen: compensate.refit) cost on a large model, and that model's whole refit
extrapolated as rounds × layers × the layer's linears.

    python bench/refit_cost.py --shape 8b --device cpu --json bench/results/quality/refit_cost_8b_cpu.json
    python bench/refit_cost.py --shape 8b 70b --device cuda --json F

Weights are random normal; the inputs' statistics come from random inputs with log-normal channel scales (only time
is measured here, the quality of the clipping is §2's). Each linear shape of a decoder layer (bench/shapes.py) is
rounded once per variant (twice on CUDA: the first warms up); R_xx^{1/2}, which the clipped RTN reads, is computed
once per input width and timed apart, as a refit shares it between the modules reading one input and with the
whitened error every round computes anyway. The refit's other parts (the whitened error's factorisation, the QERA
factors) are the same with or without clipping and are not timed here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import timed, write_json  # noqa: E402
from shapes import MODELS, SHORT, linears  # noqa: E402

from spear.compensate.pipeline import REFIT_ROUNDS  # noqa: E402
from spear.compensate.refit import Rounding  # noqa: E402
from spear.compensate.stats import InputStats  # noqa: E402
from spear.quant.pipeline import QuantSettings  # noqa: E402
from spear.record import QuantConfig  # noqa: E402

W4_PC = QuantConfig(bits=4, group_size=-1, sym=True, sym_grid="absmax")
VARIANTS = {"rtn": ("rtn", False), "rtn_clip": ("rtn", True), "gptq": ("gptq", False), "gptq_clip": ("gptq", True)}
# how many weights of each shape a decoder layer holds (shapes.linears: q and o apart from k and v under GQA)
COUNT = {"qkvo": 4, "q_o": 2, "k_v": 2, "gate_up": 2, "down": 1}


def random_stats(in_features: int, device: torch.device, seed: int) -> InputStats:
    """Σ x xᵀ of min(2·in, 4096) random inputs whose channels have log-normal scales (a few large channels)."""
    g = torch.Generator().manual_seed(seed)
    tokens = min(2 * in_features, 4096)
    x = torch.randn(tokens, in_features, generator=g) * torch.randn(in_features, generator=g).exp()
    stats = InputStats.zeros(in_features, device)
    stats.update(x.to(device))
    return stats


def last_of(fn, repeats: int) -> float:
    """fn's seconds at its last repeat (the earlier ones warm up)."""
    return [timed(fn)[1] for _ in range(repeats)][-1]


def shape_costs(shape: str, device: torch.device, seed: int, save) -> dict:
    """Each linear shape's seconds by variant (`save(rows)` after each, so a cut run keeps what it measured), then the
    model's refit rounding extrapolated."""
    repeats = 2 if device.type == "cuda" else 1
    rows, stats_by_width = {}, {}
    for name, (n, k) in linears(shape).items():
        if k not in stats_by_width:
            stats = random_stats(k, device, seed)
            stats_by_width[k] = (stats, timed(stats.r_xx_sqrt)[1])  # fresh stats: computed here, once
        stats, sqrt_s = stats_by_width[k]
        W = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 1)).to(device) * 0.02
        row = {"shape": [n, k], "per_layer": COUNT[name], "sqrt_s": sqrt_s, "seconds": {}}
        for variant, (method, clip) in VARIANTS.items():
            rounding = Rounding(QuantSettings(method, W4_PC), clip=clip)
            row["seconds"][variant] = last_of(lambda: rounding.round(W, stats), repeats)
            print(f"{shape} {name} {n}x{k} {variant}: {row['seconds'][variant]:.2f} s", file=sys.stderr, flush=True)
        rows[name] = row
        save({"linears": rows})
        del W
    layers = MODELS[SHORT[shape]].n_layers
    model = {variant: REFIT_ROUNDS * layers * sum(r["per_layer"] * r["seconds"][variant] for r in rows.values())
             for variant in VARIANTS}
    return {"linears": rows, "layers": layers, "rounds": REFIT_ROUNDS, "model_refit_rounding_s": model}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs="+", default=["8b"], choices=list(SHORT))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    results = {}
    for shape in args.shape:
        def save(partial: dict) -> None:
            write_json(args.json, {"device": str(device), "shapes": {**results, shape: partial}})

        results[shape] = shape_costs(shape, device, args.seed, save)
        save(results[shape])
    for shape, r in results.items():
        print(f"{shape}: the refit's rounding, {r['rounds']} rounds × {r['layers']} layers: " + ", ".join(
            f"{variant} {seconds / 60:.1f} min" for variant, seconds in r["model_refit_rounding_s"].items()))


if __name__ == "__main__":
    main()
