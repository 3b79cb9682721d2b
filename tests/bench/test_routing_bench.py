"""`everystop bench routing`'s workloads and verdict, without a cluster."""

from __future__ import annotations

import math

from everystop.bench.routing import LONG_PROMPT, shared_prefix, skewed, verdict

TOKENS = list(range(5000))


def test_the_skewed_mix_has_exactly_the_long_prompts_asked_for() -> None:
    workload, ids = skewed(TOKENS, 40, 3, seed=1)
    lengths = [r.prompt_len for r in workload.requests]
    assert lengths.count(LONG_PROMPT) == 3 and len(lengths) == 40
    assert all(len(ids[r.id]) == r.prompt_len for r in workload.requests)
    assert all(24 <= n <= 96 for n in lengths if n != LONG_PROMPT)


def test_shared_prefix_prompts_start_with_one_of_the_system_prompts() -> None:
    workload, ids = shared_prefix(TOKENS, 30, groups=4, prefix_len=64, seed=1)
    heads = {tuple(ids[r.id][:64]) for r in workload.requests}
    assert len(heads) <= 4 and len(workload.requests) == 30


def _policy(p99: float, short_p99: float, tok_s: float, hit: float = 0.0) -> dict:
    return {"ttft_ms": {"p99": p99}, "ttft_ms_short_prompts": {"p99": short_p99},
            "ttft_ms_long_prompts": {"p99": p99}, "output_tok_s": tok_s,
            "prefix_cache": {"hit_rate": hit}}


def test_the_verdict_is_computed_from_the_run_and_can_say_no() -> None:
    met = verdict({"skewed": {"policies": {
        "least-loaded": _policy(600, 100, 10), "round-robin": _policy(1000, 500, 10),
        "power-of-two": _policy(700, 300, 10)}}})
    assert met["skewed"]["target_met"] and math.isclose(met["skewed"]["p99_ttft_ll_over_rr"], 0.6)
    missed = verdict({"skewed": {"policies": {
        "least-loaded": _policy(800, 100, 10), "round-robin": _policy(1000, 500, 10),
        "power-of-two": _policy(700, 300, 10)}},
        "shared_prefix": {"policies": {"least-loaded": _policy(500, 0, 5, hit=0.6),
                                       "prefix-affinity": _policy(400, 0, 5, hit=0.8)}}})
    assert not missed["skewed"]["target_met"]
    assert not missed["shared_prefix"]["target_met"]  # 1.33x < 1.5x


def test_the_verdict_says_whether_the_p99_is_a_long_prompt() -> None:
    def rests(n: int, num_long: int) -> bool:
        policies = {p: _policy(800, 100, 10)
                    for p in ("least-loaded", "round-robin", "power-of-two")}
        result = {"skewed": {"policies": policies,
                             "workload": skewed(TOKENS, n, num_long, seed=1)[0].spec}}
        return bool(verdict(result)["skewed"]["p99_rests_on_long_prompts"])

    # 4 in 96: the p99 lies between the two slowest long prompts; 4 in 404 or 1 in 100: between
    # the two slowest short ones, or the slowest short one and the long one (1% of the way).
    assert rests(96, 4) and rests(48, 4)
    assert not rests(404, 4) and not rests(100, 1)


def test_the_simulated_run_measures_capacity_and_loads_from_it() -> None:
    import argparse

    from everystop.bench.routing import add_arguments
    from everystop.bench.routing_sim import simulate_all

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--sim-loads", "0.5", "--sim-seeds", "1"])
    server = {"max_num_seqs": 4, "max_num_batched_tokens": 512, "num_gpu_blocks": 200}
    out = simulate_all(TOKENS, args, ["least-loaded", "round-robin"],
                       {"skewed": (lambda seed: skewed(TOKENS, 12, 1, seed), server)})
    capacity = out["skewed"]["capacity_req_s"]
    (cell,) = out["skewed"]["by_rate_req_s"].items()
    assert capacity > 0 and math.isclose(float(cell[0]), 0.5 * capacity, rel_tol=1e-2)
    assert set(cell[1]) == {"least-loaded", "round-robin"}


def test_the_simulated_shared_prefix_run_splits_its_misses_and_counts_reasons() -> None:
    import argparse

    from everystop.bench.routing import add_arguments
    from everystop.bench.routing_sim import simulate_all

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--sim-rates", "2", "--sim-seeds", "1"])
    server = {"max_num_seqs": 4, "max_num_batched_tokens": 512, "num_gpu_blocks": 200}
    out = simulate_all(TOKENS, args, ["prefix-affinity"], {"shared_prefix": (
        lambda seed: shared_prefix(TOKENS, 20, groups=3, prefix_len=64, seed=seed), server)})
    (cell,) = out["shared_prefix"]["by_rate_req_s"].values()
    pa = cell["prefix-affinity"]
    assert pa["prefix_misses_first"] == 3  # each system prompt's first request
    assert pa["prefix_misses_later"] == 0  # a pool of 200 blocks keeps all three
    assert pa["decisions_new_prefix"] == 3 and pa["decisions_affinity"] == 17


def test_server_flags_pass_through_to_every_cluster_and_serve_accepts_them() -> None:
    import argparse

    from everystop.bench.routing import add_arguments, server_flags
    from everystop.cli import build_parser

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    plain = ap.parse_args([])
    assert "--dtype" not in server_flags("skewed", plain)
    args = ap.parse_args(["--dtype", "bfloat16", "--server-flag=--num-gpu-blocks=120",
                          "--server-flag=--kv-cache-dtype=float32"])
    for workload in ("skewed", "shared-prefix"):
        flags = server_flags(workload, args)
        serve = build_parser(["serve"]).parse_args(["serve", *flags])
        assert serve.dtype == "bfloat16" and serve.kv_cache_dtype == "float32"
        # Given flags come after the workload's own, so they override its limits.
        assert serve.num_gpu_blocks_override == 120
