"""SPEAR's engine against vLLM on one exported artifact (issue 33): the same greedy tokens, and tokens/s of each.

    python bench/vllm_compare.py --artifact runs/smollm2-w4 --vllm-python /work/vllm-venv/bin/python

The artifact is exported (`spear export-vllm`) to --export (default: <artifact>-vllm). SPEAR generates in this
process (its serving engine, the artifact's default dtype on the device: float32 on a CPU), vLLM in its own
environment (`python -m spear_vllm.generate`, the spear-vllm plugin installed there). Rows, each vLLM row
compared token for token with the SPEAR generation of the same model:
  spear           vLLM + plugin (W4 + adaptive ECs), eager   vs SPEAR with its ECs
  spear-compiled  the same under vLLM's torch.compile         vs SPEAR with its ECs
  w4              --quantization compressed-tensors (no ECs)  vs SPEAR with the ECs removed
  static-lora     stock vLLM, the export's static_lora        vs SPEAR with every gate removed (gamma = 1)
Every prompt generates --max-tokens tokens (EOS ignored) alone, after one untimed warm-up; tokens/s is
generated tokens over the timed seconds. The JSON (date, commit, versions, the load average around the
run) goes to bench/results/ecosystem/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import write_json  # noqa: E402

from spear.artifact import load_artifact  # noqa: E402
from spear.export.vllm import LORA_DIR, export_vllm  # noqa: E402
from spear.layer import SpearLinear  # noqa: E402
from spear.runtime.engine import EngineConfig, build_engine  # noqa: E402
from spear.runtime.requests import SamplingParams  # noqa: E402

PROMPTS = ("The history of the French language", "def fibonacci(n):\n")
VLLM_ROWS = {  # row: (arguments of spear_vllm.generate, the SPEAR variant it must match)
    "spear": (["--eager"], "ec"),
    "spear-compiled": ([], "ec"),
    "w4": (["--eager", "--quantization", "compressed-tensors"], "no-ec"),
    "static-lora": (["--eager", "--quantization", "compressed-tensors", "--lora", LORA_DIR], "gate-off"),
}


def spear_generate(artifact: str, variant: str, prompts: list[list[int]], max_tokens: int) -> dict:
    lm = load_artifact(artifact, torch.device("cpu"))
    for m in lm.model.modules():
        if isinstance(m, SpearLinear) and m.ec is not None:
            if variant == "no-ec":
                m.ec = None
            elif variant == "gate-off":
                m.ec.gate = None
    engine = build_engine(lm.model, lm.tokenizer, EngineConfig(max_num_seqs=1, max_model_len=1024))

    def run(rid: str, ids: list[int], n: int) -> list[int]:
        engine.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        out = []
        while engine.has_unfinished():
            for o in engine.step():
                out += o.new_token_ids
        return out

    run("warm-up", prompts[0], 8)
    tokens, seconds = [], 0.0
    for i, ids in enumerate(prompts):
        start = time.perf_counter()
        tokens.append(run(str(i), ids, max_tokens))
        seconds += time.perf_counter() - start
    return {"token_ids": tokens, "seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds,
            "dtype": str(lm.model.dtype).removeprefix("torch."), "threads": torch.get_num_threads()}


def vllm_generate(python: str, export: Path, args: list[str], prompts: list[list[int]], max_tokens: int) -> dict:
    args = [str(export / a) if a == LORA_DIR else a for a in args]
    cmd = [python, "-m", "spear_vllm.generate", str(export), "--max-tokens", str(max_tokens), *args]
    for ids in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, ids))]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.splitlines() if "Error" in line][-1:] or proc.stderr.splitlines()[-1:]
        return {"error": tail[0] if tail else f"exit {proc.returncode}", "command": " ".join(cmd)}
    result = next(line for line in reversed(proc.stdout.splitlines()) if line.startswith('{"token_ids"'))
    return json.loads(result) | {"command": " ".join(cmd)}


def matched(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per prompt, how many leading tokens two generations share."""
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--artifact", required=True, help="a SPEAR artifact directory (compensated)")
    p.add_argument("--export", default=None, help="where to export it (default: <artifact>-vllm)")
    p.add_argument("--vllm-python", default=os.environ.get("SPEAR_VLLM_PYTHON", "/work/vllm-venv/bin/python"),
                   help="the python of the environment with vLLM and spear-vllm (default $SPEAR_VLLM_PYTHON)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rows", default=",".join(VLLM_ROWS), help=f"vLLM rows among {', '.join(VLLM_ROWS)}")
    p.add_argument("--spear-threads", type=int, default=None,
                   help="torch threads of SPEAR's engine (vLLM-CPU binds its own: one core a rank, one kept free)")
    p.add_argument("--json", default="bench/results/ecosystem/vllm_compare_cpu.json")
    args = p.parse_args()
    if args.spear_threads:
        torch.set_num_threads(args.spear_threads)
    rows = args.rows.split(",")
    if unknown := set(rows) - set(VLLM_ROWS):
        sys.exit(f"unknown rows {sorted(unknown)}; choose among {', '.join(VLLM_ROWS)}")
    export = Path(args.export or f"{args.artifact.rstrip('/')}-vllm")
    info = export_vllm(args.artifact, export)
    lm = load_artifact(args.artifact, torch.device("cpu"))
    prompts = [lm.tokenizer(text)["input_ids"] for text in PROMPTS]
    del lm
    load_before = os.getloadavg()
    spear = {v: spear_generate(args.artifact, v, prompts, args.max_tokens) for v in {VLLM_ROWS[r][1] for r in rows}}
    results = {}
    for row in rows:
        vargs, variant = VLLM_ROWS[row]
        out = vllm_generate(args.vllm_python, export, vargs, prompts, args.max_tokens)
        if "token_ids" in out:
            out["matched_tokens"] = matched(out["token_ids"], spear[variant]["token_ids"])
        results[row] = out | {"spear_variant": variant}
    versions = subprocess.run([args.vllm_python, "-c", "import vllm, torch, compressed_tensors as c; "
                               "print(vllm.__version__, torch.__version__, c.__version__)"],
                              capture_output=True, text=True).stdout.split()
    write_json(args.json, {
        "artifact": args.artifact, "export": str(export), "lora_rank": info.lora_rank, "ec_modules": info.ec_modules,
        "prompts": list(PROMPTS), "prompt_ids": prompts, "max_tokens": args.max_tokens,
        "cpus": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "vllm_env": dict(zip(("vllm", "torch", "compressed_tensors"), versions)),
        "spear": spear, "vllm": results})
    print(f"{'row':<16} {'vLLM tok/s':>10} {'SPEAR tok/s':>11}  matched greedy tokens (of {args.max_tokens})")
    for row, out in results.items():
        s = spear[out["spear_variant"]]
        if "error" in out:
            print(f"{row:<16} error: {out['error']}")
        else:
            print(f"{row:<16} {out['tokens_per_s']:>10.1f} {s['tokens_per_s']:>11.1f}  {out['matched_tokens']}")
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
