"""Token perplexity with the standard LLM-quantization protocol (../shared/data/README.md).

Read the whole test file as one string (the raw file, not rows joined with "\\n\\n"),
tokenize once, cut into non-overlapping windows of `seqlen` tokens, drop the tail,
score each window from scratch, report exp(mean token NLL).
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

DATASETS = {"wikitext2": "wikitext-2-raw/wiki.test.raw", "ptb": "ptb/ptb.test.txt"}


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
        batch = data[i : i + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits
        # token NLL of positions 1..L-1 given their prefixes, summed per window
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum")
        nll_sum += nll.item()
    scored = windows * (seqlen - 1)
    mean_nll = nll_sum / scored
    return PerplexityResult(dataset, math.exp(mean_nll), windows, seqlen, scored, mean_nll, time.perf_counter() - start)
