"""Runs the engine loop on its own thread and streams each request's outputs to asyncio.

Why a thread, not a process: the forward pass spends its time in torch kernels that release the
GIL, so the HTTP event loop stays responsive, while outputs reach consumers with no
serialization or process hop. The lock guards scheduler state only around schedule() and
update(); the forward pass itself runs unlocked, so adds and aborts never wait for it.

NOTE: an abort during a forward pass is safe: freed blocks are handed out again only by the next
schedule(), which runs after the pass, and update_from_output skips finished requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from everystop.config import CacheConfig, SchedulerConfig, StructuredOutputConfig
from everystop.core.outputs import RequestOutput
from everystop.core.request import Request
from everystop.core.scheduler import Scheduler, SchedulerStats
from everystop.engine.engine_state import EngineHealth, EngineMemory
from everystop.engine.llm_engine import FinishListener, IterationListener, LLMEngine
from everystop.sampling_params import SamplingParams
from everystop.tokenizer import EngineTokenizer

T = TypeVar("T")

logger = logging.getLogger("everystop.engine")


class EngineDraining(RuntimeError):
    """The engine is shutting down and admits nothing new (the server answers 503)."""


class EngineDead(RuntimeError):
    """The engine loop crashed; nothing more will be produced."""


class EngineStalled(RuntimeError):
    """One engine iteration has run longer than the stall timeout: the engine is treated as
    dead (streams end with an error, /health answers 503) rather than left to hang."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    last_read: float
    closed: bool = False
    evicted: bool = False  # a slow reader's: aborted, backlog dropped


class AsyncEngine:
    """The only door to the engine for the server and telemetry: requests in, streams out,
    and named reads (limits, tokenizer, stats, health) and writes (config) that take the
    engine lock themselves where they need it."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], *,
                 watchdog_interval_s: float = 1.0, stall_timeout_s: float | None = 600.0,
                 slow_reader_timeout_s: float | None = 60.0) -> None:
        """`engine`: a built engine, or a function that builds one; the function runs on the
        engine thread (its exception is raised here).

        NOTE: build on the engine thread where the engine does torch work (the server does):
        then every forward pass, start-up's included, runs on that one thread. libgomp keeps a
        thread pool per thread that starts parallel regions; two pools on a 2-core machine are
        more OpenMP threads than CPUs, and libgomp then spins ~100 times instead of
        GOMP_SPINCOUNT before sleeping, so every parallel region pays a futex wake-up (measured
        here: +45 us per decode GEMV call, 11.6 -> 15.9 ms per single-stream decode step).

        `stall_timeout_s`: an iteration running longer than this declares the engine dead
        (None: never). The default leaves room for the slowest steps seen on a loaded CPU
        (~35 s); a hung kernel or collective is what it is for.

        `slow_reader_timeout_s`: a consumer that has outputs waiting and has taken none for
        this long (a client that stopped reading its SSE stream) has its request aborted and
        its backlog dropped, so its blocks come back and its memory stops growing (None:
        never)."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self.draining = False
        self.error: BaseException | None = None
        self.watchdog_interval_s = watchdog_interval_s
        self.num_watchdog_aborts = 0
        self.num_slow_reader_aborts = 0
        self.slow_reader_timeout_s = slow_reader_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._beat = time.monotonic()  # the engine thread's last sign of life
        build: Callable[[], LLMEngine] | None = None
        if isinstance(engine, LLMEngine):
            self.engine = engine
        else:
            build = engine
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(build,), name="everystop-engine",
                                        daemon=True)
        self._thread.start()
        if build is not None:
            self._built.wait()
            if self._build_error is not None:
                raise self._build_error
        if stall_timeout_s is not None:
            threading.Thread(target=self._watch_stalls, name="everystop-engine-watchdog",
                             daemon=True).start()

    # -- consumer side (event-loop thread) ------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams, *,
                     request_id: str | None = None, priority: int = 1, tenant: str = "default",
                     max_tokens_to_context: bool = False, lora: str | None = None) -> Request:
        """Tokenize and build a Request off the engine thread (`LLMEngine.make_request`)."""
        return self.engine.make_request(prompt, params, request_id=request_id,
                                        priority=priority, tenant=tenant,
                                        max_tokens_to_context=max_tokens_to_context, lora=lora)

    def lora_adapters(self) -> list[str]:
        return self.engine.lora_adapters()

    def load_lora(self, name: str, path: str) -> None:
        """`LLMEngine.load_lora` between two steps (blocking: reads the adapter's files)."""
        with self._lock:
            self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        with self._lock:
            self.engine.unload_lora(name)

    def submit(self, req: Request) -> None:
        """Admit a request for streaming. Raises RequestRejected, QueueFull, EngineDraining,
        EngineDead. Must be called from the event loop that will read the stream."""
        if self.error is not None:
            raise EngineDead(f"engine stopped: {self.error}")
        if self.draining:
            raise EngineDraining("the server is shutting down")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic())
        with self._lock:
            self.engine.add_request(req)
            self._streams[req.request_id] = stream
        self._wake.set()

    async def submit_async(self, req: Request) -> None:
        """`submit`, as EngineClient has it (a cluster front awaits its replicas there)."""
        self.submit(req)

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a submitted request as they are produced. Leaving the iteration early
        (client gone, task cancelled) aborts the request and frees its blocks."""
        stream = self._streams[request_id]
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                stream.last_read = time.monotonic()
                if isinstance(item, BaseException):
                    raise EngineDead(f"engine stopped: {item}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            stream.closed = True
            if finished:
                with self._lock:  # the watchdog iterates _streams under the lock
                    self._streams.pop(request_id, None)
            else:
                self.abort(request_id)

    async def generate(self, prompt: str | list[int], params: SamplingParams, *,
                       request_id: str | None = None, priority: int = 1,
                       tenant: str = "default") -> AsyncIterator[RequestOutput]:
        req = self.make_request(prompt, params, request_id=request_id, priority=priority,
                                tenant=tenant)
        self.submit(req)
        async for out in self.stream(req.request_id):
            yield out

    def abort(self, request_id: str) -> None:
        """End a request. A consumer still reading (drain) gets a final "abort" output; a gone
        one's stream is dropped."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None and (stream.closed or stream.loop.is_closed()):
                self._streams.pop(request_id, None)
            if self.engine.is_live(request_id):
                self.engine.abort_request(request_id)
        self._wake.set()

    # -- engine thread --------------------------------------------------------------------------
    def _run(self, build: Callable[[], LLMEngine] | None) -> None:
        if build is not None:
            try:
                self.engine = build()
            except BaseException as exc:  # handed to the constructor's caller
                self._build_error = exc
                return
            finally:
                self._built.set()
        last_watchdog = time.monotonic()
        try:
            while not self._stop and self.error is None:  # error: declared stalled
                self._beat = time.monotonic()
                with self._lock:
                    # Pending outputs (an abort's final output) must be delivered even when
                    # nothing is left to run.
                    busy = self.engine.has_work()
                if time.monotonic() - last_watchdog > self.watchdog_interval_s:
                    self._watchdog()
                    last_watchdog = time.monotonic()
                if not busy:
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    # An idle engine learns of a dead tensor-parallel worker here, so /health
                    # turns 503 without waiting for the next request to fail.
                    self.engine.check_health()
                    continue
                outputs = self.engine.step(self._lock)
                self._deliver(outputs)
                self.engine.idle_if_held(outputs)
        except BaseException as exc:  # surface the crash to every consumer, never hang them
            logger.exception("engine loop crashed")
            self._declare_dead(exc)

    def _declare_dead(self, exc: BaseException) -> None:
        if self.error is not None:
            return
        self.error = exc
        for stream in list(self._streams.values()):
            with contextlib.suppress(RuntimeError):  # that consumer's event loop is gone
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)

    def _watch_stalls(self) -> None:
        """Its own thread: the engine thread cannot notice that it is stuck itself."""
        assert self.stall_timeout_s is not None
        period = min(1.0, self.stall_timeout_s / 4)
        while not self._stop and self.error is None:
            time.sleep(period)
            stuck_s = time.monotonic() - self._beat
            if stuck_s > self.stall_timeout_s and not self._stop:
                logger.error("engine iteration running for %.1fs (stall timeout %.1fs): "
                             "declaring the engine dead", stuck_s, self.stall_timeout_s)
                self._declare_dead(EngineStalled(
                    f"engine stalled: one iteration has run {stuck_s:.0f}s "
                    f"(stall timeout {self.stall_timeout_s:g}s)"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their consumers: one wake-up per event loop per step, not
        one per output (each wake-up is a write to the loop's self-pipe and a loop iteration,
        128 of them per step at 128 streams)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            # NOTE: a finished stream stays registered until its consumer has read the end
            # (stream()'s finally pops it), so a consumer that starts late still finds it.
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # its event loop is gone: nobody will ever read these
                for _, out in items:
                    self.abort(out.request_id)

    def _watchdog(self) -> None:
        """Free sequences whose consumer is gone (stream closed or its loop stopped) without an
        abort reaching us."""
        with self._lock:
            gone = [rid for rid, s in self._streams.items() if s.closed or s.loop.is_closed()]
            orphans = [rid for rid in self.engine.live_request_ids() if rid not in self._streams]
        for rid in gone + orphans:
            self.num_watchdog_aborts += 1
            self.abort(rid)
        self._evict_slow_readers()

    def _evict_slow_readers(self) -> None:
        timeout = self.slow_reader_timeout_s
        if timeout is None:
            return
        now = time.monotonic()
        with self._lock:
            # NOTE: qsize() from this thread is a length read: at worst one tick stale.
            slow = [(rid, s) for rid, s in self._streams.items() if not (s.closed or s.evicted)
                    and s.queue.qsize() > 0 and now - s.last_read > timeout]
        for rid, stream in slow:
            logger.warning("request %s: its reader took nothing for %.0fs with %d outputs "
                           "waiting: aborting it", rid, now - stream.last_read,
                           stream.queue.qsize())
            self.num_slow_reader_aborts += 1
            stream.evicted = True
            with contextlib.suppress(RuntimeError):  # its loop is gone: the watchdog frees it
                # Queued before the abort's final output (one loop, first in first out).
                stream.loop.call_soon_threadsafe(_drop_backlog, stream.queue)
            self.abort(rid)

    # -- named reads (no lock: plain attribute reads, safe from any thread) ----------------------
    @property
    def tokenizer(self) -> EngineTokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.engine.scheduler_config

    @property
    def cache_config(self) -> CacheConfig:
        return self.engine.cache_config

    @property
    def structured_output_config(self) -> StructuredOutputConfig:
        """The size and time limits on structured-output specs."""
        return self.engine.config.structured

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def clock(self) -> Callable[[], float]:
        return self.engine.clock

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def stats(self) -> SchedulerStats:
        return self.engine.stats()

    def memory(self) -> EngineMemory:
        """The model's and the KV pools' memory (plain reads, as `stats`)."""
        return self.engine.memory()

    def health(self) -> EngineHealth:
        """Touches no engine lock, so it answers while the engine is saturated."""
        if self.error is not None:
            return EngineHealth("dead", str(self.error))
        if not self._thread.is_alive() and not self._stop:
            return EngineHealth("dead", "the engine thread has exited")
        if self.draining:
            return EngineHealth("draining")
        return EngineHealth("ok")

    def is_live(self, request_id: str) -> bool:
        """Engine thread (listeners) or under no expectation of consistency: a dict lookup."""
        return self.engine.is_live(request_id)

    def add_listeners(self, on_iteration: IterationListener | None = None,
                      on_finish: FinishListener | None = None) -> None:
        """Listeners run on the engine thread, under the engine lock."""
        with self._lock:
            self.engine.add_listeners(on_iteration, on_finish)

    def remove_listeners(self, on_iteration: IterationListener | None = None,
                         on_finish: FinishListener | None = None) -> None:
        with self._lock:
            self.engine.remove_listeners(on_iteration, on_finish)

    # -- locked reads and writes ------------------------------------------------------------------
    def inspect(self, look: Callable[[Scheduler], T]) -> T:
        """Run a read-only look at live scheduler state under the engine lock."""
        with self._lock:
            return self.engine.inspect(look)

    def check_cache_config(self, cache: CacheConfig) -> None:
        """ConfigError if `cache` would strand a live request (see LLMEngine)."""
        with self._lock:
            self.engine.check_cache_config(cache)

    def update_config(self, scheduler: SchedulerConfig, cache: CacheConfig) -> int:
        """Swap configs in between two iterations; returns the step count at the switch
        (iterations scheduled after it use the new values)."""
        with self._lock:
            return self.engine.update_config(scheduler, cache)

    # -- lifecycle ------------------------------------------------------------------------------

    async def drain(self, grace_s: float) -> None:
        """Stop admitting, let in-flight requests finish for up to grace_s, abort the rest."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._streams):
            self.abort(rid)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """Event-loop side of `_deliver`: each output onto its stream's queue, in step order."""
    for queue, out in items:
        queue.put_nowait(out)


def _drop_backlog(queue: asyncio.Queue) -> None:
    """Event-loop side of a slow reader's eviction: the outputs it never took are dropped. A
    request that had already finished keeps a final output (marked "abort": its reader missed
    part of it), so the reader, if it ever comes back, still sees an end."""
    last = None
    while not queue.empty():
        last = queue.get_nowait()
    if isinstance(last, BaseException):
        queue.put_nowait(last)
    elif last is not None and last.finished:
        queue.put_nowait(dataclasses.replace(last, new_text="", new_token_ids=[],
                                             new_logprobs=[], finish_reason="abort"))
