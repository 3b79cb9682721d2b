"""Preemption policy: which running sequence to evict, and whether to recompute or swap it.

Costs come from measurements the executor makes at start-up (prefill tokens/s on this model and
device, host<->device copy bandwidth), not from constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from everystop.config import SchedulerConfig
from everystop.core.request import Request


@dataclass(frozen=True)
class PreemptionCostModel:
    """Measured costs. Recompute re-runs prefill over every computed token; swap copies the
    sequence's blocks out and back in."""

    prefill_tokens_per_s: float = 5_000.0
    swap_bytes_per_s: float = 5e9
    bytes_per_block: int = 1 << 20

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def swap_seconds(self, num_blocks: int) -> float:
        return 2.0 * num_blocks * self.bytes_per_block / self.swap_bytes_per_s


def is_protected(req: Request, config: SchedulerConfig, now: float) -> bool:
    """Anti-thrashing: a sequence preempted too often lately is the last to be chosen again."""
    window_start = now - config.preemption_window_s
    recent = sum(1 for t in req.preemption_times if t >= window_start)
    return recent >= config.max_preemptions_in_window


def victim_rank(req: Request, config: SchedulerConfig, now: float) -> tuple[bool, int, float]:
    """Higher rank = kept longer. Lowest priority (largest tier number) goes first, then the
    most recently admitted, so old sequences keep their progress; protected ones go last."""
    admitted = req.last_admitted_time if req.last_admitted_time is not None else now
    return (is_protected(req, config, now), -req.priority, -admitted)


def choose_strategy(req: Request, num_blocks: int, config: SchedulerConfig,
                    cost: PreemptionCostModel, can_swap: bool, now: float) -> str:
    """'recompute' or 'swap' for this victim."""
    if config.preemption_mode == "recompute" or not can_swap:
        return "recompute"
    if config.preemption_mode == "swap":
        return "swap"
    if is_protected(req, config, now):
        # It has been recomputed over and over: keep its work this time.
        return "swap"
    if req.num_computed_tokens < config.recompute_threshold_tokens:
        return "recompute"
    if cost.swap_seconds(num_blocks) < cost.recompute_seconds(req.num_computed_tokens):
        return "swap"
    return "recompute"
