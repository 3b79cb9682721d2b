"""What a benchmark result needs to say about the machine it ran on: the CPU's model and the
vector-ISA flags that decide which kernels ran, the load, and the read bandwidth measured in the
same minutes (the bound a memory-bound kernel is judged against)."""

from __future__ import annotations

import os
import platform
import time
from typing import Any

# Environment that narrows what the libraries use (an AVX2-only CPU reproduced on a larger one).
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
           "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
             "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16")


def cpu_info() -> dict[str, Any]:
    """CPU model name, cores, and which of ISA_FLAGS it has (from /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model": model, "cpus": os.cpu_count(),
            "isa_flags": [f for f in ISA_FLAGS if f in flags],
            "isa_env": {k: os.environ[k] for k in ISA_ENV if k in os.environ},
            "load_avg": list(os.getloadavg())}


def read_bandwidth_gb_s(mib: int = 512, repeats: int = 5) -> float:
    """Best-of-`repeats` read bandwidth: a sum over `mib` MiB of fp32 (larger than any cache),
    with torch's threads."""
    import torch

    src = torch.ones(mib << 18, dtype=torch.float32)
    src.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t0)
    return src.numel() * 4 / best / 1e9
