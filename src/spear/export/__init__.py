"""Exports of an artifact to other serving stacks (vllm.py: vLLM's compressed-tensors W4A16 plus the ECs)."""
