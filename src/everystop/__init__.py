"""everystop: an LLM inference server built around continuous batching."""

from everystop.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):  # the engine (and torch behind it) loads only when asked for
    if name == "LLM":
        from everystop.engine.llm import LLM
        return LLM
    raise AttributeError(name)
