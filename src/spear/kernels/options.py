"""The kernels' and the runtime model's switches: one frozen record, read from the environment once, here.

Every field is a path that is on by default and kept because its A/B is open or because it is a baseline to time
against (bench/NOTES-kernels.md); the settled ones are gone from the code. The environment variable of each
field, read when this module is first imported (a bad value stops the import with one line naming it):

    SPEAR_PDL=0               launches without programmatic dependent launch (kernels.pdl)
    SPEAR_PDL_LATE=0          W4 dot-loop launches let the next launch start right after their wait, not after
                              their main loop (kernels.pdl.W4Launch.late)
    SPEAR_PDL_LATE_GEMV=0     the same for W4 GEMV-loop launches (a few rows)
    SPEAR_W4_PRELOAD=0        the single-stage GEMV loops load each step's codes in that step, not one step ahead
    SPEAR_W4_EVEN=0           the GEMV loops mask their code loads even where the shape divides
    SPEAR_W4_GEMV_SPLITS="1 2 4"  fixed K splits the tuner also times the one-row GEMV candidates at ("": none)
    SPEAR_F16_GEMV=1          0: float linears stay on cuBLAS; always: the fp16 GEMV kernel even where cuBLAS wins
    SPEAR_FUSE_SWIGLU=0       gate/up's SiLU·up as its own launch, not in the W4 decode launch's epilogue
    SPEAR_FOLD_NORM=0         the add + RMSNorm between W4 decode launches as its own launch
    SPEAR_FOLD_NORM_TP=1      that fold also into tensor parallelism's reduction epilogue (off: level in time)
    SPEAR_DENSE_KERNELS=0     a float model keeps the transformers layout, every linear through cuBLAS
    SPEAR_CPU_W4=0            4-bit linears served on a CPU as dense float32 copies, not through the int4 kernel
                              and the scratch path (kernels.cpu_w4)

Code reads `OPTIONS` through this module (`options.OPTIONS.fold_norm`), so a test or a benchmark may replace it.
The W4 tuning cache's key holds `OPTIONS.changed()` (kernels.tune_cache), so choices timed under other switches
are not reused.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass


def _flag(env: dict[str, str], name: str, default: str) -> bool:
    value = env.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name} is 0 or 1; got {value!r}")
    return value == "1"


def _splits(value: str) -> tuple[int, ...]:
    if not all(s.isdigit() and int(s) > 0 for s in value.split()):
        raise ValueError(f"SPEAR_W4_GEMV_SPLITS is positive integers separated by spaces; got {value!r}")
    return tuple(int(s) for s in value.split())


@dataclass(frozen=True)
class KernelOptions:
    pdl: bool = True
    pdl_late: bool = True
    pdl_late_gemv: bool = True
    w4_preload: bool = True
    w4_even: bool = True
    gemv_splits: tuple[int, ...] = (1, 2, 4)
    f16_gemv: str = "1"  # "0", "1" or "always"
    fuse_swiglu: bool = True
    fold_norm: bool = True
    fold_norm_tp: bool = False
    dense_kernels: bool = True
    cpu_w4: bool = True

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> KernelOptions:
        env = os.environ if env is None else env
        f16_gemv = env.get("SPEAR_F16_GEMV", "1")
        if f16_gemv not in ("0", "1", "always"):
            raise ValueError(f"SPEAR_F16_GEMV is 0, 1 or always; got {f16_gemv!r}")
        return cls(
            pdl=_flag(env, "SPEAR_PDL", "1"),
            pdl_late=_flag(env, "SPEAR_PDL_LATE", "1"),
            pdl_late_gemv=_flag(env, "SPEAR_PDL_LATE_GEMV", "1"),
            w4_preload=_flag(env, "SPEAR_W4_PRELOAD", "1"),
            w4_even=_flag(env, "SPEAR_W4_EVEN", "1"),
            gemv_splits=_splits(env.get("SPEAR_W4_GEMV_SPLITS", "1 2 4")),
            f16_gemv=f16_gemv,
            fuse_swiglu=_flag(env, "SPEAR_FUSE_SWIGLU", "1"),
            fold_norm=_flag(env, "SPEAR_FOLD_NORM", "1"),
            fold_norm_tp=_flag(env, "SPEAR_FOLD_NORM_TP", "0"),
            dense_kernels=_flag(env, "SPEAR_DENSE_KERNELS", "1"),
            cpu_w4=_flag(env, "SPEAR_CPU_W4", "1"),
        )

    def changed(self) -> str:
        """The fields off their defaults, as `name=value` joined by commas ("" at the defaults)."""
        default = KernelOptions()
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if getattr(self, f.name) != getattr(default, f.name))


OPTIONS = KernelOptions.from_env()
