"""How much of the W4 gap the quantizer alone closes when each row's clipping is chosen by whitened error, no EC:
plain RTN (absmax) against `compensate.refit.clipped_rtn` on the same grid, bits and layout (the rounding that
joint fitting uses on RTN codes), or plain GPTQ against `clipped_gptq` (`--method gptq`: each module's GPTQ on its
float inputs' Hessian, as the refit's). Prints and saves FP, W4 plain and W4 clipped perplexities and the whitened
errors.

    python bench/clip_rtn.py --sequences 128 --seq-len 128 --max-windows 8 --json bench/results/quality/clip_rtn_cpu.json
    python bench/clip_rtn.py --method gptq --sequences 128 --seq-len 128 --max-windows 8 --json F

The clipping's statistics R_xx come from the float model's self-samples (--sequences × --seq-len), as the refit's do.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_self_sample_args, load_self_sampled, write_json  # noqa: E402

from spear.compensate.refit import CLIP_RATIOS, GPTQ_CLIP_RATIOS, clipped_gptq, clipped_rtn  # noqa: E402
from spear.compensate.stats import collect_input_stats  # noqa: E402
from spear.eval.perplexity import perplexity  # noqa: E402
from spear.models.layerwise import quantizable_linears  # noqa: E402
from spear.quant.gptq import gptq_quantize  # noqa: E402
from spear.quant.pipeline import QuantSettings  # noqa: E402
from spear.record import QuantConfig, rtn_quantize  # noqa: E402


def evaluate(model, tokenizer, max_windows: int) -> dict[str, float]:
    return {ds: perplexity(model, tokenizer, ds, max_windows=max_windows, progress=False).ppl
            for ds in ("wikitext2", "ptb")}


def gap_closed(fp: dict, w4: dict, row: dict) -> dict[str, float]:
    return {ds: (w4[ds] - row[ds]) / (w4[ds] - fp[ds]) for ds in fp}


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_self_sample_args(p)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=-1)
    p.add_argument("--max-windows", type=int, default=8)
    p.add_argument("--method", choices=["rtn", "gptq"], default="rtn")
    args = p.parse_args()
    quant = QuantConfig(bits=args.bits, group_size=args.group_size)
    gptq = QuantSettings("gptq", quant)
    lm, ids = load_self_sampled(args)
    model, tokenizer = lm.model, lm.tokenizer
    linears = quantizable_linears(model)
    floats = {n: m.weight.detach().clone() for n, m in linears.items()}
    stats = collect_input_stats(model, ids)
    fp = evaluate(model, tokenizer, args.max_windows)
    print(f"FP          {fp}", flush=True)
    rows, errors = {}, {}
    roundings = {"rtn": (lambda n: rtn_quantize(floats[n], quant), lambda n: clipped_rtn(floats[n], quant, stats[n])),
                 "gptq": (lambda n: gptq_quantize(floats[n], stats[n].sum_xx, quant, gptq.gptq_damp,
                                                  gptq.gptq_block_size, act_order=gptq.gptq_act_order),
                          lambda n: clipped_gptq(floats[n], stats[n].sum_xx, gptq))}[args.method]
    for name, rounding in zip((args.method, "clipped"), roundings):
        start, total = time.perf_counter(), 0.0
        for n, m in linears.items():
            w_hat = rounding(n).dequantize(torch.float32)
            total += ((floats[n] - w_hat) @ stats[n].r_xx_sqrt().float()).pow(2).sum().item()
            m.weight.copy_(w_hat)
        seconds = time.perf_counter() - start
        rows[name], errors[name] = evaluate(model, tokenizer, args.max_windows), total
        print(f"W{args.bits} {name:<8} {rows[name]}  whitened error {total:.1f}  ({seconds:.0f} s)", flush=True)
    closed = gap_closed(fp, rows[args.method], rows["clipped"])
    print(f"clipping alone closes {closed['wikitext2']:.1%} / {closed['ptb']:.1%} of the W{args.bits} "
          f"{args.method.upper()} gap; whitened error {errors[args.method] / errors['clipped']:.2f}× lower")
    if args.json:
        write_json(args.json, {"model": args.model, "quant": quant.to_dict(),
                               "calibration": {"sequences": args.sequences, "seq_len": args.seq_len},
                               "max_windows": args.max_windows, "method": args.method,
                               "clip_ratios": list(CLIP_RATIOS if args.method == "rtn" else GPTQ_CLIP_RATIOS), "fp": fp,
                               args.method: rows[args.method], "clipped": rows["clipped"], "whitened_error": errors,
                               "gap_closed_by_clipping": closed})


if __name__ == "__main__":
    main()
