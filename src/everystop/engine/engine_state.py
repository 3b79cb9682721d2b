"""What an engine reports about itself besides its scheduler's stats: whether it is alive, and
the memory its model and KV pools hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class EngineHealth:
    status: Literal["ok", "draining", "dead"]
    error: str | None = None


@dataclass(frozen=True)
class EngineMemory:
    """None where this process holds no such memory (a cluster's ingress: its replicas report
    their own) or cannot measure it (no mincore)."""

    weight_bytes: int | None = None  # the model's weights as held (quantized: their blocks)
    kv_pool_resident_bytes: int | None = None  # KV pool pages resident (allocated untouched)
