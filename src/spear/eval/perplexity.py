"""Token perplexity with the standard LLM-quantization protocol (../shared/data/README.md).

Read the whole test file as one string (the raw file, not rows joined with "\\n\\n"),
tokenize once, cut into non-overlapping windows of `seqlen` tokens, drop the tail,
score each window from scratch, report exp(mean token NLL).

A window's logits are made from its last hidden states a chunk of positions at a time (`LOGITS_CHUNK_BYTES`):
at 2048 tokens of a 151,936-token vocabulary the whole [2048, vocab] float32 logits, and cross-entropy's
log-softmax of them, would be 2.5 GB beside the model.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from spear.errors import SpearError
from spear.layer import SpearLinear
from spear.models.head import last_hidden, logits_of, position_chunks

DATASETS = {"wikitext2": "wikitext-2-raw/wiki.test.raw", "ptb": "ptb/ptb.test.txt"}
LOGITS_CHUNK_BYTES = 64 << 20  # float32 logits scored at once
# Windows per forward when none is asked: each is scored from scratch, so only the speed changes. A linear without a
# dense copy (api.load(dense=False)) dequantizes its codes once a forward, shared by the windows of a batch: on a
# 2-core CPU, 0.5B, 4 windows of 2048 tokens took 115 s at 4 a forward, as the dense copies take at 1 (114 s), and 154
# s at 1 (bench/eval_memory.py, BENCHMARKS §8)
EVAL_BATCH_CUDA = 8
EVAL_BATCH_CPU_CODES = 4


@dataclass
class PerplexityResult:
    dataset: str
    ppl: float
    windows: int
    seqlen: int
    tokens_scored: int
    mean_nll: float
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def data_dir() -> Path:
    """$SPEAR_DATA, else the first `shared/data` found beside the working dir or this package."""
    if "SPEAR_DATA" in os.environ:
        return Path(os.environ["SPEAR_DATA"])
    for start in (Path.cwd(), Path(__file__).resolve()):
        for folder in (start, *start.parents):
            candidate = folder / "shared" / "data"
            if (candidate / "README.md").exists():
                return candidate
    raise SpearError("evaluation data not found: set SPEAR_DATA to the folder holding wikitext-2-raw/ and ptb/")


def dataset_path(dataset: str) -> Path:
    if dataset not in DATASETS:
        raise SpearError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    path = data_dir() / DATASETS[dataset]
    if not path.is_file():
        raise SpearError(f"dataset file missing: {path}")
    return path


def tokenize_file(tokenizer, path: Path) -> torch.Tensor:
    """The whole file as one string, tokenized once: [num_tokens]."""
    text = path.read_text(encoding="utf-8")
    return tokenizer(text, return_tensors="pt", verbose=False).input_ids[0]


def cut_windows(ids: torch.Tensor, seqlen: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [windows, seqlen] from the start of ids [N]; the tail is dropped."""
    windows = len(ids) // seqlen
    if max_windows is not None:
        windows = min(windows, max_windows)
    return ids[: windows * seqlen].view(windows, seqlen)


@torch.no_grad()
def perplexity(
    model: nn.Module,
    tokenizer,
    dataset: str = "wikitext2",
    seqlen: int = 2048,
    max_windows: int | None = None,
    batch_size: int = 1,
    progress: bool = True,
) -> PerplexityResult:
    if seqlen < 2:
        raise SpearError(f"--seqlen must be at least 2, got {seqlen}")
    ids = tokenize_file(tokenizer, dataset_path(dataset))
    data = cut_windows(ids, seqlen, max_windows)
    windows = len(data)
    if windows == 0:
        raise SpearError(f"{dataset} has {len(ids)} tokens, fewer than one window of {seqlen}")
    device = next(model.parameters()).device
    start = time.perf_counter()
    nll_sum = 0.0
    for i in tqdm(range(0, windows, batch_size), desc=f"perplexity {dataset}", unit="batch", disable=not progress):
        nll_sum += window_nll(model, data[i : i + batch_size].to(device))
    scored = windows * (seqlen - 1)
    mean_nll = nll_sum / scored
    return PerplexityResult(dataset, math.exp(mean_nll), windows, seqlen, scored, mean_nll, time.perf_counter() - start)


def eval_batch(model: nn.Module) -> int:
    """Windows per forward when none is asked: EVAL_BATCH_CUDA on CUDA; on a CPU EVAL_BATCH_CPU_CODES where a
    quantized linear holds no dense copy, else 1."""
    if next(model.parameters()).is_cuda:
        return EVAL_BATCH_CUDA
    codes_only = any(isinstance(m, SpearLinear) and m.weight_hat is None for m in model.modules())
    return EVAL_BATCH_CPU_CODES if codes_only else 1


def window_nll(model: nn.Module, batch: torch.Tensor, chunk_bytes: int = LOGITS_CHUNK_BYTES) -> float:
    """Σ token NLL of positions 1..L−1 of each window given their prefixes, the logits made a chunk of positions at a
    time from the last hidden states (module docstring)."""
    h = last_hidden(model, batch)[0].view(*batch.shape, -1)[:, :-1].flatten(0, 1)  # [B·(L−1), H]
    targets = batch[:, 1:].flatten()
    rows = max(1, chunk_bytes // (4 * model.get_output_embeddings().weight.shape[0]))
    nll = 0.0
    for sl in position_chunks(len(h), rows):
        nll += F.cross_entropy(logits_of(model, h[sl]).float(), targets[sl], reduction="sum").item()
    return nll
