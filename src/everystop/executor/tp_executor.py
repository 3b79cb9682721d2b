"""Tensor-parallel executor: rank 0 runs in the engine process (shard 0 and all sampling), ranks
1..N-1 in spawned worker processes, supervised from here.

Each step: rank 0 broadcasts the plan (tp_group.encode_plan), then every rank runs the same
sharded forward pass over its own slice of the KV pool (the block tables are the same on every
rank), with two all-reduces per layer plus one after the embedding; logits for the sampled rows
are gathered on rank 0, which samples once.

Failure: a supervisor thread watches the workers' process sentinels. A worker that dies fails
the next (or current: gloo sees the closed socket at once) collective, and every later call,
with a TensorParallelError naming the rank and its exit code; a hung worker fails it after
ParallelConfig.collective_timeout_s. Either way the engine stops and never hangs.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

from everystop.config import ConfigError, EngineConfig
from everystop.core.outputs import ModelOutput, SchedulerOutput
from everystop.executor.executor import RunnerExecutor
from everystop.executor.model_runner import ModelRunner
from everystop.executor.models.loader import ModelLoadError, resolve_model_path
from everystop.executor.tp_group import abort, connect, create_store, encode_plan, send_message
from everystop.executor.tp_worker import WorkerSpec, rank_device, worker_main

logger = logging.getLogger("everystop.executor")
T = TypeVar("T")
_START_TIMEOUT_S = 120.0  # a worker must report in (interpreter and torch import) by then


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died, hung or failed: the engine cannot continue."""


class TensorParallelExecutor(RunnerExecutor):
    def __init__(self, config: EngineConfig) -> None:
        self.world_size = world = config.parallel.tensor_parallel_size
        self.timeout_s = config.parallel.collective_timeout_s
        self.model_path = resolve_model_path(config.model.model)
        device = config.model.device
        if device.startswith("cuda") and torch.cuda.device_count() < world:
            raise ConfigError(f"tensor_parallel_size {world} needs {world} GPUs (one per "
                              f"shard); {torch.cuda.device_count()} visible")
        self.failure: str | None = None
        self._stopping = threading.Event()
        self._store = create_store(world, self.timeout_s)
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        # A script that never calls shutdown() ends with the interpreter: stop the workers
        # politely first (atexit runs this before multiprocessing terminates its daemons, which
        # would look like a crash and abort torch's threads mid-flight).
        self._at_exit = functools.partial(_shutdown_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        try:
            self._spawn(config)
            self._await_hello()
            self._supervisor = threading.Thread(target=self._supervise, daemon=True,
                                                name="everystop-tp-supervisor")
            self._supervisor.start()
            rank0 = torch.device(rank_device(device, 0))
            self.ctx = self._guarded(lambda: connect(0, world, self._store, 0, rank0,
                                                     self.timeout_s))
            model = dataclasses.replace(config.model, model=self.model_path,
                                        device=str(rank0))
            self._adopt(self._guarded(lambda: ModelRunner(
                model, config.cache, config.scheduler.max_model_len,
                config.scheduler.max_num_batched_tokens, parallel=self.ctx)))
        except BaseException:
            self.shutdown()
            raise

    # --- start-up ---------------------------------------------------------------------------

    def _spawn(self, config: EngineConfig) -> None:
        ctx = mp.get_context("spawn")
        # CPU ranks share the machine's cores; each worker takes its share of ours.
        threads = max(1, torch.get_num_threads() // self.world_size)
        for rank in range(1, self.world_size):
            model = dataclasses.replace(config.model, model=self.model_path,
                                        device=rank_device(config.model.device, rank))
            spec = WorkerSpec(rank, self.world_size, self._store.port,
                              dataclasses.replace(config, model=model), threads, self.timeout_s)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(spec, send), daemon=True,
                               name=f"everystop-tp-rank{rank}")
            with _workers_skip_main():
                proc.start()
            send.close()
            self._procs.append(proc)
            self._conns.append(recv)

    def _await_hello(self) -> None:
        """Wait until every worker is about to join the groups, failing fast if one dies."""
        pending = dict(zip(self._conns, range(1, self.world_size)))
        deadline = time.monotonic() + _START_TIMEOUT_S
        while pending:
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel ranks {sorted(pending.values())} "
                                          f"did not start within {_START_TIMEOUT_S:.0f}s")
            for conn in wait(list(pending), timeout=0.5):
                try:
                    kind, *rest = conn.recv()
                except EOFError:
                    kind, rest = "error", [self._silent_exit(pending[conn])]
                if kind == "error":
                    raise TensorParallelError(f"tensor-parallel worker failed: {rest[0]}")
                del pending[conn]

    def _silent_exit(self, rank: int) -> str:
        """What to say about a worker that died before it could report (its interpreter or
        torch failed to start: the traceback is on its stderr, which is ours)."""
        proc = self._procs[rank - 1]
        proc.join(timeout=5.0)
        return (f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} during "
                "start-up, before it could report; its own error is printed above (the "
                "workers share this process's stderr)")

    # --- supervision ------------------------------------------------------------------------

    def _supervise(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs, start=1)}
        while not self._stopping.is_set() and self.failure is None:
            dead = wait(list(sentinels), timeout=0.2)
            if dead and not self._stopping.is_set():
                self._record_death(sentinels[dead[0]])

    def _record_death(self, rank: int) -> None:
        proc, conn = self._procs[rank - 1], self._conns[rank - 1]
        proc.join(timeout=1.0)
        reason = f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code " \
                 f"{proc.exitcode}"
        try:
            while conn.poll():
                kind, *rest = conn.recv()
                if kind == "error":
                    reason += f" after an error: {rest[0]}"
        except (EOFError, OSError):
            pass
        if self.failure is None:
            self.failure = reason + "; the engine cannot continue"
            logger.error("%s", self.failure)
            if hasattr(self, "ctx"):
                abort(self.ctx)  # NCCL would otherwise wait for the dead rank until timeout

    def _guarded(self, fn: Callable[[], T]) -> T:
        """Run a step that involves every rank; any failure is final for the whole group."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        try:
            return fn()
        except (ConfigError, ModelLoadError):
            # The user's mistake, raised by rank 0 itself (every rank hits the same one).
            self.failure = "tensor-parallel start-up failed"
            raise
        except Exception as exc:
            # The collective may notice a dead peer before the supervisor does: give it a moment
            # to name the rank and exit code.
            deadline = time.monotonic() + 2.0
            while self.failure is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if self.failure is None:
                self.failure = (f"tensor-parallel step failed on rank 0 ({type(exc).__name__}: "
                                f"{exc}); a worker may be hung (collective timeout "
                                f"{self.timeout_s:.0f}s)")
            raise TensorParallelError(self.failure) from exc

    def check_health(self) -> None:
        """Raise TensorParallelError if a worker has died (for health endpoints)."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    # --- the Executor protocol (the rest is RunnerExecutor's) -------------------------------

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        runner = self._live_runner()

        def step() -> ModelOutput:
            send_message(self.ctx, ("execute", encode_plan(sched)))
            return runner.execute(sched)

        return self._guarded(step)

    def forward_logits(self, sched: SchedulerOutput) -> torch.Tensor:
        """Float32 logits [N, vocab] of the sampled rows of one forward pass, no sampling (for
        checks against a single-process run). Writes K/V into the given blocks."""
        runner = self._live_runner()

        def step() -> torch.Tensor:
            send_message(self.ctx, ("logits", encode_plan(sched)))
            logits = runner.forward_logits(sched.scheduled)[1]
            assert logits is not None  # rank 0 always gathers
            return logits

        return self._guarded(step)

    def describe_capacity(self) -> str:
        return (f"tensor-parallel x{self.world_size}; " + self._live_runner().describe_capacity())

    def _measure_prefill(self, runner: ModelRunner) -> float:
        """Prefill timed across all ranks (each runs its shard of the same pass)."""
        num_tokens = 64

        def measure() -> float:
            send_message(self.ctx, ("measure_prefill", num_tokens))
            return runner.measure_prefill_tokens_per_s(num_tokens)

        return self._guarded(measure)

    def shutdown(self) -> None:
        """Stop the workers (politely, then by force) and reap them. Safe to call twice."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        atexit.unregister(self._at_exit)
        if self.failure is None and self.runner is not None:
            # they are being killed below anyway
            with contextlib.suppress(Exception):
                send_message(self.ctx, ("stop",))
        for proc in self._procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self.runner = None


def _shutdown_at_exit(ref: weakref.ref[TensorParallelExecutor]) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()


@contextlib.contextmanager
def _workers_skip_main() -> Iterator[None]:
    """Spawn a worker that does not re-run the caller's main module.

    multiprocessing's spawn re-imports `__main__` in every child so that pickled objects
    defined there resolve. Ours need nothing from it (the target and its arguments are
    everystop's), and re-running it breaks the common ways of calling us: a script read from
    stdin or `python -c` cannot be re-read, and a script without an `if __name__ ==
    "__main__":` guard would build a second engine in every worker. So, for the moment of the
    spawn, the main module does not say where it came from."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)
