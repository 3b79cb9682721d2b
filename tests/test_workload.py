"""Workloads: seeded, in range, real English text, shared prefixes, one length syntax for the
generator and the simulator's spec string, JSON round trip, the committed files load."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from everystop.workload import (
    LengthDist,
    WorkloadSpec,
    arrival_offsets,
    generate_workload,
    load_workload,
    perf_workload,
    synthetic,
)

COMMITTED = Path(__file__).resolve().parents[1] / "benchmarks" / "workloads"


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
    assert LengthDist.parse("const:7") == LengthDist("fixed", 7, 7)
    assert LengthDist.parse("lognormal:80:0.5:16:256") == LengthDist("lognormal", 16, 256, 80, 0.5)
    assert LengthDist.parse("lognormal:80:0.5:100").max == 100
    for bad in ("gaussian:1:2", "uniform:5", "lognormal:80", "uniform:9:3"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)
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


def test_lognormal_is_clipped_and_centred_on_its_median() -> None:
    dist = LengthDist.parse("lognormal:80:0.75:16:256")
    rng = random.Random(0)
    values = [dist.sample(rng) for _ in range(4000)]
    assert min(values) == 16 and max(values) == 256
    assert statistics.median(values) == pytest.approx(80, rel=0.1)


def test_synthetic_spec_uses_the_same_lengths_and_arrivals() -> None:
    wl = synthetic("n=300,prompt=lognormal:200:0.5:1024,output=fixed:9,rate=10,prefix=0.5:64,"
                   "tenants=3,seed=4")
    assert all(r.max_tokens == 9 and r.prompt == "" for r in wl.requests)
    assert all(1 <= r.prompt_len <= 1024 + 64 for r in wl.requests)
    shared = [r for r in wl.requests if r.prefix_group]
    assert 100 < len(shared) < 200 and {r.prefix_len for r in shared} == {64}
    assert {r.tenant for r in wl.requests} == {"t0", "t1", "t2"}
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(wl.requests, wl.requests[1:])]  # type: ignore[operator]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.2)
    assert all(r.arrival_s == 0.0 for r in synthetic("n=5").requests)
    assert arrival_offsets(3, None, 1.0, random.Random(0)) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        synthetic("n=5,colour=red")


def test_committed_workloads_load() -> None:
    mixed = load_workload(COMMITTED / "mixed-128.json")
    assert len(mixed.requests) == 128 and mixed.spec["prefix_len"] == 128
    grouped = [r for r in mixed.requests if r.prefix_group]
    assert grouped and all(r.prefix_len == 128 for r in grouped)
    assert len(load_workload(COMMITTED / "single-16.json").requests) == 16
    perf = perf_workload()
    assert perf.name == "perf-mixed-128" and len(perf.requests) == 128
    assert all(len(r.prompt_token_ids or []) == r.prompt_len for r in perf.requests)
    assert sum(r.prompt_len for r in perf.requests) == 34020
    assert perf.total_output_tokens == 13401
    assert perf_workload(16).requests == perf.requests[:16]
