"""Bounds the two caches of compiled oneDNN GEMMs inside torch, so that a long-running server's
memory stops growing with every new batch shape.

Why: prefill GEMMs go through oneDNN (`mkldnn::_linear_pointwise`, from layers/linear.py and the
quantized kernels), and oneDNN compiles one primitive per (rows, out, in) shape and keeps it in
two LRU caches of 1,024 entries each: oneDNN's own primitive cache
(ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep's, torch's C++ wrapper (LRU_CACHE_CAPACITY). Each
entry is ~0.3-0.45 MiB (the default model's four projections, measured with mallinfo2), and a
step's row count is whatever the scheduler packed (up to max_num_batched_tokens), so a server
meets new shapes for a long time: one process grew 451 MiB of malloc'd memory over rows 9..256
(992 shapes), and an engine fed new prompt sets kept growing ~30 MiB per set (a soak).
Either cache alone keeps the primitives alive, so both are bounded.

The bound's cost: a shape that fell out is compiled again, ~0.6-0.8 ms per GEMM on a 2-core
Zen 5 (1.66 vs 1.05 ms per call, new vs cached shapes), a few per prefill step of 100+ ms; a
step's own shapes (at most ~8: four projections, two tile widths each) always fit. 0 would turn
caching off (every GEMM compiled at every call: ~30x slower prefill), so 1 is the least.

Both libraries read their variable once, when their cache is first used, so this runs before the
process's first oneDNN GEMM: the model runner calls it before loading the model. A variable the
user set wins over the default (not over an explicit capacity).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

# Entries per cache when neither the config nor the environment names a number: ~26 MiB at
# most per cache for the default model, ~8 steps' worth of distinct shapes.
DEFAULT_CAPACITY = 64
CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int | None = None) -> dict[str, str]:
    """Set both caches' capacity variables: to `capacity` if given, else to DEFAULT_CAPACITY
    where the environment does not already set them. Returns the values now in effect."""
    if capacity is not None and capacity < 1:
        raise ValueError(f"oneDNN cache capacity must be >= 1, got {capacity}")
    for name in CAPACITY_VARIABLES:
        if capacity is not None:
            os.environ[name] = str(capacity)
        else:
            os.environ.setdefault(name, str(DEFAULT_CAPACITY))
    in_effect = {name: os.environ[name] for name in CAPACITY_VARIABLES}
    logger.debug("oneDNN cache capacities: %s", in_effect)
    return in_effect
