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
        # What Ray reserved for this replica: its tensor-parallel ranks run as its child
        # processes, inside this one reservation (deploy.replica_resources sizes it for all).
        self.resources: dict[str, float] = {}
        if replica_id is None:
            import ray
            from ray import serve
            replica_id = serve.get_replica_context().replica_id.unique_id
            context = ray.get_runtime_context()
            self.node_id = context.get_node_id()
            self.resources = dict(context.get_assigned_resources())
        self.tensor_parallel_size = config.parallel.tensor_parallel_size
        self.replica_id = replica_id
        # Built on the engine thread: all torch work on one thread (see AsyncEngine).
        self.front = AsyncEngine(lambda: LLMEngine.from_config(config))
        self._reports = 0
        self._admin: Any = None  # server.admin.SchedulerConfigAdmin, built on first use

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

    async def admin(self, op: str, body: Any = None, target: str | None = None
                    ) -> dict[str, Any]:
        """One /admin call on this replica's engine: `op` "get" or "patch". Returns
        {"status": HTTP status, "body": JSON}. `target` is the replica the ingress meant (the
        router sends it there); if Ray placed the call elsewhere this one says so instead of
        answering for another replica."""
        import asyncio

        from everystop.server.admin import AdminError, SchedulerConfigAdmin

        if target is not None and target != self.replica_id:
            return {"status": 409, "body": {"error": {
                "message": f"meant for replica {target}, reached {self.replica_id}",
                "type": "server_error", "param": None, "code": "wrong_replica"}}}
        if self._admin is None:
            # No store: the ingress keeps no history in cluster mode (see docs/scale-out.md).
            self._admin = SchedulerConfigAdmin(self.front)
        if op == "get":
            return {"status": 200, "body": self._admin.snapshot()}
        if op != "patch":
            raise ValueError(f"unknown admin op {op!r}")
        try:
            return {"status": 200,
                    "body": await asyncio.to_thread(self._admin.commit, body, "admin")}
        except AdminError as exc:
            return {"status": exc.status, "body": exc.body()}

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve calls this every `request_routing_stats_period_s`; the router reads it."""
        stats = self.front.stats()
        self._reports += 1
        return {"seq": self._reports, "health": self.front.health().status, "pid": os.getpid(),
                "node": self.node_id, "resources": self.resources,
                "tensor_parallel_size": self.tensor_parallel_size,
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
