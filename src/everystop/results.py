"""The one way a benchmark or simulator command reports: its result JSON inside one envelope,
printed and written to `--out`.

The envelope says what a reader needs to trust or redo the numbers: the command line, the git
commit (and whether the tree had changes), the machine (CPU model, cores, the vector-ISA flags
that decide which kernels ran, the environment that narrows them, the load averages when the
result was written: 1, 5 and 15 minutes, so the whole run's load shows), and the roofline the
result sits under (None when the command measured none).
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

# Environment that narrows what the libraries use (an AVX2-only CPU reproduced on a larger one).
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
           "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
             "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16")


def cpu_info() -> dict[str, Any]:
    """CPU model name, cores, and which of ISA_FLAGS it has (from /proc/cpuinfo), the ISA
    environment, the load averages and the Python interpreter.

    `cpu_id` ("family 25 model 17 stepping 1", where /proc/cpuinfo says): a VM may show every
    CPU it runs on under one model name ("AMD EPYC"), while two such machines differ ~2x in
    pure Python speed here; the family and model tell them apart."""
    model, flags = platform.processor() or platform.machine(), set()
    ids: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                elif key in ("cpu family", "model", "stepping") and key not in ids:
                    ids[key] = line.split(":", 1)[1].strip()
    except OSError:
        pass
    cpu_id = " ".join(f"{k.removeprefix('cpu ')} {ids[k]}"
                      for k in ("cpu family", "model", "stepping") if k in ids)
    return {"model": model, "arch": platform.machine(), "cpus": os.cpu_count(),
            **({"cpu_id": cpu_id} if cpu_id else {}),
            "isa_flags": [f for f in ISA_FLAGS if f in flags],
            "isa_env": {k: os.environ[k] for k in ISA_ENV if k in os.environ},
            "load_avg": list(os.getloadavg()), "python": python_info()}


def python_info() -> str:
    """The interpreter that ran it, e.g. "cpython 3.11.2" or "pypy 3.11.11 (7.3.19)
    PYPY_GC_NURSERY=256MB": pure Python code's speed depends on it, and on the settings of
    PyPy's collector, as much as on the CPU."""
    impl = sys.implementation
    text = f"{impl.name} {platform.python_version()}"
    if impl.name != "cpython":
        v = impl.version
        text += f" ({v.major}.{v.minor}.{v.micro})"
    gc_env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("PYPY_GC_")]
    return " ".join([text, *gc_env])


def git_commit() -> str | None:
    """HEAD of the checkout this package runs from, with "+changes" when the tree differs
    (None outside a git checkout)."""
    root = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if dirty.strip() else "")


def command_line() -> str:
    """The command as typed (`python -m everystop` and the console script both read
    `everystop`)."""
    prog = sys.argv[0]
    if prog.endswith("__main__.py") or Path(prog).name == "everystop":
        prog = "everystop"
    return shlex.join([prog, *sys.argv[1:]])


def envelope(roofline: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"command": command_line(),
            "git_commit": git_commit(), "machine": cpu_info(), "roofline": roofline}


def finite(x: Any) -> Any:
    """JSON has no NaN or infinity: they are written as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x


def write_result(result: dict[str, Any], out: str | Path | None,
                 roofline: dict[str, Any] | None = None, quiet: bool = False,
                 compact: bool = False) -> dict[str, Any]:
    """The envelope's fields first, then the result's own (a result's own `machine` dict is
    merged over the envelope's; its own non-null `roofline` wins). NaN and infinity become
    null. Printed unless quiet; written to `out` when given, whole or not at all (a result
    rewritten after every run survives a kill), on one line when compact (long per-step
    lists). Returns what was written."""
    env = envelope(roofline)
    full = {**env, **result}
    if isinstance(result.get("machine"), dict):
        full["machine"] = {**env["machine"], **result["machine"]}
    if result.get("roofline") is None:
        full["roofline"] = roofline
    full = finite(full)
    text = json.dumps(full, default=str, **({"separators": (",", ":")} if compact
                                            else {"indent": 2}))
    if not quiet:
        print(text)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(path)
    return full
