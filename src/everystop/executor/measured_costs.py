"""The preemption cost model's two measurements (prefill tokens/s, swap bytes/s), cached on
disk per machine and model so that a start-up after the first skips them (two warm-up
forward passes and a copy: seconds on a busy CPU).

The key names everything the numbers depend on: the model file (path, size, mtime), dtypes,
device, thread count, the CPU's model name and the torch version. A cache that cannot be read
or written is ignored: the numbers are then measured, as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable

from everystop.config import cache_dir


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cache_file() -> str:
    return os.path.join(cache_dir(), "preemption_costs.json")


def cached_costs(model_path: str, settings: dict[str, object],
                 measure: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """(prefill tokens/s, swap bytes/s) from the cache, or from `measure()` (then stored)."""
    import torch

    st = os.stat(model_path)
    key_src = json.dumps({"model": [os.path.abspath(model_path), st.st_size, st.st_mtime_ns],
                          "cpu": _cpu_name(), "torch": torch.__version__, **settings},
                         sort_keys=True, default=str)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    path = _cache_file()
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        table = {}
    if isinstance(table, dict) and isinstance(table.get(key), list) and len(table[key]) == 2:
        prefill, swap = table[key]
        return float(prefill), float(swap)
    prefill, swap = measure()
    table = table if isinstance(table, dict) else {}
    table[key] = [prefill, swap]
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(table, f)
        os.replace(tmp, path)  # atomic: readers see the old table or the new one
    except OSError:
        pass
    return prefill, swap
