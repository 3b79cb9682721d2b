"""The head-to-head bench's workload scaling (model-free)."""

from __future__ import annotations

import pytest

from everystop.bench.servers import process_memory
from everystop.bench.vs_llamacpp import scale_lengths
from everystop.workload import perf_workload


def test_scaling_keeps_the_mix_and_cuts_prompts_to_their_first_tokens() -> None:
    wl = perf_workload(16)
    quarter = scale_lengths(wl, 0.25)
    assert len(quarter.requests) == 16
    for old, new in zip(wl.requests, quarter.requests):
        assert new.prompt_len == len(new.prompt_token_ids) >= 1
        assert new.prompt_token_ids == old.prompt_token_ids[:new.prompt_len]
        assert abs(new.prompt_len - old.prompt_len / 4) <= 1
        assert new.max_tokens == max(1, round(old.max_tokens / 4))
    assert scale_lengths(wl, 1.0) is wl


@pytest.mark.parametrize("factor", [0.0, -1.0, 1.5])
def test_a_scale_outside_zero_to_one_is_refused(factor: float) -> None:
    with pytest.raises(SystemExit, match="length-scale"):
        scale_lengths(perf_workload(2), factor)


def test_memory_reads_this_process() -> None:
    mem = process_memory()
    assert 0 < mem["rss_bytes"] <= mem["peak_rss_bytes"]
