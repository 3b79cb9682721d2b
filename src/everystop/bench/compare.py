"""`everystop bench compare`: one workload through every batching mode, in one process.

Modes share one loaded model (one executor); each gets a fresh scheduler and KV cache manager,
so the only difference between runs is the scheduling policy:

    static      static batches of 32, each runs until its longest member finishes
    continuous  iteration-level scheduling, whole prompts only (no chunked prefill)
    chunked     + chunked prefill under a small token budget (decodes go first)
    prefix      + automatic prefix caching
    hf          (optional) transformers generate, static padded batches: an outside reference

Offline (all requests at t=0) measures capacity; online replays the same requests as a Poisson
process at a fraction of a measured capacity. The JSON is rewritten after every run, so a long
comparison can be watched and a killed one keeps what it finished.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from everystop.bench.metrics import SLO, full_report
from everystop.bench.offline import EngineRun, run_engine, straggler_stats, warm_up
from everystop.results import write_result
from everystop.workload import Workload, arrival_offsets

ENGINE_MODES = ("static", "continuous", "chunked", "prefix")

EngineFactory = Callable[[dict[str, Any]], Any]


@dataclass
class CompareOptions:
    modes: list[str] = field(default_factory=lambda: list(ENGINE_MODES))
    loads: list[float] = field(default_factory=lambda: [0.7])  # fractions of capacity; [] = none
    online_modes: list[str] | None = None  # None: the same as `modes`
    capacity_from: str = "chunked"  # a mode name, or "self" (each mode at its own capacity)
    static_batch_size: int = 32
    chunk_budget: int = 256  # max_num_batched_tokens (= chunk_size) for the chunked modes
    dollars_per_hour: float = 0.10
    seed: int = 0
    burstiness: float = 1.0
    hf_requests: int = 0  # run the transformers reference on the first N requests (0: skip)
    gate_delay_ms: float = 0.0  # > 0: also run the gate check (see _gate_check) with this delay
    gate_requests: int = 48
    slo: SLO = field(default_factory=SLO)
    progress: bool = True


def mode_options(mode: str, opts: CompareOptions, max_model_len: int) -> dict[str, Any]:
    """The engine options that define a mode (everything else is the shared base)."""
    if mode == "static":
        return dict(scheduling="static", max_batch_size=opts.static_batch_size,
                    max_num_seqs=opts.static_batch_size, enable_chunked_prefill=False,
                    # NOTE: the static scheduler prefills a whole batch at once, ignoring it
                    max_num_batched_tokens=max(max_model_len, opts.static_batch_size),
                    enable_prefix_caching=False, static_batch_timeout_s=0.5)
    if mode == "continuous":
        # Without chunking the budget must fit whole prompts (vLLM: max_model_len).
        return dict(enable_chunked_prefill=False, max_num_batched_tokens=max_model_len,
                    enable_prefix_caching=False)
    if mode in ("chunked", "prefix"):
        return dict(enable_chunked_prefill=True, max_num_batched_tokens=opts.chunk_budget,
                    chunk_size=opts.chunk_budget, enable_prefix_caching=mode == "prefix")
    raise ValueError(f"unknown mode {mode!r} (choose from {', '.join(ENGINE_MODES)}, hf)")


class CompareRecorder:
    """Accumulates runs and rewrites the result JSON (results.write_result's envelope around
    meta, runs, capacity and gate) after each one."""

    def __init__(self, path: Path | None, meta: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"meta": meta, "runs": {}, "capacity": {}, "gate": {}}

    def add(self, name: str, run: EngineRun, opts: CompareOptions, extra: dict[str, Any]) -> None:
        report = full_report(run.results, run.duration_s, opts.slo)
        report["meta"] = {"kind": "engine", "run": name, **extra}
        report["steps"] = [{k: round(v, 6) if isinstance(v, float) else v for k, v in s.items()}
                           for s in run.steps_as_dicts()]
        if name.endswith("static") or name.endswith("hf"):
            report["stragglers"] = straggler_stats(run.steps)
        self.data["runs"][name] = report
        self.save()

    def save(self) -> None:
        if self.path is not None:
            write_result(self.data, self.path, quiet=True, compact=True)


def run_compare(workload: Workload, factory: EngineFactory, opts: CompareOptions,
                max_model_len: int = 2048, out_json: Path | None = None,
                meta: dict[str, Any] | None = None, resume: dict[str, Any] | None = None,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Offline runs of every mode, then online runs at each load; returns the result dict.
    resume: an earlier result of the same comparison; runs it already holds are not redone."""
    rec = CompareRecorder(out_json, {**(meta or {}), "options": _options_json(opts),
                                     "workload": workload.name,
                                     "num_requests": len(workload.requests)})
    if resume:
        for key in ("runs", "capacity"):
            rec.data[key].update(resume.get(key, {}))

    def one(mode: str, arrivals: list[float] | None, name: str, extra: dict[str, Any],
            step_delay_s: float = 0.0, workload: Workload = workload) -> None:
        if name in rec.data["runs"]:
            log(f"{name:<22} kept from the earlier result")
            return
        engine = factory(mode_options(mode, opts, max_model_len))
        warm_up(engine)
        load_before = _loadavg()
        run = run_engine(engine, workload, arrivals, step_delay_s=step_delay_s,
                         progress=opts.progress, desc=name)
        # The machine may be shared: keep its load next to the numbers it affected.
        rec.add(name, run, opts, {"mode": mode, **extra,
                                  "loadavg_1m": [load_before, _loadavg()]})
        s = rec.data["runs"][name]["summary"]
        log(f"{name:<22} {s['output_throughput']:8.1f} out tok/s  TTFT p99 "
            f"{s['ttft_ms']['p99']:9.1f} ms  TPOT p50 {s['tpot_ms']['p50']:7.1f} ms  "
            f"({run.duration_s:.1f} s)")

    for mode in opts.modes:
        one(mode, None, f"offline/{mode}", {"arrivals": "all at t=0"})
        rec.data["capacity"][mode] = rec.data["runs"][f"offline/{mode}"]["summary"][
            "request_throughput"]
    if opts.hf_requests and "offline/hf" not in rec.data["runs"]:
        from everystop.bench.hf_reference import run_hf_static
        sub = workload.head(opts.hf_requests)
        run = run_hf_static(sub, opts.static_batch_size, progress=opts.progress)
        rec.add("offline/hf", run, opts, {"mode": "hf", "subset": len(sub.requests)})
        log(f"offline/hf (first {len(sub.requests)} requests) "
            f"{rec.data['runs']['offline/hf']['summary']['output_throughput']:.1f} out tok/s")

    for load in opts.loads:
        for mode in opts.online_modes if opts.online_modes is not None else opts.modes:
            basis = mode if opts.capacity_from == "self" else opts.capacity_from
            rate = load * rec.data["capacity"][basis]
            arrivals = arrival_offsets(len(workload.requests), rate, opts.burstiness,
                                       random.Random(opts.seed))
            one(mode, arrivals, f"online{load:g}/{mode}",
                {"load": load, "rate": rate, "capacity_from": basis,
                 "burstiness": opts.burstiness})

    if opts.gate_delay_ms and ("chunked" in rec.data["capacity"]):
        _gate_check(rec, opts, workload, one)
    rec.save()
    return rec.data


def _gate_check(rec: CompareRecorder, opts: CompareOptions, workload: Workload,
                one: Callable[..., None]) -> None:
    """The deploy gate, exercised on real runs of the chunked mode at the first online rate:
    a baseline, an identical rerun and a copy with an injected per-step delay (a synthetic
    regression), back to back on the first `gate_requests` requests so that all three see the
    same machine load (on a shared machine, a baseline from minutes earlier does not)."""
    from everystop.bench.gate import gate, verdict_line

    load = opts.loads[0]
    online = rec.data["runs"].get(f"online{load:g}/chunked")
    rate = online["meta"]["rate"] if online else load * rec.data["capacity"]["chunked"]
    sub = workload.head(min(opts.gate_requests, len(workload.requests)))
    arrivals = arrival_offsets(len(sub.requests), rate, opts.burstiness, random.Random(opts.seed))
    extra = {"load": load, "rate": rate, "capacity_from": "chunked",
             "burstiness": opts.burstiness, "subset": len(sub.requests)}
    names = ["gate/baseline", "gate/rerun", f"gate/delay{opts.gate_delay_ms:g}ms"]
    for name, delay in zip(names, (0.0, 0.0, opts.gate_delay_ms)):
        one("chunked", arrivals, name, {**extra, "step_delay_ms": delay},
            step_delay_s=delay / 1000.0, workload=sub)
    base = rec.data["runs"][names[0]]
    for cand in names:
        result = gate(base, rec.data["runs"][cand])
        rec.data["gate"][f"{names[0]} vs {cand}"] = {**result, "verdict": verdict_line(result)}


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _options_json(opts: CompareOptions) -> dict[str, Any]:
    d = asdict(opts)
    d.pop("progress", None)
    return d


def shared_model_factory(base_options: dict[str, Any], max_budget: int) -> EngineFactory:
    """Engines for each mode over ONE loaded model: the first call loads it (with the largest
    token budget any mode uses, so its buffers fit every mode); later calls reuse its executor,
    tokenizer and preemption cost model under a fresh scheduler and KV cache manager."""
    from everystop.config import EngineConfig
    from everystop.engine.llm_engine import LLMEngine

    shared: list[Any] = []

    def build(mode_opts: dict[str, Any]) -> Any:
        config = EngineConfig.from_options(**{**base_options, **mode_opts})
        if not shared:
            probe = EngineConfig.from_options(**{**base_options,
                                                 "max_num_batched_tokens": max_budget})
            first = LLMEngine.from_config(probe)
            shared.append((first.executor, first.tokenizer, first.scheduler.cost_model,
                           first.model_path))
        executor, tokenizer, cost_model, model_path = shared[0]
        return LLMEngine(config, executor, tokenizer, cost_model=cost_model,
                         model_path=model_path)

    return build
