"""bench/memory.py: the random-weight checkpoint it writes, its byte arithmetic, and measured steps on `tiny`."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import pytest
import torch
from safetensors import safe_open

import memory  # bench/, on sys.path through conftest
from conftest import make_byte_tokenizer, make_tiny_llama
from spear.record import QuantConfig, rtn_quantize

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    tok = tmp_path_factory.mktemp("tok")
    make_byte_tokenizer().save_pretrained(tok)
    return memory.build_checkpoint("tiny", tmp_path_factory.mktemp("memory") / "ckpt", tok, shard_mb=4)


def test_served_bytes_of_a_known_shape():
    """Per layer q, o [64, 64], k, v [32, 64], gate, up [128, 64], down [64, 128]: 36,864 weights at 4 bits = 18,432
    bytes, per channel 512 rows of an fp16 scale and a 4-bit zero (1,024 + 256); norms (2 · 2 · 64 + 64) and the
    tied embeddings (256 · 64) in fp16."""
    assert memory.served_bytes(SMALL) == 2 * (18432 + 1024 + 256) + 2 * 320 + 2 * 256 * 64
    assert memory.served_bytes(SMALL, group_size=32) == 2 * (18432 + 2 * 1152 + 1152 // 2) + 2 * 320 + 2 * 256 * 64
    assert memory.served_bytes(SMALL | {"tie_word_embeddings": False}) == memory.served_bytes(SMALL) + 2 * 256 * 64


def test_served_bytes_count_what_the_library_packs():
    """The arithmetic agrees with QuantizedWeight.nbytes_packed of every decoder linear of a model of that shape,
    and the parameter count with the model's."""
    model = make_tiny_llama()
    config = model.config.to_dict()
    packed = other = 0
    for name, p in model.named_parameters():
        if ".layers." in name and p.dim() == 2:
            packed += rtn_quantize(p, QuantConfig(bits=4, group_size=32)).nbytes_packed()
        else:
            other += 2 * p.numel()
    assert memory.served_bytes(config, group_size=32) == packed + other
    assert memory.param_count(config) == sum(p.numel() for p in model.parameters())


def test_checkpoint_is_sharded_and_loads_in_transformers(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    index = json.loads((tiny_checkpoint / "model.safetensors.index.json").read_text())
    files = sorted(tiny_checkpoint.glob("*.safetensors"))
    assert len(files) > 1 and {f.name for f in files} == set(index["weight_map"].values())
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert set(index["weight_map"]) == set(memory.tensor_shapes(config))
    assert index["metadata"]["total_size"] == 2 * memory.param_count(config)
    for f in files:  # each shard within --shard-mb, unless one tensor alone is larger
        with safe_open(str(f), "pt") as st:
            if len(st.keys()) > 1:
                assert f.stat().st_size <= 4e6 + 1e5
            for name in st.keys():
                t = st.get_tensor(name)
                assert t.dtype == torch.float16 and (t != 0).all()
                assert t.dim() == 1 or 0.015 < t.float().std() < 0.025, name

    model, info = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert sum(p.numel() for p in model.parameters()) == memory.param_count(config) == 6_365_504
    assert (tiny_checkpoint / "tokenizer.json").is_file()


def test_a_measured_step_records_rss_and_exit_status(tiny_checkpoint, tmp_path):
    args = argparse.Namespace(device="cpu", timeout=300, settle_s=1, tokens=8, serve_args="", compensate_args="",
                              serve_compensated=False)
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    row = memory.run_step("quantize_rtn", str(tiny_checkpoint), config, tmp_path, args)
    assert row["rc"] == 0, row.get("error")
    assert row["peak_rss_bytes"] >= row["kernel_maxrss_bytes"] > 0 and row["wall_s"] > 0
    assert row["artifact_bytes"] == memory.dir_bytes(tmp_path / "rtn") > 0
    assert memory.run_step("serve", str(tiny_checkpoint), config, tmp_path / "none", args)["skipped"]

    record = {"served_bytes": 1, "layer_fp32_bytes": 0}
    (artifact,) = memory.targets(record, {"quantize_rtn": row | {"rc": 1}}, tmp_path)
    assert artifact["value"] == row["artifact_bytes"] and not artifact["pass"]


def test_a_failed_command_is_recorded_not_raised(tmp_path):
    row = memory.measure(memory.spear("quantize", str(tmp_path / "missing"), "--out", str(tmp_path / "a")),
                         tmp_path / "q", timeout=120)
    assert row["rc"] == 2 and row["error"].startswith("spear: error: model not found")


def test_the_kv_cache_is_read_from_the_servers_line(tmp_path):
    """K and V of 2 layers × 2 KV heads × 16 dims per token, float32: 512 bytes a token, 16 tokens a block."""
    out = tmp_path / "serve.out"
    out.write_text("KV cache: 4096 blocks, 65536 tokens (0.03 GiB, float32): 32 sequences of 2048 tokens\nserving\n")
    assert memory.served_kv(SMALL, out) == {"kv_blocks": 4097, "kv_tokens": 65536, "kv_bytes": 4097 * 16 * 512}
    out.write_text("KV cache: 4096 blocks, 65536 tokens (32.02 MiB, float16): 32 sequences of 2048 tokens\n")
    assert memory.served_kv(SMALL, out)["kv_bytes"] == 4097 * 16 * 256
    out.write_text("serving\n")
    assert memory.served_kv(SMALL, out) == {}


def test_serve_rows_carry_the_servers_startup_stages(tmp_path):
    from spear.server.launch import startup_summary

    out = tmp_path / "serve.out"
    out.write_text("serving\n" + startup_summary(366.5, {"load": 20.0, "kernels": 300.25, "kv_cache_and_graphs": 46.0}))
    assert memory.served_startup(out) == {"startup_s": {"load": 20.0, "kernels": 300.2, "kv_cache_and_graphs": 46.0}}
    out.write_text("serving\n")
    assert memory.served_startup(out) == {}


def test_compensate_rows_carry_the_stages_and_calibration_the_artifact_recorded(tmp_path):
    summary = {"modules": 3, "ec_memory_pct": 0.98, "seconds": {"load": 1.234, "calibrate": 5.0},
               "calibration": {"steps": 100, "precision": "bfloat16", "final_train_kl": 0.1, "history": None}}
    (tmp_path / "config.json").write_text(json.dumps({"compensation": summary}))
    row = memory.compensation_record(tmp_path)
    assert row["stage_s"] == {"load": 1.23, "calibrate": 5.0} and row["ec_modules"] == 3
    assert row["calibration"]["precision"] == "bfloat16" and row["calibration"]["steps"] == 100
    assert memory.gpu_used_bytes() is None or memory.gpu_used_bytes() >= 0  # None without nvidia-smi


def test_a_cut_compensate_keeps_the_stages_its_log_says_it_finished(tmp_path):
    from spear.util import stage_done

    err = tmp_path / "compensate.err"
    with open(err, "w") as f, contextlib.redirect_stderr(f):
        print("calibrating:  12%|#         | 180/1500\r", file=sys.stderr)
        stage_done("load", 17.31)
        stage_done("calibration sequences", 201.0)
        stage_done("hidden", 1.0, show=False)
    rows = memory.stage_lines(err)
    assert [r["stage"] for r in rows] == ["load", "calibration sequences"] and rows[0]["seconds"] == 17.3
    assert all(("gpu_peak_gib" in r) == torch.cuda.is_initialized() for r in rows)


def test_a_random_artifact_with_ecs_loads_and_its_start_is_split_by_stage(tmp_path):
    """fixtures.write_random_artifact with ECs writes an artifact that loads (it once wrote EC entries that
    artifact_config could not read), and serve_startup's timers see the tuner and graph captures they wrap (on CPU:
    none run, so each stage's calls are absent) while the stages add up to the start."""
    import serve_startup  # bench/
    from fixtures import write_random_artifact
    from shapes import MODELS
    from spear import api

    path = write_random_artifact(MODELS["tiny"], tmp_path / "art", ec_fraction=0.5, rank=4)
    lm = api.load(str(path), torch.device("cpu"), serving=True)
    ecs = [m for m in lm.model.modules() if type(m).__name__ == "ErrorCompensator"]
    assert len(ecs) == 7  # half of 2 layers × 7 linears
    row = serve_startup.start_once(path, torch.device("cpu"))
    assert row["timed_calls"] == {}  # no CUDA: no tuning, no graphs, no KV warm-up step
    assert row["total_s"] >= row["load_s"] + row["kernels_s"] + row["kv_cache_and_graphs_s"] - 1e-6
    assert row["kv_blocks"] > 1 and row["max_num_seqs"] == 256


def test_stage_timers_count_calls_and_restore_what_they_wrapped():
    import types

    import serve_startup  # bench/

    owner = types.SimpleNamespace(step=lambda x: x + 1)
    original = owner.step
    timers = serve_startup.StageTimers()
    timers.wrap(owner, "step", "steps")
    assert owner.step(1) == 2 and owner.step(2) == 3
    assert timers.calls == {"steps": 2} and timers.seconds["steps"] >= 0
    timers.undo()
    assert owner.step is original



def test_the_slow_compile_logger_sees_only_slow_calls_inside_the_graph_stages():
    import types

    import serve_startup  # bench/

    def slow_compile(src):
        time.sleep(serve_startup.SLOW_COMPILE_S + 0.05)
        return src

    log: list[dict] = []
    src = types.SimpleNamespace(fn=types.SimpleNamespace(__name__="decode_kernel"), signature={"x": "*fp16"})
    triton_like = types.SimpleNamespace(compile=slow_compile)
    graph = types.SimpleNamespace(capture=lambda: triton_like.compile(src))
    timers = serve_startup.StageTimers()
    timers.wrap(triton_like, "compile", "triton_compile", sync=False, observe=serve_startup.slow_compile_logger(log))
    timers.wrap(graph, "capture", "decode_graphs", sync=False)
    graph.capture()
    triton_like.compile(src)  # as slow, but outside a graph stage
    assert [(e["stage"], e["kernel"], e["signature"]) for e in log] == [("decode_graphs", "decode_kernel",
                                                                         "{'x': '*fp16'}")]
    assert timers.calls["triton_compile in decode_graphs"] == 1 and timers.calls["triton_compile"] == 2
    timers.undo()


def test_the_ahead_check_names_the_parameter_a_graph_launch_differs_by():
    """serve_startup.AheadCheck: a launch of a graph stage whose specialization the dry steps did not record is
    listed with the parameter that differs from the nearest recorded launch of its kernel (an integer that is 1
    there and not here); one they recorded is not."""
    import serve_startup  # bench/

    from spear.kernels import compile_ahead, ops

    kernel = compile_ahead.kernel_of(ops.__name__, "_silu_mul_kernel")
    gate, up, out = (torch.zeros(64) for _ in range(3))

    def launch(stride):
        return compile_ahead.launch_of(kernel, (gate, up, out, 64, stride, 64), {"BLOCK": 64, "PDL": False})

    timers = serve_startup.StageTimers()
    check = serve_startup.AheadCheck(timers)
    timers.undo()
    recorded, same, other = launch(1), launch(1), launch(32)
    check.ahead[recorded.key()] = recorded
    for graph_launch in (same, other):
        check.graphs[graph_launch.key()] = graph_launch
    assert check.not_ahead() == [{"kernel": "_silu_mul_kernel", "recorded_for_kernel": 1,
                                  "differs_by": ["stride_gate: ('int', True, False, True) ahead, "
                                                 "('int', False, True, True) here"]}]
