"""everystop: an LLM inference server built around continuous batching."""

import os
import sys

# NOTE: OpenMP threads that spin while waiting for work make torch's CPU ops collapse when the
# machine is shared: a spinning thread holds a core the thread it waits for needs (measured on
# 2 shared cores: bf16 decode median 2,024 ms/token spinning vs 43 ms passive). The policy is
# read once, when torch loads its OpenMP runtime, so it is set here before anything imports
# torch; an explicit OMP_WAIT_POLICY (or torch imported first) wins.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from everystop.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):  # the engine (and torch behind it) loads only when asked for
    if name == "LLM":
        from everystop.engine.llm import LLM
        return LLM
    raise AttributeError(name)
