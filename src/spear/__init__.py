"""SPEAR: 4-bit LLMs with input-adaptive error compensators."""

__version__ = "0.1.0"

from spear.errors import SpearError

__all__ = ["SpearError", "__version__"]
