"""Admission checks made when a request arrives: can it ever run here, is its queue full?"""

from __future__ import annotations

from everystop.config import SchedulerConfig
from everystop.core.drain_rate import DrainMeter, wait_for
from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.request import Request


class RequestRejected(ValueError):
    """The request can never run on this engine (too long for the model or the KV pool)."""


class QueueFull(Exception):
    """Backpressure: the tenant's or tier's queue is at its cap; retry in `retry_after_s` (the
    full queue's depth over its measured drain rate; inf when it was never seen to drain)."""

    def __init__(self, reason: str, retry_after_s: float = 1.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


def model_len_limit(cfg: SchedulerConfig, kv: KVCacheManager) -> int:
    """The configured max_model_len; unset (no model to ask), what the pool holds for one
    sequence outside the watermark. The engine resolves it from the model where there is one."""
    return cfg.max_model_len or (kv.num_gpu_blocks - kv.watermark_blocks) * kv.block_size


class QueuedCounts:
    """Requests waiting for their first admission, per tenant and per priority tier, and how
    fast each of those queues drains: what the queue caps are checked against and what a
    refusal's Retry-After is made of.

    NOTE: a tenant with nothing queued has no entry (nor meter): client-chosen tenant ids come
    and go, and the maps hold only the ones queued now."""

    def __init__(self) -> None:
        self.by_tenant: dict[str, int] = {}
        self.by_tier: dict[int, int] = {}
        self.tenant_drain: dict[str, DrainMeter] = {}
        self.tier_drain: dict[int, DrainMeter] = {}

    def add(self, req: Request, delta: int, now: float) -> None:
        """`delta` +1: `req` joined the queue; -1: it left (admitted or aborted)."""
        tenant, tier = req.tenant, req.priority
        count = self.by_tenant.get(tenant, 0) + delta
        if delta > 0 and tenant not in self.tenant_drain:
            self.tenant_drain[tenant] = DrainMeter(now)
        if delta > 0 and tier not in self.tier_drain:
            self.tier_drain[tier] = DrainMeter(now)
        if delta < 0:
            self.tenant_drain[tenant].leave(now, -delta)
            self.tier_drain[tier].leave(now, -delta)
        if count:
            self.by_tenant[tenant] = count
        else:
            del self.by_tenant[tenant]
            del self.tenant_drain[tenant]
        self.by_tier[tier] = self.by_tier.get(tier, 0) + delta

    def retry_after_s(self, req: Request, tenant_queue: bool, now: float) -> float:
        """When the full queue (the tenant's, or else the tier's) should have room for `req`:
        all of it drained at its rate, or, for a tenant not yet seen to move, at its tier's."""
        tier_meter = self.tier_drain.get(req.priority)
        if tenant_queue:
            return wait_for(self.by_tenant.get(req.tenant, 0),
                            [self.tenant_drain.get(req.tenant), tier_meter], now)
        return wait_for(self.by_tier.get(req.priority, 0), [tier_meter], now)


def check_admissible(req: Request, cfg: SchedulerConfig, kv: KVCacheManager,
                     queued: QueuedCounts, now: float) -> None:
    """Raise RequestRejected (never runnable) or QueueFull (not now); return if it may queue."""
    check_runnable(req.num_prompt_tokens, req.sampling_params.max_tokens, req.priority, cfg, kv)
    tenant_cap, tier_cap = cfg.max_queued_per_tenant, cfg.max_queued_per_tier[req.priority]
    if tenant_cap and queued.by_tenant.get(req.tenant, 0) >= tenant_cap:
        raise QueueFull(f"tenant {req.tenant!r} has {tenant_cap} requests queued",
                        queued.retry_after_s(req, True, now))
    if tier_cap and queued.by_tier.get(req.priority, 0) >= tier_cap:
        raise QueueFull(f"priority tier {req.priority} has {tier_cap} requests queued",
                        queued.retry_after_s(req, False, now))


def check_runnable(num_prompt_tokens: int, max_tokens: int, priority: int,
                   cfg: SchedulerConfig, kv: KVCacheManager) -> None:
    """Raise RequestRejected if a request of this shape could never run here, whatever the
    engine's state (the fleet simulator asks it before choosing whether to wait for an offer)."""
    if num_prompt_tokens == 0:
        raise RequestRejected("the prompt is empty")
    max_model_len = model_len_limit(cfg, kv)
    max_total_tokens = num_prompt_tokens + max_tokens
    if max_total_tokens > max_model_len:
        raise RequestRejected(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens "
            f"({max_tokens}) exceeds max_model_len ({max_model_len})")
    usable = kv.num_gpu_blocks - kv.watermark_blocks
    need = peak_blocks(num_prompt_tokens, max_tokens, cfg, kv)
    if need > usable:
        raise RequestRejected(
            f"the request needs up to {need} KV blocks but the pool has {usable}")
    if not cfg.enable_chunked_prefill and num_prompt_tokens > cfg.max_num_batched_tokens:
        raise RequestRejected(
            f"prompt ({num_prompt_tokens} tokens) exceeds max_num_batched_tokens "
            f"({cfg.max_num_batched_tokens}) and chunked prefill is off")
    if not 0 <= priority <= 2:
        raise RequestRejected(f"priority must be 0, 1 or 2, not {priority}")


def peak_blocks(num_prompt_tokens: int, max_tokens: int, cfg: SchedulerConfig,
                kv: KVCacheManager) -> int:
    """The most KV blocks a request of this shape holds at once: all its tokens' blocks, or,
    under a sliding window, those its largest pass reads (a prompt chunk within the token
    budget; without chunked prefill, a recompute of every token in one pass)."""
    num_tokens = num_prompt_tokens + max_tokens
    chunked = cfg.scheduling == "continuous" and cfg.enable_chunked_prefill
    return kv.max_blocks_held(num_tokens, cfg.max_num_batched_tokens if chunked else num_tokens)
