"""Calibration token sequences.

Default: data-free. Sequences are sampled from the float model itself (seeded), and
cached on disk keyed by the model and the settings. The sampler's knobs set the
diversity of the text: `temperature` and `top_p`, and `first_token`: "bos" starts every
sequence from the BOS token alone (an instruct model then writes much the same kind of
text each time), "random" puts one uniformly drawn vocabulary token after it (LLM-QAT's
data-free generation), which sends each sequence to a different topic and register, and "chat" starts every
sequence with the model's own chat template opened for a user turn (an instruct model then writes a question, ends
the turn and answers it: end-of-sequence tokens stay drawable in this mode only, since the chat's turns end with one).
Measured against "bos" (CPU protocol, BENCHMARKS §2 "Why zero-shot recovers less"): −2.8 / −1.5 points of the perplexity
gap, and less of LAMBADA's and ARC-e's loss won back; "bos" stays the default.
`start`: "bos" keeps each sequence as sampled, from BOS; "mid" samples MID_MARGIN tokens more and keeps a window
that starts at a random one of them, so the sequence starts mid-text with no BOS, as the evaluation windows do
(perplexity windows are cut from one token stream) and as text-file windows do.
`surprise`: the share of positions whose token is drawn from the full distribution at SURPRISE_TEMPERATURE instead: real
text surprises the model far more often than its own samples do (WikiText-2's perplexity under the float model is
21.8), and the states after a surprise are where the quantized model's errors then count; a hotter sampler
throughout derails the text instead (temperature 1.2: −4.5 points). Untested on the full protocol.
`pack`: k samples end to end per sequence (each later one without its BOS), so that calibration covers the
evaluation's context lengths (2,048-token windows across documents) with text that has not drifted as one long sample
does (256 × 1024 and 128 × 2048 samples: −1.6 and −2.4 points against 512 × 512). Measured: 4 × 512 end to end,
75.7 / 80.2% (−0.7 / +0.8 points); from mid-text, 76.1 / 79.9%: within the noise, so the default stays 1.
Option: a text file, cut into windows of the requested length.

Defaults, from a sweep on the hard case (SmolLM2-135M, W4 RTN per-channel, SPEAR at 1%; BENCHMARKS §2): the count
is the lever, together with the KL steps that use it (128 → 512 sequences: 73.4% → 75.8–76.4% of the WikiText-2
gap at 200 steps; 1024 at 200 / 400 steps: 76.1 / 78.1%; 512 at 400 / 800 steps: 76.2 / 76.6%; 2048 × 700: 79.8%;
4096 × 1000: 80.4% and 79.8% in two draws; **4096 × 1500: 80.8 / 82.9%**, W4 GPTQ per-channel 70.2%); the sampler
barely moves it (top-p 0.9 / 0.95 / 1.0 and temperature 0.8 within ±0.7 points at 512), and top-p 0.95 was the best
row. Hence 4096 sequences (and CalibrateConfig.steps 1500). sample_with_cache draws them in one batch on an H200 in
43 s (4 batches of 1024 took 92 s; transformers' generate took 110 ms a step at batch 256, sample_with_cache 39 ms).
"""

from __future__ import annotations

import hashlib
import inspect
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache

from spear.errors import SpearError
from spear.nucleus import top_k_top_p
from spear.util import cache_dir, text_config

FIRST_TOKENS = ("bos", "random", "chat")
STARTS = ("bos", "mid")
SURPRISE_TEMPERATURE = 2.0  # `surprise` positions sample the whole vocabulary at this temperature
MID_MARGIN = 64  # "mid": extra tokens sampled per sequence; the window starts at a random one of them


@dataclass(frozen=True)
class CalibConfig:
    num_sequences: int = 4096  # module docstring: the count is the lever, with CalibrateConfig.steps
    seq_len: int = 512
    seed: int = 0
    text_file: str | None = None  # None: sample from the float model (data-free)
    batch_size: int = 4096  # sequences sampled at once, at most (sampling_batch; its value is in the cache key)
    kv_cache_gb: float | None = None  # the sampler's KV cache stays under this (None: sampling_batch's default)
    temperature: float = 1.0
    top_p: float = 0.95
    first_token: str = "bos"  # "bos" | "random" | "chat" (module docstring)
    start: str = "bos"  # "bos": each sequence as sampled, from BOS; "mid": a window from inside it (module docstring)
    surprise: float = 0.0  # share of positions sampled at SURPRISE_TEMPERATURE, untruncated (module docstring)
    pack: int = 1  # samples put end to end per calibration sequence (module docstring)

    def __post_init__(self) -> None:
        if self.first_token not in FIRST_TOKENS:
            raise SpearError(f"unknown first-token mode {self.first_token!r}; choose one of {', '.join(FIRST_TOKENS)}")
        if self.start not in STARTS:
            raise SpearError(f"unknown calibration start {self.start!r}; choose one of {', '.join(STARTS)}")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise SpearError(f"sampling needs temperature > 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}")
        if not 0 <= self.surprise < 1:
            raise SpearError(f"surprise is a share of positions in [0, 1), got {self.surprise}")
        if not 1 <= self.pack <= self.num_sequences:
            raise SpearError(f"pack must be between 1 and the {self.num_sequences} sequences, got {self.pack}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise SpearError(f"kv_cache_gb must be positive, got {self.kv_cache_gb}")
        if self.num_sequences < 1 or self.seq_len < 2:
            raise SpearError(f"calibration needs ≥ 1 sequence of ≥ 2 tokens, got {self.num_sequences} × {self.seq_len}")

    @property
    def sampled_len(self) -> int:
        """Tokens sampled per sequence: seq_len, and MID_MARGIN more for start "mid"."""
        return self.seq_len + (MID_MARGIN if self.start == "mid" else 0)


def calibration_ids(model: nn.Module, tokenizer, cfg: CalibConfig, model_key: str) -> torch.Tensor:
    """[num_sequences, seq_len] token ids on CPU; self-sampled ones are cached under `model_key`."""
    if cfg.text_file:
        return text_file_ids(tokenizer, Path(cfg.text_file), cfg)
    sampler = "" if (cfg.temperature, cfg.top_p, cfg.first_token) == (1.0, 1.0, "bos") else \
        f":{cfg.temperature}:{cfg.top_p}:{cfg.first_token}"  # top-p 1 keeps the keys of existing caches
    sampler += "" if cfg.start == "bos" else f":{cfg.start}"
    sampler += "" if cfg.surprise == 0 else f":surprise{cfg.surprise}"
    batch = sampling_batch(model, cfg)  # once, so that the key names the batch the draw used
    sampler += f":kv:b{batch}"  # sample_with_cache's draws (not generate's), set by the batch
    key = hashlib.sha1(f"{model_key}:{cfg.num_sequences}:{cfg.seq_len}:{cfg.seed}{sampler}".encode()).hexdigest()[:16]
    path = cache_dir("calib") / f"selfsample-{key}.safetensors"
    if path.exists():
        ids = load_file(str(path))["ids"]
    else:
        ids = sample_from_model(model, tokenizer, cfg, batch)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes sampling the same ids at once each rename a whole file
        save_file({"ids": ids}, str(tmp), metadata={k: str(v) for k, v in asdict(cfg).items()})
        tmp.rename(path)
    return pack_sequences(ids, cfg.pack, cfg.start == "bos")


def pack_sequences(ids: torch.Tensor, pack: int, drop_bos: bool) -> torch.Tensor:
    """Every `pack` consecutive samples [N, L] end to end, the later ones without their first token (their BOS) when
    `drop_bos`: [N // pack, L + (pack − 1)·(L − 1)], as an evaluation window runs across documents; leftovers dropped."""
    if pack == 1:
        return ids
    n, length = ids.shape
    groups = ids[: n // pack * pack].view(n // pack, pack, length)
    rest = groups[:, 1:, 1:] if drop_bos else groups[:, 1:]
    return torch.cat([groups[:, 0], rest.flatten(1)], dim=1)


def ids_digest(ids: torch.Tensor) -> str:
    """A short SHA-256 of the calibration ids, recorded beside results: two runs calibrated on the same tokens
    exactly when their digests agree (self-samples drawn on another device or library may differ)."""
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


def calibration_record(cfg: CalibConfig, ids: torch.Tensor) -> dict:
    """What an artifact or a result records of its calibration: the settings, and the digest of the ids they gave."""
    return asdict(cfg) | {"ids_sha256": ids_digest(ids)}


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


CHAT_SENTINEL = "\x00SPEAR-USER-TURN\x00"


def chat_prefix(tokenizer) -> list[int]:
    """The token ids of the model's chat template up to where a user's first message goes (its system prompt, if
    the template adds one, included)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise SpearError("first_token 'chat' needs a tokenizer with a chat template; this model has none")
    text = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_SENTINEL}], tokenize=False)
    if CHAT_SENTINEL not in text:
        raise SpearError("first_token 'chat': the chat template does not place the user's message in its text")
    return tokenizer(text.split(CHAT_SENTINEL)[0], add_special_tokens=False).input_ids


def _warp(logits: torch.Tensor, cfg: CalibConfig) -> torch.Tensor:
    """Next-token logits [B, V] (float32) after cfg's temperature and top-p, and its surprise positions (module
    docstring), as transformers' warpers apply them."""
    usual = logits / cfg.temperature
    if cfg.top_p < 1:  # the nucleus: the most likely tokens until their mass reaches top_p, the rest -inf
        rows = len(logits)
        usual = top_k_top_p(usual, torch.zeros(rows, dtype=torch.long, device=logits.device),
                            torch.full((rows,), cfg.top_p, device=logits.device))
    if cfg.surprise == 0:
        return usual
    surprised = torch.rand(len(logits), device=logits.device) < cfg.surprise
    return torch.where(surprised[:, None], logits / SURPRISE_TEMPERATURE, usual)


@torch.no_grad()
def sample_with_cache(model: nn.Module, first: torch.Tensor, length: int, cfg: CalibConfig) -> torch.Tensor:
    """Sequences [B, length] continuing `first` [B, k] one token a step through the model's KV cache, the draws on
    the device (no host sync per step, unlike generate's stopping checks). End-of-sequence tokens are never drawn
    (generate's min_new_tokens does the same), except for first_token "chat", whose turns end with one. Draws from
    torch's global generator."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = None if cfg.first_token == "chat" else eos
    eos = torch.tensor([] if eos is None else eos if isinstance(eos, list) else [eos], dtype=torch.long,
                       device=first.device)
    # transformers renamed the forward's `past_key_values` to `cache` (5.2x); the cache object grows in place
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = {name: DynamicCache(config=model.config)}
    out = model(input_ids=first, use_cache=True, logits_to_keep=1, **cache)
    tokens = [first]
    for _ in range(length - first.shape[1]):
        logits = out.logits[:, -1].float().index_fill_(-1, eos, float("-inf"))
        probs = _warp(logits, cfg).softmax(-1)
        nxt = torch.multinomial(probs, 1)
        tokens.append(nxt)
        out = model(input_ids=nxt, use_cache=True, logits_to_keep=1, **cache)
    return torch.cat(tokens, dim=1)


def sampling_batch(model: nn.Module, cfg: CalibConfig) -> int:
    """Sequences sampled at once: cfg.batch_size, fewer where their KV cache (2 · layers · kv heads · head dim values
    a token, in the model's dtype) would pass cfg.kv_cache_gb; by default, on CUDA, cuda_kv_budget, elsewhere 16 GB.
    The batch is in the cache key, so it rests on this process's memory, not on what other processes leave free.

    Few large batches pay: a step costs 39 ms at 256 sequences, 45 ms at 1,024 and 84 ms at 4,096 on an H200
    (SmolLM2-135M, 512 tokens), so 4,096 sequences took 92 s in batches of 1,024 and 43 s in one."""
    row = kv_row_bytes(text_config(model), next(model.parameters()).element_size(), cfg.sampled_len)
    if row is None:
        return min(cfg.batch_size, cfg.num_sequences)
    return batch_within(row, kv_cache_budget(model, cfg), cfg)


def kv_row_bytes(config, element_size: int, tokens: int) -> int | None:
    """KV cache bytes of one sequence of `tokens` (a config object or dict); None where the config does not say."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    heads, layers = get("num_attention_heads"), get("num_hidden_layers")
    head_dim = get("head_dim") or (get("hidden_size") // heads if heads else None)
    kv_heads = get("num_key_value_heads") or heads
    if not (head_dim and kv_heads and layers):
        return None
    return 2 * layers * kv_heads * head_dim * element_size * tokens


def batch_within(row_bytes: int, budget: float, cfg: CalibConfig) -> int:
    return max(1, min(cfg.batch_size, cfg.num_sequences, int(budget // row_bytes)))


def sampler_bytes(config: dict, dtype: torch.dtype, device: torch.device, cfg: CalibConfig, models_bytes: int) -> int:
    """The self-sampler's peak beyond the models (`models_bytes`, what the process holds when it samples), from the
    model's config alone: its KV cache at the batch sampling_batch will take, one layer's cache once more (it grows by
    concatenation), and a step's float32 logits over the vocabulary with their nucleus copies (probabilities, sorted
    values and int64 order, cumulative sums: ~24 bytes an entry). 0 for a text file."""
    row = kv_row_bytes(config, torch.finfo(dtype).bits // 8, cfg.sampled_len)
    if cfg.text_file or row is None:
        return 0
    batch = batch_within(row, kv_budget(cfg, device, models_bytes), cfg)
    return int(batch * row * (1 + 1 / config["num_hidden_layers"]) + batch * config.get("vocab_size", 0) * 24)


def kv_cache_budget(model: nn.Module, cfg: CalibConfig) -> float:
    """Bytes the sampler's KV cache may take (sampling_batch), beside what this process holds now."""
    device = next(model.parameters()).device
    return kv_budget(cfg, device, torch.cuda.memory_allocated(device) if device.type == "cuda" else 0)


def kv_budget(cfg: CalibConfig, device: torch.device, allocated: int) -> float:
    """cfg.kv_cache_gb where set; else on CUDA cuda_kv_budget beside `allocated` bytes, elsewhere 16 GiB."""
    if cfg.kv_cache_gb is not None:
        return cfg.kv_cache_gb * 2**30
    if device.type == "cuda":
        return cuda_kv_budget(torch.cuda.get_device_properties(device).total_memory, allocated)
    return 16 * 2**30


def cuda_kv_budget(total: int, allocated: int) -> float:
    """40% of the device's memory, at most half of what this process's tensors leave (the models loaded: at 8B the
    student and teacher hold 33 GiB). The half leaves room for the cache's growth by concatenation, the step's
    logits and what the caching allocator cannot reuse of the grown cache: at 40% alone, an 8B model's 4096
    self-samples ran out of an H100's 79 GiB with 66.4 GiB allocated and 11.5 GiB reserved unused (BENCHMARKS §8).
    Both terms are this process's own, never what other processes leave free, so the batch (in the cache key) is
    the same from one run to the next; while the models hold under 20% of the card it is 40% of the card, as before."""
    return min(0.4 * total, 0.5 * max(total - allocated, 0))


@torch.no_grad()
def sample_from_model(model: nn.Module, tokenizer, cfg: CalibConfig, batch: int | None = None) -> torch.Tensor:
    """Ancestral sampling (cfg.temperature, cfg.top_p, no top-k, no end-of-sequence), full length, `batch` sequences
    at a time (default: sampling_batch)."""
    device = next(model.parameters()).device
    torch.manual_seed(cfg.seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    bos = tokenizer.bos_token_id
    special = set(tokenizer.all_special_ids)
    ordinary = torch.tensor([t for t in range(min(vocab, len(tokenizer))) if t not in special])
    prefix = torch.tensor(chat_prefix(tokenizer)) if cfg.first_token == "chat" else None
    if prefix is not None and len(prefix) >= cfg.sampled_len:
        raise SpearError(f"the chat template's opening is {len(prefix)} tokens; --calib-len must be longer")
    out = []
    batch = batch or sampling_batch(model, cfg)
    for start in tqdm(range(0, cfg.num_sequences, batch), desc="self-sampling calibration data", unit="batch"):
        n = min(batch, cfg.num_sequences - start)
        if prefix is not None:
            first = prefix.expand(n, -1)
        elif bos is None:
            first = ordinary[torch.randint(0, len(ordinary), (n, 1))]
        elif cfg.first_token == "random":
            first = torch.cat([torch.full((n, 1), bos), ordinary[torch.randint(0, len(ordinary), (n, 1))]], 1)
        else:
            first = torch.full((n, 1), bos)
        out.append(sample_with_cache(model, first.to(device), cfg.sampled_len, cfg).cpu())
    ids = torch.cat(out)
    if cfg.start == "mid":  # window [o, o + seq_len), o in 1..MID_MARGIN: no BOS, mid-text, as evaluation windows
        offsets = torch.randint(1, MID_MARGIN + 1, (len(ids), 1), generator=torch.Generator().manual_seed(cfg.seed))
        ids = ids.gather(1, offsets + torch.arange(cfg.seq_len))
    return ids
