"""Preserve-then-quantize (SRR) against QERA at equal rank, as whitened error energy (BENCHMARKS §2).

    python bench/srr_estimate.py [--model smollm2] [--every 3] [--json FILE]

For a sample of linears (every `--every`-th), with R = E[x xᵀ] from 16 × 256 tokens of wiki.valid:
  qera r:    what a rank-r closed form leaves of the W4 error, Σ_{i>r} σ_i²((W − Q(W)) R^{1/2})
  srr r k:   keep the top-k whitened singular directions L of W in the EC, quantize W − L, correct the rest at rank
             r − k: Σ_{i>r−k} σ_i²((W − L − Q(W − L)) R^{1/2})
Both as a share of W4's own whitened error energy (RTN per-channel, absmax). A CPU estimate, not a perplexity run.
"""

from __future__ import annotations

import argparse
import json

import torch

from spear.compensate.stats import collect_input_stats, sqrtm_psd
from spear.eval.perplexity import data_dir
from spear.models import load_float_model
from spear.record import QuantConfig, rtn_quantize


def tail_energies(M: torch.Tensor) -> torch.Tensor:
    """t[r] = Σ_{i>r} σ_i²(M): what a best rank-r correction leaves of ‖M‖²."""
    s2 = torch.linalg.svdvals(M.double()) ** 2
    return s2.flip(0).cumsum(0).flip(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--every", type=int, default=3, help="take every N-th linear")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    lm = load_float_model(args.model, torch.device("cpu"), torch.float32)
    text = (data_dir() / "wikitext-2-raw" / "wiki.valid.tokens.txt").read_text()[:200_000]
    ids = lm.tokenizer(text, return_tensors="pt").input_ids[0][: 16 * 256].view(16, 256)
    modules = dict(lm.model.named_modules())
    names = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear) and n != "lm_head"][:: args.every]
    stats = collect_input_stats(lm.model, ids, names)
    quant = QuantConfig(4, -1)

    def dequantized(w: torch.Tensor) -> torch.Tensor:
        return rtn_quantize(w, quant).dequantize()

    rows = {}
    for name in names:
        W = modules[name].weight.float()
        S = sqrtm_psd(stats[name].r_xx.double()).float()
        qera = tail_energies((W - dequantized(W)) @ S)  # qera[r]: left after the rank-r closed form; qera[0]: W4's error
        U, s, Vh = torch.linalg.svd((W @ S).double(), full_matrices=False)
        S_inv = torch.linalg.pinv(S.double())
        row = {f"qera{r}": qera[r].item() / qera[0].item() for r in (1, 2, 4)}
        for k in range(1, 5):
            L = (((U[:, :k] * s[:k]) @ Vh[:k]) @ S_inv).float()  # the top-k whitened directions of W, unwhitened
            srr = tail_energies((W - L - dequantized(W - L)) @ S)
            for r in (r for r in (1, 2, 4) if r >= k):
                row[f"srr{r}k{k}"] = srr[r - k].item() / qera[0].item()
        rows[name] = row
        print(name, {k: round(v, 3) for k, v in row.items()}, flush=True)
    for r in (1, 2, 4):
        worse = sum(row[f"srr{r}k1"] > row[f"qera{r}"] for row in rows.values())
        print(f"rank {r}, k = 1: SRR leaves more error than QERA in {worse} of {len(rows)} modules")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
