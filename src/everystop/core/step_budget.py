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
  5. TTFT aging trades TPOT headroom for prefill. A prompt's lateness is the time it has
     waited (since arrival, or its last preemption) plus the least time its remaining prompt
     can still take (an otherwise empty step prefilling all of it): a lower bound on its TTFT.
     Against its TTFT target T (ttft_target_ms; `auto`: per step, the larger of its tier's
     TPOT target and what an empty step prefilling one full chunk costs), its chunk may fill
     a stretched target

         stretch = 1 + (tpot_max_stretch - 1) * clamp((lateness / T - 1/2) / (1/2), 0, 1)

     times the step's target: nothing below half of T, growing linearly, tpot_max_stretch
     (default 4) from lateness = T on; its chunk cap grows in proportion from chunk_size to
     max_num_batched_tokens (the hard cap, always). A prompt stretches only a step whose
     target is no tighter than its own tier's: a late best-effort prompt never spends a
     premium decode's headroom (rule 4's floor is its guarantee there). Each row is sized
     against its own stretch, so no step is predicted over tpot_max_stretch times its target
     unless a rule-4 floor chunk put it there: every decode still gets its token every step
     (rule 1), and a TPOT - a mean of step times - stays within tpot_max_stretch times the
     target. Stretch only ever adds room, so the floor and the aging bound of rule 4 hold as
     before. The pass reports its stretched target (SchedulerOutput.tpot_target_s: the
     TPOT-overrun alert compares steps with what the budget allowed them) and the stretch
     (tpot_stretch).
  6. With TTFT aging on, a prompt in a step with no decode row is not cut at chunk_size:
     chunks exist to interleave prefill with decodes, and with none to interleave a cut only
     adds a step's fixed cost to the prompt's TTFT. max_num_batched_tokens still binds (a
     newcomer waits at most one step of that many tokens, as when several prompts share one).

Rules 5 and 6 are off by default (ttft_target_ms=0): a TPOT target alone then keeps every
step within it, short of rule 4 (the simulator's A100 tables read it so). They are for a
deployment whose TTFT matters as much as its TPOT: `--ttft-target-ms auto` (or MS).

With the target off (tpot_target_ms=0) only the token cap applies: the fixed budget of before.

What a target can promise: rule 1 puts every decode in every step, so a step carrying a
premium row costs at least the fixed cost plus a decode row per running sequence, whatever
tier. On a CPU that alone can exceed a tight target (the step-cost fit predicts it by batch
size); no prefill budget meets such a target, and the TPOT-overrun alert says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

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


# Rule 5: the fraction of its TTFT target a prompt's lateness must pass before it stretches.
AGING_START = 0.5


def ttft_stretch(lateness_s: float, ttft_target_s: float, max_stretch: float) -> float:
    """Rule 5: the factor a prompt this late may stretch its step's TPOT target by."""
    if max_stretch <= 1.0 or not ttft_target_s > 0:
        return 1.0
    x = (lateness_s / ttft_target_s - AGING_START) / (1.0 - AGING_START)
    return 1.0 + (max_stretch - 1.0) * min(max(x, 0.0), 1.0)


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
        # Rule 5: the largest stretch a row of this step used (1: none), and the stretch the
        # last room() answer needed (applied by `use_stretch` once that row is emitted).
        self.stretch = 1.0
        self.last_room_stretch = 1.0
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

    def add_decode_row(self, start_pos: int, tier: int) -> None:
        """add(1, start_pos, decode=True, tier=tier), inlined: once per decode row per pass
        (the same arithmetic, in the same order, so the same floats)."""
        self.tokens_left -= 1
        self._decode_tokens += 1
        c = self.coeffs
        if c is not None:
            self._decode_s += c.decode_row + c.context_token * (start_pos + 1)
        else:
            self._decode_s += 0.0
        target = self.targets_s[tier]
        if target is not None and (self.target_s is None or target < self.target_s):
            self.target_s = target

    def add_decode_rows(self, start_positions: list[int], tiers: Iterable[int],
                        offset: int = 0) -> None:
        """add_decode_row for each start position (plus `offset`) in turn (the same float sums,
        in the same order), the rows' tiers given once each: a decode stretch's rows riding
        along a pass (their positions at its start, and the passes since)."""
        n = len(start_positions)
        self.tokens_left -= n
        self._decode_tokens += n
        c = self.coeffs
        if c is not None:
            decode_s, per_row, per_token = self._decode_s, c.decode_row, c.context_token
            after = offset + 1
            for pos in start_positions:
                decode_s += per_row + per_token * (pos + after)
            self._decode_s = decode_s  # (without coeffs add_decode_row adds 0.0: no change)
        for tier in tiers:
            target = self.targets_s[tier]
            if target is not None and (self.target_s is None or target < self.target_s):
                self.target_s = target

    def remove(self, n: int, start_pos: int, *, decode: bool) -> None:
        """Undo `add` for a row dropped by a preemption (the target stays: conservative)."""
        self.tokens_left += n
        cost = self._row_cost(n, start_pos, decode)
        if decode:
            self._decode_tokens -= n
            self._decode_s -= cost
        else:
            self._prefill_s -= cost

    @property
    def timed(self) -> bool:
        return self.coeffs is not None

    def alone_s(self, n: int, start_pos: int) -> float:
        """Predicted time of an otherwise empty step prefilling n tokens from start_pos."""
        c = self.coeffs
        if c is None:
            return 0.0
        return c.fixed + c.prefill_token * n + c.context_token * (start_pos + n)

    def ttft_target_s(self, configured_ms: float | str, tier: int, chunk_size: int) -> float:
        """Rule 5's T for a prompt of `tier`: configured, or ("auto") the larger of the tier's
        TPOT target and an empty step prefilling one full chunk (0: aging off)."""
        if configured_ms != "auto":
            return float(configured_ms) / 1000.0
        return max(self.targets_s[tier] or 0.0, self.alone_s(chunk_size, 0))

    def may_stretch(self, tier: int) -> bool:
        """Rule 5: a prompt trades only headroom of targets no tighter than its own tier's."""
        own = self.targets_s[tier]
        return own is not None and self.target_s is not None and own <= self.target_s

    def room(self, start_pos: int, starving: bool = False, stretch: float = 1.0) -> int:
        """Prefill tokens a row starting at start_pos may take now (rules 3, 4 and 5: the
        target stretched by `stretch`)."""
        self.last_room_stretch = 1.0
        cap = max(self.tokens_left, 0)
        if self.coeffs is None or self.target_s is None:
            return cap
        n = prefill_room(self.coeffs, self.predicted_s, self.target_s, start_pos)
        if stretch > 1.0:
            stretched = prefill_room(self.coeffs, self.predicted_s, self.target_s * stretch,
                                     start_pos)
            if stretched > n and cap > n:
                n = stretched
                self.last_room_stretch = stretch
        if starving and not self.floor_granted:
            floor = max(self.floor_tokens,
                        prefill_room(self.coeffs, self.coeffs.fixed, self.target_s, start_pos))
            if floor > n:
                self.floor_granted = True
                n = floor
        return min(n, cap)

    def use_stretch(self, stretch: float) -> None:
        """A row sized under `stretch` (room's last_room_stretch) joined the pass."""
        self.stretch = max(self.stretch, stretch)

    @property
    def effective_target_s(self) -> float | None:
        """The target this step was built under, rule 5's stretch included."""
        return None if self.target_s is None else self.target_s * self.stretch

    @property
    def prefill_budget_tokens(self) -> int:
        """What prefill could get on top of this step's decodes (rule 3 from position 0)."""
        cap = self.max_tokens - self._decode_tokens
        if self.coeffs is None or self.target_s is None:
            return cap
        decodes_s = self.coeffs.fixed + self._decode_s
        return min(cap, prefill_room(self.coeffs, decodes_s, self.target_s, 0))
