"""Zero-shot tasks scored offline the way lm-evaluation-harness (lm-eval 0.4) scores them.

Data: ../shared/data/tasks (or $SPEAR_DATA/tasks); its README gives provenance and protocol. Every item becomes
lm-eval's (context, continuation) log-likelihood requests with the target delimiter " ":

    lambada_openai  text minus its last word → " " + last word            acc (greedy), perplexity
    arc_easy/_c.    "Question: {stem}\\nAnswer:" → " " + each choice        acc, acc_norm
    piqa            "Question: {goal}\\nAnswer:" → " " + sol1 / sol2        acc, acc_norm
    winogrande      sentence up to "_" with each option → " " + the rest    acc (partial scoring)
    boolq           "{title} -- {passage}\\nQuestion: {question}?\\nAnswer:" → " no" / " yes"   acc
    hellaswag       preprocessed "activity: ctx" → " " + each ending         acc, acc_norm

BoolQ's passage is "title -- passage", as in SuperGLUE's copy that lm-eval reads (the Google file keeps the title
apart). HellaSwag comes from a preprocessed text copy whose ctx_b is not capitalized as lm-eval's is (tasks README):
its numbers are close to lm-eval's, not equal.

Tokenization and scoring follow lm-eval's HFLM: trailing spaces of the context move to the continuation, the pair is
encoded whole and split after the context's own tokens, an empty context is the BOS (else EOS) token, inputs longer
than the model's context keep their last tokens; acc is argmax of the summed log-likelihood, acc_norm of it divided
by the choice's length in characters (first maximum on ties).
"""

from __future__ import annotations

import bz2
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from spear.errors import SpearError
from spear.eval.perplexity import data_dir

TASK_METRICS = {
    "lambada_openai": ("acc", "perplexity"),
    "arc_easy": ("acc", "acc_norm"),
    "arc_challenge": ("acc", "acc_norm"),
    "piqa": ("acc", "acc_norm"),
    "winogrande": ("acc",),
    "boolq": ("acc",),
    "hellaswag": ("acc", "acc_norm"),
}
TASKS = tuple(TASK_METRICS)


@dataclass(frozen=True)
class Doc:
    """One item: lm-eval's requests for it, the gold request's index, and the choice strings (acc_norm lengths)."""

    requests: list[tuple[str, str]]  # (context, continuation)
    gold: int
    choices: list[str]


@dataclass
class TaskResult:
    task: str
    docs: int
    metrics: dict[str, float]  # acc, acc_norm, perplexity as lm-eval names them
    stderr: dict[str, float]  # standard error of the mean of acc / acc_norm (sample std / sqrt(n))
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def parse_tasks(text: str) -> list[str]:
    """'arc_easy,piqa' or 'all' → task names, checked."""
    names = list(TASKS) if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASK_METRICS]
    if unknown or not names:
        raise SpearError(f"unknown task {', '.join(unknown) or repr(text)}; choose from {', '.join(TASKS)} or all")
    return names


def load_docs(task: str, limit: int | None = None) -> list[Doc]:
    """The first `limit` items of a task (all of them by default), in file order, as lm-eval's --limit takes them."""
    if task not in TASK_METRICS:
        raise SpearError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    folder = data_dir() / "tasks" / task
    try:
        docs = _LOADERS[task](folder)
    except FileNotFoundError as e:
        raise SpearError(f"task data missing: {e.filename} (see ../shared/data/tasks/README.md)") from None
    return docs if limit is None else docs[:limit]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _labels(path: Path) -> list[int]:
    return [int(line) for line in path.read_text(encoding="utf-8").split()]


def _multiple_choice(context: str, choices: list[str], gold: int) -> Doc:
    return Doc([(context, " " + choice) for choice in choices], gold, choices)


def _lambada(folder: Path) -> list[Doc]:
    docs = []
    for record in _jsonl(folder / "lambada_test.jsonl"):
        words = record["text"].split(" ")
        target = " " + words[-1]
        docs.append(Doc([(" ".join(words[:-1]), target)], 0, [target]))
    return docs


def _arc(folder: Path, name: str) -> list[Doc]:
    docs = []
    for record in _jsonl(folder / name):
        question = record["question"]
        labels = [c["label"] for c in question["choices"]]
        texts = [c["text"] for c in question["choices"]]
        docs.append(_multiple_choice(f"Question: {question['stem']}\nAnswer:", texts, labels.index(record["answerKey"])))
    return docs


def _piqa(folder: Path) -> list[Doc]:
    records, labels = _jsonl(folder / "valid.jsonl"), _labels(folder / "valid-labels.lst")
    return [_multiple_choice(f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], label)
            for r, label in zip(records, labels, strict=True)]


def _winogrande(folder: Path) -> list[Doc]:
    docs = []
    for record in _jsonl(folder / "dev.jsonl"):
        sentence = record["sentence"]
        blank = sentence.index("_")
        contexts = [sentence[:blank] + record["option1"], sentence[:blank] + record["option2"]]
        continuation = " " + sentence[blank + 1 :].strip()
        docs.append(Doc([(c, continuation) for c in contexts], int(record["answer"]) - 1, contexts))
    return docs


def _boolq(folder: Path) -> list[Doc]:
    return [_multiple_choice(f"{r['title']} -- {r['passage']}\nQuestion: {r['question']}?\nAnswer:", ["no", "yes"],
                             int(r["answer"]))
            for r in _jsonl(folder / "dev.jsonl")]


def _hellaswag(folder: Path) -> list[Doc]:
    with bz2.open(folder / "hellaswag_val_full.txt.bz2", "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    docs = []
    for i in range(0, len(lines) - 5, 6):  # query, gold label, four endings
        docs.append(_multiple_choice(lines[i], lines[i + 2 : i + 6], int(lines[i + 1])))
    return docs


_LOADERS = {
    "lambada_openai": _lambada,
    "arc_easy": lambda folder: _arc(folder, "ARC-Easy-Test.jsonl"),
    "arc_challenge": lambda folder: _arc(folder, "ARC-Challenge-Test.jsonl"),
    "piqa": _piqa,
    "winogrande": _winogrande,
    "boolq": _boolq,
    "hellaswag": _hellaswag,
}


def context_length(model: nn.Module) -> int:
    """The model's context in tokens, as lm-eval resolves it from the config (2048 when it names none)."""
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(model.config, attr, None)
        if value:
            return int(value)
    return 2048


def prefix_token(tokenizer) -> int:
    """The token an empty context stands for: BOS, else EOS (lm-eval's prefix_token_id)."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of one request into context and continuation tokens."""
    if not context:
        tokens = tokenizer.encode(continuation, add_special_tokens=False)
        prefix = prefix_token(tokenizer)
        return ([prefix], tokens) if tokens[:1] != [prefix] else (tokens[:1], tokens[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_tokens = tokenizer.encode(context)
    return context_tokens, whole[len(context_tokens) :]


@torch.no_grad()
def score_tokens(
    model: nn.Module,
    requests: list[tuple[list[int], list[int]]],
    batch_size: int = 16,
    progress: bool = True,
    desc: str = "log-likelihoods",
    max_length: int | None = None,
) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), continuation is the greedy one) for each (context, continuation).

    Longest first, right-padded batches; an input keeps its last `max_length` tokens (default: the model's context;
    lm-eval's truncation). Only the positions that predict continuation tokens go through the LM head.
    """
    max_length = max_length or context_length(model)
    device = next(model.parameters()).device
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]) - len(requests[i][1]))
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    for start in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch", disable=not progress):
        batch = order[start : start + batch_size]
        inputs, targets = [], []
        for i in batch:
            context, continuation = requests[i]
            if not context or not continuation:
                raise SpearError("a log-likelihood request needs at least one context and one continuation token")
            inputs.append((context + continuation)[-(max_length + 1) :][:-1])  # [L_i]
            targets.append(continuation[-max_length:])
        width = max(len(x) for x in inputs)
        keep = max(width - len(x) + len(t) for x, t in zip(inputs, targets))  # last positions that any row scores
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for row, x in enumerate(inputs):
            ids[row, : len(x)] = torch.tensor(x)
        logits = model(input_ids=ids.to(device), use_cache=False, logits_to_keep=keep).logits  # [B, keep, V]
        logprobs = F.log_softmax(logits.float(), dim=-1)
        for row, (i, x, t) in enumerate(zip(batch, inputs, targets)):
            end = keep - (width - len(x))  # one past the row's last scored position in the kept window
            rows = logprobs[row, end - len(t) : end]  # [T, V]
            target = torch.tensor(t, device=rows.device)
            total = rows.gather(1, target[:, None]).sum().item()
            results[i] = (total, bool((rows.argmax(-1) == target).all()))
    return results


def loglikelihoods(model: nn.Module, tokenizer, requests: list[tuple[str, str]], batch_size: int = 16,
                   progress: bool = True, desc: str = "log-likelihoods",
                   max_length: int | None = None) -> list[tuple[float, bool]]:
    """lm-eval's `loglikelihood` on (context, continuation) strings."""
    tokens = [encode_pair(tokenizer, context, continuation) for context, continuation in requests]
    return score_tokens(model, tokens, batch_size, progress, desc, max_length)


def rolling_loglikelihood_requests(tokenizer, text: str, max_length: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's loglikelihood_rolling windows of one text: each scores the next `max_length` tokens (fewer in the
    last), conditioned on as many tokens before them as fill the window (the prefix token first)."""
    tokens = tokenizer.encode(text)
    sequence = [prefix_token(tokenizer), *tokens]  # sequence[i + 1] = tokens[i]
    windows = []
    for start in range(0, len(tokens), max_length):
        end = min(start + max_length, len(tokens))
        windows.append((sequence[max(0, end - max_length) : start + 1], tokens[start:end]))
    return windows


def _mean_stderr(values: list[float]) -> float:
    n = len(values)
    if n < 2:
        return float("nan")
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def _first_argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def task_metrics(task: str, docs: list[Doc], results: list[tuple[float, bool]]) -> tuple[dict, dict]:
    """lm-eval's per-task metrics (and acc/acc_norm standard errors) from each request's (loglik, is_greedy)."""
    per_doc: dict[str, list[float]] = {name: [] for name in TASK_METRICS[task]}
    at = 0
    for doc in docs:
        scored = results[at : at + len(doc.requests)]
        at += len(doc.requests)
        lls = [ll for ll, _ in scored]
        if task == "lambada_openai":
            per_doc["acc"].append(float(scored[0][1]))
            per_doc["perplexity"].append(lls[0])
            continue
        per_doc["acc"].append(float(_first_argmax(lls) == doc.gold))
        if "acc_norm" in per_doc:
            normalized = [ll / len(choice) for ll, choice in zip(lls, doc.choices)]
            per_doc["acc_norm"].append(float(_first_argmax(normalized) == doc.gold))
    metrics, stderr = {}, {}
    for name, values in per_doc.items():
        if name == "perplexity":
            metrics[name] = math.exp(-sum(values) / len(values))
        else:
            metrics[name] = sum(values) / len(values)
            stderr[name] = _mean_stderr(values)
    return metrics, stderr


def evaluate_task(model: nn.Module, tokenizer, task: str, limit: int | None = None, batch_size: int = 16,
                  progress: bool = True) -> TaskResult:
    if limit is not None and limit < 1:
        raise SpearError(f"--limit must be at least 1, got {limit}")
    docs = load_docs(task, limit)
    start = time.perf_counter()
    requests = [request for doc in docs for request in doc.requests]
    results = loglikelihoods(model, tokenizer, requests, batch_size, progress, desc=task)
    metrics, stderr = task_metrics(task, docs, results)
    return TaskResult(task, len(docs), metrics, stderr, time.perf_counter() - start)


def evaluate_tasks(model: nn.Module, tokenizer, tasks: list[str], limit: int | None = None, batch_size: int = 16,
                   progress: bool = True) -> list[TaskResult]:
    """Zero-shot scores of `model` on each task, in the order given."""
    return [evaluate_task(model, tokenizer, task, limit, batch_size, progress) for task in tasks]


def format_table(results: list[TaskResult]) -> str:
    lines = [f"{'task':<16} {'docs':>6} {'metric':<11} {'value':>9} {'stderr':>8}"]
    for r in results:
        for name, value in r.metrics.items():
            err = r.stderr.get(name)
            err_text = "" if err is None or math.isnan(err) else f"{err:.4f}"
            lines.append(f"{r.task:<16} {r.docs:>6} {name:<11} {value:>9.4f} {err_text:>8}")
    return "\n".join(lines)
