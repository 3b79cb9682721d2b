"""The simulator's former workload names, kept for code written against them in parallel (the
fleet simulator); everything lives in `everystop.workload` now. Remove once nothing imports it.
"""

from __future__ import annotations

import random

from everystop.workload import (
    LengthDist,
    Workload,
    WorkloadRequest,
    arrival_offsets,
    load_workload,
    resolve_workload,
    synthetic,
)
from everystop.workload import synthetic_prompt_ids as prompt_token_ids

SimRequest = WorkloadRequest

__all__ = ["SimRequest", "Workload", "load_workload", "poisson_arrivals", "prompt_token_ids",
           "resolve_workload", "sample_dist", "synthetic"]


def sample_dist(spec: str, rng: random.Random) -> int:
    return LengthDist.parse(spec).sample(rng)


def poisson_arrivals(n: int, rate: float | None, rng: random.Random) -> list[float]:
    return arrival_offsets(n, rate, 1.0, rng)
