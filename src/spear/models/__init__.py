"""Model loading (HF directories, GGUF files, the embedded default) and architecture helpers."""

from spear.models.loading import LoadedModel, default_device, load_float_model, resolve_model_path

__all__ = ["LoadedModel", "default_device", "load_float_model", "resolve_model_path"]
