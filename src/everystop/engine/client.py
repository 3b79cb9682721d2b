"""The engine as the HTTP server and its metrics see it: one `AsyncEngine` in this process, or
a cluster's front (everystop.cluster) over Ray Serve replicas. Both implement `EngineClient`;
a single engine also implements `EngineAdmin`, the live-tuning and inspection surface.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from everystop.config import CacheConfig
from everystop.core.listeners import FinishListener, IterationListener
from everystop.core.observed_engine import ConfiguredEngine, ObservedEngine
from everystop.core.outputs import RequestOutput, SchedulerStats
from everystop.core.request import Request
from everystop.engine.engine_state import EngineHealth, EngineMemory
from everystop.sampling_params import SamplingParams
from everystop.tokenizer import EngineTokenizer


class EngineClient(ConfiguredEngine, Protocol):
    """Requests in, outputs streamed out, and the state the server reports."""

    draining: bool
    num_watchdog_aborts: int

    @property
    def tokenizer(self) -> EngineTokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_in_flight(self) -> int: ...

    def make_request(self, prompt: str | list[int], params: SamplingParams, *,
                     request_id: str | None = None, priority: int = 1, tenant: str = "default",
                     max_tokens_to_context: bool = False, lora: str | None = None) -> Request:
        """Tokenize and build a Request (off the engine thread); `lora`: the name of the
        LoRA adapter it runs with (None: the base model)."""
        ...

    def lora_adapters(self) -> list[str]:
        """The names of the LoRA adapters served now, beside the base model."""
        ...

    async def submit_async(self, req: Request) -> None:
        """Admit `req` for streaming. Raises RequestRejected, QueueFull, EngineDraining,
        EngineDead. A cluster front learns QueueFull only from its replicas, hence async."""
        ...

    def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a submitted request; leaving the iteration early aborts it."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> SchedulerStats: ...

    def memory(self) -> EngineMemory: ...

    def health(self) -> EngineHealth: ...

    def add_listeners(self, on_iteration: IterationListener | None = None,
                      on_finish: FinishListener | None = None) -> None:
        """Called back on the engine's thread (a cluster front: finishes only; its replicas'
        steps never cross the wire)."""
        ...

    async def drain(self, grace_s: float) -> None: ...

    def shutdown(self) -> None: ...


class EngineAdmin(EngineClient, ObservedEngine, Protocol):
    """One engine in this process: its scheduler tuned and inspected live, its steps observed."""

    def check_cache_config(self, cache: CacheConfig) -> None: ...

    def load_lora(self, name: str, path: str) -> None:
        """Serve a LoRA adapter (LoraConflict: the name is taken; ValueError: unloadable)."""
        ...

    def unload_lora(self, name: str) -> None:
        """UnknownLoraAdapter, or LoraConflict while requests use it."""
        ...
