"""In-process runs of an LLMEngine over a workload: no HTTP, the engine's own step loop.

Offline = every request due at t=0; online = requests join at their arrival offsets (Poisson
or gamma) while the engine runs. Token timestamps are taken when `step()` hands the tokens
back, i.e. when a server could first send them, and latencies are measured from each request's
due time, so queueing behind a long step or a closed static batch counts against TTFT.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from everystop.bench.metrics import RequestResult
from everystop.core.outputs import IterationRecord, SchedulerOutput
from everystop.sampling_params import SamplingParams
from everystop.workload import Workload


@dataclass
class StepSample:
    """One engine step, relative to the run's start: the occupancy picture's raw data."""

    t_s: float
    num_seqs: int
    num_decode_tokens: int
    num_prefill_tokens: int
    num_waiting: int
    num_preempted: int
    latency_s: float
    num_padding_tokens: int = 0  # static padding rows among num_seqs


@dataclass
class EngineRun:
    results: list[RequestResult]
    duration_s: float
    steps: list[StepSample] = field(default_factory=list)

    def steps_as_dicts(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in self.steps]


def run_engine(engine: Any, workload: Workload, arrivals: list[float] | None = None, *,
               step_delay_s: float = 0.0, temperature: float = 0.0, progress: bool = False,
               desc: str = "") -> EngineRun:
    """Drive `engine` (an LLMEngine) until every workload request finishes. A request with
    `prompt_token_ids` is sent those ids (every engine under test gets the same), else its text.

    arrivals: due time of each request in seconds from the start (None: all at t=0).
    step_delay_s: sleep this long before every step (a synthetic regression for the gate).
    temperature: 0 is greedy; above it, request i samples with seed i (repeatable runs).
    """
    clock = engine.clock
    due = arrivals if arrivals is not None else [0.0] * len(workload.requests)
    order = sorted(range(len(workload.requests)), key=lambda i: due[i])
    results: dict[str, RequestResult] = {}
    last_token: dict[str, float] = {}
    steps: list[StepSample] = []
    t0 = clock()

    def on_step(rec: IterationRecord, sched: SchedulerOutput) -> None:
        steps.append(StepSample(rec.time - t0, rec.num_seqs, rec.num_decode_tokens,
                                rec.num_prefill_tokens, rec.num_waiting, rec.num_preempted,
                                rec.latency_s, rec.num_padding_tokens))

    engine.iteration_listeners.append(on_step)
    bar = _progress(len(order), desc) if progress else None
    next_i = 0
    try:
        while next_i < len(order) or engine.has_unfinished_requests():
            now = clock()
            while next_i < len(order) and t0 + due[order[next_i]] <= now:
                i = order[next_i]
                next_i += 1
                wr = workload.requests[i]
                params = SamplingParams(max_tokens=wr.max_tokens, temperature=temperature,
                                        seed=i if temperature else None, ignore_eos=True)
                prompt = wr.prompt if wr.prompt_token_ids is None else wr.prompt_token_ids
                req = engine.add_request(prompt, params, request_id=wr.id,
                                         priority=wr.priority, tenant=wr.tenant,
                                         arrival_time=t0 + due[i])
                results[wr.id] = RequestResult(wr.id, req.num_prompt_tokens, wr.max_tokens,
                                               wr.priority, wr.tenant, scheduled_s=due[i],
                                               sent_s=due[i])
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, min(0.05, t0 + due[order[next_i]] - clock())))
                continue
            if step_delay_s:
                time.sleep(step_delay_s)
            outs = engine.step()
            now = clock()
            for out in outs:
                res = results.get(out.request_id)
                if res is None:
                    continue
                for _ in out.new_token_ids:
                    if res.output_tokens == 0:
                        res.ttft_s = now - t0 - res.scheduled_s
                    else:
                        res.itl_s.append(now - last_token[out.request_id])
                    last_token[out.request_id] = now
                    res.output_tokens += 1
                if out.finished:
                    res.e2e_s = now - t0 - res.scheduled_s
                    if out.finish_reason == "abort" or res.output_tokens == 0:
                        res.success, res.error = False, f"finished: {out.finish_reason}"
                    if bar is not None:
                        bar.update(1)
            engine.idle_if_held(outs)
        duration = clock() - t0
    finally:
        engine.iteration_listeners.remove(on_step)
        if bar is not None:
            bar.close()
    return EngineRun([results[workload.requests[i].id] for i in range(len(order))],
                     duration, steps)


def warm_up(engine: Any, prompt: str = "Hello, world. " * 8, max_tokens: int = 4) -> None:
    """One short request so one-time costs (allocator, kernels, caches) stay out of the numbers."""
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                              ignore_eos=True))
    engine.run_until_done()


def straggler_stats(steps: list[StepSample]) -> dict[str, float]:
    """Static batching's waste, measured: among decode steps, the fraction where more than half
    of the batch that started together has already finished (its seats sit empty).

    A static batch starts with an all-prefill step; its size is that step's sequence count.
    Padding rows (finished members still computed) count as empty seats."""
    batch = 0
    decode_steps = over_half = 0
    seat_steps = used = 0
    for s in steps:
        if s.num_prefill_tokens and not s.num_decode_tokens:
            batch = s.num_seqs
            continue
        if not batch or not s.num_decode_tokens:
            continue
        live = s.num_seqs - s.num_padding_tokens
        decode_steps += 1
        over_half += 2 * live < batch
        seat_steps += batch
        used += live
    return {"decode_steps": decode_steps,
            "frac_steps_over_half_finished": over_half / decode_steps if decode_steps else 0.0,
            "mean_occupancy": used / seat_steps if seat_steps else 0.0}


def _progress(total: int, desc: str) -> Any:
    from tqdm import tqdm
    return tqdm(total=total, desc=desc or "requests", unit="req", dynamic_ncols=True)
