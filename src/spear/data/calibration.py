"""Calibration token sequences.

Default: data-free. Sequences are sampled from the float model itself (seeded,
temperature 1, starting from the BOS token or, where there is none, a random one),
and cached on disk keyed by the model and the settings. Option: a text file, cut
into windows of the requested length.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from spear.errors import SpearError
from spear.util import cache_dir


@dataclass(frozen=True)
class CalibConfig:
    num_sequences: int = 128
    seq_len: int = 512
    seed: int = 0
    text_file: str | None = None  # None: sample from the float model (data-free)
    batch_size: int = 32


def calibration_ids(model: nn.Module, tokenizer, cfg: CalibConfig, model_key: str) -> torch.Tensor:
    """[num_sequences, seq_len] token ids on CPU; self-sampled ones are cached under `model_key`."""
    if cfg.text_file:
        return text_file_ids(tokenizer, Path(cfg.text_file), cfg)
    key = hashlib.sha1(f"{model_key}:{cfg.num_sequences}:{cfg.seq_len}:{cfg.seed}".encode()).hexdigest()[:16]
    path = cache_dir("calib") / f"selfsample-{key}.safetensors"
    if path.exists():
        return load_file(str(path))["ids"]
    ids = sample_from_model(model, tokenizer, cfg)
    tmp = path.with_suffix(".tmp")
    save_file({"ids": ids}, str(tmp), metadata={k: str(v) for k, v in asdict(cfg).items()})
    tmp.rename(path)
    return ids


def text_file_ids(tokenizer, path: Path, cfg: CalibConfig) -> torch.Tensor:
    """Random windows of `seq_len` tokens from a text file (seeded)."""
    if not path.is_file():
        raise SpearError(f"calibration text file not found: {path}")
    ids = tokenizer(path.read_text(encoding="utf-8", errors="replace"), return_tensors="pt").input_ids[0]
    if len(ids) <= cfg.seq_len:
        raise SpearError(f"{path} has {len(ids)} tokens; need more than --calib-len {cfg.seq_len}")
    gen = torch.Generator().manual_seed(cfg.seed)
    starts = torch.randint(0, len(ids) - cfg.seq_len, (cfg.num_sequences,), generator=gen)
    return torch.stack([ids[s : s + cfg.seq_len] for s in starts.tolist()])


@torch.no_grad()
def sample_from_model(model: nn.Module, tokenizer, cfg: CalibConfig) -> torch.Tensor:
    """Ancestral sampling at temperature 1 (no top-k/top-p), full length, batch by batch."""
    device = next(model.parameters()).device
    torch.manual_seed(cfg.seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    bos = tokenizer.bos_token_id
    out = []
    for start in tqdm(range(0, cfg.num_sequences, cfg.batch_size), desc="self-sampling calibration data", unit="batch"):
        n = min(cfg.batch_size, cfg.num_sequences - start)
        first = torch.full((n, 1), bos) if bos is not None else torch.randint(0, vocab, (n, 1))
        ids = model.generate(
            first.to(device),
            attention_mask=torch.ones_like(first, device=device),
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=cfg.seq_len - 1, min_new_tokens=cfg.seq_len - 1,
            pad_token_id=tokenizer.eos_token_id,
        )
        out.append(ids.cpu())
    return torch.cat(out)
