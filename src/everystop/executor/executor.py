"""The executor interface the engine drives, the base every model executor shares, and the
in-process implementation.

Tensor-parallel (multi-process) executors and the simulator implement the same protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from everystop.config import CacheConfig, ModelConfig
from everystop.core.outputs import ModelOutput, SchedulerOutput
from everystop.core.preemption import PreemptionCostModel

if TYPE_CHECKING:
    from everystop.executor.model_runner import ModelRunner


class Executor(Protocol):
    """Runs scheduled steps: all the engine's loop needs (toy and simulated executors too).
    Block counts are fixed once constructed."""

    @property
    def num_gpu_blocks(self) -> int: ...

    @property
    def num_cpu_blocks(self) -> int: ...

    @property
    def sliding_window(self) -> int | None:
        """Tokens every layer attends back over (None: some layer sees the whole context):
        the KV cache releases the blocks behind it."""
        ...

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        """Do the step's swaps, run its tokens, and return one token per sampled sequence."""
        ...

    def check_health(self) -> None:
        """Raise once the executor can no longer run steps (the engine calls it while idle)."""
        ...

    def shutdown(self) -> None:
        """Release devices and memory; the executor is unusable afterwards."""
        ...


@runtime_checkable
class LoraExecutor(Protocol):
    """An executor that loads and unloads LoRA adapters while it runs (ids are the engine's)."""

    def load_lora(self, lora_id: int, path: str) -> None:
        """Serve the adapter at `path` (PEFT or GGUF) as `lora_id`; ValueError naming why."""
        ...

    def unload_lora(self, lora_id: int) -> None:
        """Drop adapter `lora_id` (no scheduled row may still carry it)."""
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


class RunnerExecutor:
    """What every model executor shares: rank 0's ModelRunner, the limits it derived, and the
    capacity and cost questions answered from it. Subclasses build the runner, then `_adopt` it;
    `_measure_prefill` is the hook a multi-rank executor overrides to time all ranks."""

    model_path: str
    runner: ModelRunner | None = None

    def _adopt(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._num_gpu_blocks = runner.num_gpu_blocks
        self._num_cpu_blocks = runner.num_cpu_blocks
        self._max_model_len = runner.max_model_len
        self._sliding_window = runner.sliding_window

    @property
    def num_gpu_blocks(self) -> int:
        return self._num_gpu_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self._num_cpu_blocks

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def sliding_window(self) -> int | None:
        return self._sliding_window

    def _live_runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("executor was shut down")
        return self.runner

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        return self._live_runner().execute(sched)

    def describe_capacity(self) -> str:
        return self.runner.describe_capacity() if self.runner else "executor shut down"

    def _measure_prefill(self, runner: ModelRunner) -> float:
        return runner.measure_prefill_tokens_per_s()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights as held in memory (quantized ones as their blocks),
        the LoRA adapters loaded now included."""
        if self.runner is None:
            return 0
        lora = self.runner.lora
        return self.runner.weight_bytes + (lora.nbytes if lora is not None else 0)

    def kv_pool_resident_bytes(self) -> int | None:
        """Resident bytes of rank 0's KV pools in this process (the other ranks' pools are in
        their own processes); None once shut down or where mincore cannot tell."""
        from everystop.executor.residency import pool_resident_bytes  # imports torch

        return pool_resident_bytes(self.runner.pool) if self.runner else None

    def preemption_cost_model(self) -> PreemptionCostModel:
        """Recompute vs swap costs measured on this model and device, once per machine: later
        start-ups read them from the cache (swap bandwidth and block bytes are rank 0's: the
        ranks swap their slices in parallel)."""
        from everystop.executor.measured_costs import cached_costs

        runner = self._live_runner()
        prefill, swap = cached_costs(
            self.model_path, self._cost_settings(runner),
            lambda: (self._measure_prefill(runner), runner.measure_swap_bytes_per_s()))
        return PreemptionCostModel(prefill_tokens_per_s=prefill, swap_bytes_per_s=swap,
                                   bytes_per_block=runner.bytes_per_block)

    def _cost_settings(self, runner: ModelRunner) -> dict[str, object]:
        """What the cached cost measurements depend on, besides the machine and model file."""
        from everystop.executor.measured_costs import kernel_build_id

        cfg = runner.model_config
        return {"dtype": cfg.dtype, "kv_dtype": str(runner.kv_dtype), "device": cfg.device,
                "quantization": cfg.quantization, "backends": repr(runner.backends),
                "kernel_build": kernel_build_id(), "threads": runner.num_threads,
                "block_size": runner.block_size, "executor": type(self).__name__}

    def record_live_prefill_rate(self, prefill_tokens_per_s: float) -> None:
        """The live step-cost fit disagrees with the cached start-up measurement: keep the
        live figure for the next start-up on this machine."""
        from everystop.executor.measured_costs import record_live_prefill_rate

        record_live_prefill_rate(self.model_path, self._cost_settings(self._live_runner()),
                                 prefill_tokens_per_s)

    def load_lora(self, lora_id: int, path: str) -> None:
        manager = self._live_runner().lora
        if manager is None:
            raise ValueError("this server loads no LoRA adapters at run time: start it with "
                             "--enable-lora (or --lora NAME=PATH)")
        manager.load(lora_id, path)

    def unload_lora(self, lora_id: int) -> None:
        manager = self._live_runner().lora
        if manager is not None:
            manager.unload(lora_id)

    def check_health(self) -> None:
        """One process: healthy while it runs."""

    def shutdown(self) -> None:
        self.runner = None


class LocalExecutor(RunnerExecutor):
    """A ModelRunner in this process, on one device."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 max_model_len: int | None, max_num_batched_tokens: int = 2048) -> None:
        from everystop.executor.model_runner import ModelRunner  # imports torch
        from everystop.executor.models.loader import resolve_model_path
        from everystop.startup_memory import checkpoint

        checkpoint("torch import")

        self.model_path = resolve_model_path(model_config.model)
        self._adopt(ModelRunner(model_config, cache_config, max_model_len,
                                max_num_batched_tokens))

