"""What the CKA sensitivity costs against the number of modules it scores (issue 50, item 5), and that cost at 8B and
70B by the count it follows.

    python bench/sensitivity_cost.py --layers 2 4 8 16 --json bench/results/memory/sensitivity_cost_cpu.json

Each module's damage re-runs the decoder layers from its own to the last on the sensitivity's tokens
(compensate.cka: the float inputs of every layer are computed once), so a model of L layers and m linears a layer
costs m · L(L+1)/2 layer passes beside the L of the float pass: quadratic in depth, linear in the modules a layer
holds. Here random Llama models of one width and growing depth (transformers' LlamaForCausalLM, float32 on the
CPU, W4 RTN per-channel Ŵ for every linear) are scored by `module_sensitivity` at its defaults (4 × 128 tokens);
per row: modules, layer passes, seconds (the fastest of --repeats) and seconds a layer pass, against one plain
forward of the same tokens. At 8B and 70B the rows give the layer passes; their time there is that count × a layer
pass's time, which scales with a layer's weights (the tokens are few: the passes are weight-bound).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json  # noqa: E402
from shapes import MODELS  # noqa: E402

from spear.compensate.cka import SensitivityConfig, module_sensitivity  # noqa: E402
from spear.record import QuantConfig, rtn_quantize  # noqa: E402

W4_PC = QuantConfig(bits=4, group_size=-1, sym=True, sym_grid="absmax")
LINEARS_A_LAYER = 7  # q, k, v, o, gate, up, down


def layer_passes(layers: int, per_layer: int = LINEARS_A_LAYER) -> int:
    """Decoder-layer passes of the damage loop: module m of layer i re-runs layers i..L-1 (module docstring)."""
    return per_layer * layers * (layers + 1) // 2


def random_llama(layers: int, hidden: int, inter: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256, vocab_size=4096,
                         max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def row(layers: int, hidden: int, inter: int, repeats: int, seed: int) -> dict:
    model = random_llama(layers, hidden, inter, seed)
    w_hat = {name: rtn_quantize(m.weight.data, W4_PC).dequantize() for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and ".layers." in name}  # every decoder linear, not the head
    cfg = SensitivityConfig()
    ids = torch.randint(0, model.config.vocab_size, (cfg.num_sequences, cfg.seq_len),
                        generator=torch.Generator().manual_seed(seed))
    seconds = min(module_sensitivity(model, w_hat, ids, cfg).seconds for _ in range(repeats))
    forward = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            model.model(input_ids=ids)
            forward.append(time.perf_counter() - start)
    passes = layer_passes(layers)
    return {"layers": layers, "hidden": hidden, "intermediate": inter, "modules": LINEARS_A_LAYER * layers,
            "layer_passes": passes, "seconds": seconds, "seconds_a_layer_pass": seconds / (passes + layers),
            "forward_s": min(forward), "in_forwards": seconds / min(forward)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    rows = []
    record = {"config": vars(args), "tokens": SensitivityConfig().num_sequences * SensitivityConfig().seq_len,
              "rows": rows}
    print(f"{'layers':>6} {'modules':>8} {'layer passes':>13} {'seconds':>8} {'ms a pass':>10} {'in forwards':>12}")
    for layers in args.layers:
        r = row(layers, args.hidden, args.intermediate, args.repeats, args.seed)
        rows.append(r)
        print(f"{r['layers']:>6} {r['modules']:>8} {r['layer_passes']:>13} {r['seconds']:>8.2f} "
              f"{1e3 * r['seconds_a_layer_pass']:>10.2f} {r['in_forwards']:>12.1f}", flush=True)
        write_json(args.json, record)  # after each row, so that a cut run keeps what it measured
    at_scale = {name: {"layers": MODELS[name].n_layers, "modules": LINEARS_A_LAYER * MODELS[name].n_layers,
                       "layer_passes": layer_passes(MODELS[name].n_layers)} for name in ("llama3-8b", "llama2-70b")}
    for name, s in at_scale.items():
        print(f"{name}: {s['modules']} modules, {s['layer_passes']} layer passes "
              f"({s['layer_passes'] / s['layers']:.0f} forwards' worth)")
    write_json(args.json, record | {"at_scale": at_scale})


if __name__ == "__main__":
    main()
