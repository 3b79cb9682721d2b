"""The routing policies alone: no Ray, no engine, hand-made load reports."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from everystop.core.block_pool import hash_block_tokens
from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.request import Request
from everystop.routing import (
    POLICIES,
    ReplicaLoad,
    RouteRequest,
    make_router,
    prefix_block_hashes,
    route_request,
)
from everystop.routing.load import tier_and_score
from everystop.sampling_params import SamplingParams


def load(rid: str, *, waiting: int = 0, running: int = 0, swapped: int = 0, free: int = 100,
         total: int = 100, prefill: int = 0, seq: int = 0) -> ReplicaLoad:
    return ReplicaLoad(rid, num_waiting=waiting, num_running=running, num_swapped=swapped,
                       free_kv_blocks=free, total_kv_blocks=total, prefill_tokens_queued=prefill,
                       seq=seq)


def test_least_loaded_prefers_the_shorter_queue() -> None:
    router = make_router("least-loaded")
    loads = [load("a", waiting=3, running=4), load("b", waiting=0, running=4),
             load("c", waiting=1, running=4)]
    assert router.rank(RouteRequest(kv_blocks_needed=2), loads) == ["b", "c", "a"]


def test_a_replica_at_95_percent_kv_is_not_chosen_while_another_has_room() -> None:
    # "a" has the emptier queue but its KV cache is 95% used; "b" has a longer queue and room.
    loads = [load("a", running=1, free=5), load("b", waiting=2, running=6, free=60)]
    for policy in ("least-loaded", "prefix-affinity"):
        router = make_router(policy)
        assert router.rank(RouteRequest(kv_blocks_needed=2), loads)[0] == "b", policy


def test_a_replica_where_the_request_does_not_fit_comes_last() -> None:
    loads = [load("a", free=3), load("b", running=1, free=95, total=100),
             load("c", waiting=5, free=92)]
    # 4 blocks: "a" cannot take it now; "c" has room but a long queue.
    assert make_router("least-loaded").rank(RouteRequest(kv_blocks_needed=4), loads) == [
        "b", "c", "a"]


def test_the_request_own_kv_need_counts() -> None:
    # Both below the high-water mark for a small request; a big one pushes "a" over it.
    loads = [load("a", free=30), load("b", waiting=1, prefill=600, free=80)]
    router = make_router("least-loaded")
    assert router.rank(RouteRequest(kv_blocks_needed=1), loads)[0] == "a"
    assert router.rank(RouteRequest(kv_blocks_needed=25), loads)[0] == "b"


def test_queued_prefill_tokens_count_as_work_ahead() -> None:
    loads = [load("a", waiting=1, prefill=4000), load("b", waiting=2, prefill=100)]
    assert make_router("least-loaded").rank(RouteRequest(1), loads)[0] == "b"


def test_a_short_request_avoids_a_replica_busy_with_a_long_prefill() -> None:
    # "a" is prefilling a 1,500-token prompt; "b" runs a full decode batch. A short request's
    # first token waits for the whole prefill on "a", for one pass on "b".
    loads = [load("a", running=2, prefill=1500), load("b", running=16)]
    assert make_router("least-loaded").rank(RouteRequest(4, num_prompt_tokens=64),
                                            loads)[0] == "b"


def test_the_request_own_prefill_size_weighs_the_decode_batch() -> None:
    # A running request adds a decode row to each pass of the newcomer's prefill: a short
    # prompt (one pass) prefers the crowded batch to 200 queued tokens; a 1,536-token prompt
    # (three passes) does not.
    loads = [load("a", running=12, free=1000, total=1000),
             load("b", running=2, prefill=200, free=1000, total=1000)]
    router = make_router("least-loaded")
    assert router.rank(RouteRequest(4, num_prompt_tokens=64), loads)[0] == "a"
    assert router.rank(RouteRequest(96, num_prompt_tokens=1536), loads)[0] == "b"


def test_in_flight_correction_spreads_a_burst_between_reports() -> None:
    router = make_router("least-loaded")
    loads = [load("a", seq=1), load("b", seq=1)]  # the same stale report for the whole burst
    chosen = []
    for _ in range(6):
        req = RouteRequest(kv_blocks_needed=2, num_prompt_tokens=64)
        rid = router.rank(req, loads)[0]
        router.on_sent(rid, req)
        chosen.append(rid)
    assert sorted(chosen) == ["a", "a", "a", "b", "b", "b"]
    assert router.in_flight("a") == 3


def test_a_report_that_shows_the_sends_is_not_double_counted() -> None:
    router = make_router("least-loaded")
    stale = [load("a", seq=1), load("b", waiting=1, prefill=256, seq=1)]
    assert router.rank(RouteRequest(1), stale)[0] == "a"
    router.on_sent("a", RouteRequest(kv_blocks_needed=2, num_prompt_tokens=256))
    router.on_sent("a", RouteRequest(kv_blocks_needed=2, num_prompt_tokens=256))
    assert router.rank(RouteRequest(1), stale)[0] == "b"  # a: 2 unseen waiting, b: 1 waiting
    # A newer report that does not show them yet (still on their way) changes nothing...
    newer = [load("a", seq=2), load("b", waiting=1, prefill=256, seq=2)]
    assert router.rank(RouteRequest(1), newer)[0] == "b"
    # ...and one that shows them running counts them once: 2 running beat 1 waiting.
    shown = [load("a", running=2, free=96, seq=3), load("b", waiting=1, prefill=256, seq=3)]
    assert router.rank(RouteRequest(1), shown)[0] == "a"
    assert router.last_scores["a"] < router.last_scores["b"]
    assert router.in_flight("a") == 2


def test_finishes_since_the_report_lower_the_load() -> None:
    router = make_router("least-loaded")
    sent_before = [RouteRequest(kv_blocks_needed=10) for _ in range(3)]
    router.rank(RouteRequest(1), [load("a", seq=4), load("b", seq=4)])
    for req in sent_before:
        router.on_sent("a", req)
    loads = [load("a", running=3, free=70, seq=5), load("b", running=2, free=80, seq=5)]
    assert router.rank(RouteRequest(1), loads)[0] == "b"
    for req in sent_before:
        router.on_finished("a", req)  # sent before report 5, finished since
    assert router.rank(RouteRequest(1), loads)[0] == "a"


def test_a_request_sent_and_finished_between_reports_leaves_no_trace() -> None:
    router = make_router("least-loaded")
    loads = [load("a", seq=1), load("b", seq=1)]
    req = RouteRequest(kv_blocks_needed=5)
    router.on_sent("a", req)
    router.on_finished("a", req)
    assert router.in_flight("a") == 0
    assert router.last_scores == {}
    router.rank(RouteRequest(1), loads)
    assert router.last_scores["a"] == router.last_scores["b"]


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica() -> None:
    router = make_router("prefix-affinity", affinity_margin=2.0)
    system = list(range(64))
    first = RouteRequest(2, prefix_block_hashes(system + [1000, 1001], 16))
    loads = [load("a", seq=1), load("b", seq=1)]
    assert router.rank(first, loads)[0] == "a"
    router.on_sent("a", first)
    # "a" is now slightly busier (one unseen request), but it holds the prefix.
    second = RouteRequest(2, prefix_block_hashes(system + [2000, 2001], 16))
    assert router.rank(second, loads)[0] == "a"
    # Without the shared prefix the least-loaded replica wins.
    other = RouteRequest(2, prefix_block_hashes(list(range(500, 564)), 16))
    assert router.rank(other, loads)[0] == "b"


def test_affinity_yields_to_load_beyond_the_margin() -> None:
    router = make_router("prefix-affinity", affinity_margin=2.0)
    prompt = prefix_block_hashes(list(range(64)), 16)
    router.on_sent("a", RouteRequest(2, prompt))
    # Scores: within a 1.2 vs b 0.6 (0.1 a request plus its 256 prompt tokens / 512);
    # beyond a 3.0, more than the margin past b.
    within = [load("a", waiting=2, prefill=512, seq=1), load("b", waiting=1, prefill=256, seq=1)]
    beyond = [load("a", waiting=5, prefill=1280, seq=1),
              load("b", waiting=1, prefill=256, seq=1)]
    assert router.rank(RouteRequest(2, prompt), within)[0] == "a"
    assert router.rank(RouteRequest(2, prompt), beyond)[0] == "b"
    # Nor does it send the request to a replica whose KV cache is past the high-water mark.
    full = [load("a", free=4, seq=1), load("b", waiting=1, seq=1)]
    assert router.rank(RouteRequest(2, prompt), full)[0] == "b"


def test_affinity_prefers_the_longest_shared_run() -> None:
    router = make_router("prefix-affinity", affinity_margin=10.0)
    tokens = list(range(96))
    router.on_sent("a", RouteRequest(1, prefix_block_hashes(tokens[:32], 16)))
    router.on_sent("b", RouteRequest(1, prefix_block_hashes(tokens[:80], 16)))
    loads = [load("a", seq=1), load("b", seq=1)]
    assert router.rank(RouteRequest(1, prefix_block_hashes(tokens, 16)), loads)[0] == "b"


def test_round_robin_takes_turns_blind_to_load() -> None:
    router = make_router("round-robin")
    loads = [load("b", waiting=50), load("a"), load("c")]
    firsts = [router.rank(RouteRequest(1), loads)[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert router.rank(RouteRequest(1), loads) == ["a", "b", "c"]
    assert router.rank(RouteRequest(1), loads) == ["b", "c", "a"]


def test_power_of_two_picks_the_shorter_of_two_random_replicas() -> None:
    router = make_router("power-of-two", seed=7)
    loads = [load("a", waiting=9), load("b", waiting=0), load("c", waiting=4),
             load("d", waiting=1)]
    depth = {"a": 9, "b": 0, "c": 4, "d": 1}
    firsts = set()
    for _ in range(200):
        ranked = router.rank(RouteRequest(1), loads)
        assert sorted(ranked) == ["a", "b", "c", "d"]
        assert depth[ranked[0]] <= depth[ranked[1]]
        firsts.add(ranked[0])
    # Random pairs: never the busiest first, but not always the idlest either.
    assert firsts == {"b", "c", "d"}
    # Seeded: the same seed gives the same sequence.
    again, other = make_router("power-of-two", seed=7), make_router("power-of-two", seed=7)
    assert [again.rank(RouteRequest(1), loads) for _ in range(20)] == [
        other.rank(RouteRequest(1), loads) for _ in range(20)]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_ranks_every_replica_once(policy: str) -> None:
    router = make_router(policy)
    loads = [load(f"r{i}", waiting=i % 3, free=10 * i + 1) for i in range(5)]
    for _ in range(10):
        assert sorted(router.rank(RouteRequest(3), loads)) == [f"r{i}" for i in range(5)]
    assert router.rank(RouteRequest(3), []) == []


def test_unknown_policy_and_bad_reports_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_router("fastest")
    with pytest.raises(ValueError, match="free_kv_blocks"):
        load("a", free=101, total=100)


def test_prefix_hashes_are_the_prefix_cache_hashes() -> None:
    tokens = list(range(40))
    hashes = prefix_block_hashes(tokens, 16)
    assert len(hashes) == 2  # full blocks only
    assert hashes[0] == hash_block_tokens(None, tuple(tokens[:16]))
    assert hashes[1] == hash_block_tokens(hashes[0], tuple(tokens[16:32]))
    # And the KV cache manager registers the same hashes for a prompt it has computed.
    kv = KVCacheManager(num_gpu_blocks=8, block_size=16)
    req = Request("r", list(tokens), SamplingParams(max_tokens=1))
    assert tuple(kv._block_hashes(req, 2)) == hashes


def test_affinity_does_not_charge_blocks_a_request_on_that_replica_already_holds() -> None:
    """A system prompt's replica, running another request with that prompt, gets the next one
    for its few new blocks: the shared 24 are in use there already, not 24 more."""
    router = make_router("prefix-affinity")
    system = list(range(384))
    first = route_request(system + [1, 2, 3], 16)  # 25 blocks, 24 of them the system prompt
    router.on_sent("a", first)
    # Both reports show their work; "a" holds the first request's 25 blocks (tier 0 at 120 of
    # 160 used). Charging the whole prompt again would put "a" at 145 > 0.9 x 160.
    loads = [load("a", running=1, free=40, total=160, seq=1),
             load("b", running=1, free=90, total=160, seq=1)]
    second = route_request(system + [4, 5, 6], 16)
    assert router.rank(second, loads)[0] == "a"
    assert router.last_reason == "affinity"
    # Once the first has finished, a report with the same numbers (other work holds the
    # blocks) no longer vouches for the prompt's: charged again, "a" past the mark yields.
    router.on_finished("a", first)
    later = [load("a", running=1, free=40, total=160, seq=2),
             load("b", running=1, free=90, total=160, seq=2)]
    assert router.rank(second, later)[0] == "b"
    assert router.last_reason == "kv_tier"


def test_unseen_requests_sharing_a_prompt_are_charged_its_blocks_once() -> None:
    router = make_router("prefix-affinity")
    system = list(range(384))
    for user in range(3):  # three sends no report shows yet: 24 shared + 1 own block each
        router.on_sent("a", route_request(system + [user], 16))
    router.rank(route_request(list(range(1000, 1040)), 16), [load("a", total=160, free=160)])
    assert router._correct(load("a", total=160, free=160)).free_blocks == 160 - (24 + 3)
    # Without the prompt's hashes (least-loaded does not need them) each is charged in full.
    plain = make_router("least-loaded")
    for user in range(3):
        plain.on_sent("a", route_request(system + [user], 16, with_hashes=False))
    assert plain._correct(load("a", total=160, free=160)).free_blocks == 160 - 3 * 25


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 200), st.integers(0, 5),
                          st.integers(1, 5000), st.integers(0, 20000), st.floats(0.0, 1.0)),
                min_size=1, max_size=12),
       st.integers(0, 400), st.integers(0, 5000), st.integers(0, 3))
def test_rank_scores_every_replica_exactly_as_tier_and_score(replicas, need, prompt, sends) -> None:
    # rank() finishes each (tier, score) from score_parts inline: the same floats as the
    # shared function, in-flight corrections included.
    loads = [load(f"r{i}", waiting=w, running=r, swapped=s, total=t, free=int(t * f),
                  prefill=p) for i, (w, r, s, t, p, f) in enumerate(replicas)]
    router = make_router("least-loaded")
    for k in range(sends):  # requests sent since the report: corrected in
        router.on_sent(f"r{k % len(loads)}", RouteRequest(kv_blocks_needed=need // 2 + k))
    request = RouteRequest(kv_blocks_needed=need, num_prompt_tokens=prompt)
    ranked = router.rank(request, loads)
    expected = {ld.replica_id: tier_and_score(router._correct(ld), request, router.weights)
                for ld in loads}
    assert router._keys == expected
    assert router.last_scores == {rid: key[1] for rid, key in expected.items()}
    assert ranked == sorted(expected, key=lambda rid: (*expected[rid], rid))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(POLICIES),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(50, 60),
                          st.floats(0.0, 1.0)), min_size=1, max_size=12),
       st.integers(0, 40), st.integers(0, 600), st.integers(0, 3))
def test_best_is_rank_first_with_the_same_side_effects(policy, replicas, need, prompt,
                                                       sends) -> None:
    # Narrow ranges, so ties in (tier, score) are common, and the reports in reverse id order:
    # the id must break ties as the sort does, not the reports' order.
    loads = [load(f"r{i}", waiting=w, running=r, total=t, free=int(t * f))
             for i, (w, r, t, f) in reversed(list(enumerate(replicas)))]
    tokens = list(range(prompt))
    routers = [make_router(policy, seed=7) for _ in range(2)]
    for router in routers:
        for k in range(sends):
            router.on_sent(f"r{k % len(loads)}", route_request(tokens, 16, with_hashes=True))
    by_rank, by_best = routers
    request = route_request(tokens, 16, with_hashes=True)
    first = by_best.best(request, loads)
    assert first == by_rank.rank(request, loads)[0]
    assert by_best.last_scores == by_rank.last_scores
    assert by_best.last_reason == by_rank.last_reason
    by_best.on_sent(first, request)
    by_rank.on_sent(first, request)
    assert by_best.reasons == by_rank.reasons
    assert make_router(policy).best(request, []) is None
