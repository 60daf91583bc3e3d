"""The frozen student's dtype and memory while the ECs train (calibrate.py's `precision` and `checkpoint_layers`),
and what a whole compensation holds at its peak (compensate_bytes: `spear compensate` checks it before loading).

The ECs and Adam always hold float32. The frozen student runs
  "float32":  upcast (an fp16/bf16 student), trained, every tensor cast back to its own dtype at the end (exact
              for the frozen part). Cheap up to ~1B parameters; the default model's figures were all measured so.
  "bfloat16": its body (embeddings, norms, dense copies) in bfloat16 and its head in float32 (the logits feed the
              KL); the ECs compute in bfloat16 from their float32 masters (mixed precision). Half the bytes and the
              tensor cores' full rate: at 8B the student takes 16 GB instead of 32. Not fp16: the KL's gradients
              (~1e-8 a logit at 4,096 tokens a batch) underflow its range without loss scaling. On exit the body
              is restored exactly (dense copies dequantized again from the codes, the rest from a host copy).
  "auto" (default): bfloat16 on CUDA for a student above BF16_ABOVE_PARAMS parameters, else float32.
checkpointed_layers recomputes each decoder layer's activations in the backward instead of keeping them
(activation checkpointing, about one more forward a step): a step's activations then take one layer's share.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from spear.compensate.refit import REFITTABLE, ratios_per_sweep
from spear.data.calibration import sampler_bytes
from spear.layer import SpearLinear
from spear.models.layerwise import decoder_layers, module_name, set_module
from spear.util import text_config

PRECISIONS = ("auto", "float32", "bfloat16")
BF16_ABOVE_PARAMS = 2_000_000_000  # "auto": bfloat16 for a CUDA student above this (a 1.2B fp32 student is 5 GB)


@contextlib.contextmanager
def float32_student(model: nn.Module) -> Iterator[None]:
    """Run `model` with every fp16/bf16 parameter and buffer in float32; cast each back on exit (exact)."""
    low = (torch.float16, torch.bfloat16)
    params = {id(p): (p, p.dtype) for p in model.parameters() if p.dtype in low}.values()
    buffers = [
        (m, name, b.dtype) for m in model.modules() for name, b in m._buffers.items() if b is not None and b.dtype in low
    ]
    for p, _ in params:
        p.data = p.data.float()
    for m, name, _ in buffers:
        m._buffers[name] = m._buffers[name].float()
    try:
        yield
    finally:
        for p, dtype in params:
            p.grad = None
            p.data = p.data.to(dtype)
        for m, name, dtype in buffers:
            m._buffers[name] = m._buffers[name].to(dtype)


def auto_precision(device: torch.device, params: int) -> str:
    """What "auto" means for a student of `params` parameters on `device` (module docstring)."""
    return "bfloat16" if device.type == "cuda" and params > BF16_ABOVE_PARAMS else "float32"


def training_precision(student: nn.Module, precision: str) -> str:
    """`precision`, with "auto" settled by the student's device and size."""
    if precision != "auto":
        return precision
    dense = sum(m.weight_hat.numel() for m in student.modules()
                if isinstance(m, SpearLinear) and m.weight_hat is not None)
    return auto_precision(next(student.parameters()).device, dense + sum(p.numel() for p in student.parameters()))


@contextlib.contextmanager
def bfloat16_student(model: nn.Module, masters: list[nn.Parameter]) -> Iterator[None]:
    """Run `model` with its body in bfloat16, its head in float32 and its ECs in float32 (module docstring); on
    exit every tensor is as it was: the dense copies dequantized again from their codes (which is how they were
    made), the other parameters copied back from the host, the ECs cast back to their dtype."""
    head_name = module_name(model, model.get_output_embeddings())
    head = model.get_submodule(head_name)
    head32 = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
    head32.weight = nn.Parameter(head.weight.detach().float(), requires_grad=False)  # untied from the embeddings
    if head.bias is not None:
        head32.bias = nn.Parameter(head.bias.detach().float(), requires_grad=False)
    ecs = {id(p): (p, p.dtype) for p in masters}.values()
    ec_ids = {id(p) for p, _ in ecs}
    body = [p for p in {id(p): p for p in model.parameters()}.values()
            if id(p) not in ec_ids and p.is_floating_point() and p.dtype != torch.bfloat16]
    saved = [(p, p.detach().to("cpu", copy=True)) for p in body]
    dense = [(m, m.weight_hat.dtype) for m in model.modules() if isinstance(m, SpearLinear) and m.weight_hat is not None]
    for p in body:
        p.data = p.data.to(torch.bfloat16)
    for m, _ in dense:
        m.weight_hat = m.weight_hat.to(torch.bfloat16)
    for p, _ in ecs:
        p.data = p.data.float()
    set_module(model, head_name, head32)
    try:
        yield
    finally:
        set_module(model, head_name, head)
        for p, dtype in ecs:
            p.grad = None
            p.data = p.data.to(dtype)
        for p, host in saved:
            p.data = host.to(p.device)
        for m, dtype in dense:
            m.weight_hat = None  # the bfloat16 copy goes before the exact one is made
            m.weight_hat = m.qweight.dequantize(dtype)


@contextlib.contextmanager
def student_in(model: nn.Module, precision: str, masters: list[nn.Parameter]) -> Iterator[None]:
    """The student in `precision` ("float32" or "bfloat16") for the block; `masters`: the trained parameters, held in
    float32 either way."""
    with float32_student(model) if precision == "float32" else bfloat16_student(model, masters):
        yield


@contextlib.contextmanager
def checkpointed_layers(model: nn.Module, enabled: bool) -> Iterator[None]:
    """While enabled, each decoder layer's forward under autograd keeps only its inputs and recomputes its
    activations in the backward (torch.utils.checkpoint, non-reentrant: keyword arguments pass through, and the
    recompute replays inside a captured CUDA graph); without grad it runs as it is."""
    if not enabled:
        yield
        return
    from torch.utils.checkpoint import checkpoint

    def wrap(forward):
        def run(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
        return run

    layers = list(decoder_layers(model))
    for layer in layers:
        layer.forward = wrap(layer.forward)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the instance attribute goes; the class's forward shows again


@contextlib.contextmanager
def tf32_matmuls() -> Iterator[None]:
    """Let float32 matmuls use TF32 tensor cores on CUDA while training (8x faster on Hopper; the KL
    gradients need no more than TF32's 10-bit mantissa); restore the caller's setting on exit."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


# What loading adds on a CPU beyond the tensors it counts (BENCHMARKS §8): transformers' model classes (0.22 GB),
# the tokenizer and the loader's leftovers in the heap; the default model's student took 1.10 GB for 0.64 counted
LOADER_BYTES = 500 * 2**20
KL_CHUNK_COPIES = 6  # a logits chunk's float32 copies alive at once in OnlineTeacher.kl (compensate_bytes)


def layer_activation_values(hidden: int, inter: int) -> int:
    """Values a token a decoder layer keeps for the backward with an EC on every linear (compensate_bytes says
    which): 12·hidden + 4·intermediate."""
    return 12 * hidden + 4 * inter


# What a KL step keeps of each decoder layer for the backward, in values a token of the training precision
# (`python bench/activation_bytes.py`, BENCHMARKS §8; the largest of three shapes): a layer without ECs keeps this
# share of 12·hidden + 4·intermediate; an EC adds 16 + 4·rank (its rank-space tensors) and its input, once for inputs
# that several ECs read (q/k/v, gate/up), never for the attention output (attention's backward keeps it anyway).
NO_EC_SHARE = {"float32": 0.59, "bfloat16": 0.66}
EC_VALUES = (16, 4)
SHARED_INPUT = {"q_proj": "attention", "k_proj": "attention", "v_proj": "attention",
                "gate_proj": "mlp", "up_proj": "mlp"}
ATTENTION_OUTPUT = ("o_proj", "out_proj", "dense", "wo")


def plan_activation_bytes(ecs: dict[str, tuple[int, int]], hidden: int, inter: int, layers: int, tokens: int,
                          precision: str, checkpoint_layers: bool) -> int:
    """A KL step's activations under the plan that put an EC on each module of `ecs` (name -> (in_features, rank)):
    compensate_bytes' count for the layers as they are, not for an EC on every linear (an upper bound ~20% over at
    8B, where the plan at 1% covers a quarter of the linears)."""
    per_layer = [NO_EC_SHARE[precision] * layer_activation_values(hidden, inter)] * layers
    inputs = set()
    for name, (width, rank) in ecs.items():
        index = re.search(r"\.(\d+)\.", name)
        if index is None or int(index[1]) >= layers:
            continue
        i, (parent, _, short) = int(index[1]), name.rpartition(".")
        per_layer[i] += EC_VALUES[0] + EC_VALUES[1] * rank
        key = (parent, SHARED_INPUT.get(short, short))
        if short not in ATTENTION_OUTPUT and key not in inputs:
            inputs.add(key)
            per_layer[i] += width
    size = 4 if precision == "float32" else 2
    kept = max(per_layer) + hidden * layers if checkpoint_layers else sum(per_layer)
    return int(kept * tokens * size)


def student_activation_bytes(student: nn.Module, tokens: int, precision: str, checkpoint_layers: bool) -> int | None:
    """plan_activation_bytes for the ECs `student` holds now, from its config; None where the config lacks a size."""
    c = text_config(student)
    hidden, layers = getattr(c, "hidden_size", None), getattr(c, "num_hidden_layers", None)
    if not (hidden and layers):
        return None
    inter = getattr(c, "intermediate_size", None) or 4 * hidden
    ecs = {name: (m.in_features, m.ec.rank) for name, m in student.named_modules()
           if isinstance(m, SpearLinear) and m.ec is not None}
    return plan_activation_bytes(ecs, hidden, inter, layers, tokens, precision, checkpoint_layers)


def refit_bytes(method: str, out: int, in_: int) -> int:
    """One module's re-rounding (compensate.refit): clipped RTN's candidates, or clipped GPTQ's stacked sweep (about
    six float32 copies of the rows stacked once per clip ratio), and the whitening of its inputs."""
    weights = out * in_
    stacked = ratios_per_sweep(weights) * weights
    rounding = 80 * weights if method == "rtn" else 24 * stacked
    return rounding + 8 * max(out, in_) ** 2


def compensate_bytes(path: Path, config: dict, dtype: torch.dtype, device: torch.device, cfg, calib) -> dict[str, int]:
    """The peak of `spear compensate` on the artifact at `path` under `cfg` (CompensateConfig) and `calib`
    (CalibConfig), by part, from its headers and config alone, beside what the process holds already
    (memory.process_bytes): the student with its dense copies (load_bytes) and, on a CPU, what loading adds beyond
    the tensors (LOADER_BYTES); the float teacher; and the largest of the stages that follow:
      self-sampling  the sampler's KV cache and a step's logits (data.calibration.sampler_bytes; none for a text
                  file; counted where the samples are cached too, an upper bound);
      statistics  one decoder layer's float64 R_xx, the walk's hidden states, and every module's whitened-error
                  vectors (float64 [out, rank cap]) that the plan and the inits read;
      refit       the same, and the largest module's float64 temporaries while its codes are re-rounded and its
                  error decomposed (~80 bytes a weight and 8 a square of its larger side, measured on a CPU);
      training    the student's extra copy in float32 (or the float32 head of a bfloat16 one); a step's
                  activations, by `checkpoint_layers`, ~12·hidden + 4·intermediate values a token a layer (norm
                  inputs, q/k/v, attention output, the MLP's gate, up and product, the ECs' inputs); the KL's six
                  float32 copies of a logits chunk (the teacher's log-probs and their exp, the student's logits and
                  log-probs, their difference and the product), training's or scoring's; the online teacher's
                  cached last hidden states (or the top-k targets)."""
    from spear.artifact import load_bytes
    from spear.shards import ShardReader

    reader, size = ShardReader(path), torch.finfo(dtype).bits // 8
    quantized = config["quantized_modules"]
    params, shapes = 0, []
    for name in reader.names():
        entry, module = reader.entry(name), name.rpartition(".")[0]
        if module in quantized:
            if name.endswith(".codes"):
                shapes.append((entry.shape[0], quantized[module]["in_features"]))
                params += entry.shape[0] * quantized[module]["in_features"]
        elif ".ec." not in name:
            params += entry.numel
    model = config["model_config"]
    model = model.get("text_config") or model
    hidden, layers = model["hidden_size"], model["num_hidden_layers"]
    inter, vocab = model.get("intermediate_size", 4 * hidden), model["vocab_size"]
    heads = model.get("num_attention_heads", 1)
    q_dim = heads * (model.get("head_dim") or hidden // heads)
    sequences = calib.num_sequences // calib.pack
    seq_len = calib.seq_len + (calib.pack - 1) * (calib.seq_len - 1)
    train = cfg.calibrate
    precision = auto_precision(device, params) if train.precision == "auto" else train.precision
    train_size = 4 if precision == "float32" else 2
    tokens = train.batch_size * seq_len
    per_layer = tokens * layer_activation_values(hidden, inter) * train_size
    activations = per_layer + tokens * hidden * train_size * layers if train.checkpoint_layers else per_layer * layers
    extra = params * (4 - size) if precision == "float32" else vocab * hidden * 4  # the upcast, or the float32 head
    rows = min(train.chunk_tokens, max(train.batch_size, train.eval_batch_size) * seq_len)
    if train.teacher_mode == "topk":
        targets = sequences * seq_len * (8 * train.topk + 4)
    else:
        targets = 0 if train.hidden_weight else min(int(train.teacher_cache_gb * 2**30), sequences * seq_len * hidden * size)
    training = extra + activations + KL_CHUNK_COPIES * rows * vocab * 4 + targets
    vectors = 8 * cfg.planner.rank_cap * sum(out for out, _ in shapes) if cfg.planner.allocation == "marginal" else 0
    statistics = (8 * (2 * hidden**2 + q_dim**2 + inter**2) + 2 * min(cfg.stats_sequences, sequences) * seq_len * hidden
                  * size + vectors)
    parts = {"student": load_bytes(path, config, dtype, dense=True) + (LOADER_BYTES if device.type == "cpu" else 0),
             "teacher": params * size, "statistics": statistics}
    if sampling := sampler_bytes(model, dtype, device, calib, parts["student"] + parts["teacher"]):
        parts["self-sampling"] = sampling
    method = config["quant"].get("method")
    if cfg.refit_rounds_for(method in REFITTABLE):
        parts["refit"] = statistics + max(refit_bytes(method, out, in_) for out, in_ in shapes)
    if cfg.trained:
        parts[f"training in {precision}"] = training
    return parts
