"""A simulated serving node: specs -> capacity -> cost model -> scheduler setup."""

from __future__ import annotations

from dataclasses import dataclass

from everystop.config import SchedulerConfig
from everystop.core.preemption import PreemptionCostModel
from everystop.sim.capacity import Capacity, kv_capacity
from everystop.sim.cost_model import CostModel, prefill_shape
from everystop.sim.simulator import SimSetup
from everystop.sim.specs import load_hardware, load_model

SCHEDULING_MODES = ("static", "continuous", "chunked")


@dataclass(frozen=True)
class Node:
    setup: SimSetup
    cost: CostModel
    capacity: Capacity

    def describe(self) -> dict:
        s = self.setup.scheduler
        hw = self.cost.hw.key if self.cost.hw else None
        return {"model": self.cost.model.key, "hardware": hw,
                "tp": self.cost.tp, "num_gpu_blocks": self.setup.num_gpu_blocks,
                "num_cpu_blocks": self.setup.num_cpu_blocks, "block_size": self.setup.block_size,
                "scheduling": s.scheduling, "enable_chunked_prefill": s.enable_chunked_prefill,
                "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
                "chunk_size": s.chunk_size, "max_batch_size": s.max_batch_size,
                "speculative_tokens": s.num_speculative_tokens if s.speculative != "off" else 0,
                "spec_acceptance": self.setup.spec_acceptance,
                "coefficients": self.cost.coeffs.to_dict()}


def scheduler_config(scheduling: str, **options: object) -> SchedulerConfig:
    """'static' | 'continuous' (whole prompts only) | 'chunked' (continuous + chunked prefill)."""
    if scheduling not in SCHEDULING_MODES:
        raise ValueError(f"scheduling must be one of {SCHEDULING_MODES}, not {scheduling!r}")
    opts = {k: v for k, v in options.items() if v is not None}
    # The committed A100 tables are for the fixed token budget; a TPOT target is opt-in here
    # (`everystop simulate --tpot-target-ms`), so they stay comparable.
    opts.setdefault("tpot_target_ms", 0.0)
    return SchedulerConfig(  # type: ignore[arg-type]
        scheduling="static" if scheduling == "static" else "continuous",
        enable_chunked_prefill=scheduling == "chunked", **opts)


def build_node(model: str = "llama-3-70b", hardware: str = "a100-80gb", tp: int = 4,
               scheduling: str = "chunked", *, gpu_memory_utilization: float = 0.90,
               activation_reserve_bytes: float = 8e9, block_size: int = 16,
               swap_space_bytes: float = 16 * 2**30, num_gpu_blocks: int | None = None,
               enable_prefix_caching: bool = True, hw_overrides: dict | None = None,
               speculative_tokens: int = 0, spec_acceptance: float = 0.7,
               **sched_options: object) -> Node:
    """Everything needed to simulate `model` on `tp` GPUs of `hardware` (`speculative_tokens`
    > 0: speculative decoding, up to that many proposals per sequence, each kept with
    probability `spec_acceptance`)."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, not {tp}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {gpu_memory_utilization}")
    m = load_model(model)
    hw = load_hardware(hardware, **(hw_overrides or {}))
    cap = kv_capacity(m, hw, tp, gpu_memory_utilization=gpu_memory_utilization,
                      activation_reserve_bytes=activation_reserve_bytes, block_size=block_size)
    if num_gpu_blocks is None and cap.num_blocks == 0:
        raise ValueError(f"{m.key} does not fit on {tp}x {hw.key}: {cap.weight_bytes / 1e9:.1f} GB "
                         f"of weights + {activation_reserve_bytes / 1e9:.1f} GB reserve leave no "
                         f"KV cache in {cap.usable_bytes / 1e9:.1f} GB usable")
    cost = CostModel.from_specs(m, hw, tp, block_size)
    sched_options.setdefault("max_model_len", m.max_model_len)
    per_token_prefill = cost.latency(prefill_shape(512)) / 512
    preempt = PreemptionCostModel(prefill_tokens_per_s=1.0 / per_token_prefill,
                                  swap_bytes_per_s=hw.pcie_bandwidth * tp,
                                  bytes_per_block=int(cap.block_bytes))
    if speculative_tokens:
        sched_options.update(speculative="ngram", num_speculative_tokens=speculative_tokens)
    setup = SimSetup(scheduler=scheduler_config(scheduling, **sched_options),
                     num_gpu_blocks=num_gpu_blocks or cap.num_blocks, block_size=block_size,
                     num_cpu_blocks=int(swap_space_bytes // cap.block_bytes),
                     enable_prefix_caching=enable_prefix_caching, preemption_cost=preempt,
                     spec_acceptance=spec_acceptance if speculative_tokens else None)
    return Node(setup, cost, cap)
