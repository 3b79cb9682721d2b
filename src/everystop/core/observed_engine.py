"""What an observer (telemetry, the server's /admin) may read from an engine, named: nothing
else of the engine is touched.

`LLMEngine` (offline, one thread) and `AsyncEngine` (the server; its `inspect` takes the engine
lock) both satisfy `ObservedEngine`; the server's `EngineAdmin` (engine/client.py) extends it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from everystop.config import CacheConfig, SchedulerConfig
    from everystop.core.listeners import FinishListener, IterationListener
    from everystop.core.scheduler import Scheduler

T = TypeVar("T")


class ConfiguredEngine(Protocol):
    """The configs every engine surface reports (ObservedEngine, the server's EngineClient)."""

    @property
    def block_size(self) -> int: ...

    @property
    def scheduler_config(self) -> SchedulerConfig: ...

    @property
    def cache_config(self) -> CacheConfig: ...


class ObservedEngine(ConfiguredEngine, Protocol):
    @property
    def clock(self) -> Callable[[], float]: ...

    def update_config(self, scheduler: SchedulerConfig, cache: CacheConfig) -> int:
        """Swap configs in between two iterations (a guardrail's auto-clamp)."""
        ...

    def is_live(self, request_id: str) -> bool:
        """Whether the scheduler still holds the request (read on the engine thread)."""
        ...

    def inspect(self, look: Callable[[Scheduler], T]) -> T:
        """Run a read-only look at live scheduler state, under the engine lock if any."""
        ...

    def add_listeners(self, on_iteration: IterationListener | None = None,
                      on_finish: FinishListener | None = None) -> None: ...

    def remove_listeners(self, on_iteration: IterationListener | None = None,
                         on_finish: FinishListener | None = None) -> None: ...
