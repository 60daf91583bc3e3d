"""A served model holds what it serves: no dense copy and no record beside the kernels' packing (issue 50)."""

import dataclasses

import pytest
import torch

from spear import api
from spear.kernels import options
from spear.kernels.cpu_w4 import CPU_W4_MAX_ROWS, has_int4_op
from spear.layer import SpearLinear
from spear.quant.pipeline import QuantSettings
from spear.record import QuantConfig
from spear.runtime.engine import EngineConfig, make_runner
from spear.runtime.kv_cache import Batch, Chunk
from spear.runtime.model import build_runtime_model, held_bytes

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not has_int4_op(), reason="this PyTorch has no CPU int4 matmul")


@pytest.fixture
def cpu_w4(monkeypatch):
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, cpu_w4=True))


@pytest.fixture(scope="module")
def artifact(tiny_model_dir, tmp_path_factory):
    return api.quantize(str(tiny_model_dir), QuantSettings("rtn", QuantConfig(4, -1)), tmp_path_factory.mktemp("a") / "art")


def test_served_model_holds_the_packed_bytes_embeddings_norms_and_kv(artifact, cpu_w4):
    """Every tensor the runtime model and its KV cache hold, counted: the int4 packing and nibble codes of each
    linear, one shared scratch, the float embeddings and norms, the KV cache; no dense copy, no record."""
    hf = api.load(str(artifact), CPU, serving=True).model
    model = build_runtime_model(hf)
    linears = [m for m in model.modules() if isinstance(m, SpearLinear)]
    assert len(linears) == 14 and all(m.cpu_w4 is not None and m.codes is None for m in linears)
    held = held_bytes(model)
    assert held["dense"] == 0 and held["codes"] == 0
    scratch = linears[0].cpu_scratch
    assert all(m.cpu_scratch is scratch for m in linears)
    packed = sum(m.cpu_w4.nbytes() + m.cpu_nibbles.nbytes() for m in linears) + scratch.nbytes()
    assert held["packed"] == packed
    weights = sum(m.out_features * m.in_features for m in linears)
    assert packed - scratch.nbytes() <= 1.3 * weights  # about 0.5 + 0.5 bytes a weight, against 4 dense
    floats = {id(p): p for n, p in hf.named_parameters() if "norm" in n or "embed" in n or "lm_head" in n}
    assert held["other"] == sum(p.numel() * p.element_size() for p in floats.values()) + model.rope.inv_freq.nbytes
    runner = make_runner(model, EngineConfig(max_num_seqs=2, max_model_len=64, num_kv_blocks=9))
    assert runner.cache.k.nbytes + runner.cache.v.nbytes == 2 * 2 * 9 * 16 * 2 * 16 * 4  # K, V: layers, blocks, ...


def test_cpu_int4_path_matches_the_dense_path(artifact, cpu_w4):
    """Decode steps (≤ CPU_W4_MAX_ROWS rows) through the int4 kernel in bfloat16, prefill through the scratch path
    in float32: the logits of the dense float32 path within bfloat16's error, and prefill's to float32's."""
    dense = build_runtime_model(api.load(str(artifact), CPU).model, kernels=False)
    served = build_runtime_model(api.load(str(artifact), CPU, serving=True).model)
    ids = torch.randint(0, 256, (CPU_W4_MAX_ROWS + 8,)).tolist()

    def logits(model, chunks):
        runner = make_runner(model, EngineConfig(max_num_seqs=1, max_model_len=64, num_kv_blocks=8))
        start, outs = 0, []
        for n in chunks:
            outs.append(model(Batch.build([Chunk(ids[start:start + n], start, [1, 2, 3])], 16, CPU), runner.cache)[0])
            start += n
        return torch.stack(outs)

    prefill = [len(ids)]  # one step of more than CPU_W4_MAX_ROWS rows: the scratch path
    assert torch.allclose(logits(served, prefill), logits(dense, prefill), rtol=1e-5, atol=1e-5)
    steps = [4, 1, 1, 1]  # short steps: the int4 kernel
    ref, out = logits(dense, steps), logits(served, steps)
    assert ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 2e-2
