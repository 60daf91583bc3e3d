"""The quality suite (BENCHMARKS.md §1–2): perplexity tables of the quantizers and of the error compensators, each
table row a process of its own, every process of a suite at once on one GPU (a 135M model leaves the GPU mostly idle
per process).

    spear bench quality --model $GGUF --out OUTDIR --suite tables      # the four settings: static baselines, SPEAR, gate off
    spear bench quality --model $GGUF --out OUTDIR --suite ablations   # the hard case (W4 RTN per-channel): every ablation
    spear bench quality --model $GGUF --out OUTDIR --suite data        # the hard case: sample count, sampler, gate form
    spear bench quality --model $GGUF --out OUTDIR --suite levers      # BOS-free windows, surprise, latency cost
    spear bench quality --model $GGUF --out OUTDIR --suite ecbits      # int8 against fp16 EC factors at 1%, two draws
    spear bench quality --model $GGUF --out OUTDIR --suite bases       # SPEAR and QERA on AWQ and OmniQuant (W4 pc)
    spear bench quality --model $GGUF --out OUTDIR --suite norms       # norm gains trained beside the ECs
    spear bench quality --model $GGUF --out OUTDIR --suite short       # more, shorter self-samples, equal tokens
    spear bench quality --model $GGUF --out OUTDIR --suite steps       # longer KL training, more self-samples
    spear bench quality --model $GGUF --out OUTDIR --suite pack        # self-samples end to end, 2,048 tokens
    spear bench quality --model $GGUF --out OUTDIR --suite zeroshot    # FP / W4 / +SPEAR on the zero-shot tasks
    spear bench quality --model $GGUF --out OUTDIR --suite full --rows full_rtn_w4pc full_gptq_w4pc  # §2's table
    spear bench quality --model $GGUF --out OUTDIR --suite quant       # the quantizers (bench/quant_table.py)
    spear bench quality --model $GGUF --out OUTDIR --suite warm        # only the warm-up

On the GPU machine, which has no shared/ beside the checkout, the evaluation text (11 MB) travels with the model's
first half and is copied aside there: the second half must follow within 30 s, and its carry uploads faster alone.

    bash ../shared/tools/stage-default-model.sh && cp -r ../shared/data .stage/a/data
    run(carry=[".stage/a"], command="bash .stage/a/device-join.sh; cp -r .stage/a/data /tmp/spear-data")
    run(carry=[".stage/b"], command="eval $(bash .stage/b/device-join.sh); bash bench/gpu_all.sh quality")

(gpu_all.sh's `quality` part reads SPEAR_DATA, default /tmp/spear-data, and brings back quality_SUITE.json.)

Rows that set no calibration options run at today's defaults (4096 self-samples × 1500 KL steps, 4-6 minutes a row
alone): the suites of eight rows were sized for the 512 × 200 of their day, so pick rows (`--rows`) to fit a call.

Several suites (`--suite levers zeroshot`) run all their rows at once. With more than one row the warm-up runs
first, so that the GGUF conversion and the self-sampled calibration ids are cached once. Each row writes
OUTDIR/NAME.json (bench/compensate_table.py's, quant_table.py's or zero_shot.py's) and NAME.log; then each suite
OUTDIR/quality_SUITE.json: the provenance and every row's table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json  # noqa: E402

BENCH = Path(__file__).resolve().parent
PC = ["--method", "rtn", "--bits", "4", "--group-size", "-1"]
G4 = ["--method", "gptq", "--bits", "4", "--group-size", "-1"]
R64 = ["--method", "rtn", "--bits", "4", "--group-size", "64"]
G3 = ["--method", "gptq", "--bits", "3", "--group-size", "64"]
AWQ = ["--method", "awq", "--bits", "4", "--group-size", "-1"]
OMNI = ["--method", "omniquant", "--bits", "4", "--group-size", "-1"]
STATIC = ["--budgets", "0.01", "--only", "LQER", "QERA", "+SPEAR"]
FULL = ["--calib-samples", "4096"]  # with --steps: BENCHMARKS §2's table at today's defaults


def suites(data_dir: str) -> dict[str, list[tuple[str, str, list[str]]]]:
    """Each suite's rows: (name, script, options)."""
    wiki_valid = f"{data_dir}/wikitext-2-raw/wiki.valid.tokens.txt"
    table = "compensate_table.py"
    return {
        "tables": [
            ("tab_rtn_w4pc_gateoff", table, PC + ["--only", "gate off (static"]),
            ("tab_rtn_w4pc_static", table, PC + ["--budgets", "0.01", "--only", "QERA", "rank 1"]),
            ("tab_rtn_w4pc_random", table, PC + ["--calib-first-token", "random", "--only", "+SPEAR"]),
            ("tab_gptq_w4pc", table, G4 + STATIC),
            ("tab_gptq_w4pc_gateoff", table, G4 + ["--only", "gate off (static"]),
            ("tab_rtn_w4g64", table, R64 + STATIC),
            ("tab_rtn_w4g64_gateoff", table, R64 + ["--only", "gate off (static"]),
            ("tab_gptq_w3g64", table, G3 + STATIC),
        ],
        "ablations": [
            ("abl_default", table, PC + ["--budgets", "0.01", "--only", "+SPEAR", "gate off (static"]),
            ("abl_static", table, PC + ["--budgets", "0.01", "--only", "LORC", "LQER", "QERA", "rank 1"]),
            ("abl_gate", table, PC + ["--only", "gate hidden"]),
            ("abl_hidden01", table, PC + ["--only", "hidden-state term 0.1"]),
            ("abl_hidden1", table, PC + ["--only", "hidden-state term 1"]),
            ("abl_placement", table, PC + ["--only", "placement spread", "placement concentrate"]),
            ("abl_lr", table, PC + ["--only", "learning rate"]),
            ("abl_data_random", table, PC + ["--calib-first-token", "random", "--only", "+SPEAR", "gate off (static"]),
            ("abl_data_top_p", table, PC + ["--calib-first-token", "random", "--calib-temperature", "0.9",
                                            "--calib-top-p", "0.95", "--only", "+SPEAR"]),
            ("abl_data_wikivalid", table, PC + ["--calib-file", wiki_valid, "--only", "+SPEAR"]),
        ],
        "data": [  # the self-sampler's count and settings (defaults: 512 sequences, top-p 0.95), and the gate's form
            ("data_128_p1", table, PC + ["--calib-samples", "128", "--calib-top-p", "1", "--only", "+SPEAR"]),
            ("data_128_p09", table, PC + ["--calib-samples", "128", "--calib-top-p", "0.9", "--only", "+SPEAR"]),
            ("data_512_p1", table, PC + ["--calib-top-p", "1", "--only", "+SPEAR"]),
            ("data_512", table, PC + ["--only", "+SPEAR", "gate off (static"]),
            ("data_512_p09", table, PC + ["--calib-top-p", "0.9", "--only", "+SPEAR"]),
            ("data_512_t08", table, PC + ["--calib-top-p", "1", "--calib-temperature", "0.8", "--only", "+SPEAR"]),
            ("data_512_token_gate", table, PC + ["--only", "per-token scalar gate"]),
            ("data_1024", table, PC + ["--calib-samples", "1024", "--only", "+SPEAR"]),
        ],
        "levers": [  # the hard case at the defaults, one lever each (four rows: about 7 minutes on the H200)
            ("lev_calib_mid", table, PC + ["--calib-start", "mid", "--only", "+SPEAR"]),
            ("lev_surprise05", table, PC + ["--calib-surprise", "0.05", "--only", "+SPEAR"]),
            ("lev_surprise02", table, PC + ["--calib-surprise", "0.02", "--only", "+SPEAR"]),
            ("lev_cost_latency", table, PC + ["--cost", "latency", "--only", "+SPEAR"]),
        ],
        "ecbits": [  # EC factors in int8 against fp16 at the same 1% (issue 51), at 512 × 200, two draws each
            (f"ecbits_{bits}_seed{seed}", table, PC + ["--calib-samples", "512", "--steps", "200", "--seed", str(seed),
                                                       "--ec-bits", bits, "--only", "+SPEAR 1%"])
            for bits in ("16", "8") for seed in (0, 1)
        ],
        "bases": [  # SPEAR and QERA on the other 4-bit per-channel bases (OmniQuant's 10 epochs: over 9 minutes with
            # seven rows beside it, so run it with one other suite at most)
            ("base_awq_w4pc", table, AWQ + ["--budgets", "0.01", "--only", "QERA", "+SPEAR"]),
            ("base_omniquant_w4pc", table, OMNI + ["--omniquant-epochs", "10", "--budgets", "0.01", "--only", "QERA",
                                                  "+SPEAR"]),
        ],
        "norms": [  # norm tweaking: the norm gains train beside the ECs (zero bytes), at two LRs; GPTQ at one
            ("norm_rtn_w4pc_2e-4", table, PC + ["--norm-lr", "2e-4", "--only", "+SPEAR"]),
            ("norm_rtn_w4pc_1e-3", table, PC + ["--norm-lr", "1e-3", "--only", "+SPEAR"]),
            ("norm_gptq_w4pc_5e-4", table, G4 + ["--norm-lr", "5e-4", "--only", "+SPEAR"]),
        ],
        "short": [  # more, shorter self-samples at equal tokens per step (the trend of 512 x 512 > 256 x 1024 > 128 x 2048)
            ("short_1024x256", table, PC + ["--calib-samples", "1024", "--calib-len", "256", "--calib-batch", "16",
                                            "--sensitivity-samples", "256", "--only", "+SPEAR"]),
            ("short_2048x128", table, PC + ["--calib-samples", "2048", "--calib-len", "128", "--calib-batch", "32",
                                            "--sensitivity-samples", "512", "--only", "+SPEAR"]),
        ],
        "steps": [  # longer KL training (the default's best held-out step is its last, 200), on more self-samples
            ("steps_400", table, PC + ["--steps", "400", "--only", "+SPEAR"]),
            ("steps_800", table, PC + ["--steps", "800", "--only", "+SPEAR"]),
            ("steps_400_n1024", table, PC + ["--calib-samples", "1024", "--calib-sample-batch", "256", "--steps", "400",
                                             "--only", "+SPEAR"]),
        ],
        "pack": [  # four 512-token self-samples end to end: the evaluation's 2,048-token context, equal tokens per step
            ("pack4", table, PC + ["--calib-pack", "4", "--calib-batch", "2", "--sensitivity-samples", "32",
                                   "--only", "+SPEAR"]),
            ("pack4_mid", table, PC + ["--calib-pack", "4", "--calib-start", "mid", "--calib-batch", "2",
                                       "--sensitivity-samples", "32", "--only", "+SPEAR"]),
        ],
        "zeroshot": [  # one process a row (one process for all three ran past a call's 9.5 minutes)
            ("zero_shot_fp", "zero_shot.py", ["--rows", "fp", "--batch-size", "64"]),
            ("zero_shot_w4", "zero_shot.py", ["--rows", "w4", "--batch-size", "64"]),
            ("zero_shot_spear", "zero_shot.py", ["--spear", "--rows", "spear", "--batch-size", "64"]),
        ],
        "full": [  # BENCHMARKS §2's first table: 4096 self-samples, 1500 KL steps per-channel, 1000 g64 (4-6 min a
            # row alone on the H200; two side by side fit a call: 360 s for the g64 pair, 450 s for the pc pair),
            # and the gate's equal-bytes ablation at each setting: a gate-less EC trained with the same KL
            (f"full_{name}{suffix}", table, setting + FULL + ["--steps", steps, *extra])
            for name, setting, steps in (("rtn_w4pc", PC, "1500"), ("gptq_w4pc", G4, "1500"),
                                         ("rtn_w4g64", R64, "1000"), ("gptq_w3g64", G3, "1000"))
            for suffix, extra in (("", ["--only", "+SPEAR 1%"]), ("_gateoff", ["--only", "gate off (static"]),
                                  ("_int8", ["--ec-bits", "8", "--only", "+SPEAR 1%"]))
        ] + [  # int8 factors with three refit rounds of the RTN codes before calibration (issue 51, item 4), two draws
            (f"full_rtn_w4pc_int8_refit_seed{seed}", table, PC + FULL + ["--steps", "1500", "--ec-bits", "8",
                                                                        "--refit-rounds", "3", "--seed", str(seed),
                                                                        "--only", "+SPEAR 1%"])
            for seed in (0, 1)
        ] + [  # GPTQ's codes re-rounded by GPTQ of W - BA, three rounds, before calibration, each row's clipping
            # chosen (clipped_gptq; CPU protocol +22.1 / +12.8 points trained, BENCHMARKS §2; --no-refit-clip: plain)
            ("full_gptq_w4pc_int8_refit", table, G4 + FULL + ["--steps", "1500", "--ec-bits", "8", "--refit-rounds", "3",
                                                             "--only", "+SPEAR 1%"])
        ] + [  # the defaults plus one joint round after calibration: 750 steps, re-round, 750 steps (equal steps)
            ("full_rtn_w4pc_int8_joint1", table, PC + FULL + ["--steps", "1500", "--ec-bits", "8", "--refit-rounds", "3",
                                                             "--joint-rounds", "1", "--only", "+SPEAR 1%"])
        ],
        "quant": [("quant_table", "quant_table.py", [])],
        "warm": [],
    }


def warm_up(model: str, num_sequences: int | None = None) -> None:
    """Convert the model and cache its self-sampled calibration ids (CalibConfig's defaults, which most rows share;
    `num_sequences` of them where every row asks for that many)."""
    from spear.api import model_key
    from spear.data.calibration import CalibConfig, calibration_ids
    from spear.models import load_float_model

    lm = load_float_model(model)
    cfg = CalibConfig() if num_sequences is None else CalibConfig(num_sequences)
    calibration_ids(lm.model, lm.tokenizer, cfg, model_key(model))


def shared_calib_samples(options: list[list[str]]) -> int | None:
    """The --calib-samples every row's options name alike, with no other option that changes the calibration ids
    (any other --calib-*, the KL batch aside), else None."""
    counts = {opts[opts.index("--calib-samples") + 1] if "--calib-samples" in opts else None for opts in options}
    kept = ("--calib-samples", "--calib-batch")
    other = any(o.startswith("--calib-") and o not in kept for opts in options for o in opts)
    return int(counts.pop()) if len(counts) == 1 and None not in counts and not other else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", type=Path, default=BENCH / "results" / "quality")
    p.add_argument("--suite", nargs="+", default=["tables"],
                   choices=["tables", "ablations", "data", "levers", "ecbits", "bases", "norms", "short", "steps", "pack",
                            "zeroshot", "full", "quant", "warm"])
    p.add_argument("--rows", nargs="*", default=None, help="run only these rows of the suites (by name)")
    p.add_argument("--time-limit", type=int, default=540,
                   help="seconds the whole run may take: the warm-up's share comes off every row's limit")
    args = p.parse_args()
    deadline = time.monotonic() + args.time_limit
    from spear.eval.perplexity import data_dir

    by_suite = suites(str(data_dir()))
    rows = [(suite, *row) for suite in args.suite for row in by_suite[suite] if args.rows is None or row[0] in args.rows]
    if args.suite == ["warm"]:
        warm_up(args.model)
        return
    if not rows:
        raise SystemExit(f"no row of {', '.join(args.suite)} is named {', '.join(args.rows or [])}")
    args.out.mkdir(parents=True, exist_ok=True)
    if len(rows) > 1:  # one row converts and samples for itself: a second model load saved
        warm_up(args.model, shared_calib_samples([options for *_, options in rows]))
    procs = []
    row_limit = max(1, int(deadline - time.monotonic()) - 5)  # 5 s to merge the rows' JSON before the caller's limit
    for _, name, script, options in rows:
        cmd = ["timeout", str(row_limit), sys.executable, str(BENCH / script), "--model", args.model,
               *options, "--json", str(args.out / f"{name}.json")]
        with open(args.out / f"{name}.log", "w") as log:
            procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
    tables = {}
    for (suite, *_), (name, proc) in zip(rows, procs):
        proc.wait()
        path = args.out / f"{name}.json"
        tables.setdefault(suite, {})[name] = {"returncode": proc.returncode,
                                              "rows": json.loads(path.read_text())["rows"] if path.exists() else []}
        print(f"{name}: exit {proc.returncode}, {len(tables[suite][name]['rows'])} rows", flush=True)
    for suite, by_name in tables.items():
        write_json(args.out / f"quality_{suite}.json", {"suite": suite, "model": args.model, "tables": by_name})


if __name__ == "__main__":
    main()
