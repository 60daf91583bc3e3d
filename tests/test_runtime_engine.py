"""The engine on CPU: greedy equals transformers' generate, batching changes nothing, stops, aborts, admission."""

from __future__ import annotations

import pytest
import torch

from spear.errors import SpearError
from spear.runtime.detokenizer import Detokenizer
from spear.runtime.engine import (
    MIXED_GRAPH_TOKENS,
    Engine,
    EngineConfig,
    build_engine,
    mixed_buckets,
)
from spear.runtime.requests import SamplingParams
from spear.runtime.scheduler import StaticChunkPolicy

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from spear.api import load

    return load(str(tiny_model_dir), CPU, torch.float32)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    results = {rid: {"ids": [], "text": "", "reason": None} for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            r = results[out.request_id]
            assert r["reason"] is None, "no output after finishing"
            r["ids"] += out.new_token_ids
            r["text"] += out.new_text
            r["reason"] = out.finish_reason
    return results


def hf_greedy(lm, ids: list[int], n: int) -> list[int]:
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_equals_transformers_generate_tiny(tiny):
    engine = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=256, num_kv_blocks=40))
    ids = prompt(21)
    got = run(engine, {"a": (ids, SamplingParams(max_tokens=30, temperature=0))})["a"]
    assert got["ids"] == hf_greedy(tiny, ids, 30)
    assert set(engine.startup_s) == {"kernels", "kv_cache_and_graphs"} and min(engine.startup_s.values()) >= 0


def test_startup_summary_names_each_stage():
    from spear.server.launch import startup_summary

    line = startup_summary(12.25, {"load": 2.0, "kernels": 9.5, "kv_cache_and_graphs": 0.75})
    assert line == "ready in 12.2 s (load 2.0 s, kernels 9.5 s, kv cache and graphs 0.8 s)"


def test_greedy_equals_transformers_generate_smollm2(smollm2):
    engine = build_engine(smollm2.model, smollm2.tokenizer, EngineConfig(max_model_len=128, num_kv_blocks=16))
    ids = smollm2.tokenizer("The capital of France is")["input_ids"]
    got = run(engine, {"a": (ids, SamplingParams(max_tokens=12, temperature=0))})["a"]
    assert got["ids"] == hf_greedy(smollm2, ids, 12)
    assert got["text"] == smollm2.tokenizer.decode(got["ids"], skip_special_tokens=True)
    assert "Paris" in got["text"]


def test_batching_and_chunked_prefill_change_nothing(tiny):
    requests = {"short": (prompt(5, 1), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
                "long": (prompt(45, 2), SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))}
    alone = {rid: run(build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=128)), {rid: r})[rid]
             for rid, r in requests.items()}
    # a 16-token prefill budget: the long prompt prefills in chunks while the short one decodes
    engine = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=128, policy=StaticChunkPolicy(16)))
    together = run(engine, requests)
    assert together == alone
    assert [len(together[r]["ids"]) for r in ("short", "long")] == [20, 9]
    assert together["short"]["reason"] == "length"


def test_abort_frees_blocks(tiny):
    engine = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=128, num_kv_blocks=20))
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request("a", prompt(20), params)
    engine.add_request("b", prompt(20, 1), params)
    engine.step()
    assert engine.num_running == 2 and engine.kv_blocks_used == 2 * 2  # prompt + 1 token: 2 blocks each
    engine.abort("a")
    engine.abort("unknown")
    assert engine.num_running == 1 and engine.kv_blocks_used == 2
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finished and outs["a"].finish_reason == "abort" and not outs["b"].finished
    engine.abort("b")
    engine.step()
    assert not engine.has_unfinished() and engine.kv_blocks_used == 0


def test_stop_strings_and_stop_tokens(tiny):
    def engine():
        return build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=128))

    ids = prompt(10, 3)
    full = run(engine(), {"a": (ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))})["a"]
    text = full["text"]
    stop = text[12:15]
    cut = text.find(stop)
    got = run(engine(), {"a": (ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=("zzzz", stop)))})
    assert got["a"]["text"] == text[:cut] and got["a"]["reason"] == "stop"
    token = full["ids"][5]
    got = run(engine(), {"a": (ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=(token,)))})
    first = full["ids"].index(token)
    assert got["a"]["ids"] == full["ids"][:first + 1] and got["a"]["reason"] == "stop"


def test_detokenizer_holds_back_a_possible_stop_string(tiny):
    tok = tiny.tokenizer
    d = Detokenizer(tok, tok("hi")["input_ids"], stop=("STOP",))
    pieces = []
    for ch in "abcST":
        assert not d.add(tok(ch)["input_ids"][0])
        pieces.append(d.take(final=False))
    assert "".join(pieces) == "abc"  # "ST" could start "STOP"
    assert not d.add(tok("X")["input_ids"][0])
    assert d.take(final=False) == "STX"
    for ch in "STO":
        d.add(tok(ch)["input_ids"][0])
    assert d.add(tok("P")["input_ids"][0]) and d.take(final=True) == ""


def test_seeded_sampling_is_reproducible(tiny):
    def sampled(seed, other=False):
        engine = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=128))
        params = SamplingParams(max_tokens=25, temperature=1.0, top_p=0.9, top_k=50, seed=seed, ignore_eos=True)
        requests = {"a": (prompt(8), params)}
        if other:
            requests["b"] = (prompt(30, 5), SamplingParams(max_tokens=10, temperature=0.7))
        return run(engine, requests)["a"]["ids"]

    assert sampled(7) == sampled(7) == sampled(7, other=True)
    assert sampled(7) != sampled(8)
    # a CPU generator keeps 32 bits of its seed: the 64-bit seed is mixed first (audit: 7 and 7 + 2^32 sampled alike)
    assert sampled(7) != sampled(7 + 2**32) and sampled(-1) != sampled(2**32 - 1)


def test_bad_requests_raise(tiny):
    engine = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=64, num_kv_blocks=5))
    with pytest.raises(SpearError, match="context"):
        engine.add_request("a", prompt(64), SamplingParams())
    with pytest.raises(SpearError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    engine.add_request("a", prompt(10), SamplingParams())
    with pytest.raises(SpearError, match="in use"):
        engine.add_request("a", prompt(10), SamplingParams())
    with pytest.raises(SpearError, match="exceeds"):
        build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=100_000))


def test_many_requests_with_a_small_pool_all_finish(tiny):
    engine = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=128, max_num_seqs=8, num_kv_blocks=9))
    requests = {f"r{i}": (prompt(10 + i, i), SamplingParams(max_tokens=6 + i, temperature=0, ignore_eos=True))
                for i in range(16)}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    seen_waiting = False
    results = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id] += out.new_token_ids
        seen_waiting |= engine.num_waiting > 0 and engine.num_running > 0
        assert engine.kv_blocks_used <= engine.kv_blocks_total == 8
    assert seen_waiting and engine.kv_blocks_used == 0
    assert all(len(results[f"r{i}"]) == 6 + i for i in range(16))
    alone = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=128))
    assert run(alone, {"r15": requests["r15"]})["r15"]["ids"] == results["r15"]



@torch.no_grad()
def test_graph_padded_decode_batch_matches_eager(tiny):
    """The CUDA-graph path's inputs (bucket padding, full-width tables), run eagerly: same logits, live blocks untouched."""
    from spear.runtime.engine import make_runner
    from spear.runtime.kv_cache import Chunk
    from spear.runtime.model import build_runtime_model

    model = build_runtime_model(tiny.model)
    runner = make_runner(model, EngineConfig(max_model_len=64, max_num_seqs=4, num_kv_blocks=12))
    assert runner.graphs == {} and runner.mixed == {} and runner.table_width == 4  # CPU: eager
    tables = [[3, 7], [5], [9, 2, 4]]
    prompts = [prompt(20, 1), prompt(9, 2), prompt(33, 3)]
    runner.forward([Chunk(p, 0, t) for p, t in zip(prompts, tables)])
    decodes = [Chunk([p[-1]], len(p), t) for p, t in zip(prompts, tables)]
    k, v = runner.cache.k.clone(), runner.cache.v.clone()
    eager = runner.forward(decodes)
    k_eager, v_eager = runner.cache.k.clone(), runner.cache.v.clone()
    runner.cache.k.copy_(k)
    runner.cache.v.copy_(v)
    padded = model(runner.padded_batch(decodes, 4), runner.cache)  # [4, vocab]
    torch.testing.assert_close(padded[:3], eager)
    torch.testing.assert_close(runner.cache.k[:, 1:], k_eager[:, 1:])  # the dummies wrote to the null block only
    torch.testing.assert_close(runner.cache.v[:, 1:], v_eager[:, 1:])


def test_mixed_step_as_token_rows_matches_the_chunked_step(tiny):
    """runner.token_rows: a mixed step (decodes beside prefill chunks, one starting mid-prompt) as one-token
    rows in a graph's padded static shapes, run eagerly (on CUDA: a replayed decode-step graph), gives the
    chunked step's logits and the same K/V in every live block."""
    from spear.runtime.engine import make_runner
    from spear.runtime.kv_cache import Chunk
    from spear.runtime.model import build_runtime_model
    from spear.runtime.runner import token_rows

    model = build_runtime_model(tiny.model)
    runner = make_runner(model, EngineConfig(max_model_len=64, max_num_seqs=4, num_kv_blocks=12))
    tables = [[3, 7], [5], [9, 2, 4]]
    prompts = [prompt(20, 1), prompt(9, 2), prompt(33, 3)]
    runner.forward([Chunk(prompts[0], 0, tables[0]), Chunk(prompts[1], 0, tables[1]), Chunk(prompts[2][:17], 0, tables[2])])
    step = [Chunk([prompts[0][-1]], 20, tables[0]), Chunk(prompts[2][17:], 17, tables[2]), Chunk([prompts[1][-1]], 9, tables[1])]
    k, v = runner.cache.k.clone(), runner.cache.v.clone()
    chunked = runner.forward(step)  # eager on CPU
    k_chunked, v_chunked = runner.cache.k.clone(), runner.cache.v.clone()
    runner.cache.k.copy_(k)
    runner.cache.v.copy_(v)
    rows, last = token_rows(step)
    assert len(rows) == 18 and last == [0, 16, 17]
    padded = model(runner.padded_batch(rows, 32), runner.cache)  # [32, vocab]
    torch.testing.assert_close(padded[last], chunked, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runner.cache.k[:, 1:], k_chunked[:, 1:])  # padding rows wrote to the null block only
    torch.testing.assert_close(runner.cache.v[:, 1:], v_chunked[:, 1:])


def test_mixed_step_pieces_match_the_eager_model(tiny):
    """Mixed steps through runner.MixedStepGraphs (run eagerly here: on CUDA each piece is a CUDA graph) give the
    eager model's tokens, with the token count padded to the bucket and padding written to the null block."""
    requests = {"short": (prompt(5, 1), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
                "long": (prompt(45, 2), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))}
    config = EngineConfig(max_model_len=128, max_num_seqs=4, policy=StaticChunkPolicy(16))
    eager = run(build_engine(tiny.model, tiny.tokenizer, config), requests)
    engine = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=128, max_num_seqs=4,
                                                                   policy=StaticChunkPolicy(16), mixed_graph_tokens=(8, 32)))
    assert sorted(engine.runner.mixed) == [8, 32]
    calls = []
    for pieces in engine.runner.mixed.values():
        original = pieces.run
        pieces.run = lambda batch, n, original=original: calls.append(batch.tokens.shape[0]) or original(batch, n)
    assert run(engine, requests) == eager
    assert calls and max(calls) <= 32  # the prefill chunks (16 tokens + decodes) went through the pieces


def test_mixed_graph_buckets_stop_at_the_first_that_holds_a_step():
    assert MIXED_GRAPH_TOKENS == (16, 32, 64, 128, 256, 512, 1024)
    assert mixed_buckets(32 * 4096) == MIXED_GRAPH_TOKENS
    assert mixed_buckets(544) == MIXED_GRAPH_TOKENS  # 32 decodes beside a 512-token chunk
    assert mixed_buckets(200) == (16, 32, 64, 128, 256) and mixed_buckets(16) == (16,) and mixed_buckets(5) == (16,)
    assert mixed_buckets(544, above=128) == (256, 512, 1024)  # smaller steps replay a whole-step graph
    assert mixed_buckets(100, above=128) == ()


@pytest.mark.parametrize("row_graph_tokens", [4, 0])
def test_runner_picks_a_whole_step_graph_the_pieces_or_eager(tiny, row_graph_tokens):
    """ModelRunner.forward with CPU stand-ins for its CUDA graphs (the padded batch run eagerly): decode steps, and
    mixed steps of up to row_graph_tokens tokens as token rows, replay a whole-step graph; larger mixed steps take
    the pieces where a bucket holds them, else run eagerly. The tokens are the eager engine's."""
    from dataclasses import replace

    from spear.runtime.runner import graph_buckets

    requests = {"short": (prompt(5, 1), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
                "long": (prompt(45, 2), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))}
    config = EngineConfig(max_model_len=128, max_num_seqs=4, policy=StaticChunkPolicy(16))
    eager = run(build_engine(tiny.model, tiny.tokenizer, config), requests)
    engine = build_engine(tiny.model, tiny.tokenizer,
                          replace(config, mixed_graph_tokens=(16,), row_graph_tokens=row_graph_tokens))
    runner, steps = engine.runner, []  # (chunks, tokens, path) per step

    def took(path):
        steps[-1] = (*steps[-1][:2], path)

    class EagerGraph:
        def __init__(self, size):
            self.size = size

        def run(self, batch):
            assert batch.decode and batch.tokens.shape[0] == self.size  # one-token rows, padded to the bucket
            took("graph")
            return runner.model(batch, runner.cache)

    runner.graphs = {s: EagerGraph(s) for s in graph_buckets(max(4, row_graph_tokens))}
    pieces = runner.mixed[16]
    pieces_run = pieces.run
    pieces.run = lambda batch, n: took("pieces") or pieces_run(batch, n)
    runner.on_step = lambda chunks: steps.append((len(chunks), sum(len(c.tokens) for c in chunks), "eager"))
    assert run(engine, requests) == eager
    for chunks, tokens, path in steps:
        whole = chunks == tokens or tokens <= row_graph_tokens
        assert path == ("graph" if whole else "pieces" if tokens <= 16 else "eager"), (chunks, tokens, path)
    mixed_rows = (2, 3, "graph") if row_graph_tokens else (2, 3, "pieces")  # a decode beside the prompt's last 2
    assert {(2, 16, "pieces"), (2, 17, "eager"), mixed_rows, (2, 2, "graph")} <= set(steps)


def test_overlapped_steps_give_the_same_outputs(tiny):
    """EngineConfig.overlap (a step launched before the previous one's tokens are read) changes no output:
    chunked prefill beside decodes, admission as slots free up, stop strings, stop tokens, length limits
    (max_tokens and the context), an abort mid-way; every block is back in the pool at the end."""
    ids = prompt(10, 3)
    full = run(build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=128)),
               {"a": (ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))})["a"]
    requests = {
        "stop_string": (ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(full["text"][12:15],))),
        "stop_token": (ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                           stop_token_ids=(full["ids"][5],))),
        "long_prompt": (prompt(45, 2), SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)),
        "context": (prompt(60, 4), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)),  # 64-token context
        "one_token": (prompt(7, 5), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)),
        # sampled (greedy on the tiny random model repeats one token, which would hide a token fed late)
        "sampled": (prompt(9, 6), SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)),
        "sampled_top_k": (prompt(30, 7), SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=12,
                                                        ignore_eos=True)),
        **{f"r{i}": (prompt(5 + i, 10 + i), SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True))
           for i in range(6)},
    }

    def serve(overlap: bool) -> tuple[dict, Engine]:
        engine = build_engine(tiny.model, tiny.tokenizer, EngineConfig(
            max_model_len=64, max_num_seqs=4, policy=StaticChunkPolicy(16), overlap=overlap))
        for rid, (p, params) in requests.items():
            engine.add_request(rid, p, params)
        results = {rid: {"ids": [], "text": "", "reason": None} for rid in requests}
        steps = engine.decode_rows = 0
        engine.admitted_at = {}  # request → the step that admitted it
        while engine.has_unfinished():
            steps += 1
            if steps == 6:
                engine.abort("r5")
            before, waiting = engine.num_steps, {s.request_id for s in engine.waiting}
            outputs = engine.step()
            engine.decode_rows += engine.last_step.num_decodes if engine.num_steps > before else 0
            engine.admitted_at |= {rid: steps for rid in waiting - {s.request_id for s in engine.waiting}}
            for out in outputs:
                r = results[out.request_id]
                assert r["reason"] is None, "no output after finishing"
                r["ids"] += out.new_token_ids
                r["text"] += out.new_text
                r["reason"] = out.finish_reason
        return results, engine

    plain, plain_engine = serve(False)
    overlapped, engine = serve(True)
    assert overlapped == plain
    # the only rows thrown away: one decode of each request that stopped on a token or string, or was aborted,
    # while its last token was in flight (a length limit is known ahead: no row past it, and its slot and blocks
    # go to the next request as early as without overlap)
    assert plain_engine.decode_rows <= engine.decode_rows <= plain_engine.decode_rows + 3
    assert engine.admitted_at == plain_engine.admitted_at
    assert plain["stop_string"]["reason"] == plain["stop_token"]["reason"] == "stop"
    assert plain["context"]["reason"] == "length" and len(plain["context"]["ids"]) == 4
    assert plain["r5"]["reason"] == "abort" and plain["r0"]["ids"] and len(plain["r4"]["ids"]) == 11
    assert len(set(plain["sampled"]["ids"])) > 5  # tokens that differ from step to step
    assert engine.kv_blocks_used == 0 and engine.num_running == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs, pinned copies and events need a GPU")
def test_overlapped_steps_on_the_gpu_give_the_same_outputs(tiny_model_dir):
    """On CUDA (whole-step graphs, the samples patched in on the device, copied to the host by an event), overlapped
    steps give exactly the plain steps' outputs, greedy and seeded."""
    from spear.api import load

    lm = load(str(tiny_model_dir), torch.device("cuda"), torch.float16)
    requests = {f"g{i}": (prompt(6 + 3 * i, i), SamplingParams(max_tokens=5 + 4 * i, temperature=0, ignore_eos=True))
                for i in range(4)}
    requests |= {f"s{i}": (prompt(9 + i, 20 + i), SamplingParams(max_tokens=20, temperature=1.0, seed=i, ignore_eos=True))
                 for i in range(3)}

    def serve(overlap: bool) -> dict:
        config = EngineConfig(max_model_len=128, max_num_seqs=4, policy=StaticChunkPolicy(16), overlap=overlap,
                              tune_kernels=False)  # outputs, not speed: no minutes of tuning compiles
        return run(build_engine(lm.model, lm.tokenizer, config), requests)

    plain = serve(False)
    assert serve(True) == plain
    assert len(set(plain["s0"]["ids"])) > 5


def test_overlapped_steps_feed_the_policy_each_steps_own_composition(tiny):
    """With overlap the call that launches a step times the step before, so a feedback policy (SLOPolicy.observe)
    gets each step when its tokens are read: its own decodes and prefill tokens, in launch order, every step once."""

    class Recording(StaticChunkPolicy):
        def __init__(self):
            super().__init__(16)
            self.seen = []

        def observe(self, stats):
            assert stats.seconds > 0
            self.seen.append((stats.num_decodes, stats.num_prefill_tokens))

    launched = {}
    for overlap in (False, True):
        policy = Recording()
        engine = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=64, max_num_seqs=4, policy=policy,
                                                                       overlap=overlap))
        for i in range(5):
            engine.add_request(f"r{i}", prompt(20 + 7 * i, i), SamplingParams(max_tokens=4 + i, temperature=0,
                                                                              ignore_eos=True))
        steps = []
        while engine.has_unfinished():
            before = engine.num_steps
            engine.step()
            if engine.num_steps > before:
                steps.append((engine.last_step.num_decodes, engine.last_step.num_prefill_tokens))
        launched[overlap] = steps
        assert policy.seen == steps, f"overlap={overlap}: observed {policy.seen}, launched {steps}"
    assert any(p for _, p in launched[True]) and any(d for d, _ in launched[True])  # mixed steps were fed back


def reference_tokens(lm, ids: list[int], params: SamplingParams) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy through transformers, one full forward a token, with adjust_logits applied: tokens and log-softmaxes."""
    from spear.runtime.sampler import adjust_logits

    ids, out, logprobs = list(ids), [], []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = lm.model(torch.tensor([ids])).logits[0, -1].float()
        logprobs.append(logits.log_softmax(-1))
        adjust_logits(logits, params, torch.tensor(out, dtype=torch.long))
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out, logprobs


@pytest.mark.parametrize("overlap", [False, True])  # overlapped: the token still in flight counts too
def test_penalties_and_logit_bias_match_a_reference_loop(tiny, overlap):
    ids = prompt(9, seed=3)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    penalized = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, presence_penalty=1.5,
                               frequency_penalty=0.7, logit_bias=((ids[-1], 4.0), (7, -100.0)))
    engine = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=64, overlap=overlap))
    got = run(engine, {"plain": (ids, plain), "penalized": (ids, penalized)})
    expected, _ = reference_tokens(tiny, ids, penalized)
    assert got["penalized"]["ids"] == expected
    assert got["plain"]["ids"] == reference_tokens(tiny, ids, plain)[0] != expected
    assert 7 not in expected and engine.kv_blocks_used == 0


def test_logprobs_are_the_models(tiny):
    ids = prompt(11, seed=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    engine = build_engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=64, overlap=True))
    engine.add_request("a", ids, params)
    engine.add_request("b", prompt(5), SamplingParams(max_tokens=6, temperature=0))  # asks for none
    got = {"a": [], "b": []}
    while engine.has_unfinished():
        for out in engine.step():
            assert (out.logprobs is None) == (out.request_id == "b" or not out.new_token_ids)
            got[out.request_id] += list(zip(out.new_token_ids, out.logprobs or [None] * len(out.new_token_ids)))
    tokens, reference = reference_tokens(tiny, ids, params)
    assert [t for t, _ in got["a"]] == tokens
    for (token, lp), ref in zip(got["a"], reference):
        assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-4)
        top = ref.topk(3)
        assert [i for i, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
