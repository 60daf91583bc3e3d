"""lm-evaluation-harness `LM` adapter, registered as "spear": any SPEAR artifact or model under lm-eval's tasks.

    spear-lm-eval run --model spear --model_args path=DIR[,dtype=float16,max_length=N] --device cuda --tasks arc_easy
    python: `import spear.eval.lm_eval_adapter`, then `lm_eval.simple_evaluate(model="spear", model_args="path=DIR")`

The device comes from lm-eval's own --device (default: CUDA when present), the batch size from --batch_size.

lm-eval (0.4) finds models only in its own table or among classes already imported, so the plain `lm_eval` command
cannot see this one: `spear-lm-eval` is lm-eval's own command line with this module imported first. Only this
module imports lm-eval; the rest of SPEAR runs without it. Scoring is spear.eval.tasks' (lm-eval's HFLM semantics:
tokenization split, truncation, greedy flag, rolling windows); generation is greedy.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from spear.errors import SpearError, require_module
from spear.eval.tasks import context_length, loglikelihoods, rolling_loglikelihood_requests, score_tokens

require_module("lm_eval", "the lm-eval adapter")
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@register_model("spear")
class SpearLM(LM):
    """model_args: path (artifact dir, HF dir, .gguf or 'smollm2'), dtype, max_length, max_gen_toks."""

    def __init__(self, path: str = "smollm2", device: str | None = None, dtype: str | None = None,
                 batch_size: int | str | None = 16, max_length: int | None = None, max_gen_toks: int = 256,
                 **_lm_eval_options) -> None:
        from spear import api

        super().__init__()
        if dtype is not None and dtype not in DTYPES:
            raise SpearError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        loaded = api.load(path, torch.device(device) if device else None, DTYPES.get(dtype))
        self.model, self.tokenizer, self.path = loaded.model, loaded.tokenizer, path
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 16  # "auto" → 16
        self.max_length = int(max_length) if max_length else context_length(self.model)
        self.max_gen_toks = int(max_gen_toks)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def tokenizer_name(self) -> str:
        return self.path

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [request.args for request in requests]
        results = loglikelihoods(self.model, self.tokenizer, pairs, self.batch_size, not disable_tqdm,
                                 max_length=self.max_length)
        for pair, result in zip(pairs, results):
            self.cache_hook.add_partial("loglikelihood", pair, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows = [rolling_loglikelihood_requests(self.tokenizer, request.args[0], self.max_length)
                   for request in requests]
        scored = score_tokens(self.model, [w for text in windows for w in text], self.batch_size, not disable_tqdm,
                              "rolling log-likelihoods", max_length=self.max_length)
        totals, at = [], 0
        for request, text in zip(requests, windows):
            totals.append(sum(ll for ll, _ in scored[at : at + len(text)]))
            at += len(text)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, totals[-1])
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context, cut before the first stop string (lm-eval's `until`) and after
        `max_gen_toks` tokens; the context keeps its last max_length - max_gen_toks tokens."""
        eos = self.tokenizer.decode([self.tokenizer.eos_token_id])
        outputs = []
        for request in tqdm(requests, desc="generate_until", disable=disable_tqdm):
            context, options = request.args
            options = dict(options)
            if options.pop("do_sample", False) and options.get("temperature", 0.0) > 0:
                raise SpearError("the spear lm-eval adapter generates greedily only (do_sample=False)")
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(options.get("max_gen_toks", self.max_gen_toks))
            ids = self.tokenizer.encode(context)[-(self.max_length - max_new) :]
            out = self.model.generate(torch.tensor([ids], device=self.device), max_new_tokens=max_new, do_sample=False,
                                      stop_strings=[*until, eos], tokenizer=self.tokenizer,
                                      pad_token_id=self.tokenizer.eos_token_id)
            text = self.tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", request.args, text)
            outputs.append(text)
        return outputs


def main() -> None:
    """`spear-lm-eval`: lm-eval's command line, with the "spear" model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
