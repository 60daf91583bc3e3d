"""Evaluation: token perplexity on WikiText-2 and PTB; zero-shot tasks scored as lm-eval scores them."""

from spear.eval.perplexity import DATASETS, PerplexityResult, perplexity
from spear.eval.tasks import TASKS, TaskResult, evaluate_tasks

__all__ = ["DATASETS", "PerplexityResult", "TASKS", "TaskResult", "evaluate_tasks", "perplexity"]
