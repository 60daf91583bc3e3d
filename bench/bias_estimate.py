"""Would a per-output bias beside each EC earn its bytes? (CPU lab script)

A W4 linear's output error (W − Q)x has a mean part (W − Q)μ, μ = E[x], that a bias vector would remove exactly; after
RMSNorm the inputs have a large mean (q, k, v take it whole), so that part is a large share of the error energy
E‖(W − Q)x‖² = tr(E R Eᵀ), R = E[x xᵀ]. But a linear EC already sees μ inside x. At int8 factors a bias of `out` fp16
values costs about one rank step ((in + out) bytes + 4), so the fair comparison, per module, is the error energy left
by the best rank r + 1 (the tail of (W − Q) R^{1/2}'s singular values) against a bias plus the best rank r on the
centred inputs (the tail of (W − Q) C^{1/2}, C = R − μμᵀ; the bias takes the rest of the mean exactly):

    python bench/bias_estimate.py --model smollm2 --json FILE

Layer-wise only: it says whether a trained bias is worth building, not what it would reach end to end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_self_sample_args, load_self_sampled, write_json  # noqa: E402

RANKS = (1, 2, 4)


def tail_energy(E: torch.Tensor, cov: torch.Tensor, rank: int) -> float:
    """min over rank-`rank` M of tr((E − M) cov (E − M)ᵀ): the squared singular values of E cov^{1/2} past `rank`."""
    ev, U = torch.linalg.eigh(cov)
    s = torch.linalg.svdvals(E @ (U * ev.clamp(min=0).sqrt()) @ U.T)
    return float((s[rank:] ** 2).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_self_sample_args(p)
    args = p.parse_args()
    from spear.models.layerwise import quantizable_linears
    from spear.record import QuantConfig, rtn_quantize

    lm, ids = load_self_sampled(args)
    linears = quantizable_linears(lm.model)
    sums: dict[str, list] = {}

    def hook(name):
        def accumulate(_module, inputs, _out):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            s = sums.setdefault(name, [0.0, 0.0, 0])
            s[0], s[1], s[2] = s[0] + x.sum(0), s[1] + x.T @ x, s[2] + x.shape[0]
        return accumulate

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    with torch.no_grad():
        for row in ids.split(8):
            lm.model(row)
    for h in handles:
        h.remove()
    rows = []
    for name, m in linears.items():
        E = (m.weight.detach() - rtn_quantize(m.weight.detach(), QuantConfig(4, -1)).dequantize()).double()
        sum_x, sum_xx, n = sums[name]
        mu, R = sum_x / n, sum_xx / n
        energy = float(torch.einsum("oi,ij,oj->", E, R, E))
        row = {"module": name, "mean_share": float((E @ mu).pow(2).sum()) / energy}
        for r in RANKS:
            row[f"rank{r + 1}"] = tail_energy(E, R, r + 1) / energy
            row[f"bias_rank{r}"] = tail_energy(E, R - torch.outer(mu, mu), r) / energy
        rows.append(row)
    kinds = sorted({r["module"].rsplit(".", 1)[-1] for r in rows})
    medians = {k: {key: statistics.median(r[key] for r in rows if r["module"].endswith(k)) for key in rows[0]
                   if key != "module"} for k in kinds}
    print("error energy left, share of W4 RTN's, median over layers: rank r + 1 | bias + rank r")
    for k, m in medians.items():
        cells = "  ".join(f"r={r}: {m[f'rank{r + 1}']:.3f} | {m[f'bias_rank{r}']:.3f}" for r in RANKS)
        print(f"{k:10s} mean part {m['mean_share']:.3f}  {cells}")
    if args.json:
        write_json(args.json, {"model": args.model, "quant": "W4 RTN per-channel absmax",
                               "calibration": f"{args.sequences} x {args.seq_len} self-sampled",
                               "medians_by_kind": medians, "rows": rows})


if __name__ == "__main__":
    main()
