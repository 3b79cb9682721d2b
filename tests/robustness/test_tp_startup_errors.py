"""A tensor-parallel worker that fails while starting: the user reads the worker's own error
(not only "rank 1 exited during start-up"), and nothing is left running.

The real executor spawns real workers; one fault is injected into what the worker is given."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from everystop.config import EngineConfig
from everystop.executor import tp_executor
from everystop.executor.models.loader import default_model_path
from everystop.executor.tp_executor import TensorParallelError, TensorParallelExecutor
from everystop.executor.tp_worker import WorkerSpec


def config() -> EngineConfig:
    return EngineConfig.from_options(model=default_model_path(), tensor_parallel_size=2,
                                     kv_cache_memory=8 << 20, max_model_len=128)


def no_workers_left() -> bool:
    return not [p for p in multiprocessing.active_children() if p.name.startswith("everystop-tp")]


def _dies_without_a_word(spec: WorkerSpec, conn: object) -> None:
    os._exit(3)  # as an interpreter that cannot even start would


def test_a_workers_own_start_up_error_reaches_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    def spec_with_no_threads(*fields: object) -> WorkerSpec:
        rank, world, port, cfg, _threads, timeout = fields
        return WorkerSpec(rank, world, port, cfg, 0, timeout)  # type: ignore[arg-type]

    monkeypatch.setattr(tp_executor, "WorkerSpec", spec_with_no_threads)
    start = time.monotonic()
    with pytest.raises(TensorParallelError) as failed:
        TensorParallelExecutor(config())
    message = str(failed.value)
    # torch's own words, from inside the worker, with the rank that said them.
    assert "rank 1: RuntimeError: set_num_threads expects a positive integer" in message
    assert time.monotonic() - start < 60
    assert no_workers_left()


def test_a_worker_that_dies_before_reporting_is_named_with_its_exit_code(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp_executor, "worker_main", _dies_without_a_word)
    with pytest.raises(TensorParallelError) as failed:
        TensorParallelExecutor(config())
    message = str(failed.value)
    assert "rank 1" in message and "exited with code 3 during start-up" in message
    assert "its own error is printed above" in message
    assert no_workers_left()
