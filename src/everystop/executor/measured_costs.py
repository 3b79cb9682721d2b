"""The preemption cost model's two measurements (prefill tokens/s, swap bytes/s), cached on
disk per machine and model so that a start-up after the first skips them (two warm-up
forward passes and a copy: seconds on a busy CPU).

The key names everything the numbers depend on: the model file (path, size, mtime), dtypes,
quantization, the kernel backends and the build of the kernel sources (`kernel_build_id`),
device, thread count, the CPU's model name and the torch version. An entry is measured again
when it is older than MAX_AGE_S, and the engine overwrites its prefill rate with the live
step-cost fit's (`record_live_prefill_rate`) when the two disagree by a large factor: one
start-up measured under contention must not steer every later start on this machine. A cache
that cannot be read or written is ignored: the numbers are then measured, as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

from everystop.config import cache_dir

# An entry older than this is measured again (a new BIOS setting, a kernel update, a
# neighbour that has moved in or out: nothing in the key sees those).
MAX_AGE_S = 7 * 24 * 3600.0
_KERNEL_SOURCES = Path(__file__).parent / "layers" / "csrc"


def kernel_build_id() -> str:
    """A digest of the CPU kernel sources: a rebuilt library (a kernel change) is another key."""
    digest = hashlib.sha256()
    try:
        for path in sorted(_KERNEL_SOURCES.iterdir()):
            if path.is_file():
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
    except OSError:
        return "unknown"
    return digest.hexdigest()[:12]


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


def _key(model_path: str, settings: dict[str, object]) -> str:
    import torch

    st = os.stat(model_path)
    key_src = json.dumps({"model": [os.path.abspath(model_path), st.st_size, st.st_mtime_ns],
                          "cpu": _cpu_name(), "torch": torch.__version__, **settings},
                         sort_keys=True, default=str)
    return hashlib.sha256(key_src.encode()).hexdigest()[:16]


def _read_table() -> dict[str, object]:
    try:
        with open(_cache_file()) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _write_table(table: dict[str, object]) -> None:
    path = _cache_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(table, f)
        os.replace(tmp, path)  # atomic: readers see the old table or the new one
    except OSError:
        pass


def cached_costs(model_path: str, settings: dict[str, object],
                 measure: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """(prefill tokens/s, swap bytes/s) from the cache, or from `measure()` (then stored)."""
    key = _key(model_path, settings)
    table = _read_table()
    entry = table.get(key)
    # NOTE: entries of the old format (a bare [prefill, swap] list, no date) count as stale.
    if (isinstance(entry, dict) and isinstance(entry.get("measured_at"), (int, float))
            and time.time() - entry["measured_at"] < MAX_AGE_S):
        return float(entry["prefill"]), float(entry["swap"])
    prefill, swap = measure()
    table[key] = {"prefill": prefill, "swap": swap, "measured_at": time.time(),
                  "source": "start-up"}
    _write_table(table)
    return prefill, swap


def record_live_prefill_rate(model_path: str, settings: dict[str, object],
                             prefill_tokens_per_s: float) -> None:
    """Overwrite the cached prefill rate with one the live step-cost fit measured over many
    passes (the swap figure and the entry's age are kept)."""
    key = _key(model_path, settings)
    table = _read_table()
    entry = table.get(key)
    if not isinstance(entry, dict):
        return
    entry.update(prefill=prefill_tokens_per_s, source="live fit")
    _write_table(table)
