"""Speculative decoding in the simulator: a proposer with nothing to read, an acceptance rate
as the simulator's input, and the sizing rule (core/spec_sizing.py) priced by the cost model.

The proposer always proposes the simulated token, k times; the executor (sim_executor.py)
keeps each proposal with probability `acceptance`, position by position, until the first
rejection (the model the sizing rule assumes: expected tokens (1 - a^(k+1)) / (1 - a)). The
pass is priced with its 1+k rows per speculating sequence (cost_model.IterationShape's
num_draft_tokens), so the scheduler's own step-cost fit and sizing rule run as in the server.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from everystop.core.outputs import SchedulerOutput
from everystop.core.spec_sizing import SizingRow, SpecSizer
from everystop.core.step_cost import StepShape
from everystop.sim.cost_model import CostModel, IterationShape

SIM_TOKEN = 7  # the simulated model's every token (SimExecutor.SAMPLED_TOKEN)
REJECTED_TOKEN = 8  # the model's token where a proposal is rejected


class SimProposer:
    """Proposes k copies of the simulated token: acceptance is decided by the executor."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return [SIM_TOKEN] * max(k, 0)


def verify(out: SchedulerOutput, acceptance: float, rng: random.Random) -> dict[str, list[int]]:
    """The model's tokens at each speculating row's 1+k positions: the proposals kept one by
    one with probability `acceptance` until the first rejection."""
    verified: dict[str, list[int]] = {}
    for e in out.scheduled:
        k = e.num_draft_tokens
        if not k:
            continue
        kept = 0
        while kept < k and rng.random() < acceptance:
            kept += 1
        tokens = [SIM_TOKEN] * (k + 1)
        if kept < k:
            tokens[kept] = REJECTED_TOKEN
        verified[e.request_id] = tokens
    return verified


def uniform_shape(shape: StepShape) -> IterationShape:
    """The cost model's shape of a pure decode pass (rows of equal context) with proposals."""
    rows, drafts = shape.num_decode_rows, shape.num_prefill_tokens
    # each row's 1 + k query tokens attend to about its context
    pairs = round(shape.context_tokens / rows * (rows + drafts)) if rows else 0
    return IterationShape(num_seqs=rows, num_decode_tokens=rows, num_prefill_tokens=0,
                          context_tokens_read=shape.context_tokens,
                          attention_pairs=pairs,
                          num_sampled=rows + drafts, num_draft_tokens=drafts)


def sizing_table(cost: CostModel, batches: Sequence[int], acceptances: Sequence[float],
                 k_max: int = 4, context: int = 1024) -> list[dict]:
    """What the sizing rule chooses for a decode batch of each size, every sequence at
    `context` tokens with per-position acceptance a, priced by `cost`: the mean k, and the
    modeled output tokens/s with and without speculation."""
    rows_out = []
    for batch in batches:
        base = StepShape(0, batch, batch * (context + 1))
        plain_s = cost.latency(uniform_shape(base))
        row: dict = {"batch": batch, "plain_tokens_per_s": batch / plain_s}
        for a in acceptances:
            ks = SpecSizer(initial_acceptance=a).choose(
                [SizingRow(f"s{i}", k_max) for i in range(batch)], base,
                lambda s: cost.latency(uniform_shape(s)))
            drafts = sum(ks)
            spec_s = cost.latency(uniform_shape(StepShape(drafts, batch, base.context_tokens
                                                          + drafts)))
            tokens = sum((1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1 for k in ks)
            row[f"a{a:g}"] = {"mean_k": drafts / batch, "tokens_per_s": tokens / spec_s}
        rows_out.append(row)
    return rows_out
