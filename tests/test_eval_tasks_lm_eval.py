"""The lm-eval adapter against lm-eval itself, on a tiny random Llama: registered as "spear"; loglikelihood,
loglikelihood_rolling and generate_until equal lm-eval's own HFLM on the same model; and lm-eval's own task
definitions, run on the first items of our task files, build the requests and reach the metrics that
spear.eval.tasks does."""

import json
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.tasks._yaml_loader import load_yaml  # noqa: E402

from spear.eval.lm_eval_adapter import SpearLM  # noqa: E402
from spear.eval.perplexity import data_dir  # noqa: E402
from spear.eval.tasks import evaluate_task, load_docs, loglikelihoods  # noqa: E402

DOCS = 4


@pytest.fixture(scope="module")
def spear_lm(tiny_model_dir):
    lm = get_model("spear").create_from_arg_string(f"path={tiny_model_dir}", {"batch_size": 3, "device": "cpu"})
    assert isinstance(lm, SpearLM) and lm.max_length == 512 and lm.batch_size == 3
    return lm


@pytest.fixture(scope="module")
def hflm(spear_lm):
    return HFLM(pretrained=spear_lm.model, tokenizer=spear_lm.tokenizer, batch_size=3)


def _instances(kind, args):
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihood_equals_hflm_and_our_scorer(spear_lm, hflm):
    pairs = [r for task in ("arc_easy", "winogrande", "lambada_openai") for d in load_docs(task, 2) for r in d.requests]
    pairs.append(("", " empty context"))
    ours = spear_lm.loglikelihood(_instances("loglikelihood", pairs), disable_tqdm=True)
    theirs = hflm.loglikelihood(_instances("loglikelihood", pairs), disable_tqdm=True)
    assert len(ours) == len(pairs) and all(isinstance(ll, float) and isinstance(g, bool) for ll, g in ours)
    assert [g for _, g in ours] == [g for _, g in theirs]
    assert [ll for ll, _ in ours] == pytest.approx([ll for ll, _ in theirs], abs=1e-4)
    direct = loglikelihoods(spear_lm.model, spear_lm.tokenizer, pairs, 5, progress=False)
    assert [ll for ll, _ in ours] == pytest.approx([ll for ll, _ in direct], abs=1e-5)


def test_loglikelihood_rolling_equals_hflm(tiny_model_dir, spear_lm):
    short = SpearLM(str(tiny_model_dir), device="cpu", max_length=96)  # windows of 96 tokens
    hflm = HFLM(pretrained=short.model, tokenizer=short.tokenizer, batch_size=3, max_length=96)
    texts = ["short text", "a longer text that spans several windows of 96 tokens. " * 5]
    ours = short.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in texts]), True)
    theirs = hflm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in texts]), True)
    assert all(isinstance(x, float) for x in ours) and ours == pytest.approx(theirs, abs=1e-3)
    assert ours[1] < ours[0] < 0


def test_generate_until_equals_hflm(spear_lm, hflm):
    requests = [("Question: why?\nAnswer:", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}),
                ("abc", {"until": "x", "max_gen_toks": 6})]
    ours = spear_lm.generate_until(_instances("generate_until", requests), disable_tqdm=True)
    hflm_single = HFLM(pretrained=spear_lm.model, tokenizer=spear_lm.tokenizer, batch_size=1)
    theirs = hflm_single.generate_until(_instances("generate_until", requests), disable_tqdm=True)
    assert ours == theirs and all(isinstance(t, str) for t in ours)
    assert "\n" not in ours[0] and "x" not in ours[1]


def _hf_rows(task):
    """The first DOCS items of our file in the schema of the Hugging Face copy that lm-eval's task reads."""
    folder = data_dir() / "tasks" / task

    def rows(name):
        return [json.loads(line) for line in (folder / name).read_text().splitlines()[:DOCS]]

    if task == "arc_easy":
        return [{"question": r["question"]["stem"], "answerKey": r["answerKey"],
                 "choices": {"text": [c["text"] for c in r["question"]["choices"]],
                             "label": [c["label"] for c in r["question"]["choices"]]}} for r in rows("ARC-Easy-Test.jsonl")]
    if task == "piqa":
        labels = (folder / "valid-labels.lst").read_text().split()
        return [{**r, "label": int(label)} for r, label in zip(rows("valid.jsonl"), labels)]
    if task == "boolq":  # SuperGLUE's passage is "title -- passage"
        return [{"question": r["question"], "passage": f"{r['title']} -- {r['passage']}", "label": int(r["answer"])}
                for r in rows("dev.jsonl")]
    if task == "winogrande":
        return rows("dev.jsonl")
    if task == "lambada_openai":
        return rows("lambada_test.jsonl")
    raise AssertionError(task)


@pytest.mark.parametrize("task, yaml_path", [("arc_easy", "arc/arc_easy.yaml"), ("piqa", "piqa/piqa.yaml"),
                                             ("boolq", "super_glue/boolq/default.yaml"),
                                             ("winogrande", "winogrande/default.yaml"),
                                             ("lambada_openai", "lambada/lambada_openai.yaml")])
def test_lm_evals_own_task_gives_our_requests_and_metrics(spear_lm, task, yaml_path, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / f"{task}.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in _hf_rows(task)))
    config = load_yaml(Path(lm_eval.__file__).parent / "tasks" / yaml_path)
    config.pop("tag", None)
    config.update(dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": {"test": str(data)}},
                  training_split=None, validation_split=None, test_split="test")
    out = lm_eval.simple_evaluate(model=spear_lm, tasks=[config], num_fewshot=0, log_samples=True,
                                  task_manager=TaskManager(include_defaults=False))  # no index of lm-eval's tasks
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    assert [[tuple(a) for a in s["arguments"]] for s in samples] == [d.requests for d in load_docs(task, DOCS)]
    ours = evaluate_task(spear_lm.model, spear_lm.tokenizer, task, DOCS, progress=False)
    theirs = {key.split(",")[0]: value for key, value in out["results"][task].items() if key.endswith(",none")}
    for name, value in ours.metrics.items():
        assert theirs[name] == pytest.approx(value, rel=1e-4), name
