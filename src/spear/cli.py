"""The `spear` command line: thin, every command calls the library (spear.api)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from spear.errors import SpearError, optional_requirement, require_module


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"spear: error: {message} (see --help)\n")


def _add_quant_args(p: argparse.ArgumentParser) -> None:
    from spear.quant.pipeline import QuantSettings

    p.add_argument("--method", default="rtn", choices=["rtn", "gptq", "awq", "omniquant"],
                   help="rtn (default), gptq, awq, or omniquant (learnable weight clipping, trained layer by layer)")
    p.add_argument("--bits", type=int, default=4, help="2 to 8 (default 4)")
    p.add_argument("--group-size", type=int, default=-1, help="-1 per-channel (default), or e.g. 32, 64, 128")
    p.add_argument("--asym", action="store_true", help="asymmetric (min-max) grid instead of symmetric")
    p.add_argument("--sym-grid", default="absmax", choices=["absmax", "gptq"],
                   help="symmetric grid: absmax s=max|w|/(2^(b-1)-1) (default) or gptq s=2max|w|/(2^b-1)")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True,
                   help="GPTQ: quantize columns in order of decreasing Hessian diagonal (default on; --no-act-order for the plain sweep)")
    p.add_argument("--omniquant-epochs", type=int, default=QuantSettings.omniquant_epochs,
                   help=f"OmniQuant: passes over the calibration set per layer (default {QuantSettings.omniquant_epochs})")
    _add_calib_args(p)


def _add_calib_args(p: argparse.ArgumentParser) -> None:
    from spear.data.calibration import CalibConfig

    p.add_argument("--calib-samples", type=int, default=CalibConfig.num_sequences,
                   help=f"calibration sequences (default {CalibConfig.num_sequences}; with the default steps they closed "
                        "89.2-89.8%% of SmolLM2's W4 per-channel gap, 16384 90.1%% and its zero-shot targets; "
                        "BENCHMARKS §2)")
    p.add_argument("--calib-len", type=int, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument("--calib-file", default=None, help="a text file to calibrate on instead of self-sampled sequences")
    p.add_argument("--calib-start", default=CalibConfig.start, choices=["bos", "mid"],
                   help="self-samples from BOS as sampled, or windows cut from inside them: no BOS, mid-text, as the "
                        f"evaluation's windows (default {CalibConfig.start})")
    p.add_argument("--calib-kv-gb", type=float, default=None,
                   help="GiB the self-sampler's KV cache may take (default on CUDA: 40%% of the device's memory, at "
                        "most half of what the loaded models leave; lower it where self-sampling runs out of memory)")
    p.add_argument("--seed", type=int, default=0)


def _calib_config(args):
    from spear.data.calibration import CalibConfig

    return CalibConfig(num_sequences=args.calib_samples, seq_len=args.calib_len, seed=args.seed,
                       text_file=args.calib_file, start=args.calib_start, kv_cache_gb=args.calib_kv_gb)


def _add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqlen", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--max-windows", type=int, default=None, help="evaluate only the first N windows")
    p.add_argument("--batch-size", type=int, default=None,
                   help="windows per forward pass (default: 8 on CUDA; on a CPU 4 for an artifact, else 1; "
                        "with --tasks, 16 items)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")


def _budget(text: str) -> tuple[float, str]:
    """'1%' or '0.01' → (0.01, "model"); '2%:linears' → (0.02, "linears") (compensate.pipeline.BUDGET_BASES)."""
    from spear.compensate.pipeline import BUDGET_BASES

    amount, _, base = text.partition(":")
    base = base or "model"
    if base not in BUDGET_BASES:
        raise argparse.ArgumentTypeError(f"budget base must be {' or '.join(BUDGET_BASES)} (as in 2%:linears), got {base!r}")
    try:
        value = float(amount[:-1]) / 100 if amount.endswith("%") else float(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget must look like 1%, 0.01 or 2%:linears, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"budget must be between 0% and 100%, got {text!r}")
    return value, base


def _add_compensate_args(p: argparse.ArgumentParser) -> None:
    from spear.compensate.calibrate import CalibrateConfig
    from spear.compensate.pipeline import REFIT_ROUNDS
    from spear.compensate.planner import PlannerConfig

    p.add_argument("--budget", type=_budget, default=(0.01, "model"),
                   help="EC memory as a share of the whole W4 model (default 1%%), or with :linears of its quantized "
                        "linears alone (2%%:linears), the same share whatever the embeddings weigh")
    p.add_argument("--kind", default="adaptive", choices=["adaptive", "lorc", "lqer", "qera"],
                   help="adaptive: SPEAR's gated, KL-calibrated EC (default); lorc/lqer/qera: static closed form")
    p.add_argument("--no-gate", action="store_true",
                   help="adaptive: KL-calibrate the ECs without the gate γ (its bytes go to rank): a static EC that "
                        "stock vLLM's LoRA path serves exactly, within a point of the gated one (BENCHMARKS §2)")
    p.add_argument("--rank", type=int, default=None, help="fixed EC rank for every chosen module (multiple of 8)")
    p.add_argument("--ec-bits", type=int, default=PlannerConfig.factor_bits, choices=[16, 8],
                   help="bits of the EC factors A and B as stored: 8 (int8 with a scale per rank direction: about "
                        "twice the rank for the same budget; default) or 16 (fp16)")
    p.add_argument("--placement", default="auto", choices=["auto", "concentrate", "spread", "uniform"],
                   help="auto: rank by marginal gain per byte over every linear, the damage entropy as its prior "
                        "(default); concentrate/spread/uniform: the fixed ablation modes")
    p.add_argument("--steps", type=int, default=CalibrateConfig.steps,
                   help=f"KL calibration steps (adaptive; default {CalibrateConfig.steps})")
    p.add_argument("--refit-rounds", type=int, default=None,
                   help="joint fitting (RTN and GPTQ codes): re-round the codes with the EC's low-rank part in place and "
                        f"refit it, this many rounds, before calibration (default {REFIT_ROUNDS} where SPEAR rounded "
                        "the codes (RTN, GPTQ), else 0; compensate/refit.py)")
    p.add_argument("--no-refit-clip", action="store_true",
                   help="joint fitting re-rounds RTN or GPTQ codes on the plain grid, without choosing each row's "
                        "clipping by whitened error (compensate.refit.clipped_rtn, clipped_gptq)")
    p.add_argument("--joint-rounds", type=int, default=0,
                   help="after calibration (RTN and GPTQ codes, adaptive EC): re-round the codes against the trained "
                        "EC and train it again, this many rounds, the steps split evenly; the round of least KL is "
                        "kept (default 0)")
    p.add_argument("--calib-precision", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the frozen student's dtype while the ECs train (they and Adam stay float32): auto is "
                        "bfloat16 on CUDA above 2B parameters, float32 otherwise")
    p.add_argument("--checkpoint-layers", action="store_true",
                   help="recompute each decoder layer's activations in the backward (less memory, ~1/3 more time)")
    p.add_argument("--calib-checkpoint", default=None, metavar="DIR",
                   help="write the KL training's state to DIR at each held-out scoring and resume from it when "
                        "started again (a run cut by a time limit or a preempted machine; compensate/resume.py)")
    p.add_argument("--cost", default="bytes", choices=["bytes", "latency"],
                   help="what a rank step costs the planner: bytes (default), or bytes + the decode µs the fused EC "
                        "adds (fit of the H200 kernel benchmark; compensate/cost.py)")
    p.add_argument("--tp", type=int, default=1, help="with --cost latency: tensor-parallel ranks the model will "
                                                     "serve on (row-parallel ECs add a reduction)")
    p.add_argument("--reduce-us", type=float, default=0.0,
                   help="with --cost latency and --tp > 1: µs of that reduction (0: p2p in the GEMM epilogue; "
                        "~47: a separate NCCL all-reduce)")


def _compensate_config(args):
    from dataclasses import replace

    from spear.compensate.pipeline import CompensateConfig

    from spear.compensate.cost import BytesCost, LatencyCost

    if args.steps < 1:
        raise SpearError(f"--steps must be at least 1, got {args.steps}")
    if args.cost == "bytes" and (args.tp != 1 or args.reduce_us):
        raise SpearError("--tp and --reduce-us are terms of --cost latency")
    cost = LatencyCost(tp=args.tp, t_reduce_us=args.reduce_us) if args.cost == "latency" else BytesCost()
    if args.no_gate and args.kind != "adaptive":
        raise SpearError(f"--no-gate applies to --kind adaptive; {args.kind} has no gate")
    budget, base = args.budget
    cfg = CompensateConfig(kind=args.kind, budget=budget, budget_base=base, seed=args.seed, cost=cost,
                           gate=not args.no_gate, refit_rounds=args.refit_rounds,
                           refit_clip=not args.no_refit_clip, joint_rounds=args.joint_rounds)
    return replace(cfg, planner=replace(cfg.planner, mode=args.placement, rank=args.rank, factor_bits=args.ec_bits),
                   calibrate=replace(cfg.calibrate, steps=args.steps, precision=args.calib_precision,
                                     checkpoint_layers=args.checkpoint_layers, checkpoint_dir=args.calib_checkpoint))


# `spear bench SUITE`: the script of bench/ that runs it; each writes one JSON with date, commit, device and versions
BENCH_SUITES = {"quality": "quality", "decode": "decode", "kernels": "w4_kernels", "slo": "slo_experiment",
                "tp": "tp_decode", "serve": "serve"}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="spear", description="4-bit LLMs with input-adaptive error compensators")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    q = sub.add_parser("quantize", help="quantize a model to an artifact directory")
    q.add_argument("model", help="HF model directory, .gguf file, or 'smollm2'")
    q.add_argument("--out", required=True, help="artifact directory to write")
    q.add_argument("--device", default=None)
    _add_quant_args(q)

    im = sub.add_parser("import", help="a pre-quantized checkpoint (GPTQ, AWQ, compressed-tensors, GGUF) "
                                       "as an artifact directory, without re-quantizing")
    im.add_argument("checkpoint", help="HF directory with a quantization_config (gptq, awq, compressed-tensors "
                                       "pack-quantized) or a .gguf file (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, "
                                       "Q8_0 linears, mixed as in Q4_K_M: each at its own bits)")
    im.add_argument("--out", required=True, help="artifact directory to write")
    im.add_argument("--base", default=None,
                    help="the float model it was quantized from (HF directory, .gguf or 'smollm2'): the reference "
                         "`spear compensate` calibrates against (without it the artifact cannot be compensated)")

    v = sub.add_parser("verify", help="check an artifact without loading it: its config, tokenizer and chat "
                                      "template load, and each shard matches the sha256 its config.json records")
    v.add_argument("artifact", help="artifact directory written by `spear quantize` (or compensate, import)")

    ev = sub.add_parser("export-vllm", help="a (compensated) artifact as a model directory vLLM serves: "
                                            "compressed-tensors W4A16, the ECs for the spear-vllm plugin, "
                                            "and a static LoRA adapter")
    ev.add_argument("artifact", help="artifact directory written by `spear quantize` (and `spear compensate`)")
    ev.add_argument("--out", required=True, help="model directory to write (`vllm serve DIR`)")

    e = sub.add_parser("eval", help="token perplexity, or zero-shot task accuracy, of a model or artifact")
    e.add_argument("model", help="artifact directory, HF model directory, .gguf file, or 'smollm2'")
    e.add_argument("--dataset", default="wikitext2", choices=["wikitext2", "ptb"])
    e.add_argument("--tasks", default=None,
                   help="zero-shot tasks instead of perplexity, scored as lm-eval does: comma-separated among "
                        "lambada_openai, arc_easy, arc_challenge, piqa, winogrande, boolq, hellaswag, or all")
    e.add_argument("--limit", type=int, default=None, help="with --tasks: only the first N items of each task")
    e.add_argument("--out-json", default=None, help="also write the result to this JSON file")
    _add_eval_args(e)
    e.set_defaults(batch_size=None)  # windows (perplexity, 1) or requests (tasks, 16) per forward pass

    c = sub.add_parser("compensate", help="add error compensators to a quantized artifact (in place)")
    c.add_argument("artifact", help="artifact directory written by `spear quantize`")
    _add_compensate_args(c)
    _add_calib_args(c)
    c.add_argument("--device", default=None)

    r = sub.add_parser("run", help="the main job: quantize, plan, calibrate, evaluate and report on one model")
    r.add_argument("model", nargs="?", default="smollm2")
    r.add_argument("--quick", action="store_true", help="short evaluation and calibration (a few minutes on a CPU)")
    r.add_argument("--out", default=None, help="run directory (default runs/<model>-<setting>)")
    r.add_argument("--no-compensate", action="store_true", help="quantize and evaluate only")
    _add_compensate_args(r)
    _add_quant_args(r)
    _add_eval_args(r)

    s = sub.add_parser("serve", help="serve a model or artifact over an OpenAI-compatible HTTP API")
    s.add_argument("model", help="artifact directory, HF model directory, .gguf file, or 'smollm2'")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-waiting", type=int, default=256, help="queued requests beyond which requests get HTTP 429")
    s.add_argument("--chunk-tokens", type=int, default=None,
                   help="prompt tokens prefilled per engine step (default: 512 on a GPU; 128 on a CPU, where a "
                        "larger chunk stalls every running stream for seconds)")
    s.add_argument("--itl-slo-ms", type=float, default=None,
                   help="SLO-aware chunks (at most --chunk-tokens) from the artifact's latency table, profiled first if absent")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="context per sequence (default: the model's, at most 4096); the KV cache must hold one")
    s.add_argument("--max-num-seqs", type=int, default=256,
                   help="sequences decoded together at most (as many as the KV cache holds)")
    s.add_argument("--kv-cache-memory", default=None,
                   help="the KV cache's size: bytes or a size such as 2GiB, 512MiB, 1.5GB (default: on a GPU "
                        "--gpu-memory-utilization of its memory less the weights', on a CPU 512MiB)")
    s.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the KV cache's dtype: auto, the model's (default); on a CPU bfloat16 or float16 hold twice "
                        "the tokens in the same memory, read back in float32")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory for the weights, activations and KV cache (default 0.9)")
    s.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: one process per GPU (gloo processes on CPU), rank 0 serves HTTP")
    s.add_argument("--tp-reduction", default="p2p",
                   help="how the row-parallel layers of 4-bit models reduce on GPUs: p2p (the W4 kernel writes to the "
                        "peers, default), symmetric (one symmetric-memory all-reduce) or collective (NCCL)")
    s.add_argument("--no-overlap", action="store_true",
                   help="read each step's tokens before launching the next (default: the host's work for one step "
                        "overlaps the GPU's next step; always off with --tp and on a CPU)")
    s.add_argument("--engine-process", action="store_true",
                   help="on a CPU, run the engine in a process of its own on every core, as vLLM's engine core "
                        "(default: in the server's process on one core fewer); on 2 cores +11%% tokens/s at batch 8 "
                        "and none at batch 1, and several times slower where other processes want the cores")
    s.add_argument("--max-body-mb", type=float, default=4.0, help="request bodies over this get HTTP 413")
    s.add_argument("--read-timeout-s", type=float, default=30.0,
                   help="a request (headers and body) must arrive within this; slower connections are closed")
    s.add_argument("--max-connections", type=int, default=1024, help="open connections beyond this are closed at once")
    s.add_argument("--allowed-hosts", nargs="+", default=None,
                   help="Host header names accepted (default: the loopback names when bound to loopback, else any; "
                        "'*': any)")
    s.add_argument("--api-key", default=os.environ.get("SPEAR_API_KEY"),
                   help="require Authorization: Bearer KEY on every /v1 route (default: $SPEAR_API_KEY; none: no auth)")
    s.add_argument("--api-key-probes", action="store_true", help="/health and /metrics need the key too")
    s.add_argument("--served-model-name", nargs="+", default=(), metavar="NAME",
                   help="the names requests may give as `model`, listed by /v1/models; responses name the first "
                        "(default: MODEL as given and its base name, as /models/q4 and q4)")
    s.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")

    pr = sub.add_parser("profile", help="measure engine step latency (decode batch x prefill tokens) for the SLO scheduler")
    pr.add_argument("model", help="artifact directory, HF model directory, .gguf file, or 'smollm2'")
    pr.add_argument("--out", default=None, help="JSON file to write (default: DIR/latency_table.json for an artifact)")
    pr.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="decode batch sizes (default 1 4 8 16 32)")
    pr.add_argument("--prefill-tokens", type=int, nargs="+", default=None, help="prefill tokens (default 0 64 128 256 512)")
    pr.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    pr.add_argument("--json", action="store_true", help="print the table as one JSON object on stdout")

    b = sub.add_parser("bench", help="run a benchmark suite of the source checkout (bench/, BENCHMARKS.md)")
    b.add_argument("name", choices=list(BENCH_SUITES))
    b.add_argument("options", nargs=argparse.REMAINDER, help="the suite's own options (add --help to list them)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from spear.models.loading import transformers_quiet

    transformers_quiet()
    try:
        commands = {"quantize": cmd_quantize, "eval": cmd_eval, "compensate": cmd_compensate, "run": cmd_run,
                    "serve": cmd_serve, "profile": cmd_profile, "bench": cmd_bench,
                    "import": cmd_import, "export-vllm": cmd_export_vllm, "verify": cmd_verify}
        return commands[args.command](args)
    except SpearError as e:
        print(f"spear: error: {e}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:  # a plan the estimates passed, still too large for the device
        if not is_out_of_memory(e):
            raise
        print(f"spear: error: {out_of_memory(e, args.command)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spear: interrupted", file=sys.stderr)
        return 130


# what to change, by command, when a device runs out of memory past the estimates made before loading
CALIBRATION_ADVICE = "lower --calib-kv-gb (self-sampling), add --checkpoint-layers (training), or use a larger device"
MEMORY_ADVICE = {"compensate": CALIBRATION_ADVICE, "run": CALIBRATION_ADVICE,
                 "serve": "lower --gpu-memory-utilization or --max-num-seqs"}


def is_out_of_memory(error: BaseException) -> bool:
    """The host's MemoryError or torch's OutOfMemoryError (a RuntimeError, raised by the caching allocator)."""
    torch = sys.modules.get("torch")
    return isinstance(error, MemoryError) or (torch is not None and isinstance(error, torch.OutOfMemoryError))


def out_of_memory(error: BaseException, command: str) -> str:
    """One line for an out-of-memory error: what failed to allocate (the first two sentences of torch's message:
    "CUDA out of memory. Tried to allocate 744.00 MiB") and what to change."""
    first = ". ".join(str(error).split(". ")[:2]).strip() or type(error).__name__
    advice = MEMORY_ADVICE.get(command, "use a smaller batch or a larger device")
    return f"out of memory during `spear {command}` ({first}): {advice}"


def lm_eval_main() -> int:
    """`spear-lm-eval`: lm-eval's command line with the "spear" model registered (spear.eval.lm_eval_adapter)."""
    try:
        from spear.eval.lm_eval_adapter import main as lm_eval_cli
    except SpearError as e:  # lm-eval is not installed
        print(f"spear-lm-eval: error: {e}", file=sys.stderr)
        return 2
    lm_eval_cli()
    return 0


def _device(args):
    import torch

    if args.device is None:
        return None
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SpearError("--device cuda given but no CUDA device is available")
    try:
        return torch.device(args.device)
    except RuntimeError:
        raise SpearError(f"unknown device {args.device!r}; use cpu or cuda") from None


def _settings(args):
    from spear.quant.pipeline import QuantSettings
    from spear.record import QuantConfig

    quant = QuantConfig(bits=args.bits, group_size=args.group_size, sym=not args.asym, sym_grid=args.sym_grid)
    if args.calib_samples < 1 or args.calib_len < 2:
        raise SpearError("--calib-samples must be at least 1 and --calib-len at least 2")
    calib = _calib_config(args)
    if args.omniquant_epochs < 1:
        raise SpearError("--omniquant-epochs must be at least 1")
    return QuantSettings(method=args.method, quant=quant, gptq_act_order=args.act_order,
                         omniquant_epochs=args.omniquant_epochs), calib


def cmd_quantize(args) -> int:
    from spear import api

    settings, calib = _settings(args)
    out = api.quantize(args.model, settings, args.out, calib, device=_device(args))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_import(args) -> int:
    from spear.quant.importer import import_checkpoint

    out = import_checkpoint(args.checkpoint, args.out, args.base)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_verify(args) -> int:
    from spear.artifact import verify_artifact

    print(verify_artifact(args.artifact).summary())
    return 0


def cmd_export_vllm(args) -> int:
    from spear.export.vllm import LORA_DIR, export_vllm

    r = export_vllm(args.artifact, args.out)
    lora = f"; static LoRA rank {r.lora_rank} in {r.out_dir / LORA_DIR}" if r.lora_rank else ""
    print(f"wrote {r.out_dir}: {r.quantized} linears as compressed-tensors W4A16, {r.ec_modules} ECs{lora}",
          file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    from spear import api
    from spear.eval.perplexity import eval_batch, perplexity

    if args.tasks is not None:
        return _eval_tasks(args)
    _check_eval_args(args)
    lm = api.load(args.model, device=_device(args), dense=False)  # an artifact's codes held, never a dense copy
    batch = args.batch_size or eval_batch(lm.model)  # a linear dequantizes its codes once a forward
    result = perplexity(lm.model, lm.tokenizer, args.dataset, args.seqlen, args.max_windows, batch)
    record = {"model": args.model, **result.to_dict()}
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(record, indent=2))
    if args.json:
        print(json.dumps(record))
    else:
        print(f"{'model':<40} {'dataset':<10} {'windows':>7} {'ppl':>10}")
        print(f"{args.model:<40} {result.dataset:<10} {result.windows:>7} {result.ppl:>10.3f}")
    return 0


def _eval_tasks(args) -> int:
    from spear import api
    from spear.eval.tasks import evaluate_tasks, format_table, parse_tasks

    tasks = parse_tasks(args.tasks)
    args.batch_size = args.batch_size or 16
    _check_eval_args(args)
    if args.limit is not None and args.limit < 1:  # before the model loads
        raise SpearError(f"--limit must be at least 1, got {args.limit}")
    lm = api.load(args.model, device=_device(args), dense=False)
    results = evaluate_tasks(lm.model, lm.tokenizer, tasks, args.limit, args.batch_size)
    record = {"model": args.model, "limit": args.limit, "tasks": [r.to_dict() for r in results]}
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(record, indent=2))
    print(json.dumps(record) if args.json else format_table(results))
    return 0


def cmd_compensate(args) -> int:
    from spear import api

    calib = _calib_config(args)
    report = api.compensate_artifact(args.artifact, _compensate_config(args), calib, device=_device(args))
    s = report.summary()
    print(f"{s['kind']} ECs on {s['modules']} modules ({s['mode']}, entropy {s['entropy']:.3f}), ranks {s['ranks']}, "
          f"{s['ec_bytes'] / 1e6:.2f} MB = {s['ec_memory_pct']:.2f}% of the W4 model, {s['ec_linears_pct']:.2f}% of its "
          f"4-bit linears; wrote {args.artifact}", file=sys.stderr)
    return 0


def _note_full_protocol_on_cpu(config, device) -> None:
    """One line on stderr where the full protocol is about to run on a CPU (hours, not the H200's minutes)."""
    from spear.models.loading import default_device

    on_cpu = (device or default_device()).type == "cpu"
    if on_cpu and not config.quick and config.compensate is not None and not config.calib.text_file:
        steps = config.compensate.calibrate.steps
        print(f"spear: note: {config.calib.num_sequences} self-samples of {config.calib.seq_len} tokens and {steps} KL "
              "steps on a CPU take hours; --quick runs a CPU-sized version in minutes", file=sys.stderr)


def cmd_run(args) -> int:
    from spear.run import RunConfig, run

    _check_eval_args(args)
    settings, calib = _settings(args)
    config = RunConfig.build(args.model, settings, calib, quick=args.quick, out=args.out,
                             seqlen=args.seqlen, max_windows=args.max_windows, batch_size=args.batch_size,
                             compensate=None if args.no_compensate else _compensate_config(args))
    device = _device(args)
    _note_full_protocol_on_cpu(config, device)
    report = run(config, device=device)
    if args.json:
        print(json.dumps(report))
    return 0


def cmd_serve(args) -> int:
    from spear.server.guard import GuardConfig
    from spear.server.launch import ServeConfig, parse_memory, serve

    hosts = None if args.allowed_hosts is None else tuple(args.allowed_hosts)
    http = GuardConfig(int(args.max_body_mb * 2**20), args.read_timeout_s, args.max_connections, hosts,
                       args.api_key, args.api_key_probes)
    config = ServeConfig(args.host, args.port, args.max_waiting, args.chunk_tokens, args.itl_slo_ms,
                         args.max_model_len, args.max_num_seqs, args.tp, args.tp_reduction, not args.no_overlap, http,
                         None if args.kv_cache_memory is None else parse_memory(args.kv_cache_memory),
                         args.gpu_memory_utilization, tuple(args.served_model_name), args.kv_cache_dtype,
                         args.engine_process)
    serve(args.model, config, device=_device(args))
    return 0


def cmd_profile(args) -> int:
    from spear.runtime.latency import profile_model

    table, path = profile_model(args.model, args.out, args.batch_sizes, args.prefill_tokens, device=_device(args))
    if args.json:
        print(json.dumps(table.to_dict()))
    else:
        print(table.format())
    print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    import runpy

    script = Path(__file__).resolve().parents[2] / "bench" / f"{BENCH_SUITES[args.name]}.py"
    if not script.exists():
        raise SpearError(f"spear bench runs the scripts of a source checkout; {script} does not exist")
    sys.argv = [str(script), *args.options]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):  # the script's own one-line refusal (e.g. no CUDA GPU): exit 2, as every CLI error
            raise SpearError(e.code) from None
        raise
    except ModuleNotFoundError as e:  # a suite's optional dependency (triton, httpx): what to install, in one line
        if e.name and optional_requirement(e.name):
            require_module(e.name.partition(".")[0], f"spear bench {args.name}")
        raise
    return 0


def _check_eval_args(args) -> None:
    if args.max_windows is not None and args.max_windows < 1:
        raise SpearError(f"--max-windows must be at least 1, got {args.max_windows}")
    if args.batch_size is not None and args.batch_size < 1:
        raise SpearError(f"--batch-size must be at least 1, got {args.batch_size}")


if __name__ == "__main__":
    sys.exit(main())
