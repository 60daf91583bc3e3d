"""Evaluation: token perplexity on WikiText-2 and PTB."""

from spear.eval.perplexity import DATASETS, PerplexityResult, perplexity

__all__ = ["DATASETS", "PerplexityResult", "perplexity"]
