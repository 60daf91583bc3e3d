"""The serving engine: continuous batching over the paged KV cache.

Each `step()` runs one forward that mixes a decode for every running sequence whose
prompt is in the cache (decodes never wait) with chunks of prompts still to prefill, up
to the token budget the scheduler policy grants.

The KV cache is sized by memory, as vLLM's (`kv_cache_blocks`): a byte budget, or on a GPU
a fraction of its memory less what the weights and a warm-up step hold; it must hold one
sequence of the full context. Waiting requests are admitted in arrival order while a slot
is free and the cache has blocks for their prompt and first generated token; a decode takes
a block when it crosses into a new one. When none is free, the most recently admitted
running sequence is preempted (vLLM's recompute preemption): its blocks go back to the pool
and it returns to the front of the queue, its prompt and the tokens it has generated to be
prefilled again; what it already returned is not returned again. Blocks return to the pool
on finish, abort or preemption.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from spear.errors import SpearError
from spear.runtime.detokenizer import Detokenizer
from spear.runtime.kv_cache import Batch, BlockAllocator, Chunk, KVCache, cdiv
from spear.runtime.model import Transformer, build_runtime_model
from spear.runtime.requests import RequestOutput, SamplingParams, TokenLogprobs
from spear.runtime.runner import ModelRunner, TokenPatch, compile_graphs
from spear.runtime.sampler import sample_tokens
from spear.runtime.scheduler import SchedulerPolicy, StaticChunkPolicy

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096
# The KV cache's bytes on a CPU (kv_cache_blocks): 11.6k tokens of SmolLM2-135M in float32 (45 KiB a token: 2.8
# sequences of its 4096-token default context, or 128 of 90), 4k of a 7B GQA model in bfloat16 (128 KiB a token). The
# cache is zero-filled, so this is resident memory from the start (the 32 × 4096-token worst case before it: 6 GB for
# SmolLM2); 512 MiB keeps `spear serve` of SmolLM2's W4 artifact within 1.5 GB idle (BENCHMARKS §8).
CPU_KV_CACHE_MEMORY = 512 << 20
# Powers of two: the W4 kernels' row tile is the power of two ≥ the rows (kernels.w4._row_tile), so a bucket
# between two powers would cost as much as the larger one.
MIXED_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512, 1024)


def mixed_seed(seed: int) -> int:
    """A request's 64-bit seed mixed (splitmix64) before it seeds a generator: a CPU generator keeps only the low
    32 bits of its seed, so seeds equal modulo 2^32 would otherwise sample alike."""
    z = (seed + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


@dataclass
class EngineConfig:
    max_num_seqs: int = 256  # running sequences at most (as many as the KV cache holds, up to this)
    max_model_len: int | None = None  # tokens per sequence; None: the model's context, at most 4096
    block_size: int = 16
    # The KV cache's size (kv_cache_blocks): num_kv_blocks blocks if given; else kv_cache_memory bytes if given; else
    # on CUDA gpu_memory_utilization × the device's memory less what is in use after the weights and a warm-up step
    # (vLLM's --gpu-memory-utilization), on a CPU CPU_KV_CACHE_MEMORY.
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    # The KV cache's dtype (kv_cache_dtype): None, the model's; on a CPU bfloat16 or float16 too (half the bytes a
    # token: twice the tokens in the same memory; attention reads the cache back in the model's dtype). CUDA's
    # attention kernels read the cache in the model's dtype only.
    kv_cache_dtype: torch.dtype | None = None
    gpu_memory_utilization: float = 0.9
    policy: SchedulerPolicy = field(default_factory=StaticChunkPolicy)
    cuda_graphs: bool = True  # capture decode steps in CUDA graphs (CUDA only)
    # Token-count buckets for mixed steps (prefill chunks beside decodes) replayed as CUDA-graph pieces
    # between attentions (runner.MixedStepGraphs); empty: mixed steps run eagerly. None: MIXED_GRAPH_TOKENS
    # on CUDA with cuda_graphs (cut by mixed_buckets), else empty. On the H200 a step of 8 decodes and a
    # 64-token chunk took 16.3 ms wall for 16.3 ms of kernels this way (43 ms eager: host-bound).
    mixed_graph_tokens: tuple[int, ...] | None = None
    # Steps of up to this many tokens (decodes and prefill-chunk tokens together) replay one CUDA graph of the
    # whole step, every token a query row of the decode-attention kernel (runner.token_rows); mixed-graph
    # pieces take only larger steps. 0: whole-step graphs for pure decode steps only. The whole-step graphs'
    # buckets run up to the first power of two ≥ max(max_num_seqs, row_graph_tokens).
    row_graph_tokens: int = 128
    seed: int = 0  # the generator of requests without their own seed
    # Overlap the host's work with the GPU's (one step behind, as SGLang's overlap scheduler): a step is launched
    # with the previous step's samples still on the device (runner.TokenPatch), and that step's tokens are then
    # read, appended and returned while the new one runs. A sequence that stops on a token or a stop string
    # thereby computes one more step, thrown away. Not with tensor parallelism.
    overlap: bool = False
    # Time the W4 and fp16 GEMV kernels' configs per weight shape and row bucket at start-up (model.use_kernels;
    # minutes of compiles on a machine without the Triton cache). Off: each kernel's untuned default config, the same
    # outputs (tests that check outputs, not speed).
    tune_kernels: bool = True


@dataclass
class InFlight:
    """A launched step's samples: row i is seqs[i]'s token; with overlap, copied to the host when `ready` is done."""

    number: int  # Engine.num_launched when it was launched
    seqs: list[Sequence]
    tokens: torch.Tensor  # [B] on the device
    host: torch.Tensor  # [B] its copy on the host (pinned on CUDA)
    ready: torch.cuda.Event | None
    launched_at: float = 0.0  # time.perf_counter() at its launch
    stats: StepStats | None = None  # its decodes and prefill tokens (Engine.step sets them after the launch)
    logprobs: StepLogprobs | None = None  # of the rows whose requests asked for them


@dataclass
class StepLogprobs:
    """Log-probabilities of a launched step's samples (on the device until its tokens are read)."""

    rows: list[int]  # rows of the step's samples
    sampled: torch.Tensor  # [len(rows)] each row's sampled token's
    top: torch.Tensor  # [len(rows), k] the k most likely tokens' (k: the most any of these rows asked for)
    top_ids: torch.Tensor  # [len(rows), k]

    def read(self, seqs: list[Sequence]) -> dict[int, TokenLogprobs]:
        """Row → its TokenLogprobs, with as many top tokens as its request asked for."""
        sampled, top, top_ids = self.sampled.tolist(), self.top.tolist(), self.top_ids.tolist()
        out = {}
        for j, row in enumerate(self.rows):
            k = seqs[row].params.logprobs
            out[row] = TokenLogprobs(sampled[j], tuple(zip(top_ids[j][:k], top[j][:k])))
        return out


@dataclass
class StepStats:
    seconds: float = 0.0
    num_decodes: int = 0
    num_prefill_tokens: int = 0


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detokenizer: Detokenizer
    max_len: int  # prompt + max_tokens, capped at the context
    prefill_ids: list[int]  # tokens to prefill: the prompt (after a preemption, the prompt and output so far)
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    pending_row: int | None = None  # overlapped steps: its last token is this row of the step in flight's samples
    pending_step: int = -1  # that step's number (Engine.num_launched)
    released: bool = False  # out of the running set, its blocks freed (Engine._release, Engine._preempt)
    finished: bool = False

    @property
    def prefilled(self) -> bool:
        return self.num_computed >= len(self.prefill_ids)

    def blocks_short(self, block_size: int) -> int:
        """Blocks its table lacks for the token at position num_computed (its next decode's)."""
        return max(0, cdiv(self.num_computed + 1, block_size) - len(self.block_table))

    def at_length(self, extra: int = 0) -> bool:
        """Its output has max_tokens tokens, or it fills its context, with `extra` tokens more (a sample in flight)."""
        done = len(self.output_ids) + extra
        return done >= self.params.max_tokens or len(self.prompt_ids) + done >= self.max_len

    def next_chunk(self, budget: int) -> Chunk:
        """The decode token, or up to `budget` prompt tokens still to prefill. A token still on the device is a
        placeholder here, patched on the device (runner.TokenPatch)."""
        if self.prefilled:
            return Chunk([0 if self.pending_row is not None else self.output_ids[-1]], self.num_computed,
                         self.block_table)
        tokens = self.prefill_ids[self.num_computed:self.num_computed + budget]
        return Chunk(tokens, self.num_computed, self.block_table)


def context_len(model: Transformer, config: EngineConfig) -> int:
    """Tokens per sequence: config.max_model_len, or the model's context up to DEFAULT_MAX_MODEL_LEN."""
    if config.max_model_len is not None and config.max_model_len > model.args.max_seq_len:
        raise SpearError(f"max_model_len {config.max_model_len} exceeds the model's context of {model.args.max_seq_len}")
    return min(config.max_model_len or DEFAULT_MAX_MODEL_LEN, model.args.max_seq_len)


KV_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kv_cache_dtype(model: Transformer, config: EngineConfig) -> torch.dtype:
    """The KV cache's dtype: config.kv_cache_dtype, or the model's; SpearError where the attention cannot read it."""
    dtype = config.kv_cache_dtype or model.dtype
    if dtype not in KV_CACHE_DTYPES:
        raise SpearError(f"the KV cache holds float32, bfloat16 or float16, not {dtype}")
    if dtype != model.dtype and model.device.type == "cuda":
        raise SpearError(f"on CUDA the attention kernels read the KV cache in the model's dtype "
                         f"({str(model.dtype).removeprefix('torch.')}): drop --kv-cache-dtype or pass auto")
    return dtype


def kv_block_bytes(model: Transformer, block_size: int, dtype: torch.dtype | None = None) -> int:
    """Bytes of one KV-cache block: K and V of `block_size` tokens in every layer, in `dtype` (None: the model's)."""
    args = model.args
    return 2 * args.n_layers * block_size * args.n_kv_heads * args.head_dim * (dtype or model.dtype).itemsize


def kv_cache_blocks(model: Transformer, config: EngineConfig) -> int:
    """The KV cache's blocks, the null block included, as EngineConfig says; no more than max_num_seqs sequences of the
    full context use (more would never be used). make_runner checks that they hold one such sequence."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    max_len = context_len(model, config)
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif model.device.type == "cuda":
        budget = _cuda_kv_budget(model, config, max_len)
    else:
        budget = CPU_KV_CACHE_MEMORY
    most = config.max_num_seqs * cdiv(max_len, config.block_size) + 1
    return min(most, max(budget, 0) // kv_block_bytes(model, config.block_size, kv_cache_dtype(model, config)))


def _cuda_kv_budget(model: Transformer, config: EngineConfig, max_len: int) -> int:
    """gpu_memory_utilization × the device's memory less what is in use (weights, the CUDA context, other processes)
    once a step of the most tokens the engine runs (every sequence decoding beside the policy's largest prefill
    chunk) has run over a cache of the null block alone: its activations stay reserved for the steps to come."""
    tokens = config.max_num_seqs + config.policy.prefill_budget(0, 0, max_len)
    chunks = [Chunk([0] * min(max_len, tokens - i), 0, []) for i in range(0, tokens, max_len)]  # the null block's
    args = model.args
    cache = KVCache(args.n_layers, 1, config.block_size, args.n_kv_heads, args.head_dim, model.dtype, model.device)
    with torch.inference_mode():
        model(Batch.build(chunks, config.block_size, model.device), cache)
    torch.cuda.synchronize(model.device)
    free, total = torch.cuda.mem_get_info(model.device)
    return int(total * config.gpu_memory_utilization) - (total - free)


def make_runner(model: Transformer, config: EngineConfig) -> ModelRunner:
    """The KV cache and model runner that `config` asks for; SpearError if the cache cannot hold one sequence of the
    full context."""
    max_len, dtype = context_len(model, config), kv_cache_dtype(model, config)
    graphs = config.cuda_graphs and model.device.type == "cuda"
    if graphs:  # before the KV cache takes the free memory that its compiling workers need (runner.compile_graphs)
        compile_graphs(model, config.block_size, dtype, max_len, config.max_num_seqs,
                       _mixed_graph_tokens(config, config.max_num_seqs * max_len), config.row_graph_tokens)
    blocks, per_seq = kv_cache_blocks(model, config), cdiv(max_len, config.block_size)
    if blocks - 1 < per_seq:
        block_bytes = kv_block_bytes(model, config.block_size, dtype)
        holds = max(blocks - 1, 0) * config.block_size
        raise SpearError(f"the KV cache budget of {_size(blocks * block_bytes)} holds {holds} tokens; one sequence of "
                         f"{max_len} tokens needs {_size((per_seq + 1) * block_bytes)}: raise --kv-cache-memory (or "
                         f"--gpu-memory-utilization) or lower --max-model-len")
    args = model.args
    cache = KVCache(args.n_layers, blocks, config.block_size, args.n_kv_heads, args.head_dim, dtype, model.device)
    mixed = _mixed_graph_tokens(config, min(config.max_num_seqs * max_len, (blocks - 1) * config.block_size)) \
        if graphs else config.mixed_graph_tokens or ()
    return ModelRunner(model, cache, max_len, config.max_num_seqs, config.cuda_graphs, mixed, config.row_graph_tokens)


def _mixed_graph_tokens(config: EngineConfig, most: int) -> tuple[int, ...]:
    """The mixed steps' graph buckets: config's, or those up to a step of `most` tokens (mixed_buckets)."""
    if config.mixed_graph_tokens is not None:
        return config.mixed_graph_tokens
    return mixed_buckets(most, above=config.row_graph_tokens)


def kv_cache_summary(runner: ModelRunner) -> str:
    """One line: the KV cache's blocks, tokens, memory and dtype, and how many sequences of the full context it holds."""
    cache = runner.cache
    tokens = (cache.num_blocks - 1) * cache.block_size
    return (f"KV cache: {cache.num_blocks - 1} blocks, {tokens} tokens ({_size(cache.nbytes)}, "
            f"{str(cache.k.dtype).removeprefix('torch.')}): {tokens // runner.max_model_len} sequences of "
            f"{runner.max_model_len} tokens")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def mixed_buckets(max_step_tokens: int, above: int = 0) -> tuple[int, ...]:
    """MIXED_GRAPH_TOKENS up to the first that holds `max_step_tokens` (a step carries at most every running
    sequence's whole context, and no more than the KV cache holds), without those of `above` tokens or fewer
    (steps that small replay a whole-step graph)."""
    buckets = MIXED_GRAPH_TOKENS[: sum(b < max_step_tokens for b in MIXED_GRAPH_TOKENS) + 1]
    return tuple(b for b in buckets if b > above) if max_step_tokens > above else ()


def build_engine(hf_model: nn.Module, tokenizer, config: EngineConfig | None = None) -> Engine:
    """An engine over a transformers Llama-family model (float or a loaded SPEAR artifact)."""
    config = config or EngineConfig()
    start = time.perf_counter()
    model = build_runtime_model(hf_model, tune=config.tune_kernels)
    built = time.perf_counter()
    engine = Engine(make_runner(model, config), tokenizer, config, eos_token_ids(hf_model))
    engine.startup_s = {"kernels": built - start, "kv_cache_and_graphs": time.perf_counter() - built}
    return engine


def eos_token_ids(hf_model: nn.Module) -> tuple[int, ...]:
    """The end-of-sequence ids of the model's generation config."""
    eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


class Engine:
    def __init__(self, model_runner: ModelRunner, tokenizer, config: EngineConfig, eos_token_ids: tuple[int, ...] = ()):
        self.runner = model_runner
        self.tokenizer = tokenizer
        self.config = config
        self.policy = config.policy
        self.allocator = BlockAllocator(model_runner.cache.num_blocks)
        self.block_size = model_runner.cache.block_size
        self.max_model_len = model_runner.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids) | ({tokenizer.eos_token_id} - {None})
        self.generator = torch.Generator(model_runner.cache.device).manual_seed(config.seed)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._aborted: list[RequestOutput] = []
        self._in_flight: InFlight | None = None  # the launched step whose tokens are not read yet
        self.num_launched = 0
        self.last_step = StepStats()
        self.num_steps = 0
        self.num_preemptions = 0
        self._last_ready = 0.0  # overlapped: when the last step's tokens were read (time.perf_counter())
        # build_engine's seconds: "kernels" (the serving linears packed, and tuned on CUDA), "kv_cache_and_graphs"
        # (the KV cache sized after a warm-up step, the CUDA graphs captured)
        self.startup_s: dict[str, float] = {}

    # Counters the server's /metrics reads.
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def kv_blocks_used(self) -> int:
        return self.allocator.num_used

    @property
    def kv_blocks_total(self) -> int:
        return self.allocator.num_total

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborted or self._in_flight)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise SpearError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise SpearError(f"the prompt has {len(prompt_token_ids)} tokens; the context is {self.max_model_len} "
                             f"and must leave room for at least one generated token")
        if any(s.request_id == request_id for s in (*self.waiting, *self.running)):
            raise SpearError(f"request id {request_id!r} is already in use")
        max_len = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)  # the cache holds it (make_runner)
        generator = self.generator
        if params.seed is not None:
            generator = torch.Generator(self.generator.device).manual_seed(mixed_seed(params.seed))
        detokenizer = Detokenizer(self.tokenizer, prompt_token_ids, params.stop)
        self.waiting.append(Sequence(request_id, list(prompt_token_ids), params, generator, detokenizer, max_len,
                                     list(prompt_token_ids)))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Drop a request (unknown or finished ids are ignored); the next step reports it finished with `reason`."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    seq.finished = True  # a token of it still in flight is dropped
                    seq.released = True
                    self.allocator.free(seq.block_table)
                    self._aborted.append(self._output(seq, [], reason))
                    return

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of this step (EngineConfig.overlap: of the one before)."""
        start = time.perf_counter()
        outputs, self._aborted = self._aborted, []
        in_flight, self._in_flight = self._in_flight, None
        for seq in [s for s in self.running if s.pending_row is not None and s.at_length(extra=1)]:
            self._release(seq)  # its token in flight ends it: its slot and blocks go to the next requests now
        if in_flight is not None and self._decode_blocks_needed() > self.allocator.num_free:
            # a preemption ahead: read the step in flight first (finished sequences free their blocks, and a
            # preempted one is recomputed from tokens on the host)
            outputs += self._finish(in_flight)
            self._observe_finished(in_flight)
            in_flight = None
        preempted = self._grow_decodes()
        work = [(seq, seq.next_chunk(1)) for seq in self.running if seq.prefilled]
        num_decodes = len(work)
        waiting_tokens = sum(len(s.prefill_ids) - s.num_computed for s in (*self.running, *self.waiting) if not s.prefilled)
        budget = self.policy.prefill_budget(num_decodes, sum(c.start + 1 for _, c in work), waiting_tokens)
        if num_decodes == 0:
            budget = max(budget, 1)  # with nothing to decode, a step must make progress
        work += self._prefill_chunks(budget, admit=not preempted)  # (a step that preempted admits no one, as vLLM)
        if work:
            self._launch(work, in_flight)
        if in_flight is not None:  # overlapped: the previous step's tokens, while this one runs
            outputs += self._finish(in_flight)
            self._observe_finished(in_flight)
        if not self.config.overlap and self._in_flight is not None:  # this step's own
            outputs += self._finish(self._in_flight)
            self._in_flight = None
        if not work:
            return outputs
        self.last_step = StepStats(time.perf_counter() - start, num_decodes, sum(len(c.tokens) for _, c in work[num_decodes:]))
        self.num_steps += 1
        if self.config.overlap:  # this call timed the step before: feedback waits for this one's tokens
            self._in_flight.stats = self.last_step
        elif hasattr(self.policy, "observe"):  # feedback policies (SLOPolicy) correct their predictions
            self.policy.observe(self.last_step)
        return outputs

    def _observe_finished(self, step: InFlight) -> None:
        """Overlapped: feedback policies see a step's own time, from its launch or the step before's tokens,
        whichever came later, to its tokens (the gap a client sees between tokens), with its own decodes and
        prefill tokens; the call that launched it timed the step before."""
        now = time.perf_counter()
        seconds, self._last_ready = now - max(step.launched_at, self._last_ready), now
        if step.stats is not None and hasattr(self.policy, "observe"):
            self.policy.observe(replace(step.stats, seconds=seconds))

    def _release(self, seq: Sequence) -> None:
        """Out of the running set, its blocks back in the pool (a step in flight may still write them: the steps
        of the requests that get them run after it, in stream order)."""
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.released = True

    def _decode_blocks_needed(self) -> int:
        """Blocks the running decodes need for this step's tokens beyond those they hold."""
        return sum(s.blocks_short(self.block_size) for s in self.running if s.prefilled)

    def _grow_decodes(self) -> bool:
        """Give each decoding sequence, oldest first, the block its next token needs; while none is free, preempt the
        most recently admitted running sequence (itself, if it is that one). Returns whether any was preempted."""
        preempted = False
        for seq in list(self.running):
            while not seq.released and seq.prefilled and seq.blocks_short(self.block_size):
                if self.allocator.num_free:
                    seq.block_table += self.allocator.allocate(1)
                else:
                    self._preempt(self.running[-1])
                    preempted = True
        return preempted

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and queue it first, to prefill its prompt and output again (no token of
        it is in flight: Engine.step reads the step in flight before it preempts)."""
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.prefill_ids = seq.prompt_ids + seq.output_ids
        log.warning("KV cache full: preempted request %s, its %d blocks freed, its %d tokens to be recomputed "
                    "(%d running, %d waiting)", seq.request_id, len(seq.block_table), len(seq.prefill_ids),
                    len(self.running), len(self.waiting))
        seq.block_table, seq.num_computed, seq.released = [], 0, True
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _launch(self, work: list[tuple[Sequence, Chunk]], previous: InFlight | None) -> None:
        """Run the step's forward and sample (tokens in flight: not waited for); decode tokens still on the device
        come from the `previous` step's samples."""
        launched_at = time.perf_counter()
        index, rows, first = [], [], 0
        for seq, chunk in work:
            if seq.pending_row is not None and seq.prefilled:  # its decode token is a sample still on the device
                index.append(first)
                rows.append(seq.pending_row)
            first += len(chunk.tokens)
        patch = TokenPatch(index, rows, previous.tokens) if index else None
        logits = self.runner.forward([chunk for _, chunk in work], patch)  # [B, vocab]
        rows = []
        for i, (seq, chunk) in enumerate(work):
            seq.num_computed += len(chunk.tokens)
            if seq.prefilled:
                rows.append(i)
        seqs = [work[i][0] for i in rows]
        if len(rows) < len(work):  # sequences still mid-prompt have no token to sample
            logits = logits[rows]
        tokens = self._sample(logits, seqs, previous)
        logprobs = _logprobs(logits, seqs, tokens)
        ready = None
        if tokens.is_cuda and self.config.overlap:  # else _finish's tolist() waits for the step
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = tokens
        self.num_launched += 1
        self._in_flight = InFlight(self.num_launched, seqs, tokens, host, ready, launched_at, logprobs=logprobs)
        if self.config.overlap:
            for i, seq in enumerate(seqs):
                seq.pending_row, seq.pending_step = i, self.num_launched

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], previous: InFlight | None) -> torch.Tensor:
        """The step's tokens; if sampling the batch raises, each row is sampled alone and a row that still raises
        fails its own request (finish reason "error"), never the others."""
        generated = [self._generated(s, previous) for s in seqs]
        try:
            return sample_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs], generated)
        except Exception:
            log.exception("sampling a batch of %d failed; sampling its rows one by one", len(seqs))
        rows = []
        for i, seq in enumerate(seqs):
            try:
                rows.append(sample_tokens(logits[i : i + 1], [seq.params], [seq.generator], generated[i : i + 1]))
            except Exception:
                log.exception("sampling request %s failed", seq.request_id)
                self.abort(seq.request_id, reason="error")
                rows.append(torch.zeros(1, dtype=torch.long, device=logits.device))  # dropped: the request is over
        return torch.cat(rows)

    def _generated(self, seq: Sequence, previous: InFlight | None) -> torch.Tensor | None:
        """The ids `seq` has generated, on the device, its sample still in flight (overlap) included; None unless
        its params adjust its logits (penalties need them)."""
        if not seq.params.adjusts_logits:
            return None
        ids = torch.tensor(seq.output_ids, dtype=torch.long, device=self.runner.cache.device)
        if seq.pending_row is not None:
            ids = torch.cat([ids, previous.tokens[seq.pending_row : seq.pending_row + 1]])
        return ids

    def _finish(self, step: InFlight) -> list[RequestOutput]:
        """Append a launched step's tokens to its sequences (finished or aborted ones since: dropped)."""
        if step.ready is not None:
            step.ready.synchronize()
        logprobs = step.logprobs.read(step.seqs) if step.logprobs is not None else {}
        outputs = []
        for row, (seq, token) in enumerate(zip(step.seqs, step.host.tolist())):
            if seq.pending_step == step.number:  # no later step sampled for it yet
                seq.pending_row = None
            if not seq.finished:
                outputs.append(self._append(seq, token, logprobs.get(row)))
        return outputs

    def _prefill_chunks(self, budget: int, admit: bool) -> list[tuple[Sequence, Chunk]]:
        """Continue admitted prompts, then (`admit`) admit waiting requests in order while slots, budget and blocks
        for their prompt and first generated token last."""
        work = []
        for seq in self.running:
            if budget > 0 and not seq.prefilled:
                work.append((seq, seq.next_chunk(budget)))
                budget -= len(work[-1][1].tokens)
        while admit and budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            needed = cdiv(len(self.waiting[0].prefill_ids) + 1, self.block_size)
            if needed > self.allocator.num_free:
                break
            seq = self.waiting.popleft()
            seq.block_table, seq.released = self.allocator.allocate(needed), False
            self.running.append(seq)
            work.append((seq, seq.next_chunk(budget)))
            budget -= len(work[-1][1].tokens)
        return work

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        seq.output_ids.append(token)
        stop_ids = seq.params.stop_token_ids if seq.params.ignore_eos else (*seq.params.stop_token_ids, *self.eos_token_ids)
        reason = None
        if token in stop_ids or seq.detokenizer.add(token):
            reason = "stop"
        elif seq.at_length():
            reason = "length"
        if reason is not None:
            if not seq.released:
                self._release(seq)
            seq.finished = True
        return self._output(seq, [token], reason, None if logprobs is None else [logprobs])

    def _output(self, seq: Sequence, new_ids: list[int], reason: str | None,
                logprobs: list[TokenLogprobs] | None = None) -> RequestOutput:
        return RequestOutput(seq.request_id, new_ids, seq.detokenizer.take(final=reason is not None), reason is not None,
                             reason, len(seq.prompt_ids), len(seq.output_ids), logprobs)


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor) -> StepLogprobs | None:
    """The log-probabilities of the samples of the rows whose requests asked for them (not waited for)."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if not rows:
        return None
    logprobs = logits[rows].float().log_softmax(dim=-1)  # [R, V]
    sampled = logprobs.gather(1, tokens[rows, None])[:, 0]
    top = logprobs.topk(max(seqs[i].params.logprobs for i in rows), dim=-1)
    return StepLogprobs(rows, sampled, top.values, top.indices)
