"""The CPU paged-attention kernel (csrc/paged_attention.cpp, built together with the fused ops
of csrc/fused_ops.cpp), built lazily on first use.

torch's extension machinery compiles it once per machine into the torch extensions dir
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and it is reloaded from there
afterwards. A failed build logs one warning and reports the kernel as unavailable, so the
caller falls back to the pure-torch path instead of crashing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
# Built into the same library: fused norm / activation / rope / argmax ops (layers/cpu_ops.py).
_EXTRA_SOURCES = [Path(__file__).with_name("csrc") / "fused_ops.cpp"]
_HEADERS = [Path(__file__).with_name("csrc") / "vec16.h"]  # included by both sources
_EXTENSION_NAME = "everystop_paged_attention"
# -fno-math-errno: libm calls need not set errno. (It does not make GCC vectorize std::exp:
# glibc declares its vector variants only under -ffast-math, hence exp16 in csrc/vec16.h.)
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
# Rows (query tokens x heads of one kv group) that share one pass over the K/V blocks: large
# enough to amortize loading a block, small enough that a prefill chunk splits into many items
# for the threads to share.
ROWS_PER_ITEM = 24
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_state: dict[str, bool] = {}  # "ok" -> whether the op is loaded; absent until first attempt


def kernel_available() -> bool:
    """Build/load the extension if not tried yet; True if the op can be called."""
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _build()
    return _state["ok"]


def _build() -> bool:
    try:
        _load_or_build()
        torch.ops.everystop.paged_attention  # noqa: B018 - raises if registration failed
        return True
    except Exception as exc:  # any compiler/loader failure means "use the fallback"
        logger.warning("CPU paged-attention kernel unavailable, using the torch fallback: %s",
                       exc)
        return False


def _load_or_build() -> None:
    """Load the built library straight from its cache directory, or build it there first.

    NOTE: the directory is named after a hash of the sources, their header, the flags and the
    torch version, and those files are copied into it, so checkouts at different paths (or an
    installed package next to a source tree) share one build instead of rebuilding each
    other's, and a cached build is loaded without running the compiler's up-to-date check
    (seconds at startup).
    """
    from torch.utils.cpp_extension import get_default_build_root, load

    sources = [_SOURCE, *_EXTRA_SOURCES]
    files = [*sources, *_HEADERS]
    texts = [src.read_bytes() for src in files]
    digest = hashlib.sha256(b"\0".join([*texts, " ".join(_CFLAGS).encode(),
                                          torch.__version__.encode()])).hexdigest()[:12]
    name = f"{_EXTENSION_NAME}_{digest}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    build_dir = Path(root) / name
    library = build_dir / f"{name}.so"
    if library.is_file() and not (build_dir / "lock").exists():
        torch.ops.load_library(str(library))
        return
    build_dir.mkdir(parents=True, exist_ok=True)
    copies = []
    for src, text in zip(files, texts):
        copy = build_dir / src.name
        if not copy.is_file() or copy.read_bytes() != text:
            tmp = copy.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(text)
            os.replace(tmp, copy)
        if src in sources:
            copies.append(str(copy))
    # NOTE: -march=native is safe because the extension is built on the machine that runs
    # it (the cache dir is per machine).
    load(name=name, sources=copies, build_directory=str(build_dir), extra_cflags=_CFLAGS,
         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


def supports(q: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these inputs (it is CPU-only)."""
    return (q.device.type == "cpu" and key_cache.device.type == "cpu"
            and key_cache.dtype in CACHE_DTYPES)


def paged_attention_cpu(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Call the kernel; the caller has checked kernel_available() and supports()."""
    # q is small next to the caches, so it is handed over in fp32 and the output cast back:
    # one kernel instantiation per cache dtype instead of one per (q, cache) dtype pair.
    out = torch.ops.everystop.paged_attention(
        q.float().contiguous(), key_cache.contiguous(), value_cache.contiguous(),
        block_tables.long().contiguous(), query_start_loc.long().contiguous(),
        seq_lens.long().contiguous(), float(scale), ROWS_PER_ITEM)
    return out if q.dtype == torch.float32 else out.to(q.dtype)
