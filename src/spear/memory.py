"""Memory up front: each command estimates what it will hold before it loads anything, and refuses a plan that
cannot fit with one line that says what to change, instead of an out-of-memory kill halfway.

The estimates count the tensors a command holds (weights in their compute dtype, dense copies, records at their
bits), not the allocator's slack or activations; `HEADROOM` covers those. On a CPU the budget is the host's
available memory (MemAvailable: free plus reclaimable page cache), on CUDA the device's free memory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spear.errors import SpearError

HEADROOM = 1.1  # activations, allocator slack, the tokenizer: 10% over the tensors' bytes


def gib(nbytes: float) -> str:
    return f"{nbytes / 1024**3:.1f} GiB"


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can take on `device`: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def require(nbytes: int, device: torch.device, what: str, advice: str) -> None:
    """Raise SpearError (one line: what needs how much, what there is, what to change) when `nbytes` with headroom
    does not fit in what `device` has available."""
    need, have = int(nbytes * HEADROOM), available_bytes(device)
    if need > have:
        where = "GPU" if device.type == "cuda" else "host"
        raise SpearError(f"{what} needs about {gib(need)} of {where} memory and {gib(have)} is available: {advice}")


def checkpoint_floats(directory: Path) -> int:
    """Floating-point elements of the safetensors of an HF directory, from the headers alone."""
    from spear.shards import ShardReader

    reader = ShardReader(directory)
    entries = (reader.entry(name) for name in reader.names())
    return sum(e.numel for e in entries if e.dtype in ("F16", "BF16", "F32", "F64"))


def compensate_bytes(path: Path, config: dict, dtype: torch.dtype, device: torch.device, seq_len: int,
                     stats_sequences: int, calibrate) -> dict[str, int]:
    """The peak of `spear compensate` on the artifact at `path`, by part, from its headers and config alone: the
    student with its dense copies (load_bytes), the float teacher, and the larger of the two stages that follow,
    the input statistics (one decoder layer's float64 R_xx and the walk's hidden states) and training (the
    student's extra copy in float32, or the float32 head of a bfloat16 one; a step's activations, by
    `calibrate.checkpoint_layers`; the logits of one chunk). Activations count ~12·hidden + 4·intermediate values
    a token a layer (norm inputs, q/k/v, attention output, the MLP's gate, up and product, the ECs' inputs)."""
    from spear.artifact import load_bytes
    from spear.compensate.precision import BF16_ABOVE_PARAMS
    from spear.shards import ShardReader

    reader, size = ShardReader(path), torch.finfo(dtype).bits // 8
    quantized = config["quantized_modules"]
    params = 0
    for name in reader.names():
        entry, module = reader.entry(name), name.rpartition(".")[0]
        if module in quantized:
            params += entry.shape[0] * quantized[module]["in_features"] if name.endswith(".codes") else 0
        elif ".ec." not in name:
            params += entry.numel
    model = config["model_config"]
    model = model.get("text_config") or model
    hidden, layers = model["hidden_size"], model["num_hidden_layers"]
    inter, vocab = model.get("intermediate_size", 4 * hidden), model["vocab_size"]
    heads = model.get("num_attention_heads", 1)
    q_dim = heads * (model.get("head_dim") or hidden // heads)
    precision = calibrate.precision
    if precision == "auto":
        precision = "bfloat16" if device.type == "cuda" and params > BF16_ABOVE_PARAMS else "float32"
    train_size = 4 if precision == "float32" else 2
    tokens = calibrate.batch_size * seq_len
    per_layer = tokens * (12 * hidden + 4 * inter) * train_size
    activations = per_layer + tokens * hidden * train_size * layers if calibrate.checkpoint_layers else per_layer * layers
    extra = params * (4 - size) if precision == "float32" else vocab * hidden * 4  # the upcast, or the float32 head
    training = extra + activations + 4 * calibrate.chunk_tokens * vocab * 4
    statistics = 8 * (2 * hidden**2 + q_dim**2 + inter**2) + 2 * stats_sequences * seq_len * hidden * size
    return {"student": load_bytes(path, config, dtype, dense=True), "teacher": params * size,
            "statistics": statistics, f"training in {precision}": training}

