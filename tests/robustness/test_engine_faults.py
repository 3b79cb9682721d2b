"""Faults inside the engine: only the requests a fault comes from fail, with a clear error, their
blocks come back, and the engine keeps serving; a dead or stalled engine thread says so on
/health and ends its streams with an error instead of hanging them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from starlette.testclient import TestClient

from everystop.core.outputs import ModelOutput, ScheduledSequence, SchedulerOutput
from everystop.engine.async_engine import AsyncEngine
from everystop.engine.llm_engine import LLMEngine
from everystop.executor.model_runner import _drop_non_finite
from everystop.sampling_params import SamplingParams
from everystop.server.app import build_app
from tests.core.toy_executor import ToyExecutor, reference_output
from tests.engine.toy_engine import make_toy_engine, run_all
from tests.server.fakes import ChatCharTokenizer

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


class FaultyExecutor(ToyExecutor):
    """The toy model; `fault(sched, out)` may raise, or mark sequences failed, or sleep."""

    def __init__(self, inner: ToyExecutor,
                 fault: Callable[[SchedulerOutput, ModelOutput], None]) -> None:
        self.__dict__.update(inner.__dict__)
        self.fault = fault

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        out = super().execute(sched)
        self.fault(sched, out)
        return out


def faulty_engine(fault: Callable[[SchedulerOutput, ModelOutput], None]) -> LLMEngine:
    eng = make_toy_engine(num_blocks=64, max_num_seqs=4)
    eng.executor = FaultyExecutor(eng.executor, fault)
    return eng


def with_victim(text: str) -> Callable[[ScheduledSequence], bool]:
    return lambda e: e.token_ids[:len(text)] == [ord(c) for c in text]


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: an illegal memory access"),
                                   ValueError("shapes (4, 8) and (7, 8) do not match")])
def test_a_failed_forward_pass_fails_only_its_culprit(error: Exception) -> None:
    """Every pass holding the bad request raises (after the toy wrote the pass's K/V): the
    engine narrows it down (engine/fault_isolation.py) and only that request fails."""
    fired: list[list[str]] = []
    bad_id: list[str] = []

    def fault(sched: SchedulerOutput, _: ModelOutput) -> None:
        if any(e.request_id in bad_id for e in sched.scheduled):
            fired.append([e.request_id for e in sched.scheduled])
            raise error

    eng = faulty_engine(fault)
    first = eng.add_request("A first one", PARAMS)
    eng.step()  # A is prefilled alone ...
    ids = [eng.add_request(p, PARAMS).request_id for p in ("Bad batch", "Cee", "Dee", "Eee")]
    bad_id.append(ids[0])
    late = eng.add_request("F, after the fault", PARAMS)  # queued: no seat in the failed step
    final = run_all(eng)
    assert len(fired[0]) == 4 and fired[-1] == [ids[0]]  # ... then B, and B alone
    for rid, out in final.items():
        if rid == ids[0]:
            assert out.finish_reason == "error" and type(error).__name__ in out.error
        else:
            assert out.finish_reason == "length" and out.error is None
    assert final[first.request_id].token_ids == reference_output(first.prompt_token_ids, 12)
    assert final[late.request_id].token_ids == reference_output(late.prompt_token_ids, 12)
    assert eng.stats().num_used_blocks == 0
    again = eng.add_request("still serving", PARAMS)
    assert run_all(eng)[again.request_id].finish_reason == "length"


def test_non_finite_logits_fail_only_that_sequence() -> None:
    def fault(sched: SchedulerOutput, out: ModelOutput) -> None:
        for e in sched.scheduled:
            if e.sample and with_victim("NaN")(e):
                del out.sampled_token_ids[e.request_id]
                out.failed[e.request_id] = "the model produced non-finite logits (NaN or Inf)"

    eng = faulty_engine(fault)
    bad = eng.add_request("NaN here", PARAMS)
    good = eng.add_request("fine", PARAMS)
    final = run_all(eng)
    assert final[bad.request_id].finish_reason == "error"
    assert "non-finite" in final[bad.request_id].error
    assert final[good.request_id].token_ids == reference_output(good.prompt_token_ids, 12)
    assert eng.stats().num_used_blocks == 0


def test_runner_reports_rows_with_nan_or_inf_and_samples_the_rest() -> None:
    seqs = [ScheduledSequence(f"r{i}", [1], 0, [0], True, PARAMS) for i in range(3)]
    logits = torch.zeros(3, 5)
    logits[1, 2] = float("nan")
    out = ModelOutput()
    kept, rows = _drop_non_finite(seqs, logits, out)
    assert [s.request_id for s in kept] == ["r0", "r2"] and rows.shape == (2, 5)
    assert list(out.failed) == ["r1"]
    logits[1, 2], logits[2, 0] = 0.0, float("-inf")
    assert list(_drop_non_finite(seqs, logits, ModelOutput())[1].shape) == [2, 5]


def test_finite_logits_whose_sum_overflows_are_all_kept_and_opposite_infinities_all_dropped(
        ) -> None:
    """The one-sum shortcut sees a non-finite sum in both cases; the rows decide."""
    seqs = [ScheduledSequence(f"r{i}", [1], 0, [0], True, PARAMS) for i in range(3)]
    big = torch.full((3, 5), 3e38)
    kept, rows = _drop_non_finite(seqs, big, ModelOutput())
    assert len(kept) == 3 and torch.equal(rows, big)
    logits = torch.zeros(3, 5)
    logits[0, 1], logits[2, 4] = float("inf"), float("-inf")
    out = ModelOutput()
    kept, _ = _drop_non_finite(seqs, logits, out)
    assert [s.request_id for s in kept] == ["r1"] and list(out.failed) == ["r0", "r2"]


@pytest.fixture
def make_client() -> Iterator[Callable[..., tuple[TestClient, AsyncEngine]]]:
    fronts: list[AsyncEngine] = []

    def make(engine: LLMEngine, **kw: object) -> tuple[TestClient, AsyncEngine]:
        engine.tokenizer = ChatCharTokenizer()
        front = AsyncEngine(engine, **kw)  # type: ignore[arg-type]
        fronts.append(front)
        return TestClient(build_app(front, "toy")), front

    yield make
    for front in fronts:
        front.shutdown()


def sse_events(client: TestClient, prompt: str) -> list[dict[str, object]]:
    body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_server_answers_a_forward_fault_as_an_error_and_keeps_serving(
        make_client: Callable[..., tuple[TestClient, AsyncEngine]]) -> None:
    def fault(sched: SchedulerOutput, _: ModelOutput) -> None:
        if any(with_victim("boom")(e) for e in sched.scheduled):
            raise RuntimeError("injected")

    client, front = make_client(faulty_engine(fault))
    events = sse_events(client, "boom")
    assert events[-1]["error"]["code"] == "engine_error"  # type: ignore[index]
    r = client.post("/v1/completions", json={"prompt": "boom", "max_tokens": 3})
    assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 3})
    assert r.status_code == 200 and client.get("/health").status_code == 200
    assert front.stats().num_used_blocks == 0


def test_engine_thread_death_is_503_and_ends_streams_with_an_error(
        make_client: Callable[..., tuple[TestClient, AsyncEngine]]) -> None:
    eng = make_toy_engine()
    real_schedule = eng.scheduler.schedule

    def schedule() -> SchedulerOutput:
        if any(r.prompt_token_ids[:3] == [ord(c) for c in "die"]
               for r in eng.scheduler.requests.values()):
            raise AssertionError("scheduler invariant broken (injected)")
        return real_schedule()

    eng.scheduler.schedule = schedule  # type: ignore[method-assign]
    client, _ = make_client(eng)
    assert client.get("/health").status_code == 200
    events = sse_events(client, "die now")
    assert events[-1]["error"]["code"] == "engine_dead"  # type: ignore[index]
    r = client.get("/health")
    assert r.status_code == 503 and "injected" in r.json()["error"]
    r = client.post("/v1/completions", json={"prompt": "anyone?", "max_tokens": 3})
    assert r.status_code == 503


def test_a_stalled_engine_is_declared_dead(
        make_client: Callable[..., tuple[TestClient, AsyncEngine]]) -> None:
    def fault(sched: SchedulerOutput, _: ModelOutput) -> None:
        if any(with_victim("hang")(e) for e in sched.scheduled):
            # Well past the 0.4 s stall timeout, so a watcher thread a loaded host runs late
            # still finds the pass stuck (had the pass ended first, the request would succeed).
            time.sleep(3.0)

    client, _ = make_client(faulty_engine(fault), stall_timeout_s=0.4)
    events = sse_events(client, "hang")
    assert events[-1]["error"]["code"] == "engine_dead"  # type: ignore[index]
    assert "stalled" in events[-1]["error"]["message"]  # type: ignore[index]
    r = client.get("/health")
    assert r.status_code == 503 and "stalled" in r.json()["error"]
