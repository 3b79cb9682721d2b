"""How many tokens the next forward pass may take: a hard token cap and a step-time target.

The rule, per `schedule()` call:

  1. Decodes go first, always: one token per decoding sequence, limited only by
     max_num_batched_tokens, max_num_seqs and KV blocks - never by time.
  2. The step's target is the tightest TPOT target among the tiers decoding in it. With no
     decodes there is no target (nobody waits between tokens): prefill gets the token cap.
  3. A prefill chunk starting at position `start` may take the largest n with

         predicted(step so far) + (per_prefill_token + per_context_token) * n
                                + per_context_token * start                    <= target

     and never more than the tokens left under max_num_batched_tokens (a hard cap).
  4. Anti-starvation: a prompt that has waited longer than aging_interval_s (since arrival, or
     since its last preemption) still gets a floor chunk when the target leaves it less: the
     tokens an otherwise empty step runs within the target, at least one KV block. It is
     offered once per step, so a step overshoots its target by at most about one target, and
     a starving prompt of L tokens is through prefill within L / floor steps.

With the target off (tpot_target_ms=0) only the token cap applies: the fixed budget of before.

What a target can promise: rule 1 puts every decode in every step, so a step carrying a
premium row costs at least the fixed cost plus a decode row per running sequence, whatever
tier. On a CPU that alone can exceed a tight target (`everystop bench step-floor` measures it
by batch size); no prefill budget meets such a target, and the TPOT-overrun alert says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from everystop.config import SchedulerConfig
from everystop.core.step_cost import SEED_PROMPT_TOKENS, StepCoefficients, StepCostModel, StepShape

# The auto target is never below this: ~100 ms per step is where a GPU's default budget
# (2,048 tokens) lands, and a human reader does not see stutter under it.
MIN_AUTO_TARGET_S = 0.100


def default_target_s(cost: StepCostModel) -> float:
    """The target used when none is configured: 100 ms, or on a machine too slow for that, the
    predicted time of a step with one start-up-sized prompt (so a prompt can always move)."""
    ref = cost.predict(StepShape(SEED_PROMPT_TOKENS, 0, SEED_PROMPT_TOKENS))
    return max(MIN_AUTO_TARGET_S, ref)


def tier_targets_s(config: SchedulerConfig, auto_s: float) -> tuple[float | None, ...]:
    """Seconds per tier 0, 1, 2; None where the target is off."""
    targets: list[float | None] = []
    for per_tier in config.tpot_target_ms_per_tier:
        ms = per_tier if per_tier is not None else config.tpot_target_ms
        targets.append(auto_s if ms is None else (ms / 1000.0 if ms > 0 else None))
    return tuple(targets)


class TierTargets:
    """tier_targets_s, worked out again only when the (frozen) config or the auto target
    changes, not at every pass."""

    def __init__(self) -> None:
        self._key: tuple[SchedulerConfig, float] | None = None
        self._targets: tuple[float | None, ...] = ()

    def get(self, config: SchedulerConfig, auto_s: float) -> tuple[float | None, ...]:
        if self._key is None or config is not self._key[0] or auto_s != self._key[1]:
            self._key, self._targets = (config, auto_s), tier_targets_s(config, auto_s)
        return self._targets


def prefill_room(coeffs: StepCoefficients, predicted_s: float, target_s: float,
                 start_pos: int) -> int:
    """The most prefill tokens, in one row starting at `start_pos`, that keep a step already
    predicted at `predicted_s` within `target_s` (0 when it is already over)."""
    per_token = coeffs.prefill_token + coeffs.context_token
    left_s = target_s - predicted_s - coeffs.context_token * start_pos
    if left_s < 0:
        return 0
    if per_token <= 0:
        return 1 << 40  # the model sees no cost in prefill: only the token cap binds
    return math.floor(left_s / per_token + 1e-9)


class StepBudget:
    """The budget of one pass under construction: tokens left under the cap, the predicted step
    time so far and the target the decoding tiers set. `coeffs=None`: the token cap only."""

    def __init__(self, max_tokens: int, coeffs: StepCoefficients | None,
                 targets_s: Sequence[float | None], floor_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens_left = max_tokens
        self.coeffs = coeffs
        self.targets_s = targets_s
        self.floor_tokens = floor_tokens
        self.target_s: float | None = None
        self.floor_granted = False
        self._decode_tokens = 0
        self._decode_s = 0.0
        self._prefill_s = 0.0

    @property
    def predicted_s(self) -> float:
        fixed = self.coeffs.fixed if self.coeffs else 0.0
        return fixed + self._decode_s + self._prefill_s

    def _row_cost(self, n: int, start_pos: int, decode: bool) -> float:
        c = self.coeffs
        if c is None:
            return 0.0
        per_row = c.decode_row if decode else c.prefill_token * n
        return per_row + c.context_token * (start_pos + n)

    def add(self, n: int, start_pos: int, *, decode: bool, tier: int | None) -> None:
        """Account for a row of n tokens at start_pos. A decode row tightens the target to its
        tier's (tier None: no target, e.g. static padding)."""
        self.tokens_left -= n
        cost = self._row_cost(n, start_pos, decode)
        if decode:
            self._decode_tokens += n
            self._decode_s += cost
            target = self.targets_s[tier] if tier is not None else None
            if target is not None and (self.target_s is None or target < self.target_s):
                self.target_s = target
        else:
            self._prefill_s += cost

    def remove(self, n: int, start_pos: int, *, decode: bool) -> None:
        """Undo `add` for a row dropped by a preemption (the target stays: conservative)."""
        self.tokens_left += n
        cost = self._row_cost(n, start_pos, decode)
        if decode:
            self._decode_tokens -= n
            self._decode_s -= cost
        else:
            self._prefill_s -= cost

    def room(self, start_pos: int, starving: bool = False) -> int:
        """Prefill tokens a row starting at start_pos may take now (rules 3 and 4)."""
        cap = max(self.tokens_left, 0)
        if self.coeffs is None or self.target_s is None:
            return cap
        n = prefill_room(self.coeffs, self.predicted_s, self.target_s, start_pos)
        if starving and not self.floor_granted:
            floor = max(self.floor_tokens,
                        prefill_room(self.coeffs, self.coeffs.fixed, self.target_s, start_pos))
            if floor > n:
                self.floor_granted = True
                n = floor
        return min(n, cap)

    @property
    def prefill_budget_tokens(self) -> int:
        """What prefill could get on top of this step's decodes (rule 3 from position 0)."""
        cap = self.max_tokens - self._decode_tokens
        if self.coeffs is None or self.target_s is None:
            return cap
        decodes_s = self.coeffs.fixed + self._decode_s
        return min(cap, prefill_room(self.coeffs, decodes_s, self.target_s, 0))
