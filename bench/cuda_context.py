"""What a CUDA context takes on the device before any model tensor, against `spear.memory.CUDA_CONTEXT`, the figure
every GPU memory estimate adds for it (issue 50). nvidia-smi's per-process used memory, read after each stage:

    context     the first tensor (the driver's context, the caching allocator's first block)
    cublas      a float16 matmul (cuBLAS and its workspace)
    triton      SPEAR's W4 decode kernel, one launch (the module loads of a compiled kernel)

    python bench/cuda_context.py --json bench/results/memory/cuda_context_h100.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import write_json  # noqa: E402

from spear.memory import CUDA_CONTEXT  # noqa: E402


def used_by_this_process() -> int:
    """This process's device memory in bytes, as nvidia-smi counts it (the context, modules and allocator blocks)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        if int(pid) == os.getpid():
            return int(mib) * 2**20
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_context.py measures a CUDA context: run it on the GPU machine")
    stages = {}
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    stages["context"] = used_by_this_process()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    (a @ a).sum().item()
    stages["cublas"] = used_by_this_process()
    from spear.record import QuantConfig, rtn_quantize
    from spear.kernels.pack import pack_w4
    from spear.kernels.w4 import w4_linear

    w = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    packed = pack_w4(rtn_quantize(w.float(), QuantConfig(bits=4, group_size=-1)))
    w4_linear(torch.randn(1, 4096, device="cuda", dtype=torch.float16), packed).sum().item()
    stages["triton"] = used_by_this_process()
    allocated = torch.cuda.memory_reserved()
    record = {"estimate_bytes": CUDA_CONTEXT, "used_bytes": stages,
              "allocator_reserved_bytes": allocated,
              "beyond_tensors_bytes": {k: v - (allocated if k == "triton" else 0) for k, v in stages.items()},
              "command": "python bench/cuda_context.py --json F"}
    write_json(args.json, record)
    for k, v in stages.items():
        print(f"{k:8s} {v / 2**20:8.0f} MiB")
    print(f"estimate {CUDA_CONTEXT / 2**20:8.0f} MiB; allocator reserved {allocated / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
