"""--max-loras: the running requests use at most that many LoRA adapters at once, so no pass
carries more; a request for another adapter waits its turn in queue order, and every request
finishes."""

from __future__ import annotations

import pytest

from everystop.config import ConfigError, SchedulerConfig
from everystop.core.request import Request
from everystop.sampling_params import SamplingParams

from .helpers import Harness, make_harness


def _add(h: Harness, rid: str, lora_id: int, max_tokens: int = 6) -> Request:
    req = Request(rid, list(range(5)), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                     ignore_eos=True), lora_id=lora_id)
    h.scheduler.add_request(req)
    h.outputs[rid] = []
    return req


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_no_pass_carries_more_adapters_than_the_cap(cap: int) -> None:
    h = make_harness(max_loras=cap)
    ids = [0, 1, 2, 0, -1, 3, 1, -1, 2, 3]
    for i, lora_id in enumerate(ids):
        _add(h, f"r{i}", lora_id, max_tokens=3 + i % 4)
    h.run()
    assert set(h.finish) == {f"r{i}" for i in range(len(ids))}
    widest = max(len({s.lora_id for s in sched.scheduled if s.lora_id >= 0})
                 for sched in h.history)
    assert widest == cap  # the cap binds, and is reached


def test_a_request_for_another_adapter_waits_at_the_head_of_its_queue() -> None:
    h = make_harness(max_loras=1)
    _add(h, "first", 0, max_tokens=4)
    _add(h, "other", 1)
    _add(h, "base", -1)
    sched, _ = h.step()
    assert [s.request_id for s in sched.scheduled] == ["first"]  # queue order is kept
    while "first" not in h.finish:
        h.step()
    sched, _ = h.step()
    assert {s.request_id for s in sched.scheduled} == {"other", "base"}


def test_without_a_cap_every_adapter_runs_at_once() -> None:
    h = make_harness()
    for i in range(4):
        _add(h, f"r{i}", i)
    sched, _ = h.step()
    assert {s.lora_id for s in sched.scheduled} == {0, 1, 2, 3}


def test_a_negative_cap_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max_loras"):
        SchedulerConfig(max_loras=-1)


def test_each_pass_names_the_running_requests_adapters() -> None:
    """What the executor keeps in memory under --max-cpu-loras (executor/lora/manager.py)."""
    h = make_harness(max_loras=1)
    _add(h, "first", 0, max_tokens=3)
    _add(h, "other", 1, max_tokens=2)
    _add(h, "base", -1, max_tokens=2)
    sched, _ = h.step()
    assert sched.running_lora_ids == {0}  # "other" waits: not running
    while "first" not in h.finish:
        sched, _ = h.step()
    sched, _ = h.step()
    assert sched.running_lora_ids == {1}
