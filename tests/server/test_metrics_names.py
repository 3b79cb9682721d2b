"""`--metrics-names`: vLLM's Grafana dashboard finds every series it queries, under vLLM's
names and with the `model_name` label it filters on; the default keeps ours alone."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import ServerProcess, start_toy_server

pytestmark = pytest.mark.server

# The series each version of vLLM's published Grafana dashboard queries (sources in the file).
DASHBOARDS = json.loads((Path(__file__).parent / "data" / "vllm_grafana_series.json")
                        .read_text())["dashboards"]
DASHBOARD_SERIES = sorted({name for d in DASHBOARDS for name in d["series"]})
# Other vLLM series its alert rules and newer dashboards query.
NEWER_SERIES = ["vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds_bucket",
                "vllm:request_inference_time_seconds_sum", "vllm:num_preemptions_total",
                "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                "vllm:iteration_tokens_total_bucket"]
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ", re.M)


def series(server: ServerProcess) -> dict[str, list[str]]:
    """Sample name -> its label sets, from one scrape after one finished request."""
    body = {"model": "toy", "prompt": "metrics", "max_tokens": 4}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found: dict[str, list[str]] = {}
    for name, labels in SAMPLE.findall(text):
        found.setdefault(name, []).append(labels)
    return found


@pytest.fixture(scope="module", params=["everystop", "vllm", "both"])
def named(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[str, dict[str, list[str]]]]:
    tmp: Path = tmp_path_factory.mktemp("names")
    server = start_toy_server(tmp, "--metrics-names", request.param)
    try:
        yield request.param, series(server)
    finally:
        server.stop()


def test_vllm_dashboard_series_are_exported_under_vllm_names(
        named: tuple[str, dict[str, list[str]]]) -> None:
    mode, found = named
    ours = {n for n in found if n.startswith("everystop:")}
    theirs = {n for n in found if n.startswith("vllm:")}
    if mode == "everystop":
        assert not theirs and "everystop:prompt_tokens_total" in ours
        return
    missing = [n for n in DASHBOARD_SERIES + NEWER_SERIES if n not in found]
    assert not missing, missing
    for name in DASHBOARD_SERIES:
        assert all('model_name="toy"' in labels for labels in found[name]), name
    assert any('finished_reason="length"' in x for x in found["vllm:request_success_total"])
    # vllm: the series vLLM has only under its names; the rest keep ours. both: twice.
    assert ("everystop:prompt_tokens_total" in ours) == (mode == "both")
    assert "everystop:event_loop_lag_seconds_count" in ours
    if mode == "both":
        assert found["vllm:prompt_tokens_total"] == found["everystop:prompt_tokens_total"]


def test_host_swap_usage_follows_the_swap_pool() -> None:
    """`vllm:cpu_cache_usage_perc` (ours: host_kv_cache_usage_perc): swapped-out KV blocks over
    the host pool, while a starved device pool swaps requests out, and 0 once all are back."""
    from everystop.server.metrics import host_kv_usage
    from tests.core.helpers import make_harness

    h = make_harness(num_blocks=40, block_size=4, num_cpu_blocks=200, max_num_seqs=16,
                     max_num_batched_tokens=64, chunk_size=16, preemption_mode="swap")
    for i in range(24):
        h.add(f"r{i}", list(range(i, i + 6 + (i * 7) % 23)), 20)
    seen = []
    for _ in range(2000):
        if not h.scheduler.requests:
            break
        h.step()
        swapped = h.scheduler.kv.num_swapped_blocks
        assert host_kv_usage(h.scheduler.stats()) == swapped / 200
        seen.append(swapped)
    assert max(seen) > 0 and host_kv_usage(h.scheduler.stats()) == 0.0
