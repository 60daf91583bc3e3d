"""Zero-shot task scoring on a tiny random Llama: requests as lm-eval builds them, log-likelihoods checked against a
direct forward pass, metrics against hand-made results, the CLI end to end."""

import json
import math
import tempfile

import pytest
import torch
import torch.nn.functional as F

from spear.cli import main
from spear.errors import SpearError
from spear.eval.tasks import (
    TASKS, Doc, encode_pair, evaluate_task, load_docs, loglikelihoods, parse_tasks, rolling_loglikelihood_requests,
    score_tokens, task_metrics,
)
from spear.models import load_float_model


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_float_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)


def test_every_task_loads_with_its_readme_counts():
    counts = {"lambada_openai": 5153, "arc_easy": 2376, "arc_challenge": 1172, "piqa": 1838, "winogrande": 1267,
              "boolq": 3270, "hellaswag": 10042}
    for task in TASKS:
        docs = load_docs(task)
        assert len(docs) == counts[task], task
        assert all(0 <= d.gold < len(d.requests) for d in docs), task
    assert len(load_docs("piqa", limit=5)) == 5


def test_requests_are_lm_evals():
    arc = load_docs("arc_easy", 1)[0]
    assert arc.requests[0] == ("Question: Which statement best explains why photosynthesis is the foundation of most "
                               "food webs?\nAnswer:", " Sunlight is the source of energy for nearly all ecosystems.")
    assert arc.gold == 0 and len(arc.requests) == 4
    wino = load_docs("winogrande", 1)[0]
    assert wino.requests == [("Sarah was a much better surgeon than Maria so Sarah", " always got the easier cases."),
                             ("Sarah was a much better surgeon than Maria so Maria", " always got the easier cases.")]
    assert wino.gold == 1
    boolq = load_docs("boolq", 1)[0]
    assert boolq.requests[0][0].startswith("Ethanol fuel -- All biomass goes through")
    assert boolq.requests[0][0].endswith("\nQuestion: does ethanol take more energy make that produces?\nAnswer:")
    assert [c for _, c in boolq.requests] == [" no", " yes"] and boolq.gold == 0
    lambada = load_docs("lambada_openai", 1)[0]
    context, target = lambada.requests[0]
    assert target.startswith(" ") and " " not in target[1:] and context + target == json.loads(
        (open_task_file("lambada_openai/lambada_test.jsonl").readline()))["text"]
    hella = load_docs("hellaswag", 1)[0]
    assert hella.requests[3] == ("Roof shingle removal: A man is sitting on a roof. he",
                                 " starts pulling up roofing on a roof.") and hella.gold == 3


def open_task_file(relative):
    from spear.eval.perplexity import data_dir

    return open(data_dir() / "tasks" / relative, encoding="utf-8")


def test_encode_pair_moves_trailing_spaces_and_handles_empty_context(tiny):
    tok = tiny.tokenizer
    context, continuation = encode_pair(tok, "Answer: ", "yes")
    assert context == tok.encode("Answer:") and continuation == tok.encode("Answer: yes")[len(context):]
    context, continuation = encode_pair(tok, "", " yes")
    assert context == [tok.bos_token_id] and continuation == tok.encode(" yes", add_special_tokens=False)


def test_loglikelihoods_match_a_direct_forward_pass(tiny):
    requests = [("Question: why?\nAnswer:", " because"), ("ab", " c"), ("The long context " * 5, "end"), ("", " x")]
    got = loglikelihoods(tiny.model, tiny.tokenizer, requests, batch_size=3, progress=False)
    for (context, continuation), (ll, greedy) in zip(requests, got):
        ctx, cont = encode_pair(tiny.tokenizer, context, continuation)
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logprobs = F.log_softmax(tiny.model(ids).logits[0, len(ctx) - 1 : -1].float(), -1)
        target = torch.tensor(cont)
        assert ll == pytest.approx(logprobs.gather(1, target[:, None]).sum().item(), abs=1e-4)
        assert greedy == bool((logprobs.argmax(-1) == target).all())


def test_greedy_flag_and_truncation_to_the_context(tiny):
    model = tiny.model
    prompt = [5, 6, 7]
    with torch.no_grad():
        next_token = model(torch.tensor([prompt])).logits[0, -1].argmax().item()
    other = (next_token + 1) % 256
    (ll_greedy, greedy), (ll_other, not_greedy) = score_tokens(model, [(prompt, [next_token]), (prompt, [other])],
                                                               progress=False)
    assert greedy and not not_greedy and ll_greedy > ll_other
    # longer than the model's 512 positions: only the last 512 + 1 tokens count, as in lm-eval
    long_context = list(range(3, 253)) * 3  # 750 tokens
    (truncated, _), = score_tokens(model, [(long_context, [9, 10])], progress=False)
    (direct, _), = score_tokens(model, [(long_context[-511:], [9, 10])], progress=False)
    assert truncated == pytest.approx(direct, abs=1e-5)


def test_rolling_windows_cover_every_token_once(tiny):
    tok = tiny.tokenizer
    text = "hello world, " * 30  # 390 byte tokens
    windows = rolling_loglikelihood_requests(tok, text, max_length=128)
    assert [len(c) for _, c in windows] == [128, 128, 128, 6]
    assert sum((c for _, c in windows), []) == tok.encode(text)
    assert windows[0][0] == [tok.bos_token_id] and windows[1][0] == [windows[0][1][-1]]
    ids = tok.encode(text)
    assert windows[3][0] == ids[390 - 128 - 1 : 384]  # the last window: 123 + 6 tokens, so 128 inputs


def test_metrics_follow_lm_eval():
    docs = [Doc([("q", " aa"), ("q", " b")], 0, ["aa", "b"]), Doc([("q", " aaaa"), ("q", " b")], 0, ["aaaa", "b"])]
    # doc 1: acc picks 1 (wrong), acc_norm -2/2 vs -1.5/1 picks 0 (right); doc 2: both pick 0 (right)
    results = [(-2.0, False), (-1.5, False), (-3.0, False), (-3.5, False)]
    metrics, stderr = task_metrics("arc_easy", docs, results)
    assert metrics == {"acc": 0.5, "acc_norm": 1.0} and stderr["acc"] == pytest.approx(0.5)
    ties = task_metrics("boolq", [Doc([("q", " no"), ("q", " yes")], 1, ["no", "yes"])], [(-1.0, 0), (-1.0, 0)])
    assert ties[0] == {"acc": 0.0}  # ties go to the first choice, as numpy's argmax
    lambada = [Doc([("c", " w")], 0, [" w"])] * 2
    metrics, _ = task_metrics("lambada_openai", lambada, [(-1.0, True), (-3.0, False)])
    assert metrics["acc"] == 0.5 and metrics["perplexity"] == pytest.approx(math.exp(2.0))


def test_evaluate_task_on_a_random_model_is_near_chance(tiny):
    result = evaluate_task(tiny.model, tiny.tokenizer, "piqa", limit=6, batch_size=4, progress=False)
    assert result.task == "piqa" and result.docs == 6 and set(result.metrics) == {"acc", "acc_norm"}
    assert all(0.0 <= v <= 1.0 for v in result.metrics.values())


def test_bad_task_names_and_limits():
    assert parse_tasks("arc_easy, piqa") == ["arc_easy", "piqa"] and parse_tasks("all") == list(TASKS)
    with pytest.raises(SpearError, match="unknown task mmlu"):
        parse_tasks("arc_easy,mmlu")
    with pytest.raises(SpearError, match="--limit"):
        evaluate_task(None, None, "piqa", limit=0)


def test_cli_eval_tasks(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "tasks.json"
    assert main(["eval", str(tiny_model_dir), "--tasks", "winogrande,lambada_openai", "--limit", "3",
                 "--device", "cpu", "--json", "--out-json", str(out)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record == json.loads(out.read_text())
    assert [t["task"] for t in record["tasks"]] == ["winogrande", "lambada_openai"]
    assert record["tasks"][1]["docs"] == 3 and record["tasks"][1]["metrics"]["perplexity"] > 1
    assert main(["eval", str(tiny_model_dir), "--tasks", "boolq", "--limit", "2", "--device", "cpu"]) == 0
    assert "boolq" in capsys.readouterr().out
    assert main(["eval", str(tiny_model_dir), "--tasks", "nope"]) == 2
    assert "unknown task nope" in capsys.readouterr().err
    assert main(["eval", "no/such/model", "--tasks", "piqa", "--limit", "0"]) == 2
    assert "--limit must be at least 1" in capsys.readouterr().err


def test_zero_shot_bench_script_writes_fp_and_w4_rows(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import runpy
    import sys
    from pathlib import Path

    out = tmp_path / "zero_shot.json"
    script = Path(__file__).resolve().parents[1] / "bench" / "zero_shot.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--model", str(tiny_model_dir), "--tasks", "piqa,winogrande",
                                      "--limit", "2", "--device", "cpu", "--json", str(out)])
    runpy.run_path(str(script), run_name="__main__")
    record = json.loads(out.read_text())
    assert "commit" in record["provenance"] and record["w4_quant"]["method"] == "rtn" and record["limit"] == 2
    assert list(record["rows"]) == ["FP", "W4"]
    assert [r["task"] for r in record["rows"]["W4"]] == ["piqa", "winogrande"]
    assert capsys.readouterr().out.splitlines()[-1].startswith("W4")


def test_zero_shot_bench_script_builds_the_spear_row(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """--spear: the script quantizes, compensates (--quick: the short calibration) and scores FP, W4 and +SPEAR; the
    temporary artifact is gone afterwards, and the +SPEAR row ran with ECs (its scores are not W4's)."""
    import runpy
    import sys
    from pathlib import Path

    out = tmp_path / "zero_shot.json"
    script = Path(__file__).resolve().parents[1] / "bench" / "zero_shot.py"
    before = set(Path(tempfile.gettempdir()).glob("spear-zero-shot-*"))  # a killed run elsewhere may leave its own
    monkeypatch.setattr(sys, "argv", [str(script), "--model", str(tiny_model_dir), "--spear", "--quick", "--tasks",
                                      "lambada_openai", "--limit", "3", "--device", "cpu", "--json", str(out)])
    runpy.run_path(str(script), run_name="__main__")
    record = json.loads(out.read_text())
    assert record["spear_built"] and record["artifact"] is None and list(record["rows"]) == ["FP", "W4", "+SPEAR"]
    ppl = {row: results[0]["metrics"]["perplexity"] for row, results in record["rows"].items()}
    assert ppl["+SPEAR"] != ppl["W4"]
    assert set(Path(tempfile.gettempdir()).glob("spear-zero-shot-*")) == before
    assert capsys.readouterr().out.splitlines()[-1].startswith("+SPEAR")


def test_zero_shot_bench_script_runs_only_the_rows_asked(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """--rows w4 scores the W4 row alone (one process a row, side by side on one GPU); an unknown row, or the spear
    row without --spear, is a usage error (exit 2)."""
    import runpy
    import sys
    from pathlib import Path

    out = tmp_path / "zero_shot.json"
    script = Path(__file__).resolve().parents[1] / "bench" / "zero_shot.py"
    base = [str(script), "--model", str(tiny_model_dir), "--tasks", "piqa", "--limit", "2", "--device", "cpu",
            "--json", str(out)]
    monkeypatch.setattr(sys, "argv", base + ["--rows", "w4"])
    runpy.run_path(str(script), run_name="__main__")
    assert list(json.loads(out.read_text())["rows"]) == ["W4"]
    for rows, message in (("w4,int8", "unknown rows ['int8']"), ("spear", "needs --spear or --artifact")):
        monkeypatch.setattr(sys, "argv", base + ["--rows", rows])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(script), run_name="__main__")
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
