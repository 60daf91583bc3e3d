"""spear-vllm: a vLLM plugin that serves `spear export-vllm` directories with their input-adaptive ECs.

Installed beside vLLM (`pip install plugins/spear_vllm`), vLLM calls `register` in every process through the
entry point group vllm.general_plugins; it registers the "spear" quantization method (spear_vllm.quant).
"""


def register() -> None:
    import spear_vllm.quant  # noqa: F401  (registering is importing; vLLM may call this more than once)
