"""Data-free KL calibration of the error compensators.

Train only the EC parameters (every `SpearLinear.ec`) of the quantized student so that
its next-token distribution matches the float teacher's on the calibration sequences:

    L = 1/T Σ_t KL(p_t ‖ q_t) = 1/T Σ_t Σ_v p_t(v) (log p_t(v) − log q_t(v))

over all T tokens of a batch and the full vocabulary (p: teacher, q: student). With
`hidden_weight` λ > 0 a cross-layer term matches every intermediate decoder layer's output
(RILQ's model-wise discrepancy, as a relative MSE):

    L += λ · 1/(n−1) Σ_{l<n} ‖h_s^l − h_t^l‖² / ‖h_t^l‖²

With `position_weight` "confident" the training loss weighs each position by the teacher's top-1 probability
(normalised to a mean of one over each chunk of tokens), so the positions whose next token the context settles (a
passage's last word: LAMBADA) count over the open ones; the held-out score stays the plain mean KL.

With `norm_lr` > 0 the gains of the normalisation layers train too (norm tweaking: they replace
the float model's own, so the bytes do not change).

Adam, cosine or constant LR, gradient clipping; a held-out share of the sequences (at most `max_holdout`) is
scored every `eval_every` steps (`eval_batch_size` sequences a forward), the best state is kept, and training
stops after `patience` evaluations without improvement. The train KL reported before and after is scored on at
most `max_holdout` training sequences too: at 4,096 sequences the whole training set took ~12 s a pass on an H200.

Speed: a step launches ~30k operators (~190 ECs, forward and backward), so on a GPU it is bound by the
host's launches: 0.44 / 0.48 s a step at 8 / 32 sequences of 512 tokens on an H200 (BENCHMARKS §2). On CUDA
the step (forward, chunked KL, backward) is therefore captured once as a CUDA graph and replayed on
fixed buffers (`cuda_graph`, compensate.graphed_step); clipping and Adam run eagerly. Between evaluations nothing
waits for the GPU (the train KL is summed on the device), so the host queues the next step's teacher forward,
clipping and Adam while the GPU runs the last: 0.126 → 0.099 s a step at 8 sequences.

Memory: logits are never materialised for a whole batch. The student's last hidden
states [T, H] are computed once, then the head, the log-softmax and the KL run over
chunks of `chunk_tokens` tokens, each chunk's backward into the hidden states done at
once; one backward through the body follows.

Teacher targets (`teacher_mode`):
  "online" (default): the float teacher's body runs once per sequence (its last hidden
                      states are kept, H floats per token, up to `teacher_cache_gb`), its head
                      on every batch. Exact; costs the teacher's memory.
  "topk":             the teacher's top-k log-probs and the log of its remaining mass,
                      computed once (k·8 + 4 bytes per token). The loss is then the KL
                      between the two distributions coarsened to {top-k tokens, rest}:
                      a lower bound of the full KL, exact when k = vocab − 1.

Precision: the ECs and Adam hold float32; the frozen student runs in float32 or, above 2B parameters on CUDA, in
bfloat16, and may recompute each decoder layer's activations in the backward (compensate/precision.py).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.compensate.graphed_step import GraphedStep
from spear.errors import SpearError
from spear.layer import ErrorCompensator, SpearLinear
from spear.compensate.precision import (PRECISIONS, checkpointed_layers, student_activation_bytes, student_in,
                                        tf32_matmuls, training_precision)
from spear.compensate.resume import CalibrationCheckpoint, TrainingState, fingerprint
from spear.models.head import last_hidden, logits_of, position_chunks

TEACHER_MODES = ("online", "topk")
POSITION_WEIGHTS = ("uniform", "confident")
SCHEDULES = ("cosine", "constant")


@dataclass(frozen=True)
class CalibrateConfig:
    steps: int = 1500  # optimizer steps (an epoch is ceil(train sequences / batch_size) steps); BENCHMARKS §2
    batch_size: int = 8  # sequences per step
    lr: float = 1e-2  # gate MLP and alpha
    lr_ab: float = 1e-3  # A and B (SmolLM2 W4, 50 steps: 10x lower LRs leave 3x more KL)
    train_AB: bool = True  # False: only the gate and alpha move
    train_gate: bool = True  # False: the gate stays at its init (gamma ≡ 1 from the zero-init)
    schedule: str = "cosine"
    max_grad_norm: float = 1.0
    holdout: float = 0.125  # share of the sequences held out for early stopping (0: none)
    max_holdout: int = 256  # at most this many held out (each evaluation scores them all)
    eval_every: int = 25  # steps between held-out scorings (4096 × 1000 on an H200: 100 scorings at 10 took ~80 s)
    patience: int = 5  # evaluations without improvement before stopping
    seed: int = 0
    teacher_mode: str = "online"
    topk: int = 128
    chunk_tokens: int = 1024  # tokens per logits chunk
    teacher_cache_gb: float = 4.0  # the online teacher's last hidden states kept for reuse, at most this much
    hidden_weight: float = 0.0  # λ of the intermediate hidden-state term (0: KL only); needs the online teacher
    position_weight: str = "uniform"  # "confident": each position's KL weighted by the teacher's top-1 probability
    norm_lr: float = 0.0  # > 0: the norm gains train too, at this LR (norm tweaking, zero bytes; no gain measured)
    eval_batch_size: int = 32  # sequences per no-grad forward when scoring (128 on an H200: 1.34 s at 8, 0.40 at 32)
    cuda_graph: bool = True  # on CUDA, replay the training step as a captured graph (module docstring)
    precision: str = "auto"  # the frozen student's compute dtype while training (module docstring)
    checkpoint_layers: bool = False  # recompute each decoder layer's activations in the backward (module docstring)
    checkpoint_dir: str | None = None  # write the training's state there at each scoring, resume from it (resume.py)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.teacher_mode not in TEACHER_MODES:
            raise SpearError(f"unknown teacher mode {self.teacher_mode!r}; choose one of {', '.join(TEACHER_MODES)}")
        if self.position_weight not in POSITION_WEIGHTS:
            raise SpearError(f"unknown position weight {self.position_weight!r}; choose one of "
                             f"{', '.join(POSITION_WEIGHTS)}")
        if self.schedule not in SCHEDULES:
            raise SpearError(f"unknown LR schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.precision not in PRECISIONS:
            raise SpearError(f"unknown calibration precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.precision == "bfloat16" and self.norm_lr > 0:
            raise SpearError("norm gains train in float32 only: use precision float32 with norm_lr > 0")
        if not 0 <= self.holdout < 1:
            raise SpearError(f"holdout must be in [0, 1), got {self.holdout}")
        if min(self.steps, self.batch_size, self.eval_batch_size, self.max_holdout, self.eval_every, self.patience,
               self.topk, self.chunk_tokens) < 1:
            raise SpearError("steps, batch sizes, eval_every, patience, topk and chunk_tokens must be positive")
        if self.norm_lr < 0 or self.teacher_cache_gb < 0:
            raise SpearError(f"norm_lr and teacher_cache_gb must be ≥ 0, got {self.norm_lr}, {self.teacher_cache_gb}")
        if self.hidden_weight < 0 or (self.hidden_weight > 0 and self.teacher_mode != "online"):
            raise SpearError("hidden_weight must be ≥ 0, and the hidden-state term needs teacher_mode 'online'")


@dataclass
class CalibrationResult:
    initial_train_kl: float  # on at most max_holdout training sequences (module docstring)
    final_train_kl: float
    initial_heldout_kl: float | None  # None without a held-out set
    final_heldout_kl: float | None
    steps: int  # optimizer steps run
    best_step: int  # step whose EC state was kept (0: the initial state)
    seconds: float
    history: list[dict] = field(default_factory=list)  # one entry per evaluation
    heldout_sequences: int = 0
    precision: str = "float32"  # the frozen student's compute dtype (training_precision)
    activation_bytes: int | None = None  # a step's activations under this plan (precision.plan_activation_bytes)

    def to_dict(self) -> dict:
        return asdict(self)


# --- EC parameters ------------------------------------------------------------------


def ec_modules(model: nn.Module) -> dict[str, ErrorCompensator]:
    """Every EC attached to a SpearLinear of `model`, by the EC's module name."""
    return {f"{name}.ec": m.ec for name, m in model.named_modules() if isinstance(m, SpearLinear) and m.ec is not None}


def ec_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for ec in ec_modules(model).values() for p in ec.parameters()]


def ec_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every EC tensor, keyed like model.state_dict()."""
    return {f"{name}.{k}": v.detach().clone() for name, ec in ec_modules(model).items() for k, v in ec.state_dict().items()}


@torch.no_grad()
def load_ec_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (from ec_state_dict) into the model's ECs, in place; the keys must match exactly."""
    own = {f"{name}.{k}": v for name, ec in ec_modules(model).items() for k, v in ec.state_dict().items()}
    if own.keys() != state.keys():
        missing, extra = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        raise SpearError(f"EC state does not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    for k, v in own.items():
        v.copy_(state[k])


def norm_gains(model: nn.Module) -> dict[str, nn.Parameter]:
    """The gain vector of every normalisation layer (RMSNorm / LayerNorm: input, post-attention, final, q/k norms),
    by parameter name. Training them beside the ECs changes no byte count: they replace the float model's own."""
    return {f"{name}.weight": m.weight for name, m in model.named_modules()
            if type(m).__name__.endswith(("RMSNorm", "LayerNorm"))
            and isinstance(getattr(m, "weight", None), nn.Parameter)}


def _trained_state(model: nn.Module, norms: bool) -> dict[str, torch.Tensor]:
    """A detached copy of what calibration trains: every EC tensor, and the norm gains when they train."""
    state = ec_state_dict(model)
    if norms:
        state |= {name: w.detach().clone() for name, w in norm_gains(model).items()}
    return state


@torch.no_grad()
def _load_trained_state(model: nn.Module, state: dict[str, torch.Tensor], norms: bool) -> None:
    state = dict(state)
    if norms:
        for name, w in norm_gains(model).items():
            w.copy_(state.pop(name))
    load_ec_state_dict(model, state)


# --- teacher targets ----------------------------------------------------------------


def _layer_discrepancy(student_layers: tuple, teacher_layers: tuple) -> torch.Tensor:
    """1/(n−1) Σ_l ‖h_s^l − h_t^l‖² / ‖h_t^l‖² (module docstring)."""
    terms = [(s.float() - t.float()).square().sum() / t.float().square().sum().clamp(min=1e-12)
             for s, t in zip(student_layers, teacher_layers)]
    return torch.stack(terms).mean()


class OnlineTeacher:
    """The float teacher: exact full-vocabulary targets. Its last hidden states are kept per sequence
    (up to `cache_bytes`), so that each sequence's teacher body runs once, not once per epoch and per held-out
    evaluation; the logits are recomputed from them by the head, a chunk at a time."""

    def __init__(self, teacher: nn.Module, layers: bool = False, cache_bytes: int = 0):
        self.model = teacher
        self.layers = layers  # also return the decoder layers' outputs (the hidden-state term): never cached
        self.cache_bytes = 0 if layers else cache_bytes
        self.hidden: dict[int, torch.Tensor] = {}  # calibration row -> its last hidden states [L, H]
        self.cached_bytes = 0

    @torch.no_grad()
    def prepare(self, rows: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        keys = rows.tolist()
        if all(k in self.hidden for k in keys):
            return torch.cat([self.hidden[k] for k in keys]), ()
        device = next(self.model.parameters()).device
        h, layers = last_hidden(self.model, ids.to(device), self.layers)  # [T, H], layer outputs
        for k, h_row in zip(keys, h.view(len(keys), -1, h.shape[-1])):
            if k not in self.hidden and self.cached_bytes + h_row.nbytes <= self.cache_bytes:
                self.hidden[k] = h_row.clone()
                self.cached_bytes += h_row.nbytes
        return h, layers

    def kl(self, s_logits: torch.Tensor, prepared: tuple[torch.Tensor, tuple], sl: slice,
           top1: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each of the chunk's tokens' KL(p ‖ q), float32, and (`top1`) the teacher's top-1 log-probability there."""
        with torch.no_grad():
            t_logp = logits_of(self.model, prepared[0][sl]).float().log_softmax(-1).to(s_logits.device)
        s_logp = s_logits.float().log_softmax(-1)
        return (t_logp.exp() * (t_logp - s_logp)).sum(-1), t_logp.amax(-1) if top1 else None


@dataclass
class TeacherTopK:
    """The teacher's top-k next-token log-probs per position, and the log of the mass outside them."""

    idx: torch.Tensor  # [N, L, k] int32
    logp: torch.Tensor  # [N, L, k] float32
    log_tail: torch.Tensor  # [N, L] float32, log(1 − Σ_topk p)

    def prepare(self, rows: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        device = ids.device
        return (
            self.idx[rows].flatten(0, 1).to(device, torch.int64),
            self.logp[rows].flatten(0, 1).to(device),
            self.log_tail[rows].flatten(0, 1).to(device),
        )

    def kl(self, s_logits: torch.Tensor, prepared: tuple[torch.Tensor, ...], sl: slice,
           top1: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each of the chunk's tokens' KL between {top-k, rest}-coarsened p and q, and (`top1`) the teacher's top-1
        log-probability there."""
        idx, t_logp, t_log_tail = (x[sl] for x in prepared)
        s_logits = s_logits.float()
        lse = s_logits.logsumexp(-1)
        s_logp = s_logits.gather(-1, idx) - lse[:, None]
        s_log_tail = s_logits.scatter(-1, idx, -math.inf).logsumexp(-1) - lse
        t_log_tail = t_log_tail.clamp(min=-100.0)  # a zero tail contributes 0 · finite, not 0 · inf
        head = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
        top = t_logp[:, 0] if top1 else None  # topk's values: largest first
        return head + t_log_tail.exp() * (t_log_tail - s_log_tail), top


@torch.no_grad()
def teacher_topk(
    teacher: nn.Module, ids: torch.Tensor, k: int = 128, batch_size: int = 8, chunk_tokens: int = 1024
) -> TeacherTopK:
    """Cache the teacher's targets for `ids` [N, L] on CPU (see TeacherTopK)."""
    device = next(teacher.parameters()).device
    vocab = teacher.get_output_embeddings().out_features
    if not 0 < k < vocab:
        raise SpearError(f"top-k must be between 1 and vocab − 1 = {vocab - 1}, got {k}")
    idx, logp, log_tail = [], [], []
    for start in range(0, len(ids), batch_size):
        batch = ids[start : start + batch_size]
        h, _ = last_hidden(teacher, batch.to(device), False)
        for sl in position_chunks(len(h), chunk_tokens):
            lp = logits_of(teacher, h[sl]).float().log_softmax(-1)
            top = lp.topk(k, dim=-1)
            idx.append(top.indices.int().cpu())
            logp.append(top.values.cpu())
            log_tail.append(lp.scatter(-1, top.indices, -math.inf).logsumexp(-1).cpu())
    n, length = ids.shape
    return TeacherTopK(
        torch.cat(idx).view(n, length, k), torch.cat(logp).view(n, length, k), torch.cat(log_tail).view(n, length)
    )


# --- the loss -----------------------------------------------------------------------


def _batch_loss(student: nn.Module, target, prepared: tuple, ids: torch.Tensor, chunk_tokens: int, backward: bool,
                hidden_weight: float = 0.0, confident: bool = False) -> torch.Tensor:
    """Mean per-token KL of one batch against the teacher's prepared targets, as a tensor (no host sync: a CUDA
    graph can hold it); with `backward`, accumulate the gradient of KL + hidden_weight · layer discrepancy into
    the ECs, each position's KL weighed by the teacher's top-1 probability where `confident` (the returned figure
    is the plain KL alone)."""
    layers = backward and hidden_weight > 0
    h, s_layers = last_hidden(student, ids, layers)  # [T, H]
    h_leaf = h.detach().requires_grad_(backward)
    total = torch.zeros((), device=h.device)
    for sl in position_chunks(len(h), chunk_tokens):
        per_token, t_top = target.kl(logits_of(student, h_leaf[sl]), prepared, sl, top1=backward and confident)
        kl = per_token.sum() / len(h)
        if backward:
            loss = kl
            if t_top is not None:
                p_top = t_top.exp()
                loss = (p_top / p_top.mean() * per_token).sum() / len(h)  # weights of mean one over the chunk
            loss.backward()
        total += kl.detach()
    if backward:
        body = (h * h_leaf.grad).sum()  # the KL's gradient, carried into the body
        if layers:
            body = body + hidden_weight * _layer_discrepancy(s_layers, prepared[1])
        body.backward()
    return total


@torch.no_grad()
def _mean_kl(student: nn.Module, target, ids: torch.Tensor, rows: torch.Tensor, batch_size: int, chunk_tokens: int) -> float:
    device = next(student.parameters()).device
    total = 0.0
    for start in range(0, len(rows), batch_size):
        r = rows[start : start + batch_size]
        batch = ids[r].to(device)
        total += _batch_loss(student, target, target.prepare(r, batch), batch, chunk_tokens, False).item() * len(r)
    return total / len(rows)


def mean_kl(
    student: nn.Module, teacher: nn.Module | TeacherTopK, ids: torch.Tensor, batch_size: int = 8, chunk_tokens: int = 1024
) -> float:
    """Mean per-token KL(teacher ‖ student) over `ids` [N, L]; `teacher` is the float model or a top-k cache."""
    target = teacher if isinstance(teacher, TeacherTopK) else OnlineTeacher(teacher)
    return _mean_kl(student, target, ids, torch.arange(len(ids)), batch_size, chunk_tokens)


@torch.no_grad()
def gate_spread(model: nn.Module, ids: torch.Tensor, batch_size: int = 8) -> dict:
    """How much the gates adapt per token: over every gated EC and rank channel, the standard deviation
    of gamma across the tokens of `ids` [N, L], and the mean |gamma − 1| (both 0 for a static EC)."""
    stds, devs = [], []

    def hook(ec: ErrorCompensator):
        def fn(_module, args):
            x = args[0]
            g = ec.gamma(x @ ec.factors()[0].to(x.dtype).t()).float().flatten(0, -2)  # [T, r]
            stds.append(g.std(0).mean().item())
            devs.append((g - 1).abs().mean().item())

        return fn

    gated = [ec for ec in ec_modules(model).values() if ec.gate is not None]
    handles = [ec.register_forward_pre_hook(hook(ec)) for ec in gated]
    try:
        device = next(model.parameters()).device
        for batch in ids.split(batch_size):
            model.base_model(input_ids=batch.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    n = max(len(stds), 1)
    return {"gated_ecs": len(gated), "token_std": sum(stds) / n, "mean_abs_deviation": sum(devs) / n}


# --- training -----------------------------------------------------------------------


def _param_groups(student: nn.Module, cfg: CalibrateConfig) -> list[dict]:
    """Freeze everything, then unfreeze the EC parameters that cfg trains; Adam groups by LR."""
    for p in student.parameters():
        p.requires_grad_(False)
    ab, rest = [], []
    for ec in ec_modules(student).values():
        if cfg.train_AB:
            ab += [ec.A, ec.B]
        rest.append(ec.alpha)
        if cfg.train_gate and ec.gate is not None:
            rest += list(ec.gate.parameters())
    norms = list(norm_gains(student).values()) if cfg.norm_lr > 0 else []
    for p in ab + rest + norms:
        p.requires_grad_(True)
    groups = ({"params": ab, "lr": cfg.lr_ab}, {"params": rest, "lr": cfg.lr}, {"params": norms, "lr": cfg.norm_lr})
    return [g for g in groups if g["params"]]


def _batches(rows: torch.Tensor, batch_size: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless batches of row indices: a fresh seeded shuffle each epoch, batches may span epochs."""
    pending = torch.empty(0, dtype=torch.int64)
    while True:
        while len(pending) < batch_size:
            pending = torch.cat([pending, rows[torch.randperm(len(rows), generator=gen)]])
        yield pending[:batch_size]
        pending = pending[batch_size:]


def calibrate_ecs(
    student: nn.Module,
    teacher: nn.Module | None,
    calib_ids: torch.Tensor,
    cfg: CalibrateConfig = CalibrateConfig(),
    teacher_logits: TeacherTopK | None = None,
) -> CalibrationResult:
    """Train the student's ECs (and, with cfg.norm_lr, its norm gains), in place, to minimise KL(teacher ‖ student)
    on `calib_ids` [N, L].

    `teacher` is the float model; it may be None when `teacher_logits` (a top-k cache from
    `teacher_topk` on the same ids) is given. Every non-EC parameter of the student is left
    frozen (requires_grad False). On return the trained tensors hold the best state seen on the held-out
    sequences (or the last state when there are none).
    """
    if not ec_modules(student):
        raise SpearError("the student has no error compensators; attach ECs before calibrating")
    if teacher_logits is None and teacher is None:
        raise SpearError("calibration needs the float teacher or its cached logits")
    if teacher_logits is not None and teacher_logits.logp.shape[:2] != calib_ids.shape:
        cached = tuple(teacher_logits.logp.shape[:2])
        raise SpearError(f"the cached teacher logits cover {cached} tokens but the ids are {tuple(calib_ids.shape)}")
    n = len(calib_ids)
    n_held = min(int(n * cfg.holdout), cfg.max_holdout)
    if n - n_held < 1:
        raise SpearError(f"{n} calibration sequences leave none for training with holdout {cfg.holdout}")

    start_time = time.perf_counter()
    if teacher_logits is None and cfg.teacher_mode == "topk":
        teacher_logits = teacher_topk(teacher, calib_ids, cfg.topk, cfg.batch_size, cfg.chunk_tokens)
    target = teacher_logits if teacher_logits is not None else OnlineTeacher(
        teacher, layers=cfg.hidden_weight > 0, cache_bytes=int(cfg.teacher_cache_gb * 2**30))
    gen = torch.Generator().manual_seed(cfg.seed)
    perm = torch.randperm(n, generator=gen)
    held, train = perm[:n_held], perm[n_held:]
    batch_size = min(cfg.batch_size, len(train))

    precision = training_precision(student, cfg.precision)
    activations = student_activation_bytes(student, batch_size * calib_ids.shape[1], precision, cfg.checkpoint_layers)
    if cfg.progress and activations is not None:
        print(f"calibration: a step's activations ~{activations / 2**30:.2f} GiB for these ECs, in {precision}",
              file=sys.stderr, flush=True)
    with student_in(student, precision, ec_parameters(student)), checkpointed_layers(student, cfg.checkpoint_layers), \
            tf32_matmuls():
        groups = _param_groups(student, cfg)
        device = groups[0]["params"][0].device
        ids = calib_ids.to(device)

        def score(rows: torch.Tensor) -> float:
            return _mean_kl(student, target, ids, rows, cfg.eval_batch_size, cfg.chunk_tokens)

        opt = torch.optim.Adam(groups)
        if cfg.schedule == "cosine":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))
        else:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        trainable = [p for g in groups for p in g["params"]]

        probe = train[: cfg.max_holdout]  # the train KL before and after, on a fixed share of the training set
        norms = cfg.norm_lr > 0
        initial_state = _trained_state(student, norms)
        saved = checkpoint = None
        if cfg.checkpoint_dir is not None:
            checkpoint = CalibrationCheckpoint(cfg.checkpoint_dir, fingerprint(cfg, calib_ids, initial_state))
            saved = checkpoint.load()
        if saved is None:
            initial_train = score(probe)
            best_kl = initial_held = score(held) if n_held else None
            best_step, best_state, bad, step = 0, initial_state, 0, 0
            history: list[dict] = []
        else:  # resumed where the checkpoint was written (resume.py)
            _load_trained_state(student, saved.trained, norms)
            opt.load_state_dict({"state": saved.optimizer["state"], "param_groups": opt.state_dict()["param_groups"]})
            for group, lr in zip(opt.param_groups, saved.lrs):
                group["lr"] = lr
            sched.last_epoch = saved.step
            initial_train, initial_held, history = saved.initial_train_kl, saved.initial_heldout_kl, saved.history
            best_kl, best_step, best_state, bad, step = (saved.best_kl, saved.best_step, saved.best, saved.bad,
                                                         saved.step)
        running, running_steps = torch.zeros((), device=device), 0  # the train KL since the last evaluation
        batches = _batches(train, batch_size, gen)
        for _ in range(step):  # a resumed training takes the batches an uninterrupted one would
            next(batches)
        step_fn = GraphedStep(
            lambda batch_ids, prepared: _batch_loss(student, target, prepared, batch_ids, cfg.chunk_tokens, True,
                                                    cfg.hidden_weight, cfg.position_weight == "confident"),
            trainable, enabled=cfg.cuda_graph and ids.is_cuda)
        first = cfg.steps + 1 if n_held and bad >= cfg.patience else step + 1  # stopped early: nothing left
        bar = tqdm(range(first, cfg.steps + 1), initial=first - 1, total=cfg.steps, desc="calibrating ECs (KL)",
                   unit="step", disable=not cfg.progress)
        for step in bar:  # no host sync between evaluations: the host queues the next step while the GPU runs this one
            rows = next(batches)
            batch_ids = ids[rows.to(device, non_blocking=True)]
            running = running + step_fn(batch_ids, target.prepare(rows, batch_ids)).detach()
            running_steps += 1
            torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
            opt.step()
            sched.step()
            if step % cfg.eval_every and step != cfg.steps:
                continue
            train_kl = running.item() / running_steps
            entry = {"step": step, "train_kl": train_kl, "seconds": time.perf_counter() - start_time}
            running, running_steps = torch.zeros((), device=device), 0
            if n_held:
                entry["heldout_kl"] = kl = score(held)
                if kl < best_kl:
                    best_kl, best_step, best_state, bad = kl, step, _trained_state(student, norms), 0
                else:
                    bad += 1
            history.append(entry)
            if checkpoint is not None:
                checkpoint.save(TrainingState(step, _trained_state(student, norms), best_state, best_step, best_kl, bad,
                                              initial_train, initial_held, history, opt.state_dict(),
                                              [group["lr"] for group in opt.param_groups]))
            bar.set_postfix(kl=f"{train_kl:.4f}", **({} if best_kl is None else {"heldout": f"{best_kl:.4f}"}))
            if n_held and bad >= cfg.patience:
                break
        bar.close()
        if n_held:
            _load_trained_state(student, best_state, norms)
        else:
            best_step = step
        del step_fn  # frees the graph's memory
        final_train = score(probe)
        opt.zero_grad(set_to_none=True)

    return CalibrationResult(
        initial_train_kl=initial_train,
        final_train_kl=final_train,
        initial_heldout_kl=initial_held,
        final_heldout_kl=best_kl,
        steps=step,
        best_step=best_step,
        seconds=time.perf_counter() - start_time,
        history=history,
        heldout_sequences=n_held,
        precision=precision,
        activation_bytes=activations,
    )
