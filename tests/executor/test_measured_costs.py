"""The preemption cost measurements are taken once per machine and model, then read back."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from everystop.config import CACHE_ENV
from everystop.executor import measured_costs
from everystop.executor.measured_costs import (
    MAX_AGE_S,
    cached_costs,
    kernel_build_id,
    record_live_prefill_rate,
)
from everystop.sampling_params import SamplingParams


def test_measured_once_then_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    calls: list[int] = []

    def measure() -> tuple[float, float]:
        calls.append(1)
        return 100.0 + len(calls), 1e9

    settings = {"dtype": "float32", "threads": 2}
    assert cached_costs(str(model), settings, measure) == (101.0, 1e9)
    assert cached_costs(str(model), settings, measure) == (101.0, 1e9)
    assert len(calls) == 1
    # Anything the numbers depend on is in the key: other settings, or a replaced file.
    assert cached_costs(str(model), {**settings, "threads": 1}, measure) == (102.0, 1e9)
    model.write_bytes(b"xy")
    assert cached_costs(str(model), settings, measure) == (103.0, 1e9)
    assert len(calls) == 3


def test_unwritable_cache_still_measures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))  # a file where the directory should be
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    assert cached_costs(str(model), {}, lambda: (1.0, 2.0)) == (1.0, 2.0)


def test_stale_or_old_format_entries_are_measured_again(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    rates = iter([10.0, 20.0, 30.0])
    assert cached_costs(str(model), {}, lambda: (next(rates), 1.0)) == (10.0, 1.0)
    now = time.time()
    monkeypatch.setattr(measured_costs.time, "time", lambda: now + MAX_AGE_S + 1)
    assert cached_costs(str(model), {}, lambda: (next(rates), 1.0)) == (20.0, 1.0)
    cache = tmp_path / "cache" / "preemption_costs.json"
    table = json.loads(cache.read_text())
    cache.write_text(json.dumps({k: [5.0, 1.0] for k in table}))  # the pre-date format
    assert cached_costs(str(model), {}, lambda: (next(rates), 1.0)) == (30.0, 1.0)


def test_a_live_rate_replaces_the_cached_one(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    settings = {"quantization": "bf16", "kernel_build": kernel_build_id()}
    assert cached_costs(str(model), settings, lambda: (162.0, 1e9)) == (162.0, 1e9)
    record_live_prefill_rate(str(model), settings, 2400.0)
    assert cached_costs(str(model), settings, lambda: (1.0, 1.0)) == (2400.0, 1e9)
    # another quantization or kernel build is another entry
    assert cached_costs(str(model), {**settings, "quantization": "none"},
                        lambda: (7.0, 1.0)) == (7.0, 1.0)
    assert len(kernel_build_id()) == 12 and kernel_build_id() == kernel_build_id()


def test_the_engine_replaces_a_start_up_rate_far_off_its_live_fit() -> None:
    from everystop.core.preemption import PreemptionCostModel
    from everystop.core.step_cost import StepCoefficients, StepCostModel
    from everystop.engine import llm_engine

    from ..engine.toy_engine import make_toy_engine

    for cached, replaced in ((162.0, True), (2000.0, False)):
        engine = make_toy_engine(chunk_size=128, max_num_batched_tokens=128)
        recorded: list[float] = []
        engine.executor.record_live_prefill_rate = recorded.append  # type: ignore[attr-defined]
        sched = engine.scheduler
        sched.cost_model = PreemptionCostModel(prefill_tokens_per_s=cached)
        # a fit that has learnt this machine: 64 tokens alone in 32 ms = 2000 tok/s
        sched.step_cost = StepCostModel(StepCoefficients(0.0, 0.0005, 0.0005, 0.0))
        engine._prefill_passes = llm_engine.LIVE_RATE_CHECK_PASSES - 1
        engine.add_request("x" * 80, SamplingParams(max_tokens=1))
        sched_out = sched.schedule()
        result = engine.executor.execute(sched_out)
        result.execute_time_s = 0.04
        engine.finish_step(sched_out, result, 0.0)
        live = sched.step_cost.prefill_tokens_per_s()
        assert (recorded == [pytest.approx(live)]) == replaced
        assert sched.cost_model.prefill_tokens_per_s == (pytest.approx(live) if replaced
                                                         else cached)
