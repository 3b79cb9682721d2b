"""The ingress's engine front for a cluster: the same surface the server uses on one
`AsyncEngine` (make_request, submit, stream, abort, stats, health), backed by Ray Serve replicas.

A request's life here::

    submit_async:   router ranks replicas -> replica says Accepted | Refused
                    Refused(queue_full): try the next replica; all refused -> QueueFull (429)
    stream:         outputs as the replica makes them
                    replica dies before any output: route again elsewhere (nothing was sent
                    to the client, so nothing is duplicated); after an output: EngineDead
                    (the server ends the stream with an error event)

Every request ends in exactly one outcome counter: completed, retried_completed, errored,
aborted (the client left) or refused (429), so the counts add up to the requests submitted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from everystop.cluster.registry import live_routers
from everystop.cluster.replica import Accepted, Refused
from everystop.config import CacheConfig, SchedulerConfig
from everystop.core.intake import QueueFull, RequestRejected
from everystop.core.listeners import FinishListener, IterationListener
from everystop.core.outputs import RequestOutput, SchedulerStats
from everystop.core.request import Request
from everystop.engine.async_engine import EngineDead, EngineDraining
from everystop.engine.engine_state import EngineHealth, EngineMemory
from everystop.engine.llm_engine import new_request
from everystop.engine.lora_registry import UnknownLoraAdapter
from everystop.sampling_params import SamplingParams
from everystop.tokenizer import EngineTokenizer

logger = logging.getLogger("everystop.cluster")

# A replica process gone (killed, OOM, node lost) as Ray reports it to a caller.
REPLICA_LOST = (RayActorError, ActorUnavailableError)
OUTCOMES = ("completed", "retried_completed", "errored", "aborted", "refused")


@dataclass
class _Live:
    req: Request
    stream: Any  # ray.serve.handle.DeploymentResponseGenerator
    replica_id: str
    retried: bool = False


class ClusterEngine:
    """What the server's routes see in cluster mode. `handle` is the engine deployment's
    Ray Serve handle; `limits` is one replica's `describe()`."""

    def __init__(self, handle: Any, tokenizer: EngineTokenizer, limits: dict[str, Any], *,
                 num_replicas: int, max_retries: int = 3) -> None:
        self._handle = handle.options(stream=True)
        self._unary = handle.options(stream=False)  # calls answered once (/admin)
        self._tokenizer = tokenizer
        self._limits = limits
        self.num_replicas = num_replicas
        self.max_retries = max_retries
        self._live: dict[str, _Live] = {}
        self._on_finish: list[Callable[[Request, RequestOutput], None]] = []
        self.outcomes: Counter[str] = Counter({o: 0 for o in OUTCOMES})
        self.retries: Counter[str] = Counter()  # reason -> re-routes
        self.num_submitted = 0
        self.draining = False
        self.num_watchdog_aborts = 0  # the replicas' own watchdogs do this work

    # -- requests ---------------------------------------------------------------------------------
    def lora_adapters(self) -> list[str]:
        return []  # LoRA adapters are served by a single engine only

    def make_request(self, prompt: str | list[int], params: SamplingParams, *,
                     request_id: str | None = None, priority: int = 1, tenant: str = "default",
                     max_tokens_to_context: bool = False, lora: str | None = None) -> Request:
        if lora is not None:
            raise UnknownLoraAdapter(f"LoRA adapter {lora!r}: replicas serve none")
        return new_request(self._tokenizer, self.max_model_len, prompt, params,
                           request_id=request_id, priority=priority, tenant=tenant,
                           arrival_time=time.monotonic(),
                           max_tokens_to_context=max_tokens_to_context)

    async def submit_async(self, req: Request) -> None:
        """Place `req` on a replica that accepts it. Raises QueueFull when every replica
        refused, RequestRejected, EngineDraining, EngineDead (no replica reachable)."""
        if self.draining:
            raise EngineDraining("the server is shutting down")
        self.num_submitted += 1
        try:
            self._live[req.request_id] = await self._place(req, set())
        except QueueFull:
            self.outcomes["refused"] += 1
            raise
        except BaseException:
            self.outcomes["errored"] += 1
            raise

    async def _place(self, req: Request, exclude: set[str]) -> _Live:
        refusals: list[Refused] = []
        for _ in range(self.num_replicas + self.max_retries):
            stream = self._handle.generate.remote(req, exclude=tuple(sorted(exclude)))
            try:
                first = await stream.__anext__()
            except REPLICA_LOST as exc:
                lost = _placed(req.request_id)
                logger.warning("replica %s lost before accepting %s: %s", lost, req.request_id,
                               exc)
                self.retries["replica_lost"] += 1
                if lost is not None:
                    exclude.add(lost)
                continue
            if isinstance(first, Accepted):
                return _Live(req, stream, first.replica_id)
            assert isinstance(first, Refused), first
            if first.kind == "rejected":
                raise RequestRejected(first.message)
            refusals.append(first)
            if first.replica_id in exclude or len(exclude) + 1 >= self.num_replicas:
                break  # every replica has said no
            exclude.add(first.replica_id)
            self.retries[first.kind] += 1
        if refusals and all(r.kind == "queue_full" for r in refusals):
            raise QueueFull(f"all replicas full ({refusals[-1].message})",
                            retry_after_s=min(r.retry_after_s for r in refusals))
        if refusals and all(r.kind == "draining" for r in refusals):
            raise EngineDraining("every replica is shutting down")
        raise EngineDead(f"no replica took the request ({len(refusals)} refusals, "
                         f"{self.retries['replica_lost']} replicas lost)")

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a placed request. Leaving early cancels it on its replica (which aborts
        it there and frees its blocks)."""
        live = self._live[request_id]
        yielded = False
        outcome = "aborted"  # unless it finishes or fails below: the consumer left
        try:
            while True:
                try:
                    out = await live.stream.__anext__()
                except StopAsyncIteration:
                    outcome = "errored"
                    raise EngineDead(f"replica {live.replica_id} ended the stream early") from None
                except (*REPLICA_LOST, RayTaskError) as exc:
                    if yielded or not isinstance(exc, REPLICA_LOST):
                        outcome = "errored"
                        raise EngineDead(f"replica {live.replica_id} failed mid-stream "
                                         f"({type(exc).__name__}); the output so far is "
                                         "incomplete") from exc
                    live = await self._replace(live, exc)
                    continue
                yielded = True
                yield out
                if out.finished:
                    outcome = "retried_completed" if live.retried else "completed"
                    for listener in self._on_finish:
                        listener(live.req, out)
                    return
        except EngineDead:
            outcome = "errored"
            raise
        finally:
            self._live.pop(request_id, None)
            if outcome == "aborted":
                live.stream.cancel()
            self.outcomes[outcome] += 1

    async def _replace(self, live: _Live, exc: BaseException) -> _Live:
        """The replica died before the request's first output: nothing reached the client,
        so place it again elsewhere (no duplicate output is possible)."""
        logger.warning("replica %s lost %s before its first output (%s); re-routing",
                       live.replica_id, live.req.request_id, type(exc).__name__)
        self.retries["replica_lost"] += 1
        try:
            again = await self._place(live.req, {live.replica_id})
        except (QueueFull, EngineDraining, RequestRejected) as refused:
            raise EngineDead(f"replica {live.replica_id} was lost and no other replica took "
                             f"the request: {refused}") from exc
        again.retried = True
        self._live[live.req.request_id] = again
        return again

    def abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            live.stream.cancel()
            self.outcomes["aborted"] += 1

    async def replica_admin(self, op: str, replica_id: str, body: Any = None
                            ) -> dict[str, Any]:
        """One /admin call on one replica ({"status", "body"}); a lost replica is a 503."""
        try:
            answer: dict[str, Any] = await self._unary.admin.remote(op, body, target=replica_id)
            return answer
        except (*REPLICA_LOST, RayTaskError) as exc:
            return {"status": 503, "body": {"error": {
                "message": f"replica {replica_id} did not answer ({type(exc).__name__})",
                "type": "server_error", "param": None, "code": "replica_unavailable"}}}

    # -- named reads ------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> EngineTokenizer:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self._limits["max_model_len"])

    @property
    def block_size(self) -> int:
        return int(self._limits["block_size"])

    @property
    def scheduler_config(self) -> SchedulerConfig:
        # Per replica; the admission controller compares it with the cluster's running count.
        cfg: SchedulerConfig = self._limits["scheduler_config"]
        return dataclasses.replace(cfg, max_num_seqs=cfg.max_num_seqs * self.num_replicas)

    @property
    def cache_config(self) -> CacheConfig:
        cfg: CacheConfig = self._limits["cache_config"]
        return cfg

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    @property
    def num_running(self) -> int:
        return self.stats().num_running

    def reports(self) -> dict[str, dict[str, Any]]:
        """Each replica's last load report, from the router(s) in this process."""
        merged: dict[str, dict[str, Any]] = {}
        for router in live_routers():
            merged.update(router.reports())
        return merged

    def routers(self) -> list[Any]:
        """The `EveryStopRouter`s in this process (Ray builds them; see registry.py)."""
        return live_routers()

    def stats(self) -> SchedulerStats:
        return sum_stats([r["stats"] for r in self.reports().values() if r.get("stats")])

    def memory(self) -> EngineMemory:
        """None of its own: the replicas' processes hold the model and the pools."""
        return EngineMemory()

    def health(self) -> EngineHealth:
        """ok while any replica is ok; each replica's own state is in `replica_health()`."""
        if self.draining:
            return EngineHealth("draining")
        states = self.replica_health()
        if any(s == "ok" for s in states.values()):
            return EngineHealth("ok")
        return EngineHealth("dead", f"no healthy replica ({states or 'none running'})")

    def replica_ids(self) -> list[str]:
        """The replicas running now, as the router knows them."""
        return sorted(self.reports())

    def replica_health(self) -> dict[str, str]:
        return {rid: str(r.get("health", "starting")) for rid, r in self.reports().items()}

    def add_listeners(self, on_iteration: IterationListener | None = None,
                      on_finish: FinishListener | None = None) -> None:
        """Finish listeners run here as each request ends; iteration listeners belong to the
        replicas (their steps never cross the wire) and are ignored."""
        if on_finish is not None:
            self._on_finish.append(on_finish)

    # -- lifecycle --------------------------------------------------------------------------------
    async def drain(self, grace_s: float) -> None:
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self._live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._live):
            self.abort(rid)

    def shutdown(self) -> None:
        for rid in list(self._live):
            self.abort(rid)


def _placed(request_id: str) -> str | None:
    for router in live_routers():
        rid = router.placed.get(request_id)
        if rid is not None:
            return rid
    return None


def sum_stats(reports: list[dict[str, Any]]) -> SchedulerStats:
    """The cluster's scheduler stats: counts summed, KV usage over the summed pools."""
    fields = {f.name for f in dataclasses.fields(SchedulerStats)}
    total: dict[str, Any] = {name: 0 for name in fields}
    total.update(kv_usage=0.0, step_cost={}, step_predicted_s=0.0, step_measured_s=0.0,
                 auto_tpot_target_s=0.0, spec_decode_num_accepted_tokens_per_pos=[])
    for stats in reports:
        for name in fields:
            value = stats.get(name)
            if isinstance(value, bool) or value is None or isinstance(value, dict):
                continue
            if isinstance(value, list):  # per-position counts: summed position by position
                have = total[name]
                have.extend([0] * (len(value) - len(have)))
                total[name] = [a + int(b) for a, b in zip(have, value)] + have[len(value):]
                continue
            if isinstance(value, int):
                total[name] += value
            elif name.endswith("_s"):  # per-replica timings: the slowest
                total[name] = max(total[name], float(value))
    blocks = total["num_total_blocks"]
    total["kv_usage"] = total["num_used_blocks"] / blocks if blocks else 0.0
    return SchedulerStats(**total)
