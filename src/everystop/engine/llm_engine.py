"""The step loop: schedule -> execute one mixed prefill/decode pass -> apply tokens -> emit.

Single-threaded and HTTP-agnostic; `AsyncEngine` runs it on a thread for the server, `LLM`
drives it directly for offline use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, TypeVar

from everystop.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    draft_model_path,
)
from everystop.core.intake import model_len_limit, peak_blocks
from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.listeners import FinishListener, IterationListener
from everystop.core.outputs import (
    IterationRecord,
    ModelOutput,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
)
from everystop.core.preemption import PreemptionCostModel
from everystop.core.request import Request, RequestStatus
from everystop.core.scheduler import Scheduler
from everystop.core.speculation import Proposer
from everystop.core.step_cost import SEED_PROMPT_TOKENS
from everystop.engine.engine_state import EngineMemory
from everystop.engine.fault_isolation import forward_error, isolate_faults
from everystop.engine.lora_registry import BASE, LoraRegistry
from everystop.engine.output_processor import Detokenizer, OutputProcessor
from everystop.engine.structured_output import StructuredOutputManager
from everystop.sampling_params import SamplingParams
from everystop.startup_memory import checkpoint

if TYPE_CHECKING:  # the executor package imports torch when used; the engine does not
    from everystop.executor.executor import Executor
    from everystop.tokenizer import EngineTokenizer

logger = logging.getLogger("everystop.engine")

T = TypeVar("T")
_NO_LOCK: AbstractContextManager[object] = contextlib.nullcontext()
# The start-up prefill measurement is checked against the live step-cost fit once, after this
# many passes that carried a real prompt chunk (the fit has then seen prefill, not only
# decodes), and replaced when they differ by more than this factor either way.
LIVE_RATE_CHECK_PASSES = 50
LIVE_RATE_FACTOR = 3.0


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor, tokenizer: EngineTokenizer, *,
                 cost_model: PreemptionCostModel | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 model_path: str | None = None) -> None:
        self.config = config
        self.executor = executor
        self._model_path = model_path
        self.tokenizer = tokenizer
        self.clock = clock
        cache = config.cache
        self.kv = KVCacheManager(executor.num_gpu_blocks, cache.block_size,
                                 num_cpu_blocks=executor.num_cpu_blocks,
                                 enable_prefix_caching=cache.enable_prefix_caching,
                                 watermark=cache.watermark,
                                 sliding_window=executor.sliding_window)
        self.scheduler = Scheduler(config.scheduler, self.kv, cost_model=cost_model, clock=clock)
        self.outputs = OutputProcessor(_detokenizer_factory(tokenizer), clock)
        self.iteration_listeners: list[IterationListener] = []
        self.finish_listeners: list[FinishListener] = []
        self._pending_outputs: list[RequestOutput] = []
        self._live: dict[str, Request] = {}
        self.num_steps = 0
        self._prefill_passes = 0  # counted up to LIVE_RATE_CHECK_PASSES, then the check runs
        self.loras = LoraRegistry(config.model.lora_modules)
        # The draft model of --speculative draft:PATH, attached by from_config.
        self.draft_proposer: Proposer | None = None
        self._draft_method = (config.scheduler.speculative
                              if draft_model_path(config.scheduler.speculative) else None)
        self.structured = StructuredOutputManager(getattr(tokenizer, "hf_tokenizer", None),
                                                  sorted(tokenizer.eos_token_ids),
                                                  config.structured)
        self.scheduler.draft_check = self.structured.valid_drafts

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load the model, size the KV pool, measure preemption costs, build the scheduler."""
        from everystop.executor.factory import create_executor
        from everystop.tokenizer import load_tokenizer

        executor = create_executor(config)
        # The executor resolved an unset max_model_len from the model and its pool.
        config = dataclasses.replace(config, scheduler=config.scheduler.replace(
            max_model_len=executor.max_model_len))
        tokenizer = load_tokenizer(config.model.tokenizer or executor.model_path)
        checkpoint("tokenizer")
        cost_model = executor.preemption_cost_model()
        checkpoint("preemption cost probes")
        logger.info("%s", executor.describe_capacity())  # it names the KV cache itself
        logger.info("preemption costs: %s", cost_model)
        engine = cls(config, executor, tokenizer, cost_model=cost_model,
                     model_path=executor.model_path)
        sched = engine.scheduler
        draft = draft_model_path(config.scheduler.speculative)
        if draft is not None:
            sched.proposer = engine.draft_proposer = _load_draft(config, executor, tokenizer,
                                                                 draft)
        logger.info("step cost prior (s per unit): %s; TPOT target when none is set: %.0f ms "
                    "(configured: %s ms, per tier %s)", sched.step_cost.coefficients.to_dict(),
                    1e3 * sched.auto_tpot_target_s, config.scheduler.tpot_target_ms,
                    config.scheduler.tpot_target_ms_per_tier)
        checkpoint("engine")
        return engine

    # -- requests -------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                     request_id: str | None = None, priority: int = 1,
                     tenant: str = "default", arrival_time: float | None = None,
                     max_tokens_to_context: bool = False, lora: str | None = None) -> Request:
        """Tokenize and build a Request (no scheduler state is touched: safe off-thread).
        `lora`: the name of a served LoRA adapter (UnknownLoraAdapter if none has it).

        The request gets its own resolved copy of `params` (the model's extra EOS ids added to
        the stop ids); the caller's object is never changed. With `max_tokens_to_context`,
        max_tokens is whatever the context window leaves after the prompt (OpenAI's chat
        default when no limit is given)."""
        if params is not None and params.structured_output is not None:
            self.structured.compile(params.structured_output)  # a bad spec raises here
        lora_id = BASE if lora is None else self.loras.id_for(lora)
        req = new_request(self.tokenizer, self.max_model_len, prompt, params,
                          request_id=request_id, priority=priority, tenant=tenant,
                          arrival_time=self.clock() if arrival_time is None else arrival_time,
                          max_tokens_to_context=max_tokens_to_context, lora_id=lora_id)
        req.lora_name = lora
        return req

    def lora_adapters(self) -> list[str]:
        """The names of the LoRA adapters served beside the base model."""
        return self.loras.names()

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` from the next step on."""
        self.loras.load(name, path, self.executor)

    def unload_lora(self, name: str) -> None:
        """Stop serving `name`; refused (LoraConflict) while a request uses it."""
        self.loras.unload(name, self._live.values(), self.executor)

    def add_request(self, prompt: str | list[int] | Request,
                    params: SamplingParams | None = None, *, request_id: str | None = None,
                    priority: int = 1, tenant: str = "default",
                    arrival_time: float | None = None) -> Request:
        """Queue a request; it joins at the next step. Raises RequestRejected, QueueFull or
        UnknownLoraAdapter (its adapter unloaded since it was made)."""
        req = prompt if isinstance(prompt, Request) else self.make_request(
            prompt, params, request_id=request_id, priority=priority, tenant=tenant,
            arrival_time=arrival_time)
        self.loras.check_served(req)
        self.scheduler.add_request(req)
        self.outputs.add(req)
        self._live[req.request_id] = req
        self.structured.hold(req)
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

    def has_work(self) -> bool:
        """Requests to run, or outputs (an abort's final one) still to hand out."""
        return self.scheduler.has_unfinished or bool(self._pending_outputs)

    def is_live(self, request_id: str) -> bool:
        """Whether the scheduler still holds this request (queued, running or swapped)."""
        return request_id in self.scheduler.requests

    def live_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    # -- the loop -------------------------------------------------------------------------------
    def step(self, lock: AbstractContextManager[object] = _NO_LOCK) -> list[RequestOutput]:
        """One iteration. `lock` guards scheduler state around schedule() and the update; the
        forward pass runs outside it, so a caller on another thread (AsyncEngine) can add and
        abort requests meanwhile."""
        with lock:
            outputs, self._pending_outputs = self._pending_outputs, []
            start = self.clock()
            sched = self.scheduler.schedule()
            self.structured.fill_bitmasks(sched, self._live)
        while True:
            if sched.is_empty:
                return outputs
            try:
                result = self.executor.execute(sched)
                break
            except Exception as exc:
                self.check_health()  # a dead executor (TP worker gone) is fatal: raises here
                if not is_out_of_memory(exc):
                    # Only the requests that make the pass fail fail (fault_isolation.py).
                    with lock:
                        rerun = self.scheduler.recompute_swapped(sched)
                    found = isolate_faults(self.executor.execute, rerun, exc, self.check_health,
                                           changed=rerun is not sched)
                    sched, result = found.sched, found.result
                    break
                with lock:
                    retry = self.scheduler.shrink_after_oom(sched)
                if retry is None:
                    with lock:
                        outputs.extend(self._fail_pass(sched, exc))
                    return outputs
                logger.warning("forward pass of %d sequences ran out of memory (%s); running "
                               "%d of them again", len(sched.scheduled), exc, len(retry.scheduled))
                sched = retry
        with lock:
            if result.failed:
                outputs.extend(self.fail_requests(result.failed))
            outputs.extend(self.finish_step(sched, result, start))
        return outputs

    def _fail_pass(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """End every request a failed pass takes down (one that cannot run even alone)."""
        logger.error("forward pass failed; failing the %d sequences in it",
                     len(sched.scheduled), exc_info=exc)
        return self.fail_requests(dict.fromkeys(self._step_victims(sched), forward_error(exc)))

    def _step_victims(self, sched: SchedulerOutput) -> list[str]:
        """Who a failed pass takes down: its sequences, and those swapped out in it (their
        host copy may be incomplete)."""
        swapped = [rid for rid in sched.preempted_request_ids
                   if (r := self.scheduler.requests.get(rid)) is not None
                   and r.status == RequestStatus.SWAPPED]
        return list(dict.fromkeys([e.request_id for e in sched.scheduled] + swapped))

    def fail_requests(self, reasons: dict[str, str]) -> list[RequestOutput]:
        """End requests with finish_reason "error" and the reason; their blocks are freed.
        The other requests, and the engine, go on."""
        outputs = []
        for rid, reason in reasons.items():
            if rid not in self.scheduler.requests:
                continue  # aborted while the pass ran
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            out = self.outputs.abort(rid)
            req = self._live.pop(rid, None)
            if out is None:
                continue
            out = dataclasses.replace(out, finish_reason="error", error=reason)
            outputs.append(out)
            if req is not None:
                self._notify_finished(req, out)
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
        if (self._prefill_passes < LIVE_RATE_CHECK_PASSES and result.execute_time_s > 0
                and sched.num_prefill_tokens >= SEED_PROMPT_TOKENS):
            self._prefill_passes += 1
            if self._prefill_passes == LIVE_RATE_CHECK_PASSES:
                self._check_start_up_prefill_rate()
        if self.iteration_listeners:
            self._notify_iteration(sched, start, result.execute_time_s)
        return outputs

    def _check_start_up_prefill_rate(self) -> None:
        """The start-up prefill rate (cached per machine) seeds the step-cost prior and prices
        recompute; one measured under contention would mislead every later start. Where the
        live fit disagrees by more than LIVE_RATE_FACTOR, take the live figure here and keep it
        for the next start-up (the executor's cache)."""
        sched = self.scheduler
        cached = sched.cost_model.prefill_tokens_per_s
        live = sched.step_cost.prefill_tokens_per_s()
        if not (0 < live < float("inf")) or max(live / cached, cached / live) <= LIVE_RATE_FACTOR:
            return
        logger.warning("start-up prefill measurement %.0f tok/s is off the live step-cost fit "
                       "(%.0f tok/s): using and caching the live figure", cached, live)
        sched.cost_model = dataclasses.replace(sched.cost_model, prefill_tokens_per_s=live)
        record = getattr(self.executor, "record_live_prefill_rate", None)
        if record is not None:
            record(live)

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
            tpot_target_s=sched.tpot_target_s, prefill_budget_tokens=sched.prefill_budget_tokens,
            step_cost=stats.step_cost)
        for listener in self.iteration_listeners:
            try:
                listener(record, sched)
            except Exception:  # a telemetry bug must never take the engine down
                logger.exception("iteration listener failed")

    def _notify_finished(self, req: Request, out: RequestOutput) -> None:
        self.structured.free(req.request_id)
        for listener in self.finish_listeners:
            try:
                listener(req, out)
            except Exception:
                logger.exception("finish listener failed")

    def run_until_done(self, on_output: Callable[[RequestOutput], None] | None = None) -> None:
        while self.has_work():
            outs = self.step()
            if on_output:
                for out in outs:
                    on_output(out)
            self.idle_if_held(outs)

    def idle_if_held(self, outputs: list[RequestOutput]) -> None:
        """Static batching keeps its doors shut until a full batch (or the timeout): a step
        that produced nothing then waits a moment instead of spinning."""
        if not outputs and self.scheduler.config.scheduling == "static":
            time.sleep(0.001)

    def check_health(self) -> None:
        """Raise if the executor has died (a tensor-parallel worker gone)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()

    # -- what the floors above may read and change ----------------------------------------------
    @property
    def max_model_len(self) -> int:
        return model_len_limit(self.config.scheduler, self.kv)

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.scheduler.config

    @property
    def cache_config(self) -> CacheConfig:
        return self.config.cache

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def model_path(self) -> str | None:
        """Where the weights came from (None for executors without a model, e.g. toys)."""
        return self._model_path

    def stats(self) -> SchedulerStats:
        """Queues, KV pool, counters and the step budget (fitted step cost, prefill budget)."""
        return self.scheduler.stats()

    def memory(self) -> EngineMemory:
        """The weights' bytes and the KV pools' resident bytes, for executors over a model in
        this process (toy and simulated executors hold neither)."""
        from everystop.executor.executor import RunnerExecutor

        if not isinstance(self.executor, RunnerExecutor):
            return EngineMemory()
        return EngineMemory(weight_bytes=self.executor.weight_bytes,
                            kv_pool_resident_bytes=self.executor.kv_pool_resident_bytes())

    def inspect(self, look: Callable[[Scheduler], T]) -> T:
        """Run a read-only look at the scheduler's live state (guardrails use it)."""
        return look(self.scheduler)

    def check_cache_config(self, cache: CacheConfig) -> None:
        """Raise ConfigError if `cache`'s watermark would leave a live request unable to ever
        get the blocks it may grow to."""
        kv = self.kv
        usable = kv.num_gpu_blocks - int(cache.watermark * kv.num_gpu_blocks)
        cfg = self.scheduler.config
        need = max((peak_blocks(r.num_prompt_tokens, r.sampling_params.max_tokens, cfg, kv)
                    for r in self.scheduler.requests.values()), default=0)
        if need > usable:
            raise ConfigError(f"watermark {cache.watermark} leaves {usable} usable KV blocks "
                              f"but a queued request needs up to {need}")

    def update_config(self, scheduler: SchedulerConfig, cache: CacheConfig) -> int:
        """Hot reload; the next schedule() uses the new values. Returns the step count at the
        switch. A draft model is loaded at start-up only: switching back to it re-attaches
        it, naming another is refused."""
        method, before = scheduler.speculative, self.config.scheduler.speculative
        if draft_model_path(method) and method != self._draft_method:
            raise ConfigError(f"speculative {method!r}: a draft model is loaded at start-up "
                              f"only (this engine's: {self._draft_method or 'none'})")
        self.scheduler.update_config(scheduler)
        if method == self._draft_method and method != before:
            self.scheduler.proposer = self.draft_proposer
        self.kv.set_watermark(cache.watermark)
        self.config = dataclasses.replace(self.config, scheduler=scheduler, cache=cache)
        return self.num_steps

    def add_listeners(self, on_iteration: IterationListener | None = None,
                      on_finish: FinishListener | None = None) -> None:
        """Called on the engine thread after every step / every finished request."""
        if on_iteration is not None:
            self.iteration_listeners.append(on_iteration)
        if on_finish is not None:
            self.finish_listeners.append(on_finish)

    def remove_listeners(self, on_iteration: IterationListener | None = None,
                         on_finish: FinishListener | None = None) -> None:
        if on_iteration is not None and on_iteration in self.iteration_listeners:
            self.iteration_listeners.remove(on_iteration)
        if on_finish is not None and on_finish in self.finish_listeners:
            self.finish_listeners.remove(on_finish)


def _load_draft(config: EngineConfig, executor: Executor, tokenizer: EngineTokenizer,
                path: str) -> Proposer:
    """The draft model proposer for --speculative draft:PATH, run as the target's runner runs;
    ConfigError where it may not draft for this target: a tokenizer vocabulary other than the
    target's, more parameters than the target, or a tensor-parallel target."""
    from everystop.executor.draft_proposer import draft_proposer_for
    from everystop.tokenizer import TokenizerLoadError, load_tokenizer

    runner = getattr(executor, "runner", None)
    if runner is None or config.parallel.tensor_parallel_size > 1:
        raise ConfigError("speculative draft:PATH needs the in-process executor "
                          "(tensor_parallel_size 1)")
    try:
        draft_vocab = load_tokenizer(path).hf_tokenizer.get_vocab()
    except TokenizerLoadError as exc:  # a missing or unreadable path, named as the option
        raise ConfigError(f"speculative: the draft model: {exc}") from None
    hf = getattr(tokenizer, "hf_tokenizer", None)
    target_vocab = hf.get_vocab() if hf is not None else {}
    if draft_vocab != target_vocab:
        differ = len(set(draft_vocab.items()) ^ set(target_vocab.items()))
        raise ConfigError(f"speculative: the draft model's tokenizer differs from the target's "
                          f"({len(draft_vocab)} vs {len(target_vocab)} tokens; {differ} "
                          f"(token, id) pairs not in both): {path}")
    return draft_proposer_for(runner, path)


def _detokenizer_factory(tokenizer: EngineTokenizer
                         ) -> Callable[[SamplingParams], Detokenizer]:
    """New incremental detokenizers for this tokenizer, with a request's options. (Not a bound
    method of the engine: that would tie the engine, and its KV pool, into a reference
    cycle.)"""
    factory = getattr(tokenizer, "make_detokenizer", None)  # test doubles bring their own
    if factory is not None:
        return factory

    def new(params: SamplingParams) -> Detokenizer:
        from everystop.tokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(
            tokenizer, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens)
    return new


def new_request(tokenizer: EngineTokenizer, max_model_len: int, prompt: str | list[int],
                params: SamplingParams | None = None, *, request_id: str | None = None,
                priority: int = 1, tenant: str = "default", arrival_time: float = 0.0,
                max_tokens_to_context: bool = False, lora_id: int = -1) -> Request:
    """`LLMEngine.make_request` without an engine: what a cluster's ingress builds with only
    the tokenizer and the replicas' context length (see `LLMEngine.make_request`)."""
    params = params or SamplingParams()
    vocab = tokenizer.vocab_size
    if params.bad_words:
        params.tokenize_bad_words(tokenizer.encode)
    params.check_vocab(vocab)  # ids reach tensor indices: checked here, never in a pass
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(prompt)
    else:
        token_ids = [int(t) for t in prompt]
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    stop_token_ids = list(params.stop_token_ids)
    if not params.ignore_eos:
        extra = [t for t in tokenizer.eos_token_ids if t != tokenizer.eos_token_id]
        stop_token_ids = list(dict.fromkeys(stop_token_ids + extra))
    max_tokens = params.max_tokens
    if max_tokens_to_context:
        max_tokens = max(1, max_model_len - len(token_ids))
    params = dataclasses.replace(params, stop=list(params.stop),
                                 stop_token_ids=stop_token_ids, max_tokens=max_tokens)
    return Request(request_id or uuid.uuid4().hex, token_ids, params,
                   eos_token_id=tokenizer.eos_token_id, arrival_time=arrival_time,
                   priority=priority, tenant=tenant, lora_id=lora_id)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether a forward pass failed for want of memory (host MemoryError, torch's
    OutOfMemoryError for CUDA, or a backend's RuntimeError saying "out of memory"): a smaller
    batch may fit, so the engine preempts and retries instead of failing the batch.
    NOTE: by name, not by class: the engine does not import torch."""
    if isinstance(exc, MemoryError):
        return True
    if any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
