"""In-process engine runs and the compare harness, over the toy engine (no model)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from everystop.bench.compare import CompareOptions, mode_options, run_compare
from everystop.bench.offline import StepSample, run_engine, straggler_stats
from everystop.config import EngineConfig
from everystop.engine.llm_engine import LLMEngine
from everystop.workload import LengthDist, WorkloadSpec, generate_workload
from tests.core.toy_executor import ToyExecutor
from tests.engine.toy_engine import CharTokenizer


def _workload(n: int = 12, rate: float | None = None) -> Any:
    spec = WorkloadSpec(num_requests=n, seed=1, prompt_len=LengthDist("uniform", 2, 6),
                        output_len=LengthDist("log_uniform", 2, 40), rate=rate)
    return generate_workload(spec, tokenizer=None)


def _toy_factory(mode_opts: dict[str, Any]) -> LLMEngine:
    opts = dict(block_size=4, watermark=0.0, max_model_len=2048, max_num_seqs=16)
    opts.update(mode_opts)
    config = EngineConfig.from_options(**opts)
    return LLMEngine(config, ToyExecutor(2048, 4), CharTokenizer())


def test_offline_run_times_every_token_of_every_request() -> None:
    wl = _workload()
    run = run_engine(_toy_factory({}), wl)
    assert [r.id for r in run.results] == [r.id for r in wl.requests]
    for res, req in zip(run.results, wl.requests):
        assert res.success and res.output_tokens == req.max_tokens  # ignore_eos: exact
        assert len(res.itl_s) == req.max_tokens - 1
        assert 0 <= res.ttft_s <= res.e2e_s
        assert res.e2e_s == pytest.approx(res.ttft_s + sum(res.itl_s))
        assert res.prompt_len == len(req.prompt)  # the char tokenizer's count
    assert run.steps and sum(s.num_decode_tokens for s in run.steps) > 0


def test_online_run_admits_requests_at_their_arrival_times() -> None:
    wl = _workload(n=6)
    arrivals = [0.0, 0.0, 0.1, 0.15, 0.2, 0.3]
    run = run_engine(_toy_factory({}), wl, arrivals)
    assert run.duration_s >= 0.3
    assert [r.scheduled_s for r in run.results] == arrivals
    assert all(r.success for r in run.results)


def test_straggler_stats_from_hand_made_steps() -> None:
    def step(n: int, prefill: int = 0) -> StepSample:
        return StepSample(0.0, n, 0 if prefill else n, prefill, 0, 0, 0.01)
    steps = [step(4, prefill=40), step(4), step(3), step(1), step(1),  # 2 of 4 decode steps
             step(2, prefill=10), step(2), step(1)]                   # 0 of 2 (1 of 2 is half)
    s = straggler_stats(steps)
    assert s["decode_steps"] == 6
    assert s["frac_steps_over_half_finished"] == pytest.approx(2 / 6)
    assert s["mean_occupancy"] == pytest.approx((4 + 3 + 1 + 1 + 2 + 1) / (4 * 4 + 2 * 2))


def test_static_mode_leaves_seats_empty_and_continuous_does_not_wait() -> None:
    opts = CompareOptions(static_batch_size=4)
    wl = _workload(n=8)
    static = run_engine(_toy_factory(mode_options("static", opts, 2048)), wl)
    stats = straggler_stats(static.steps)
    assert stats["frac_steps_over_half_finished"] > 0 and stats["mean_occupancy"] < 1
    assert max(s.num_seqs for s in static.steps) == 4
    cont = run_engine(_toy_factory(mode_options("chunked", opts, 2048)), wl)
    assert len(cont.steps) < len(static.steps)  # no step waits for a batch's longest member


def test_compare_writes_json_table_and_plots(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from everystop.bench.table import markdown_report
    from everystop.plots import write_compare_plots
    opts = CompareOptions(static_batch_size=4, loads=[0.5], chunk_budget=16, progress=False,
                          gate_delay_ms=2.0)
    out = tmp_path / "compare.json"
    data = run_compare(_workload(n=8), _toy_factory, opts, out_json=out,
                       meta={"machine": "toy"}, log=lambda s: None)
    on_disk = json.loads(out.read_text())
    assert {"command", "git_commit", "machine", "roofline"} <= set(on_disk)  # write_result's
    assert set(on_disk["runs"]) == {f"{p}/{m}" for p in ("offline", "online0.5")
                                    for m in ("static", "continuous", "chunked", "prefix")} | {
        "gate/baseline", "gate/rerun", "gate/delay2ms"}
    assert set(on_disk["capacity"]) == {"static", "continuous", "chunked", "prefix"}
    rate = on_disk["runs"]["online0.5/static"]["meta"]["rate"]
    assert rate == pytest.approx(0.5 * on_disk["capacity"]["chunked"])
    assert "stragglers" in on_disk["runs"]["offline/static"]
    self_check = on_disk["gate"]["gate/baseline vs gate/baseline"]
    assert self_check["passed"] and self_check["verdict"].startswith("PASS")
    delayed = on_disk["gate"]["gate/baseline vs gate/delay2ms"]
    assert not delayed["passed"] and delayed["verdict"].startswith("FAIL")
    text = markdown_report(data, "everystop bench compare ...")
    assert "Continuous batching + chunked prefill" in text and "Static batching, bs=4" in text
    assert "of decode steps ran with more than half the batch already finished" in text
    paths = write_compare_plots(data, tmp_path)
    assert all(p.stat().st_size > 1000 for p in paths)


def test_compare_resume_keeps_finished_runs() -> None:
    opts = CompareOptions(modes=["static", "chunked"], loads=[], static_batch_size=4,
                          progress=False)
    first = run_compare(_workload(n=6), _toy_factory, opts, log=lambda s: None)
    built: list[dict[str, Any]] = []

    def counting_factory(mode_opts: dict[str, Any]) -> LLMEngine:
        built.append(mode_opts)
        return _toy_factory(mode_opts)
    opts.loads = [0.5]
    second = run_compare(_workload(n=6), counting_factory, opts, resume=first,
                         log=lambda s: None)
    assert second["runs"]["offline/static"] == first["runs"]["offline/static"]
    assert len(built) == 2 and set(second["runs"]) >= {"online0.5/static", "online0.5/chunked"}
