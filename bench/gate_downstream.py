"""Where could the input-adaptive gate help? One MLP block, fitted by MSE on held-out tokens (CPU lab script).

At one layer the error an EC corrects, (W − Q(W))x, is linear in x, and so are the best coefficients in any rank-r
output span: gamma = 1 is optimal (BENCHMARKS.md §2). Downstream of a nonlinearity that no longer holds. With gate_proj
and up_proj quantized too, down_proj's input h' = SiLU(Q(Wg)x) ⊙ Q(Wu)x carries their error through SiLU and the
product, and the residual down_proj should correct, y − Q(Wd)h', is a nonlinear function of h'. This fits, per layer
and rank, an EC on down_proj (y = Q(W)h + alpha B (gamma(Ah) ⊙ Ah)) without a gate and with the paper's bottleneck
gate (hidden 8), a wide one (hidden 64), or a gate that reads h itself (a probe), and prints the held-out residual
each leaves (SmolLM2: no gate beats no gate by more than 0.0007 of the residual's share; BENCHMARKS.md §2):

    python bench/gate_downstream.py --model smollm2 --layers 0 10 20 29 --ranks 1 4 16 --json FILE

    linear      only down_proj quantized: theory says the gate cannot help (a control)
    downstream  gate_proj, up_proj and down_proj quantized: the case for an adaptive EC
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json  # noqa: E402

GATES = {"no gate": 0, "gate h8": 8, "gate h64": 64, "input gate h8": -8}  # < 0: the gate reads h, not A h


class InputGatedEC(torch.nn.Module):
    """An EC whose gate reads the layer input: B ((1 + tanh(MLP(h))) ⊙ A h), MLP in → hidden → r (a probe: in × hidden
    more bytes than the rank-space gate)."""

    def __init__(self, ec, hidden: int):
        super().__init__()
        self.ec = ec
        self.mlp = torch.nn.Sequential(torch.nn.Linear(ec.A.shape[1], hidden), torch.nn.SiLU(),
                                       torch.nn.Linear(hidden, ec.rank))
        torch.nn.init.zeros_(self.mlp[2].weight)
        torch.nn.init.zeros_(self.mlp[2].bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        u = (h @ self.ec.A.t()) * (1 + torch.tanh(self.mlp(h)))
        return self.ec.alpha * (u @ self.ec.B.t())


def block_inputs(lm, ids: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    """The MLP inputs (after the post-attention norm) of `layers`, [tokens, hidden], from a float forward pass."""
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    hooks = [lm.model.model.layers[i].mlp.register_forward_pre_hook(
        lambda _m, args, i=i: seen[i].append(args[0].reshape(-1, args[0].shape[-1]).detach())) for i in layers]
    with torch.no_grad():
        for row in ids.split(8):
            lm.model(row)
    for h in hooks:
        h.remove()
    return {i: torch.cat(v) for i, v in seen.items()}


def fit(h: torch.Tensor, target: torch.Tensor, E: torch.Tensor, rank: int, gate_hidden: int, steps: int,
        split: int) -> float:
    """Held-out ‖target − EC(h)‖² / ‖target‖² of an EC trained by Adam from the QERA form of E on h's statistics."""
    from spear.compensate.init import qera_init
    from spear.compensate.stats import sqrtm_psd
    from spear.layer import ErrorCompensator

    train_h, test_h, train_t, test_t = h[:split], h[split:], target[:split], target[split:]
    A, B = qera_init(E, rank, sqrtm_psd(train_h.double().t() @ train_h.double() / len(train_h)))
    ec = ErrorCompensator(h.shape[1], target.shape[1], rank, max(gate_hidden, 0))
    with torch.no_grad():
        ec.A.copy_(A.float())
        ec.B.copy_(B.float())
    factors = [ec.A, ec.B]
    if gate_hidden < 0:
        ec = InputGatedEC(ec, -gate_hidden)
    opt = torch.optim.Adam([{"params": factors, "lr": 1e-3},
                            {"params": [p for p in ec.parameters() if all(p is not f for f in factors)], "lr": 1e-2}])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        pick = torch.randint(0, split, (4096,), generator=gen)
        loss = F.mse_loss(ec(train_h[pick]), train_t[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        return float((test_t - ec(test_h)).pow(2).sum() / test_t.pow(2).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--layers", type=int, nargs="+", default=[0, 10, 20, 29])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--sequences", type=int, default=64, help="self-sampled sequences (a quarter held out)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from spear.api import model_key
    from spear.data.calibration import CalibConfig, calibration_ids
    from spear.models import load_float_model
    from spear.record import QuantConfig, rtn_quantize

    torch.manual_seed(0)
    lm = load_float_model(args.model, device=torch.device("cpu"), dtype=torch.float32)
    cfg = CalibConfig(num_sequences=args.sequences, seq_len=args.seq_len, batch_size=args.sequences)
    ids = calibration_ids(lm.model, lm.tokenizer, cfg, model_key(args.model))
    inputs = block_inputs(lm, ids, args.layers)
    q = QuantConfig(bits=4, group_size=-1)
    rows = []
    for layer, x in inputs.items():
        mlp = lm.model.model.layers[layer].mlp
        Wg, Wu, Wd = (m.weight.detach() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        Qg, Qu, Qd = (rtn_quantize(w, q).dequantize() for w in (Wg, Wu, Wd))
        with torch.no_grad():
            h_float = F.silu(x @ Wg.t()) * (x @ Wu.t())
            h_quant = F.silu(x @ Qg.t()) * (x @ Qu.t())
            y = h_float @ Wd.t()
        split = len(x) * 3 // 4
        for case, h in (("linear", h_float), ("downstream", h_quant)):
            target = y - h @ Qd.t()
            for rank in args.ranks:
                row = {"layer": layer, "case": case, "rank": rank}
                for label, hidden in GATES.items():
                    row[label] = fit(h, target, Wd - Qd, rank, hidden, args.steps, split)
                rows.append(row)
                print(f"layer {layer:2d}  {case:10s}  rank {rank:2d}  " +
                      "  ".join(f"{k} {row[k]:.4f}" for k in GATES), flush=True)
    if args.json:
        write_json(args.json, {"model": args.model, "layers": args.layers,
                               "calibration": f"{args.sequences} x {args.seq_len} self-sampled, 1/4 held out",
                               "steps": args.steps, "metric": "held-out relative residual |t - EC(h)|^2 / |t|^2",
                               "rows": rows})


if __name__ == "__main__":
    main()
