"""Synthetic workloads: seeded, in range, real English text, shared prefixes, JSON round trip."""

from __future__ import annotations

import random
import statistics

import pytest

from everystop.bench.workload import (
    LengthDist,
    WorkloadSpec,
    arrival_offsets,
    generate_workload,
    load_workload,
)


def _spec(**kw: object) -> WorkloadSpec:
    base: dict[str, object] = dict(num_requests=40, seed=3, prompt_len=LengthDist("uniform", 8, 40),
                                   output_len=LengthDist("log_uniform", 16, 256))
    base.update(kw)
    return WorkloadSpec(**base)  # type: ignore[arg-type]


def test_same_seed_same_workload_and_different_seed_differs() -> None:
    a = generate_workload(_spec(), tokenizer=None)
    b = generate_workload(_spec(), tokenizer=None)
    c = generate_workload(_spec(seed=4), tokenizer=None)
    assert a.to_dict() == b.to_dict()
    assert a.to_dict()["requests"] != c.to_dict()["requests"]


def test_lengths_tiers_and_tenants_follow_the_spec() -> None:
    wl = generate_workload(_spec(num_requests=200), tokenizer=None)
    assert all(8 <= r.prompt_len <= 40 for r in wl.requests)
    outs = [r.max_tokens for r in wl.requests]
    assert all(16 <= n <= 256 for n in outs)
    # log-uniform is long-tailed: the median sits far below the range's midpoint
    assert statistics.median(outs) < 100 < max(outs)
    assert {r.priority for r in wl.requests} == {0, 1, 2}
    assert {r.tenant for r in wl.requests} == {"acme", "globex", "initech"}
    assert all(r.arrival_s is None for r in wl.requests)


def test_prompts_are_english_text_not_token_ids() -> None:
    wl = generate_workload(_spec(), tokenizer=None)
    words = " ".join(r.prompt for r in wl.requests).lower().split()
    assert sum(w in {"the", "a", "is", "of", "to"} for w in words) > len(words) * 0.05


def test_shared_prefix_groups_share_their_opening_text() -> None:
    wl = generate_workload(_spec(num_requests=60, prefix_fraction=0.5, prefix_groups=2,
                                 prefix_len=6), tokenizer=None)
    groups: dict[str, list[str]] = {}
    for r in wl.requests:
        if r.prefix_group:
            groups.setdefault(r.prefix_group, []).append(r.prompt)
    assert groups and 10 < sum(map(len, groups.values())) < 50
    for prompts in groups.values():
        heads = {p.split("\n\n")[0] for p in prompts}
        assert len(heads) == 1 and len(next(iter(heads)).split()) == 6


def test_fixed_lengths_and_parse() -> None:
    assert LengthDist.parse("fixed:7") == LengthDist("fixed", 7, 7)
    assert LengthDist.parse("log_uniform:16:256") == LengthDist("log_uniform", 16, 256)
    with pytest.raises(ValueError):
        LengthDist.parse("gaussian:1:2")
    wl = generate_workload(_spec(output_len=LengthDist("fixed", 5, 5)), tokenizer=None)
    assert {r.max_tokens for r in wl.requests} == {5}


def test_arrivals_are_poisson_at_the_rate() -> None:
    ts = arrival_offsets(4000, rate=20.0, burstiness=1.0, rng=random.Random(0))
    assert ts[0] == 0.0 and all(b >= a for a, b in zip(ts, ts[1:]))
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.05, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.05, rel=0.1)  # exponential: sd = mean
    bursty = arrival_offsets(4000, 20.0, 0.25, random.Random(0))
    bgaps = [b - a for a, b in zip(bursty, bursty[1:])]
    assert statistics.stdev(bgaps) > 1.5 * statistics.stdev(gaps)


def test_json_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    wl = generate_workload(_spec(rate=5.0), tokenizer=None)
    path = tmp_path / "w.json"
    wl.save(path)
    back = load_workload(path)
    assert back.to_dict() == wl.to_dict()
    assert back.requests[3].arrival_s is not None and back.requests[0].arrival_s == 0.0
    spec = {k: v for k, v in back.spec.items() if k != "tokenizer"}
    assert WorkloadSpec.from_dict(spec) == _spec(rate=5.0)
