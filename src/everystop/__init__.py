"""everystop: an LLM inference server built around continuous batching."""

from everystop.config import default_openmp_wait
from everystop.sampling_params import SamplingParams

default_openmp_wait()  # neither import above loads torch: this still comes before it

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):  # the engine (and torch behind it) loads only when asked for
    if name == "LLM":
        from everystop.engine.llm import LLM
        return LLM
    raise AttributeError(name)
