"""One engine replica as a Ray Serve deployment: requests in, a stream of outputs out, and the
load report the router scores.

The wire protocol of `generate`: the first item says whether this replica took the request
(`Accepted`) or refused it (`Refused`: the ingress tries the next replica); then the request's
`RequestOutput`s, the last one finished. A refusal is an item, not an exception, so the ingress
can tell "this replica is full" from "this replica died".
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from everystop.config import EngineConfig
from everystop.core.intake import QueueFull, RequestRejected
from everystop.core.request import Request
from everystop.core.scheduler import Scheduler
from everystop.engine.async_engine import AsyncEngine, EngineDead, EngineDraining


@dataclass(frozen=True)
class Accepted:
    replica_id: str


@dataclass(frozen=True)
class Refused:
    replica_id: str
    kind: str  # "queue_full" | "rejected" | "draining" | "dead"
    message: str
    retry_after_s: float = 1.0


def prefill_tokens_queued(sched: Scheduler) -> int:
    """Prompt (or recompute) tokens still to prefill: queued requests and unfinished chunks."""
    queued = sum(r.num_tokens - r.num_computed_tokens
                 for q in (sched.waiting, sched.preempted) for r in q)
    running = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.running)
    return queued + running


class EngineReplica:
    """The class Ray Serve deploys (see deploy.py); plain Python, so tests can build it."""

    def __init__(self, config: EngineConfig, replica_id: str | None = None) -> None:
        from everystop.engine.llm_engine import LLMEngine

        self.node_id: str | None = None  # the Ray node it runs on (none when built by hand)
        if replica_id is None:
            import ray
            from ray import serve
            replica_id = serve.get_replica_context().replica_id.unique_id
            self.node_id = ray.get_runtime_context().get_node_id()
        self.replica_id = replica_id
        # Built on the engine thread: all torch work on one thread (see AsyncEngine).
        self.front = AsyncEngine(lambda: LLMEngine.from_config(config))
        self._reports = 0

    def describe(self) -> dict[str, Any]:
        """What the ingress needs to build requests as this engine would."""
        return {"max_model_len": self.front.max_model_len, "block_size": self.front.block_size,
                "scheduler_config": self.front.scheduler_config,
                "cache_config": self.front.cache_config, "replica_id": self.replica_id}

    async def generate(self, req: Request, exclude: tuple[str, ...] = ()
                       ) -> AsyncIterator[Accepted | Refused | Any]:
        """`exclude` is read by the router (replicas that already refused), not here."""
        # NOTE: `req` is this process's own unpickled copy. Clocks are per process (per node),
        # so this replica measures queue time and TTFT from when it received the request; the
        # ingress measures the client's view.
        req.arrival_time = self.front.clock()
        try:
            self.front.submit(req)
        except QueueFull as exc:
            yield Refused(self.replica_id, "queue_full", exc.reason, exc.retry_after_s)
            return
        except RequestRejected as exc:
            yield Refused(self.replica_id, "rejected", str(exc))
            return
        except EngineDraining as exc:
            yield Refused(self.replica_id, "draining", str(exc))
            return
        except EngineDead as exc:
            yield Refused(self.replica_id, "dead", str(exc))
            return
        yield Accepted(self.replica_id)
        # Cancellation from the ingress (client gone) ends this iteration: stream() aborts.
        async for out in self.front.stream(req.request_id):
            yield out

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve calls this every `request_routing_stats_period_s`; the router reads it."""
        stats = self.front.stats()
        self._reports += 1
        return {"seq": self._reports, "health": self.front.health().status, "pid": os.getpid(),
                "node": self.node_id,
                "prefill_tokens_queued": self.front.inspect(prefill_tokens_queued),
                "num_in_flight": self.front.num_in_flight,
                "stats": {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}}

    def check_health(self) -> None:
        """Ray Serve's health probe: a dead engine loop makes Ray replace this replica."""
        health = self.front.health()
        if health.status == "dead":
            raise RuntimeError(f"engine loop dead: {health.error}")

    def __del__(self) -> None:
        front = getattr(self, "front", None)
        if front is not None:
            front.shutdown()
