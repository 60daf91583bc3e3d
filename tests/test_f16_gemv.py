"""The fp16 GEMV (kernels.f16_gemv) against its reference, F.linear (on CPU through TRITON_INTERPRET=1, set in
conftest); the float runtime model's DenseLinear routing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernels import DEVICE, SEED

from spear.kernels import options
from spear.kernels.f16_gemv import CUBLAS, GemvConfig, _TUNED, _key, dense_linear, f16_gemv


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


@pytest.mark.parametrize("n,k,cfg", [
    (64, 256, GemvConfig(8, 128, 4)),     # K a multiple of the step: unmasked, the last step reloads the first tile
    (128, 320, GemvConfig(16, 256, 4)),   # K not a multiple: the last step masked
    (96, 64, GemvConfig(32, 128, 8)),     # one masked step wider than K
    (64, 576, GemvConfig(2, 64, 4)),      # SmolLM2's width
    (64, 256, GemvConfig(4, 128, 4, 4)),  # four row blocks a program, tiles loaded ahead across them
    (128, 320, GemvConfig(8, 128, 4, 2)),  # ... with a masked last step in each
    (96, 64, GemvConfig(16, 128, 4, 2)),  # ... each block one step wider than K: the next block's tile masked to K
])
@pytest.mark.parametrize("bias", [False, True])
def test_f16_gemv_matches_linear(n, k, cfg, bias, gen):
    w = torch.randn(n, k, generator=gen).half().to(DEVICE)
    x = torch.randn(1, k, generator=gen).half().to(DEVICE)
    b = (torch.randn(n, generator=gen) * 0.1).half().to(DEVICE) if bias else None
    out = torch.full((1, n), float("nan"), dtype=torch.float16, device=DEVICE)  # poisoned: every entry must be written
    y = f16_gemv(x, w, b, cfg, out=out)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.data_ptr() == out.data_ptr() and not y.isnan().any()
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-3, f"n={n} k={k} {cfg} bias={bias}: relative error {err:.2e}; seed {SEED}"


def test_f16_gemv_strided_weight_rows(gen):
    """Rows of a wider weight (a fused weight's part is a view with the parent's row stride)."""
    parent = torch.randn(64, 384, generator=gen).half().to(DEVICE)
    w = parent[:, 128:]
    x = torch.randn(1, 256, generator=gen).half().to(DEVICE)
    y = f16_gemv(x, w, None, GemvConfig(8, 128, 4))
    ref = x.float() @ w.float().T
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 2e-3


def test_f16_gemv_rejects_what_it_cannot_run(gen):
    w = torch.randn(64, 128, generator=gen).half()
    with pytest.raises(ValueError, match="x \\[1, 128\\]"):
        f16_gemv(torch.randn(2, 128).half(), w, None, GemvConfig(8, 128, 4))
    with pytest.raises(ValueError, match="x \\[1, 128\\]"):
        f16_gemv(torch.randn(1, 128), w, None, GemvConfig(8, 128, 4))
    with pytest.raises(ValueError, match="cannot run"):
        f16_gemv(torch.randn(1, 128).half(), w, None, GemvConfig(48, 128, 4))  # 64 rows are not blocks of 48
    with pytest.raises(ValueError, match="cannot run"):
        f16_gemv(torch.randn(1, 128).half(), w, None, GemvConfig(16, 128, 4, 3))  # nor runs of 3 blocks of 16
    with pytest.raises(ValueError, match="cannot run"):
        f16_gemv(torch.randn(1, 128).half(), w, None, CUBLAS)


def test_dense_linear_is_linear_off_the_gpu(gen, monkeypatch):
    """A tuned kernel choice applies to compiled launches only: on CPU (even tuned) and for other dtypes and row
    counts, dense_linear is F.linear exactly."""
    w = torch.randn(64, 128, generator=gen).half()
    b = torch.randn(64, generator=gen).half()
    monkeypatch.setitem(_TUNED, _key(w), GemvConfig(8, 128, 4))
    for x in (torch.randn(1, 128).half(), torch.randn(3, 128).half()):
        assert torch.equal(dense_linear(x, w, b), torch.nn.functional.linear(x, w, b))
    x = torch.randn(2, 1, 128, generator=gen)
    assert torch.equal(dense_linear(x, w.float(), b.float()), torch.nn.functional.linear(x, w.float(), b.float()))


def test_gemv_switched_off_keeps_cublas_without_timing(gen, monkeypatch):
    """SPEAR_F16_GEMV=0 (options' f16_gemv "0"): tune_gemv picks cuBLAS at once, timing nothing (so it runs on CPU too)
    and remembers it for dense_linear."""
    from spear.kernels import f16_gemv as mod

    w = torch.randn(64, 128, generator=gen).half()
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, f16_gemv="0"))
    monkeypatch.delitem(_TUNED, _key(w), raising=False)
    assert mod.tune_gemv(w) == CUBLAS
    assert _TUNED.pop(_key(w)) == CUBLAS


def test_gemv_mode_is_checked():
    """A mistyped SPEAR_F16_GEMV stops the import with one clear line, not a silent cuBLAS run."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", "import spear.kernels.f16_gemv"], capture_output=True, text=True,
                         env={**__import__("os").environ, "SPEAR_F16_GEMV": "yes"})
    assert run.returncode != 0 and "SPEAR_F16_GEMV is 0, 1 or always" in run.stderr
