"""Speculative decoding in the scheduler's pass: the n-gram proposer, and verification over the
toy executor (whose tokens are a known function of the context) with random accept/reject
patterns, preemption and aborts; the invariants are checked after every step."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from everystop.config import ConfigError, SchedulerConfig
from everystop.core.request import Request
from everystop.core.speculation import NgramProposer, speculates
from everystop.sampling_params import SamplingParams, SamplingParamsError, StructuredOutput

from .helpers import make_harness
from .test_properties import run_workload, workload_st
from .toy_executor import masked, next_token, reference_output


class OracleProposer:
    """Proposes the toy model's own next tokens, each replaced by a wrong one with probability
    `wrong`: every accept/reject pattern, drawn from `seed`."""

    def __init__(self, wrong: float, seed: int, window: int | None = None,
                 always_k: bool = False) -> None:
        self.wrong, self.rng, self.window = wrong, random.Random(seed), window
        self.always_k = always_k  # else a random count up to k
        self.num_calls = 0

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        self.num_calls += 1
        ctx, out = list(token_ids), []
        for _ in range(k if self.always_k else self.rng.randint(0, k)):
            t = next_token(masked(ctx, self.window))
            if self.rng.random() < self.wrong:
                t = 1 + (t % 2)  # never a toy-model token (those are >= 3)
            out.append(t)
            ctx.append(t)
        return out


# -- the n-gram proposer ---------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_most_recent_match() -> None:
    p = NgramProposer(min_n=1, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]
    # tail [5, 6, 7]: occurs at 0 (then 8, 9) and at 5 (then 1, 2): the most recent wins
    assert p.propose(tokens, 2) == [1, 2]
    assert p.propose(tokens, 10) == [1, 2, 5, 6, 7]  # up to the end of the tokens
    assert p.propose(tokens, 0) == []


def test_ngram_tries_the_longest_n_first() -> None:
    p = NgramProposer(min_n=1, max_n=2)
    # tail [3, 4]: matches at 0 (then 9); the 1-gram [4] alone would match later (then 8)
    assert p.propose([3, 4, 9, 4, 8, 3, 4], 1) == [9]
    # no 2-gram match: falls back to the 1-gram [4] (most recent: index 3, then 8)
    assert p.propose([3, 4, 9, 4, 8, 7, 4], 1) == [8]


def test_ngram_without_a_match_or_below_min_n_proposes_nothing() -> None:
    assert NgramProposer(1, 3).propose([1, 2, 3, 4], 3) == []
    assert NgramProposer(2, 3).propose([1, 2, 9, 2], 3) == []  # only a 1-gram repeats
    assert NgramProposer(1, 3).propose([], 3) == [] and NgramProposer(1, 3).propose([7], 3) == []
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def test_all_but_opted_out_requests_speculate() -> None:
    for changed in (dict(), dict(temperature=0.7, seed=3), dict(logprobs=1),
                    dict(presence_penalty=0.5), dict(logit_bias={3: 1.0}), dict(min_tokens=2),
                    dict(stop=["."]), dict(structured_output=StructuredOutput("json_object"))):
        assert speculates(SamplingParams(**changed)), changed
    assert not speculates(SamplingParams(disable_spec_decode=True))
    assert not speculates(SamplingParams(disable_spec_decode=True,
                                         structured_output=StructuredOutput("json_object")))
    with pytest.raises(SamplingParamsError, match="disable_spec_decode"):
        SamplingParams(disable_spec_decode="no")  # type: ignore[arg-type]


def test_options_out_of_range_are_refused_by_name() -> None:
    for bad, name in ((dict(speculative="medusa"), "speculative"),
                      (dict(speculative="draft:"), "speculative"),
                      (dict(speculative="drafts:/m.gguf"), "speculative"),
                      (dict(speculative=None), "speculative"),
                      (dict(num_speculative_tokens=0), "num_speculative_tokens"),
                      (dict(num_speculative_tokens=33), "num_speculative_tokens"),
                      (dict(ngram_min=3, ngram_max=2), "ngram_min"),
                      (dict(ngram_max=17), "ngram_max")):
        with pytest.raises(ConfigError, match=name):
            SchedulerConfig(**bad)  # type: ignore[arg-type]


def test_the_flags_reach_the_config_and_bad_values_are_refused_by_name() -> None:
    import argparse

    from everystop.engine.args import add_engine_args, engine_config_from_args

    parser = add_engine_args(argparse.ArgumentParser())

    def sched(*argv: str) -> SchedulerConfig:
        return engine_config_from_args(parser.parse_args(list(argv))).scheduler

    assert sched().speculative == "off"
    cfg = sched("--speculative", "ngram", "--num-speculative-tokens", "6", "--ngram-min", "2",
                "--ngram-max", "5")
    assert (cfg.speculative, cfg.num_speculative_tokens, cfg.ngram_min, cfg.ngram_max) == (
        "ngram", 6, 2, 5)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        sched("--speculative", "ngram", "--num-speculative-tokens", "0")
    assert sched("--speculative", "draft:/models/small.gguf").speculative == (
        "draft:/models/small.gguf")
    with pytest.raises(ConfigError, match="speculative"):
        sched("--speculative", "eagle")


# -- verification in the scheduler -----------------------------------------------------------

def spec_harness(wrong: float = 0.3, seed: int = 0, k: int = 4, **kwargs):
    h = make_harness(speculative="ngram", num_speculative_tokens=k, **kwargs)
    h.scheduler.proposer = OracleProposer(wrong, seed, kwargs.get("sliding_window"))
    return h


@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0])
def test_outputs_equal_plain_decoding_whatever_is_accepted(wrong: float) -> None:
    h = spec_harness(wrong=wrong, seed=7)
    prompts = {f"r{i}": [3 + i, 4, 5 + i, 6] * (i + 1) for i in range(6)}
    for rid, prompt in prompts.items():
        h.add(rid, prompt, max_tokens=23)
    h.run()
    for rid, prompt in prompts.items():
        assert h.outputs[rid] == reference_output(prompt, 23), rid
    s = h.scheduler.stats()
    assert s.spec_decode_num_draft_tokens > 0
    assert any(sched.num_draft_tokens for sched in h.history)
    if wrong == 0.0:
        assert s.spec_decode_num_accepted_tokens == s.spec_decode_num_draft_tokens
    elif wrong == 1.0:
        assert s.spec_decode_num_accepted_tokens == 0
    else:
        assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
    assert h.scheduler.kv.pool.num_used_blocks == 0


def test_a_pass_gives_one_to_k_plus_one_tokens_and_frees_rejected_blocks() -> None:
    h = spec_harness(wrong=0.5, seed=3, k=6, block_size=2)
    h.add("a", [3, 4, 5], max_tokens=40)
    h.step()  # the prompt
    while h.scheduler.has_unfinished:
        before = len(h.outputs["a"])
        sched, _ = h.step()
        (row,) = sched.scheduled
        got = len(h.outputs["a"]) - before
        assert 1 <= got <= row.num_draft_tokens + 1
        req = h.scheduler.requests.get("a")
        if req is not None:  # the table holds the accepted tokens, nothing past them
            assert req.num_computed_tokens == req.num_tokens - 1
            assert len(h.scheduler.kv.req_blocks["a"]) == -(-req.num_computed_tokens // 2)
    assert h.outputs["a"] == reference_output([3, 4, 5], 40)


def test_a_stop_token_among_accepted_proposals_ends_there() -> None:
    prompt = [3, 4, 5, 6]
    ref = reference_output(prompt, 30)
    eos = ref[9]
    h = spec_harness(wrong=0.0, seed=1, k=8)
    h.add("a", prompt, max_tokens=30, eos=eos)
    h.run()
    assert h.outputs["a"] == ref[:ref.index(eos) + 1]
    assert h.finish["a"] == "stop"
    # max_tokens cuts a fully accepted run too
    h = spec_harness(wrong=0.0, seed=1, k=8)
    h.add("b", prompt, max_tokens=5)
    h.run()
    assert h.outputs["b"] == ref[:5] and h.finish["b"] == "length"


def test_proposals_come_after_the_decodes_and_leave_waiting_prompts_their_budget() -> None:
    h = spec_harness(wrong=0.0, seed=2, k=8, max_num_batched_tokens=12, chunk_size=64)
    h.scheduler.proposer.always_k = True
    for i in range(4):
        h.add(f"d{i}", [3 + i, 9, 9], max_tokens=50)
    h.step()
    sched, _ = h.step()
    assert sched.num_decode_tokens == 4
    assert sched.num_draft_tokens == 12 - 4  # no prompt waits: the drafts take what is left
    h.add("late", list(range(3, 40)), max_tokens=2)
    sched, _ = h.step()
    assert sched.num_decode_tokens == 4
    assert sched.num_scheduled_tokens <= 12
    assert sched.num_prefill_tokens == 12 - 4  # the waiting prompt goes first
    assert sched.num_draft_tokens == 0
    h.run()
    assert h.outputs["late"] == reference_output(list(range(3, 40)), 2)


def test_acceptance_is_counted_by_position_and_a_larger_k_extends_the_counts() -> None:
    h = spec_harness(wrong=0.0, seed=8, k=3)
    h.scheduler.proposer.always_k = True
    h.add("a", [3, 4, 5, 6], max_tokens=20)
    h.run()
    s = h.scheduler.stats()
    per_pos = s.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == 3 and sum(per_pos) == s.spec_decode_num_accepted_tokens > 0
    assert per_pos[0] == s.spec_decode_num_drafts  # an always-right proposer: all kept
    assert s.spec_decode_acceptance_rate == 1.0
    h.scheduler.update_config(dataclasses.replace(h.scheduler.config, num_speculative_tokens=5))
    assert h.scheduler.stats().spec_decode_num_accepted_tokens_per_pos == per_pos + [0, 0]


class BatchOracle(OracleProposer):
    """The oracle, asked once per pass for every speculating row (as a draft model is)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.batches: list[list[int]] = []  # each call's ks

    def propose_batch(self, contexts: Sequence[Sequence[int]], ks: Sequence[int]
                      ) -> list[list[int]]:
        self.batches.append(list(ks))
        return [self.propose(c, k) for c, k in zip(contexts, ks)]


@pytest.mark.parametrize("budget", [64, 10])
def test_a_batch_proposer_is_asked_once_per_pass_within_the_budget(budget: int) -> None:
    h = make_harness(speculative="ngram", num_speculative_tokens=4,
                     max_num_batched_tokens=budget)
    oracle = h.scheduler.proposer = BatchOracle(0.3, 11)
    prompts = {f"r{i}": [3 + i, 4, 5 + i, 6] * (i + 1) for i in range(6)}
    for rid, prompt in prompts.items():
        h.add(rid, prompt, max_tokens=17)
    h.run()
    for rid, prompt in prompts.items():
        assert h.outputs[rid] == reference_output(prompt, 17), rid
    assert oracle.batches and oracle.num_calls == sum(len(ks) for ks in oracle.batches)
    assert any(len(ks) > 1 for ks in oracle.batches)
    for sched in h.history:  # the drafts never push a pass past its token budget
        assert sum(len(s.token_ids) for s in sched.scheduled) <= budget
    assert h.scheduler.stats().spec_decode_num_accepted_tokens > 0
    assert h.scheduler.kv.pool.num_used_blocks == 0


def test_an_attached_draft_proposer_is_kept_while_the_method_is_unchanged() -> None:
    h = make_harness(speculative="draft:/models/small.gguf", num_speculative_tokens=4)
    sched = h.scheduler
    assert sched.proposer is None  # core cannot load a model: the engine attaches it
    draft = OracleProposer(wrong=0.0, seed=1)
    sched.proposer = draft
    sched.update_config(dataclasses.replace(sched.config, num_speculative_tokens=6))
    assert sched.proposer is draft
    sched.update_config(dataclasses.replace(sched.config, speculative="ngram"))
    assert isinstance(sched.proposer, NgramProposer)
    sched.update_config(dataclasses.replace(sched.config, speculative="off"))
    assert sched.proposer is None


def test_an_executor_that_does_not_verify_turns_speculation_off() -> None:
    h = spec_harness(wrong=0.0, seed=4)
    h.scheduler.proposer.always_k = True
    h.executor.verify = False
    h.add("a", [3, 4, 5, 6], max_tokens=12)
    h.run()
    assert h.outputs["a"] == reference_output([3, 4, 5, 6], 12)
    assert h.scheduler.proposer is None
    assert h.scheduler.stats().spec_decode_num_draft_tokens == 0


def test_requests_that_opt_out_decode_one_token_per_pass() -> None:
    h = spec_harness(wrong=0.0, seed=5)
    h.scheduler.add_request(Request("s", [3, 4, 5], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, disable_spec_decode=True)))
    h.outputs["s"] = []
    h.run()
    assert all(sched.num_draft_tokens == 0 for sched in h.history)
    assert h.scheduler.proposer.num_calls == 0
    assert h.outputs["s"] == reference_output([3, 4, 5], 6)


def test_abort_and_preemption_of_speculating_rows_keep_the_invariants() -> None:
    for mode in ("recompute", "swap"):
        h = spec_harness(wrong=0.2, seed=9, k=5, num_blocks=14, block_size=2,
                         num_cpu_blocks=30, preemption_mode=mode,
                         recompute_threshold_tokens=0, max_num_batched_tokens=40)
        prompts = {f"r{i}": [3 + i, 5, 7, 9 + i] for i in range(5)}
        for i, (rid, prompt) in enumerate(prompts.items()):
            h.add(rid, prompt, max_tokens=9, priority=i % 3)
        for _ in range(3):
            h.step()
        h.scheduler.abort_requests(["r1"])
        h.run()
        assert sum(h.scheduler.num_preemptions.values()) > 0, mode
        for rid, prompt in prompts.items():
            if rid != "r1":
                assert h.outputs[rid] == reference_output(prompt, 9), (mode, rid)
        assert h.scheduler.kv.pool.num_used_blocks == 0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**workload_st, k=st.integers(1, 6), wrong=st.sampled_from([0.0, 0.2, 0.6, 1.0]),
       seed=st.integers(0, 1000), window=st.sampled_from([None, None, 4, 9]),
       seeds=st.lists(st.one_of(st.none(), st.integers(0, 2**31)), max_size=14))
def test_invariants_hold_while_speculating(k, wrong, seed, window, seeds, **workload) -> None:
    """Random accept/reject patterns, preemption (recompute and swap), aborts, sliding
    windows; greedy and seeded sampled requests (whose sampled tokens reject greedy proposals
    at random positions: the toy model's sampled_token)."""
    run_workload(**workload, sliding_window=window, speculative="ngram", seeds=seeds,
                 num_speculative_tokens=k, proposer=OracleProposer(wrong, seed, window))


class RandomCut:
    """A stand-in for a grammar's draft check: keeps a random prefix of each proposal."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.num_cut = 0

    def __call__(self, req: Request, drafts: list[int]) -> list[int]:
        assert req.sampling_params.structured_output is not None
        kept = drafts[:self.rng.randint(0, len(drafts))]
        self.num_cut += len(kept) < len(drafts)
        return kept


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**workload_st, k=st.integers(1, 6), wrong=st.sampled_from([0.0, 0.3]),
       seed=st.integers(0, 1000))
def test_invariants_hold_while_a_draft_check_cuts_proposals(k, wrong, seed, **workload) -> None:
    """Structured output's grammar cut (core/verification.py) under random accept/reject,
    preemption and aborts: only the kept proposals take KV blocks, and the output is the
    same."""
    run_workload(**workload, speculative="ngram", num_speculative_tokens=k,
                 proposer=OracleProposer(wrong, seed, always_k=True), draft_check=RandomCut(seed))


def test_a_draft_check_cuts_structured_proposals_only() -> None:
    h = spec_harness(wrong=0.0, seed=4, k=4)
    h.scheduler.proposer.always_k = True
    cut = h.scheduler.draft_check = RandomCut(4)
    h.add("s", [3, 4, 5], 12, structured_output=StructuredOutput("json_object"))
    h.add("p", [6, 7, 8], 12)
    h.run()
    assert cut.num_cut > 0
    drafted: dict[str, list[int]] = {"s": [], "p": []}
    for sched in h.history:
        for e in sched.scheduled:
            if e.num_draft_tokens:
                drafted[e.request_id].append(e.num_draft_tokens)
    assert max(drafted["p"]) == 4 and min(drafted["s"]) < 4  # the plain one's are never cut
    assert h.outputs["s"] == reference_output([3, 4, 5], 12)
    assert h.outputs["p"] == reference_output([6, 7, 8], 12)


def test_seeded_sampled_requests_give_their_own_tokens_while_speculating() -> None:
    """A sampled request's token at output index i depends on (seed, i): speculation, whose
    later positions sample indices i+1.., and preemption must both keep the indices right."""
    h = spec_harness(wrong=0.0, seed=6, k=5, num_blocks=16, block_size=2, num_cpu_blocks=40,
                     preemption_mode="recompute", recompute_threshold_tokens=0,
                     max_num_batched_tokens=40)
    prompts = {f"s{i}": [3 + i, 8, 5, 9 + i] for i in range(4)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        h.add(rid, prompt, max_tokens=14, seed=100 + i)
    h.run()
    s = h.scheduler.stats()
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
    assert sum(h.scheduler.num_preemptions.values()) > 0
    for i, (rid, prompt) in enumerate(prompts.items()):
        assert h.outputs[rid] == reference_output(prompt, 14, seed=100 + i), rid
        assert h.outputs[rid] != reference_output(prompt, 14), rid  # it did sample
