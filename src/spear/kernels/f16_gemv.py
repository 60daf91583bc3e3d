"""fp16 GEMV for a float model's one-row decode steps: y = x Wᵀ + b, x [1, K], W [N, K] (issue 5's fp16 baseline).

At one row a linear layer is a stream of its weight. cuBLAS's M = 1 kernels read the Llama-2-7B shapes at 2.4–3.6
TB/s on the H200 (BENCHMARKS §4: 13.8 µs for the 33.5 MB of q/k/v/o, 29.2 µs for down's 90 MB), against a copy
bandwidth of 4.27 TB/s. This kernel is the plain streaming form (what torch.compile makes of an M = 1 matmul in
gpt-fast): a program owns ROW_BLOCKS blocks of BLOCK_N weight rows, walks K in BLOCK_K steps with the next tile
loaded a step ahead (across row blocks too; the first before the PDL wait: weights are never written), and
multiplies in float32, one accumulator an element, summed once a row block.

`tune_gemv` times its configs against cuBLAS per weight shape and keeps the faster (the choice may be cuBLAS:
`CUBLAS`); `dense_linear` then takes the tuned choice for one-row fp16 inputs on CUDA, cuBLAS for everything else.
The reference is `torch.nn.functional.linear`.

Folding the add + RMSNorm before the GEMV and SiLU·up after gate|up's folded into it (three launches a layer
fewer; built at fb8a2ac, timed at 3e55312): the folded GEMV was 0.89–0.92× the launches it replaced on 7B shapes,
and Llama-2-7B fp16 no faster through the engine (BENCHMARKS §5), so the folds were removed.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch
import triton
import triton.language as tl

from spear.kernels import options, tune_cache
from spear.kernels.pdl import launch_options, pdl_enter, runs_compiled


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows a program (0: cuBLAS, no Triton launch)
    block_k: int  # columns a step
    num_warps: int
    row_blocks: int = 1  # blocks of block_n rows a program walks in one run (its tiles loaded ahead across them)


CUBLAS = GemvConfig(0, 0, 0)
# Where BLOCK_K = 256 × num_warps, every warp's lanes lie along K and x takes the weight tile's layout as it loads;
# narrower steps move x through shared memory each step (a barrier; offline SASS). The first timing
# (f16_gemv_h200_5788136.json) had such configs best on 12 of 16 shapes; the 2-warp ones came after it.
CANDIDATES = [CUBLAS] + [GemvConfig(*c) for c in (
    (2, 512, 2), (4, 512, 2), (8, 512, 2), (2, 1024, 4), (4, 1024, 4), (8, 1024, 4), (4, 512, 4), (8, 256, 4),
    (16, 256, 4), (4, 1024, 8), (8, 512, 8), (16, 512, 8),
    (2, 1024, 4, 4), (2, 1024, 4, 8), (4, 1024, 4, 4), (2, 512, 2, 8), (4, 512, 2, 4), (16, 256, 4, 4))]
TUNE_BYTES = 256 << 20  # weight bytes per timed graph when tuning: five times the H200's 50 MB L2
_TUNED: dict[tuple, GemvConfig] = {}


@triton.jit
def _f16_gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, K, stride_w,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                     EVEN_K: tl.constexpr, PDL: tl.constexpr):
    # A program owns ROW_BLOCKS blocks of BLOCK_N output rows (f16_gemv checks the division) and walks them as one
    # run of (row block, K step) tiles, each loaded a tile ahead, across row blocks too.
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    first_row = tl.program_id(0) * (BLOCK_N * ROW_BLOCKS)
    w_base = w_ptr + (first_row + rows)[:, None].to(tl.int64) * stride_w + cols[None, :]
    if EVEN_K:
        w = tl.load(w_base, eviction_policy="evict_first")
    else:
        w = tl.load(w_base, mask=cols[None, :] < K, other=0.0, eviction_policy="evict_first")
    # x is the launch before's output. The next launch may start right after the wait, during this one's last wave
    # (its prologue, and a GEMV's first weight tile, under this one's tail): Llama-2-7B fp16 at batch 1 took
    # 4.12-4.17 ms so against 4.30-4.32 with the release after the stores, in both orders (bench/NOTES-kernels.md).
    pdl_enter(PDL)
    for block in range(ROW_BLOCKS):
        ptrs = w_base + block * (BLOCK_N * stride_w)
        # the next row block's first tile (the last block's: the first block's again, not past the program's rows)
        next_block = w_base + ((block + 1) % ROW_BLOCKS) * (BLOCK_N * stride_w)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            more = k + BLOCK_K < K
            after = tl.where(more, ptrs + (k + BLOCK_K), next_block)
            if EVEN_K:
                x = tl.load(x_ptr + k + cols)
                w_next = tl.load(after, eviction_policy="evict_first")
            else:
                x = tl.load(x_ptr + k + cols, mask=k + cols < K, other=0.0)
                width = tl.where(more, K - k - BLOCK_K, K)  # the next tile's columns: this row's rest, or a new row's
                w_next = tl.load(after, mask=cols[None, :] < width, other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]  # y_r = Σ_k W_rk x_k, one float32 term an element
            w = w_next
        y = tl.sum(acc, axis=1)
        out_rows = first_row + block * BLOCK_N + rows
        if HAS_BIAS:
            y += tl.load(b_ptr + out_rows).to(tl.float32)
        tl.store(y_ptr + out_rows, y.to(tl.float16))


def f16_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: GemvConfig,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] fp16 times weight [N, K]ᵀ (+ bias) through the Triton kernel: [1, N] fp16 (into `out` if given)."""
    n, k = weight.shape
    if x.shape != (1, k) or x.dtype != torch.float16 or weight.dtype != torch.float16:
        raise ValueError(f"f16_gemv takes x [1, {k}] and a weight [{n}, {k}] in fp16, got {tuple(x.shape)} "
                         f"{x.dtype} and {weight.dtype}")
    if cfg == CUBLAS or n % (cfg.block_n * cfg.row_blocks) or weight.stride(1) != 1:
        raise ValueError(f"f16_gemv cannot run {cfg} on a [{n}, {k}] weight with strides {weight.stride()}")
    x = x.contiguous()
    y = torch.empty(1, n, dtype=torch.float16, device=x.device) if out is None else out
    _f16_gemv_kernel[(n // (cfg.block_n * cfg.row_blocks),)](
        x, weight, bias if bias is not None else weight, y, k, weight.stride(0),
        **f16_gemv_flags(cfg, k, bias is not None), **launch_options(x))
    return y


def f16_gemv_flags(cfg: GemvConfig, k: int, has_bias: bool) -> dict:
    """_f16_gemv_kernel's compile-time arguments under `cfg` for K = k columns (one stage: the kernel loads a tile
    ahead itself): f16_gemv launches with these, kernels.offline compiles them. PDL is the launch's."""
    return dict(HAS_BIAS=has_bias, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROW_BLOCKS=cfg.row_blocks,
                EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=1)


def _key(weight: torch.Tensor) -> tuple:
    return ("f16_gemv", *weight.shape, weight.device)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except one fp16 row on CUDA of a weight `tune_gemv` found faster through the Triton kernel."""
    cfg = _TUNED.get(_key(weight)) if x.dtype == torch.float16 and x.numel() == x.shape[-1] else None
    if cfg is None or cfg == CUBLAS or not runs_compiled(x):
        return torch.nn.functional.linear(x, weight, bias)
    return f16_gemv(x.reshape(1, -1), weight, bias, cfg).view(*x.shape[:-1], weight.shape[0])


@functools.cache
def _source_hash() -> str:
    return tune_cache.code_hash(Path(__file__))


def tune_gemv(weight: torch.Tensor, bias: torch.Tensor | None = None,
              timings: list[tuple[float, GemvConfig]] | None = None) -> GemvConfig:
    """The fastest of cuBLAS and the kernel's configs for one fp16 row on this weight shape (CUDA, outside graph
    capture; timed in a CUDA graph over copies that overflow L2), kept for `dense_linear` and in the tuning cache
    (kernels.tune_cache: a later process on the same GPU and versions reads it instead). With `timings`, every
    candidate is timed again and its (median µs, config) goes into the list, fastest first. kernels.options's
    f16_gemv: "0" picks cuBLAS untimed (the stacked float layers stay: their A/B against the GEMV), "always" the
    fastest kernel config even where cuBLAS is faster alone (cuBLAS's launches take no part in PDL)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from spear.kernels.timing import time_in_graph

    if timings is None and _key(weight) in _TUNED:
        return _TUNED[_key(weight)]
    mode = options.OPTIONS.f16_gemv
    if mode == "0" and timings is None:
        _TUNED[_key(weight)] = CUBLAS
        return CUBLAS
    n, k = weight.shape
    cache = tune_cache.path()
    cache_key = tune_cache.key(weight.device, ("f16_gemv", n, k),
                               source=f"f16_gemv.py {_source_hash()}")
    if cache is not None and timings is None:
        cached = tune_cache.config(tune_cache.read(cache).get(cache_key), (GemvConfig,), CANDIDATES)
        if cached is not None:
            _TUNED[_key(weight)] = cached
            return cached
    copies = [weight] + [weight.clone() for _ in range(max(1, triton.cdiv(TUNE_BYTES, weight.nbytes)) - 1)]
    x = torch.randn(1, k, dtype=torch.float16, device=weight.device)
    measured = []
    for cfg in CANDIDATES:
        if cfg != CUBLAS and n % (cfg.block_n * cfg.row_blocks):
            continue
        run = (functools.partial(torch.nn.functional.linear, x) if cfg == CUBLAS
               else lambda w, cfg=cfg: f16_gemv(x, w, bias, cfg))
        try:
            measured.append((time_in_graph([functools.partial(run, w) for w in copies], reps=5), cfg))
        except (OutOfResources, CompilationError):
            pass
    ranked = sorted(measured, key=lambda t: t[0])
    if mode == "always" and timings is None:  # cuBLAS only where no kernel config runs the shape
        ranked = [t for t in ranked if t[1] != CUBLAS] or ranked
    if timings is not None:
        timings.extend(ranked)
    _TUNED[_key(weight)] = ranked[0][1]
    if cache is not None:
        tune_cache.write(cache, {cache_key: ranked[0][1]}, {cache_key: [(round(us, 2), c) for us, c in ranked[:3]]})
    return ranked[0][1]

