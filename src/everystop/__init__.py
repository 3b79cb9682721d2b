"""everystop: an LLM inference server built around continuous batching."""

import os
import sys

# NOTE: how OpenMP worker threads wait between parallel regions decides decode speed on CPU:
# a decode step runs ~300 short regions. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) pays a
# wake-up per region (quiet 2-core machine: single-stream bf16 decode 67 ms/token); spinning
# forever collapses when the cores are shared (a spinning thread holds the core its partner
# needs: 2,024 ms/token measured under heavy load). A short spin (GOMP_SPINCOUNT=10000, then
# sleep) gets the quiet-machine speed (22 ms/token) and, under heavy load, stays far from the
# spinning collapse (112 ms/token; passive 43). On an oversubscribed machine set
# OMP_WAIT_POLICY=PASSIVE (docs/perf/profile.md). Read once, when torch loads its OpenMP
# runtime, so it is set here before anything imports torch; an explicit OMP_WAIT_POLICY or
# GOMP_SPINCOUNT (or torch imported first) wins.
if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from everystop.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):  # the engine (and torch behind it) loads only when asked for
    if name == "LLM":
        from everystop.engine.llm import LLM
        return LLM
    raise AttributeError(name)
