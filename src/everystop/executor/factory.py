"""The executor a configuration asks for: in-process, or one worker per tensor-parallel rank."""

from __future__ import annotations

from everystop.config import EngineConfig
from everystop.executor.executor import LocalExecutor, ModelExecutor


def create_executor(config: EngineConfig) -> ModelExecutor:
    """The executor for this configuration: in-process, or one worker per tensor-parallel rank."""
    if config.parallel.tensor_parallel_size > 1:
        from everystop.executor.tp_executor import TensorParallelExecutor  # spawns workers
        return TensorParallelExecutor(config)
    return LocalExecutor(config.model, config.cache, config.scheduler.max_model_len,
                         config.scheduler.max_num_batched_tokens)
