"""The library entry points the CLI calls: load anything, quantize to an artifact, evaluate."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from spear.artifact import ArtifactInfo, is_artifact, load_artifact, save_artifact
from spear.errors import SpearError
from spear.data.calibration import CalibConfig, calibration_ids, calibration_record, text_file_ids
from spear.models.layerwise import check_walkable
from spear.models.loading import (
    LoadedModel, checkpoint_dir, default_device, load_float_model, load_tokenizer, resolve_model_path,
)
from spear.quant.pipeline import QuantSettings, check_shapes, quantize_model
from spear.record import QuantConfig
from spear.util import release_freed_memory, stage_done

if TYPE_CHECKING:
    from spear.compensate.pipeline import CompensateConfig, CompensateReport


def load(spec: str, device: torch.device | None = None, dtype: torch.dtype | None = None,
         serving: bool = False, dense: bool = True) -> LoadedModel:
    """A SPEAR artifact directory, an HF model directory, a GGUF file, or 'smollm2'. `serving`: an artifact's
    linears come without their dequantized copies (the runtime packs them: runtime.model.use_kernels). `dense=False`
    (evaluation): transformers' model whose linears dequantize their codes as they run, the values of the dense copy
    they do not hold, so the same outputs in the memory of the 4-bit model and one layer's weight."""
    if is_artifact(spec):
        return load_artifact(spec, device, dtype, dense=dense and not serving, plain=serving)
    return load_float_model(spec, device, dtype)


def model_key(spec: str) -> str:
    """A stable key for caches: the resolved path with its size and mtime."""
    path = resolve_model_path(spec)
    stat = path.stat()
    return f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def quantize(
    spec: str,
    settings: QuantSettings,
    out_dir: str | Path,
    calib: CalibConfig = CalibConfig(),
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Quantize the float model `spec` and write the artifact to `out_dir` (atomically). Every method reads the
    checkpoint a decoder layer at a time (quant.streaming, in float32) where its tensor names allow; self-sampled
    calibration data still needs the float model whole (loaded, sampled and freed first), a text file does not."""
    from spear.quant.streaming import STREAMED_METHODS, quantize_checkpoint, streamable_skeleton

    info = ArtifactInfo(base_model=spec, quant={"method": settings.method, **settings.quant.to_dict(),
                                                 **_method_options(settings)})
    streamed = settings.method in STREAMED_METHODS and dtype in (None, torch.float32)
    if streamed and (skeleton := streamable_skeleton(hf_dir := checkpoint_dir(spec))) is not None:
        tokenizer = load_tokenizer(spec)
        ids = None
        if settings.method != "rtn":
            check_shapes(skeleton, settings.quant)
            ids = _calibration_for_walk(spec, tokenizer, calib, device)
            info.calibration = calibration_record(calib, ids)
        return quantize_checkpoint(hf_dir, skeleton, tokenizer, settings, Path(out_dir), info, ids,
                                   None if ids is None else device or default_device())  # RTN: on the host
    lm = load_float_model(spec, device, dtype)
    check_shapes(lm.model, settings.quant)
    ids = None
    if settings.method != "rtn":
        check_walkable(lm.model, calib.seq_len)
        ids = calibration_ids(lm.model, lm.tokenizer, calib, model_key(spec))
        info.calibration = calibration_record(calib, ids)
    quantize_model(lm.model, settings, ids)
    return save_artifact(lm.model, lm.tokenizer, out_dir, info)


def _calibration_for_walk(spec: str, tokenizer, calib: CalibConfig, device: torch.device | None) -> torch.Tensor:
    """Calibration ids for a quantizer that walks the checkpoint: a text file's windows without the model, or
    self-samples, for which the float model is loaded (and its replay checked), then freed before the walk."""
    if calib.text_file:
        return text_file_ids(tokenizer, Path(calib.text_file), calib)
    lm = load_float_model(spec, device)
    check_walkable(lm.model, calib.seq_len)
    ids = calibration_ids(lm.model, lm.tokenizer, calib, model_key(spec))
    del lm
    release_freed_memory()
    return ids


def _method_options(settings: QuantSettings) -> dict:
    if settings.method == "gptq":
        return {"damp": settings.gptq_damp, "block_size": settings.gptq_block_size, "act_order": settings.gptq_act_order}
    if settings.method == "awq":
        return {"grid": settings.awq_grid}
    if settings.method == "omniquant":
        return {"epochs": settings.omniquant_epochs, "lr": settings.omniquant_lr}
    return {}


def _check_compensate_memory(path: Path, config: dict, cfg: "CompensateConfig", calib: CalibConfig,
                             device: torch.device | None) -> None:
    """Refuse, before loading anything, a compensation whose estimated peak does not fit the device
    (compensate.precision.compensate_bytes, with HEADROOM over what is to come, beside what the process holds):
    one line naming the parts and what to change."""
    from spear.compensate.precision import compensate_bytes
    from spear.memory import HEADROOM, gib, process_bytes, require
    from spear.models.loading import default_dtype

    device = device or default_device()
    parts = compensate_bytes(path, config, default_dtype(device), device, cfg, calib)
    student, teacher = parts.pop("student"), parts.pop("teacher")
    stage, peak = max(parts.items(), key=lambda kv: kv[1])
    held, to_come = process_bytes(device), student + teacher + peak
    detail = f"process {gib(held)} + student {gib(student)} + teacher {gib(teacher)} + {stage} {gib(peak)}"
    advice = ("lower --calib-kv-gb (the self-sampler's KV cache), or use a device with more memory"
              if stage == "self-sampling" else
              "try --calib-precision bfloat16, --checkpoint-layers, or a device with more memory")
    require(to_come, device, f"compensating {path} ({detail})", advice)
    print(f"compensate: estimated peak {gib(held + HEADROOM * to_come)} ({detail}, "
          f"+{HEADROOM - 1:.0%} for the allocator)", file=sys.stderr, flush=True)


def compensate_artifact(
    artifact_dir: str | Path,
    cfg: "CompensateConfig",
    calib: CalibConfig = CalibConfig(),
    device: torch.device | None = None,
) -> "CompensateReport":
    """Add ECs to a quantized artifact, in place (atomically); the float model is its base model."""
    from spear.artifact import read_artifact_config
    from spear.compensate.pipeline import compensate
    from spear.compensate.refit import REFITTABLE, Rounding, check_refit

    config = read_artifact_config(artifact_dir)
    if config["base_model"] is None:
        raise SpearError(f"{artifact_dir} was imported without its float model: re-import it with --base MODEL")
    method = config["quant"].get("method")
    check_refit(cfg.rerounds_codes, method)
    _check_compensate_memory(Path(artifact_dir), config, cfg, calib, device)
    start = time.perf_counter()
    student = load_artifact(artifact_dir, device)
    teacher = load_float_model(config["base_model"], device, next(student.model.parameters()).dtype)
    loaded = time.perf_counter()
    stage_done("load", loaded - start, cfg.calibrate.progress)
    check_walkable(teacher.model, calib.seq_len)
    ids = calibration_ids(teacher.model, teacher.tokenizer, calib, model_key(config["base_model"]))
    sampled = time.perf_counter()
    stage_done("calibration sequences", sampled - loaded, cfg.calibrate.progress)
    # the artifact records the grid, not GPTQ's dampening and order: those are QuantSettings' defaults; imported
    # artifacts name no quantizer of SPEAR's (QuantSettings would refuse their method)
    rounding = Rounding.of(QuantSettings(method, QuantConfig.from_dict(config["quant"])) if method in REFITTABLE
                           else None)
    report = compensate(student.model, teacher.model, ids, cfg, rescaled=method == "awq", rounding=rounding)
    report.seconds = {"load": loaded - start, "calibration_ids": sampled - loaded} | report.seconds
    info = ArtifactInfo(config["base_model"], config["quant"], calibration_record(calib, ids),
                        plan=json.loads(report.plan.to_json()), extra={"compensation": report.summary()})
    save_artifact(student.model, student.tokenizer, artifact_dir, info)
    report.save_diagnostics(artifact_dir)
    return report
