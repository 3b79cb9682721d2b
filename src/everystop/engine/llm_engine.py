"""The step loop: schedule -> execute one mixed prefill/decode pass -> apply tokens -> emit.

Single-threaded and HTTP-agnostic; `AsyncEngine` runs it on a thread for the server, `LLM`
drives it directly for offline use.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from everystop.config import EngineConfig
from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.outputs import (IterationRecord, ModelOutput, RequestOutput, SchedulerOutput,
                                    SchedulerStats)
from everystop.core.preemption import PreemptionCostModel
from everystop.core.request import Request, RequestStatus
from everystop.core.scheduler import Scheduler
from everystop.engine.output_processor import OutputProcessor
from everystop.sampling_params import SamplingParams

logger = logging.getLogger("everystop.engine")

IterationListener = Callable[[IterationRecord, SchedulerOutput], None]
FinishListener = Callable[[Request, RequestOutput], None]


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Any, tokenizer: Any, *,
                 cost_model: PreemptionCostModel | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.clock = clock
        cache = config.cache
        self.kv = KVCacheManager(executor.num_gpu_blocks, cache.block_size,
                                 num_cpu_blocks=executor.num_cpu_blocks,
                                 enable_prefix_caching=cache.enable_prefix_caching,
                                 watermark=cache.watermark)
        self.scheduler = Scheduler(config.scheduler, self.kv, cost_model=cost_model, clock=clock)
        self.outputs = OutputProcessor(_detokenizer_factory(tokenizer), clock)
        self.iteration_listeners: list[IterationListener] = []
        self.finish_listeners: list[FinishListener] = []
        self._pending_outputs: list[RequestOutput] = []
        self._live: dict[str, Request] = {}
        self.num_steps = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        """Load the model, size the KV pool, measure preemption costs, build the scheduler."""
        from everystop.executor.executor import create_executor
        from everystop.tokenizer import load_tokenizer

        executor = create_executor(config)
        tokenizer = load_tokenizer(config.model.tokenizer or executor.model_path)
        cost_model = executor.preemption_cost_model()
        logger.info("KV cache: %s", executor.describe_capacity())
        logger.info("preemption costs: %s", cost_model)
        engine = cls(config, executor, tokenizer, cost_model=cost_model)
        sched = engine.scheduler
        logger.info("step cost prior (s per unit): %s; TPOT target when none is set: %.0f ms "
                    "(configured: %s ms, per tier %s)", sched.step_cost.coefficients.to_dict(),
                    1e3 * sched.auto_tpot_target_s, config.scheduler.tpot_target_ms,
                    config.scheduler.tpot_target_ms_per_tier)
        return engine

    # -- requests -------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                     request_id: str | None = None, priority: int = 1,
                     tenant: str = "default", arrival_time: float | None = None) -> Request:
        """Tokenize and build a Request (no scheduler state is touched: safe off-thread)."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
            vocab = self.tokenizer.vocab_size
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if not params.ignore_eos:
            extra = [t for t in self.tokenizer.eos_token_ids if t != self.tokenizer.eos_token_id]
            params.stop_token_ids = list(dict.fromkeys(params.stop_token_ids + extra))
        return Request(request_id or uuid.uuid4().hex, token_ids, params,
                       eos_token_id=self.tokenizer.eos_token_id,
                       arrival_time=self.clock() if arrival_time is None else arrival_time,
                       priority=priority, tenant=tenant)

    def add_request(self, prompt: str | list[int] | Request,
                    params: SamplingParams | None = None, **kwargs: Any) -> Request:
        """Queue a request; it joins at the next step. Raises RequestRejected or QueueFull."""
        req = prompt if isinstance(prompt, Request) else self.make_request(prompt, params, **kwargs)
        self.scheduler.add_request(req)
        self.outputs.add(req)
        self._live[req.request_id] = req
        return req

    def abort_request(self, request_ids: list[str] | str) -> None:
        """Stop requests now; their blocks are free before the next step."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        self.scheduler.abort_requests(ids)
        for rid in ids:
            out = self.outputs.abort(rid)
            req = self._live.pop(rid, None)
            if out is not None:
                self._pending_outputs.append(out)
                if req is not None:
                    self._notify_finished(req, out)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def stats(self) -> SchedulerStats:
        """Queues, KV pool, counters and the step budget (fitted step cost, prefill budget)."""
        return self.scheduler.stats()

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        start = self.clock()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        result = self.executor.execute(sched)
        outputs.extend(self.finish_step(sched, result, start))
        return outputs

    def finish_step(self, sched: SchedulerOutput, result: ModelOutput,
                    start: float) -> list[RequestOutput]:
        """Apply a pass's results: append tokens, end requests, produce their outputs."""
        updates = self.scheduler.update_from_output(sched, result)
        outputs, stopped = self.outputs.process(updates)
        for rid in stopped:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        for out in outputs:
            if out.finished:
                req = self._live.pop(out.request_id, None)
                if req is not None:
                    self._notify_finished(req, out)
        self.num_steps += 1
        if self.iteration_listeners:
            self._notify_iteration(sched, start, result.execute_time_s)
        return outputs

    def _notify_iteration(self, sched: SchedulerOutput, start: float, execute_s: float) -> None:
        stats = self.scheduler.stats()
        record = IterationRecord(
            step=self.num_steps, time=start, num_seqs=len(sched.scheduled),
            num_decode_tokens=sched.num_decode_tokens, num_prefill_tokens=sched.num_prefill_tokens,
            context_tokens=sum(e.seq_len for e in sched.scheduled),
            num_free_blocks=stats.num_free_blocks, num_running=stats.num_running,
            num_waiting=stats.num_waiting, num_preempted=len(sched.preempted_request_ids),
            latency_s=self.clock() - start, num_padding_tokens=sched.num_padding_tokens,
            execute_s=execute_s, predicted_s=sched.predicted_time_s,
            tpot_target_s=sched.tpot_target_s, prefill_budget_tokens=sched.prefill_budget_tokens)
        for listener in self.iteration_listeners:
            try:
                listener(record, sched)
            except Exception:  # a telemetry bug must never take the engine down
                logger.exception("iteration listener failed")

    def _notify_finished(self, req: Request, out: RequestOutput) -> None:
        for listener in self.finish_listeners:
            try:
                listener(req, out)
            except Exception:
                logger.exception("finish listener failed")

    def run_until_done(self, on_output: Callable[[RequestOutput], None] | None = None) -> None:
        while self.has_unfinished_requests() or self._pending_outputs:
            outs = self.step()
            if on_output:
                for out in outs:
                    on_output(out)
            if not outs and self.scheduler.config.scheduling == "static":
                time.sleep(0.001)  # doors shut, waiting for a full batch or the timeout

    def shutdown(self) -> None:
        self.executor.shutdown()


def _detokenizer_factory(tokenizer: Any) -> Callable[[], Any]:
    """New incremental detokenizers for this tokenizer. (Not a bound method of the engine: that
    would tie the engine, and its KV pool, into a reference cycle.)"""
    factory = getattr(tokenizer, "make_detokenizer", None)  # test doubles bring their own
    if factory is not None:
        return factory

    def new() -> Any:
        from everystop.tokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(tokenizer)
    return new
