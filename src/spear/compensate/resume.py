"""Resumable calibration: the KL training's state is written at every held-out scoring to one safetensors file,
so that a run cut short (a time limit, a preempted machine) goes on from its last scoring when it is started again
with the same checkpoint directory (`spear compensate --calib-checkpoint DIR`).

What is kept: the trained tensors as they are and as they were at the best held-out scoring, Adam's moments, and
in the file's metadata the step, the LR, the best step and KL, the scorings so far and a fingerprint of what the
training depends on: its settings (not how it reports or batches its scoring), the calibration ids and the plan
(every trained tensor's name and shape). A checkpoint of another training is refused in one line, never resumed.
The batches are replayed from the seed up to the step (index arithmetic, no compute), so a resumed training takes
the batches an uninterrupted one would. The file is written to a temporary name and renamed into place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spear.errors import SpearError

FILE = "calibration_state.safetensors"
NOT_TRAINING = ("progress", "checkpoint_dir", "eval_batch_size", "cuda_graph", "teacher_cache_gb")


def fingerprint(cfg, calib_ids: torch.Tensor, trained: dict[str, torch.Tensor]) -> str:
    """What a resumed training must share with the one that wrote the checkpoint (module docstring)."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_TRAINING}
    digest = hashlib.sha256(repr(sorted(settings.items())).encode())
    digest.update(calib_ids.detach().cpu().contiguous().numpy().tobytes())
    digest.update(repr(sorted((k, tuple(t.shape)) for k, t in trained.items())).encode())
    return digest.hexdigest()[:32]


@dataclass
class TrainingState:
    """Where a training stands at a held-out scoring."""

    step: int
    trained: dict[str, torch.Tensor]
    best: dict[str, torch.Tensor]
    best_step: int
    best_kl: float | None
    bad: int  # scorings without improvement since the best
    initial_train_kl: float
    initial_heldout_kl: float | None
    history: list[dict]
    optimizer: dict  # torch.optim.Optimizer.state_dict()
    lrs: list[float]  # each parameter group's LR at `step`


class CalibrationCheckpoint:
    def __init__(self, directory: str | Path, fingerprint: str):
        self.path = Path(directory) / FILE
        self.fingerprint = fingerprint

    def save(self, state: TrainingState) -> None:
        tensors = {f"trained.{k}": v for k, v in state.trained.items()}
        tensors |= {f"best.{k}": v for k, v in state.best.items()}
        scalars = {}  # Adam's state that is not a tensor (its step count, in some torch versions)
        for index, entry in state.optimizer["state"].items():
            for key, value in entry.items():
                if torch.is_tensor(value):
                    tensors[f"adam.{index}.{key}"] = value
                else:
                    scalars[f"{index}.{key}"] = value
        meta = {"fingerprint": self.fingerprint, "step": state.step, "best_step": state.best_step,
                "best_kl": state.best_kl, "bad": state.bad, "initial_train_kl": state.initial_train_kl,
                "initial_heldout_kl": state.initial_heldout_kl, "history": state.history, "lrs": state.lrs,
                "scalars": scalars}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{FILE}.{os.getpid()}.tmp")
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"spear": json.dumps(meta)})
        os.replace(tmp, self.path)

    def load(self) -> TrainingState | None:
        """The saved state, on the host (None: no checkpoint yet); SpearError for a checkpoint of another training.
        Adam's tensors go to their parameters' devices in Optimizer.load_state_dict, its step counts stay on the
        host as Adam keeps them; the trained tensors are copied into place."""
        if not self.path.exists():
            return None
        with safe_open(str(self.path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("spear", "{}"))
            if meta.get("fingerprint") != self.fingerprint:
                raise SpearError(f"{self.path} is the checkpoint of another calibration (other settings, calibration "
                                 "ids or plan): remove it or give another --calib-checkpoint directory")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        optimizer_state: dict[int, dict] = {}
        for name, value in tensors.items():
            if name.startswith("adam."):
                _, index, key = name.split(".", 2)
                optimizer_state.setdefault(int(index), {})[key] = value
        for name, value in meta["scalars"].items():
            index, key = name.split(".", 1)
            optimizer_state.setdefault(int(index), {})[key] = value
        part = {prefix: {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
                for prefix in ("trained.", "best.")}
        return TrainingState(meta["step"], part["trained."], part["best."], meta["best_step"], meta["best_kl"],
                             meta["bad"], meta["initial_train_kl"], meta["initial_heldout_kl"], meta["history"],
                             {"state": optimizer_state}, meta["lrs"])
