"""The Ray Serve RequestRouter that runs `everystop.routing`'s policies on replica load reports.

Ray builds this class itself (inside every process holding a handle to the engine deployment),
so the ingress finds it through `registry.live_routers()` to read the replicas' last reports
for /health and /metrics, and which replica took a given request.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from everystop.cluster import registry
from everystop.core.request import Request
from everystop.routing import (
    DEFAULT_AFFINITY_MARGIN,
    ReplicaLoad,
    RouteRequest,
    make_router,
    route_request,
)

_MAX_REMEMBERED = 65536


def load_from_report(replica_id: str, report: dict[str, Any] | None) -> ReplicaLoad:
    """A replica's routing stats as a ReplicaLoad; a replica that has not reported yet counts
    as idle with one block (it is ranked on queue terms alone until it reports)."""
    stats = (report or {}).get("stats")
    if not stats:
        return ReplicaLoad(replica_id, 0, 0, 0, free_kv_blocks=1, total_kv_blocks=1,
                           prefill_tokens_queued=0, seq=-1)
    return ReplicaLoad(replica_id, num_waiting=stats["num_waiting"],
                       num_running=stats["num_running"], num_swapped=stats["num_swapped"],
                       free_kv_blocks=stats["num_free_blocks"],
                       total_kv_blocks=max(1, stats["num_total_blocks"]),
                       prefill_tokens_queued=report["prefill_tokens_queued"],  # type: ignore[index]
                       seq=report["seq"])  # type: ignore[index]


class EveryStopRouter(RequestRouter):
    def initialize_state(self, policy: str = "least-loaded",
                         affinity_margin: float = DEFAULT_AFFINITY_MARGIN,
                         block_size: int = 16, seed: int = 0, **_: Any) -> None:
        self.policy_name = policy
        self.policy = make_router(policy, affinity_margin=affinity_margin, seed=seed)
        self.block_size = block_size
        # Ray's internal request id -> (replica, what the policy was told), until completion.
        self._in_flight: dict[str, tuple[str, RouteRequest]] = {}
        # The ingress's request id -> the replica that took it (for retries after a death).
        self.placed: OrderedDict[str, str] = OrderedDict()
        self.decisions: Counter[str] = Counter()  # replica -> requests routed there
        # Why each request in flight went where it did (the policy's `reasons` counts them all).
        self._reasons: dict[str, str] = {}
        self.last_score: dict[str, float] = {}  # replica -> its score at the last decision
        registry.add(self)

    # -- what the ingress reads ------------------------------------------------------------------
    def reports(self) -> dict[str, dict[str, Any]]:
        """Each running replica's last load report (empty until its first)."""
        return {rid.unique_id: dict(r.routing_stats or {}) for rid, r in self._replicas.items()}

    # -- Ray's hooks -----------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        route, exclude, request_id = self._route_of(pending_request)
        key = pending_request.metadata.internal_request_id if pending_request else None
        if key is not None:  # chosen again (Ray backs off and retries): forget the last choice
            self._forget(key)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        target = pending_request.kwargs.get("target") if pending_request else None
        if target in by_id:  # an /admin call meant for one replica (see replica.admin)
            return [[by_id[target]]]
        loads = [load_from_report(rid, r.routing_stats) for rid, r in by_id.items()]
        ranked = self.policy.rank(route, loads)
        self.last_score = dict(self.policy.last_scores)
        # Replicas that already refused this request go last: if only they are left, one of
        # them refuses again and the ingress knows every replica has said no.
        ordered = [rid for rid in ranked if rid not in exclude] + \
                  [rid for rid in ranked if rid in exclude]
        if key is not None and request_id is not None and ordered:
            # NOTE: counted as sent now, not when Ray reports it routed (a round trip later):
            # a burst routed in between would otherwise all see the same loads and pile onto
            # one replica. Ray sends to the first rank unless it is at max_ongoing_requests;
            # on_request_routed moves the count if it chose otherwise.
            self._record(key, ordered[0], route, request_id)
        if self.policy_name == "power-of-two" and not exclude and len(ordered) >= 2:
            # Ray's own power of two choices: the two replicas the policy drew go to Ray as one
            # group, and Ray takes the one with fewer ongoing requests (its queue-length probes
            # and cache), then the rest one by one. `on_request_routed` books Ray's pick.
            return [[by_id[ordered[0]], by_id[ordered[1]]]] + [[by_id[rid]]
                                                              for rid in ordered[2:]]
        return [[by_id[rid]] for rid in ordered]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        key = pending_request.metadata.internal_request_id
        entry = self._in_flight.get(key)
        if entry is not None and entry[0] != replica_id.unique_id:
            self._forget(key)
            _, _, request_id = self._route_of(pending_request)
            self._record(key, replica_id.unique_id, entry[1], request_id, reason="ray_placed")

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._reasons.pop(internal_request_id, None)
        entry = self._in_flight.pop(internal_request_id, None)
        if entry is not None:
            self.policy.on_finished(*entry)

    # -- internals -------------------------------------------------------------------------------
    @property
    def reasons(self) -> Counter[str]:
        """Why requests went where they did: reason -> requests (see `Router.reasons`)."""
        return self.policy.reasons

    def _record(self, key: str, rid: str, route: RouteRequest, request_id: str | None,
                reason: str | None = None) -> None:
        """Book a send; `reason` when Ray, not the policy, chose `rid` (`ray_placed`)."""
        self._reasons[key] = reason = reason or self.policy.reason_for(rid, route)
        self.policy.on_sent(rid, route, reason)
        self._in_flight[key] = (rid, route)
        self.decisions[rid] += 1
        if request_id is not None:
            self.placed[request_id] = rid
            while len(self.placed) > _MAX_REMEMBERED:
                self.placed.popitem(last=False)

    def _forget(self, key: str) -> None:
        """Undo `_record` (Ray chose again, or sent it elsewhere): not a send, not a decision."""
        entry = self._in_flight.pop(key, None)
        if entry is not None:
            self.policy.on_finished(*entry)
            self.decisions[entry[0]] -= 1
            reason = self._reasons.pop(key, None)
            if reason is not None:
                self.policy.reasons[reason] -= 1

    def _route_of(self, pending: PendingRequest | None
                  ) -> tuple[RouteRequest, frozenset[str], str | None]:
        """What the policy knows of a generate() call; other calls (describe) route as empty."""
        if pending is None or not pending.args or not isinstance(pending.args[0], Request):
            return RouteRequest(0), frozenset(), None
        req: Request = pending.args[0]
        route = route_request(req.prompt_token_ids, self.block_size)
        return route, frozenset(pending.kwargs.get("exclude", ())), req.request_id
