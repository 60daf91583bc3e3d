"""How much output error could re-fitting the W4 scales remove, at zero bytes, beside a rank-1 EC? (CPU lab script)

For every linear of the model, with R = E[x xᵀ] from self-sampled inputs, the output error of a quantized weight Q is
E_x ‖(W − Q)x‖² = tr((W − Q) R (W − Q)ᵀ). Keeping RTN's codes and re-fitting each row's scale (per-channel) to
minimise it gives the closed form c_i = (q_i R w_iᵀ) / (q_i R q_iᵀ) for row i; a rank-1 QERA EC removes the top σ² of
(W − Q) R^{1/2}. This prints the error left by RTN, by the re-fitted scales, by RTN + rank 1, by re-fitted scales
then rank 1, and by both fitted together:

    python bench/scale_refit_estimate.py --model smollm2 --json FILE

A layer-wise estimate only: it says whether scales trained end to end (with the ECs, in the KL loop) are worth
building, not what they would reach.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_self_sample_args, load_self_sampled, write_json  # noqa: E402


def error_energy(E: torch.Tensor, R: torch.Tensor) -> float:
    return float(torch.einsum("oi,ij,oj->", E, R, E))


def rank1_left(E: torch.Tensor, R_sqrt: torch.Tensor) -> float:
    """The error energy a rank-1 QERA EC leaves: ‖E R^{1/2}‖² − σ₁²."""
    s = torch.linalg.svdvals(E @ R_sqrt)
    return float((s[1:] ** 2).sum())


def refit_scales(Q: torch.Tensor, R: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each row's scale c_i minimising E_x ‖(target − c Q) x‖²: c_i = (q_i R t_iᵀ) / (q_i R q_iᵀ)."""
    return torch.einsum("oi,ij,oj->o", Q, R, target) / torch.einsum("oi,ij,oj->o", Q, R, Q).clamp(min=1e-30)


def joint_rank1_left(W: torch.Tensor, Q: torch.Tensor, R: torch.Tensor, R_sqrt: torch.Tensor, rounds: int = 8) -> float:
    """Row scales and a rank-1 EC fitted together (alternating: the EC's QERA form, then each row's scale against
    what the EC leaves): the error energy left."""
    from spear.compensate.init import qera_init

    c = torch.ones(len(W), dtype=W.dtype)
    for _ in range(rounds):
        A, B = qera_init(W - c[:, None] * Q, 1, R_sqrt)
        target = W - B.double() @ A.double()
        c = refit_scales(Q, R, target)
    return rank1_left(W - c[:, None] * Q, R_sqrt)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_self_sample_args(p)
    args = p.parse_args()
    from spear.compensate.stats import collect_input_stats
    from spear.record import QuantConfig, rtn_quantize

    lm, ids = load_self_sampled(args)
    stats = collect_input_stats(lm.model, ids)
    q = QuantConfig(bits=4, group_size=-1)
    rows, totals = [], {"rtn": 0.0, "refit": 0.0, "rtn_rank1": 0.0, "refit_rank1": 0.0, "joint_rank1": 0.0}
    for name, st in stats.items():
        R, R_sqrt = st.r_xx, st.r_xx_sqrt()  # q, k, v (gate, up) share one
        W = lm.model.get_submodule(name).weight.detach().double()
        Q = rtn_quantize(W.float(), q).dequantize().double()
        c = refit_scales(Q, R, W)
        row = {"module": name, "rtn": error_energy(W - Q, R), "refit": error_energy(W - c[:, None] * Q, R),
               "rtn_rank1": rank1_left(W - Q, R_sqrt), "refit_rank1": rank1_left(W - c[:, None] * Q, R_sqrt),
               "joint_rank1": joint_rank1_left(W, Q, R, R_sqrt),
               "scale_change_median": float((c - 1).abs().median())}
        for k in totals:
            totals[k] += row[k]
        rows.append(row)
    share = {k: v / totals["rtn"] for k, v in totals.items()}
    per_module = {k: float(torch.tensor([r[k] / r["rtn"] for r in rows]).median()) for k in totals}
    print(f"{len(rows)} linears; output error energy left, share of RTN's (sum over modules / median module):")
    for k in totals:
        print(f"  {k:12s} {share[k]:.3f} / {per_module[k]:.3f}")
    if args.json:
        write_json(args.json, {"model": args.model, "quant": "W4 RTN per-channel absmax",
                               "calibration": f"{args.sequences} x {args.seq_len} self-sampled",
                               "share_of_rtn_sum": share, "share_of_rtn_median_module": per_module, "rows": rows})


if __name__ == "__main__":
    main()
