"""Speculative decoding in the simulator: a speculating pass is priced with its 1+k rows per
sequence, acceptance is the simulator's input, and on the A100/70B design node the sizing rule
speculates at small batches and turns itself off at large ones."""

from __future__ import annotations

import random

import pytest

from everystop.core.outputs import ScheduledSequence, SchedulerOutput
from everystop.sampling_params import SamplingParams
from everystop.sim.cost_model import IterationShape
from everystop.sim.metrics import summarize
from everystop.sim.node import build_node
from everystop.sim.simulator import SimSetup, simulate
from everystop.sim.speculation import REJECTED_TOKEN, SIM_TOKEN, sizing_table, verify
from everystop.workload import synthetic

P = SamplingParams(max_tokens=100, ignore_eos=True)


def _pass(num_drafts: int) -> SchedulerOutput:
    """Two decode rows at position 500; the first carries `num_drafts` proposals."""
    rows = [ScheduledSequence("a", [5] + [SIM_TOKEN] * num_drafts, 500, [0], True, P,
                              num_draft_tokens=num_drafts),
            ScheduledSequence("b", [5], 500, [1], True, P)]
    return SchedulerOutput(scheduled=rows, num_decode_tokens=2, num_draft_tokens=num_drafts)


def test_a_speculating_pass_is_priced_with_its_extra_rows() -> None:
    plain, spec = (IterationShape.from_scheduler_output(_pass(k)) for k in (0, 4))
    assert spec.num_draft_tokens == 4 and spec.num_tokens == plain.num_tokens + 4 == 6
    assert spec.num_sampled == plain.num_sampled + 4  # every verified position is sampled
    assert spec.context_tokens_read == plain.context_tokens_read + 4
    cost = build_node("llama-3-70b", "a100-80gb", 4, "chunked").cost
    # extra tokens through the dense layers and the head: more FLOPs, at least as long
    assert cost.work(spec).flops > cost.work(plain).flops
    assert cost.latency(spec) >= cost.latency(plain)
    compute_bound = IterationShape(256, 256, 0, 256 * 500, 256 * 500, 256)
    assert cost.latency(IterationShape(256, 256, 0, 256 * 504, 256 * 504, 256 + 4 * 256,
                                       num_draft_tokens=4 * 256)) > cost.latency(compute_bound)
    assert IterationShape.from_record(spec.to_dict()) == spec


def test_each_proposal_is_kept_with_the_acceptance_rate_until_the_first_rejection() -> None:
    rng, out = random.Random(0), _pass(4)
    kept = []
    for _ in range(4000):
        (tokens,) = verify(out, 0.6, rng).values()
        assert len(tokens) == 5
        n = next((i for i, t in enumerate(tokens[:4]) if t != SIM_TOKEN), 4)
        assert n == 4 or tokens[n] == REJECTED_TOKEN
        kept.append(n)
    mean = sum(kept) / len(kept)
    assert mean == pytest.approx(0.6 + 0.36 + 0.216 + 0.1296, rel=0.05)  # sum of a^j, j=1..4
    assert verify(out, 1.0, rng)["a"] == [SIM_TOKEN] * 5
    assert verify(out, 0.0, rng)["a"][0] == REJECTED_TOKEN


def test_the_design_node_speculates_at_small_batches_and_not_at_large_ones() -> None:
    cost = build_node("llama-3-70b", "a100-80gb", 4, "chunked").cost
    small, large = sizing_table(cost, [4, 512], [0.5, 0.9])
    for a in ("a0.5", "a0.9"):
        assert small[a]["mean_k"] > 0
        assert small[a]["tokens_per_s"] > small["plain_tokens_per_s"]
        assert large[a]["mean_k"] == 0  # compute-bound: plain decoding is faster
        assert large[a]["tokens_per_s"] == pytest.approx(large["plain_tokens_per_s"])
    assert small["a0.9"]["tokens_per_s"] > small["a0.5"]["tokens_per_s"]


def test_a_simulated_speculating_node_gives_the_same_tokens_in_less_time_per_token() -> None:
    work = synthetic("n=12,prompt=uniform:64:128,output=const:60,seed=3")
    runs = {}
    for k, a in ((0, 0.0), (4, 0.8), (4, 0.0)):
        node = build_node("llama-3-70b", "a100-80gb", 4, "chunked", speculative_tokens=k,
                          spec_acceptance=a)
        res = simulate(work, node.setup, node.cost.latency, check=True)
        assert all(r.num_output_tokens == 60 for r in res.requests)
        runs[(k, a)] = (res, summarize(res, node.cost))
    plain, good = runs[(0, 0.0)], runs[(4, 0.8)]
    drafted = [sum(it.shape.num_draft_tokens for it in r.iterations) for r, _ in runs.values()]
    assert drafted[0] == 0 and drafted[1] > 0
    assert len(good[0].iterations) < len(plain[0].iterations)
    assert good[1]["tpot_p50_ms"] < plain[1]["tpot_p50_ms"]
    # nothing accepted: the sizing rule stops proposing after the first rejections
    assert drafted[2] < drafted[1] / 4


def test_acceptance_needs_speculation_on_and_a_rate() -> None:
    node = build_node("llama-3-70b", "a100-80gb", 4, "chunked")
    with pytest.raises(ValueError, match="spec_acceptance"):
        SimSetup(node.setup.scheduler, 100, spec_acceptance=0.5)  # speculative off
    spec = build_node("llama-3-70b", "a100-80gb", 4, "chunked", speculative_tokens=2)
    with pytest.raises(ValueError, match="spec_acceptance"):
        SimSetup(spec.setup.scheduler, 100, spec_acceptance=1.5)
