"""The executor interface the engine drives, and the in-process implementation.

Tensor-parallel (multi-process) executors and the simulator implement the same protocol.
"""

from __future__ import annotations

from typing import Protocol

from everystop.config import CacheConfig, EngineConfig, ModelConfig
from everystop.core.outputs import ModelOutput, SchedulerOutput
from everystop.core.preemption import PreemptionCostModel


class Executor(Protocol):
    """Runs scheduled steps: all the engine's loop needs (toy and simulated executors too).
    Block counts are fixed once constructed. An executor may also offer `check_health()`,
    which raises once it can no longer run steps (the engine calls it while idle)."""

    @property
    def num_gpu_blocks(self) -> int: ...

    @property
    def num_cpu_blocks(self) -> int: ...

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        """Do the step's swaps, run its tokens, and return one token per sampled sequence."""
        ...

    def shutdown(self) -> None:
        """Release devices and memory; the executor is unusable afterwards."""
        ...


class ModelExecutor(Executor, Protocol):
    """An executor over a real model (what `create_executor` builds)."""

    model_path: str

    @property
    def max_model_len(self) -> int:
        """The configured limit, or the model's context capped by one sequence's pool share."""
        ...

    def describe_capacity(self) -> str:
        """One log line: the KV cache's size in blocks, tokens and bytes."""
        ...

    def preemption_cost_model(self) -> PreemptionCostModel:
        """Recompute vs swap costs measured on this model and device, now."""
        ...


class LocalExecutor:
    """A ModelRunner in this process, on one device."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 max_model_len: int | None, max_num_batched_tokens: int = 2048) -> None:
        from everystop.executor.model_runner import ModelRunner  # imports torch
        from everystop.executor.models.loader import resolve_model_path

        self.model_path = resolve_model_path(model_config.model)
        self.runner: ModelRunner | None = ModelRunner(model_config, cache_config, max_model_len,
                                                      max_num_batched_tokens)
        self._num_gpu_blocks = self.runner.num_gpu_blocks
        self._num_cpu_blocks = self.runner.num_cpu_blocks
        self._max_model_len = self.runner.max_model_len

    @property
    def num_gpu_blocks(self) -> int:
        return self._num_gpu_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self._num_cpu_blocks

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        if self.runner is None:
            raise RuntimeError("executor was shut down")
        return self.runner.execute(sched)

    def describe_capacity(self) -> str:
        return self.runner.describe_capacity() if self.runner else "executor shut down"

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights as held in memory (quantized ones as their blocks)."""
        return self.runner.weight_bytes if self.runner else 0

    def preemption_cost_model(self) -> PreemptionCostModel:
        """Recompute vs swap costs measured on this model and device, now."""
        assert self.runner is not None
        return PreemptionCostModel(
            prefill_tokens_per_s=self.runner.measure_prefill_tokens_per_s(),
            swap_bytes_per_s=self.runner.measure_swap_bytes_per_s(),
            bytes_per_block=self.runner.bytes_per_block)

    def shutdown(self) -> None:
        self.runner = None


def create_executor(config: EngineConfig) -> ModelExecutor:
    """The executor for this configuration: in-process, or one worker per tensor-parallel rank."""
    if config.parallel.tensor_parallel_size > 1:
        from everystop.executor.tp_executor import TensorParallelExecutor
        return TensorParallelExecutor(config)
    return LocalExecutor(config.model, config.cache, config.scheduler.max_model_len,
                         config.scheduler.max_num_batched_tokens)
