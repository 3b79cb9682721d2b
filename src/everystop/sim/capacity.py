"""KV-cache capacity of a node, derived from specs the way the design doc does it.

    usable HBM   = gpu_memory_utilization * hbm_per_gpu * tp
    KV budget    = usable - weight bytes - activation reserve
    bytes/token  = 2 (K,V) * kv_heads * head_dim * layers * dtype_bytes   (whole model)
    block bytes  = block_size * bytes/token
    blocks       = floor(KV budget / block bytes)
    max seqs(L)  = floor(blocks / ceil(L / block_size))

`design_rounding=True` repeats the one shortcut in the design doc's arithmetic: it writes the
81,920 bytes/GPU/token as "80 KB", multiplies to "320 KB" and then "5.12 MB" per block, i.e. it
reads a KiB as 1,000 bytes. That is where its ~27,340 blocks come from. Its ~218 sequences
need a second, opposite slip: 140 GB / 655 MB = 213.7, but 140 * 1024 MB / 655.36 MB = 218.75
(a GB read as 1,024 MB), which `design_seq_division` reproduces. The exact byte arithmetic
gives ~2.3% fewer blocks than the design (26,702) and 208 sequences at 2,048 tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from everystop.sim.specs import HardwareSpec, ModelSpec


@dataclass(frozen=True)
class Capacity:
    tp: int
    usable_bytes: float
    weight_bytes: float
    activation_reserve_bytes: float
    kv_budget_bytes: float
    kv_bytes_per_token: float  # whole model, all GPUs
    kv_bytes_per_token_per_gpu: float
    block_size: int
    block_bytes: float
    num_blocks: int

    def max_seqs(self, context_len: int) -> int:
        """Memory-derived ceiling on concurrent sequences of this context length."""
        return self.num_blocks // -(-context_len // self.block_size)

    def to_dict(self) -> dict:
        return asdict(self)


def kv_capacity(model: ModelSpec, hw: HardwareSpec, tp: int, *,
                gpu_memory_utilization: float = 0.90, activation_reserve_bytes: float = 8e9,
                block_size: int = 16, weight_bytes: float | None = None,
                design_rounding: bool = False) -> Capacity:
    """KV pool for `model` on `tp` GPUs of `hw`.

    Args:
        activation_reserve_bytes: whole-node reserve for activations / CUDA-graph workspace
            (the design's ~8 GB).
        weight_bytes: override the weights derived from the architecture (the design uses
            "140 GB" for a 70B model, i.e. exactly 70e9 parameters * 2 bytes).
        design_rounding: read KiB as 1,000 bytes in the per-token figure, as the design does.
    """
    usable = gpu_memory_utilization * hw.hbm_bytes * tp
    weights = float(model.weight_bytes if weight_bytes is None else weight_bytes)
    budget = usable - weights - activation_reserve_bytes
    per_token = float(model.kv_bytes_per_token)
    if design_rounding:
        per_token = per_token / 1024 * 1000
    block_bytes = block_size * per_token
    num_blocks = max(0, int(budget // block_bytes))
    return Capacity(tp=tp, usable_bytes=usable, weight_bytes=weights,
                    activation_reserve_bytes=activation_reserve_bytes, kv_budget_bytes=budget,
                    kv_bytes_per_token=per_token, kv_bytes_per_token_per_gpu=per_token / tp,
                    block_size=block_size, block_bytes=block_bytes, num_blocks=num_blocks)


def design_capacity_table(model: ModelSpec, hw: HardwareSpec, tp: int = 4,
                          context_len: int = 2048) -> list[dict]:
    """The design's 'Scaling and Performance' arithmetic three ways: as the design writes it,
    exactly in bytes with the design's 140 GB of weights, and with the real parameter count."""
    design_weights = (model.num_params // 10**9) * 1e9 * model.dtype_bytes  # "70B" -> 140 GB
    rows = []
    for label, kwargs in (("design's arithmetic (KiB read as 1,000 B)",
                           dict(weight_bytes=design_weights, design_rounding=True)),
                          ("exact bytes, design's 140 GB weights",
                           dict(weight_bytes=design_weights)),
                          (f"exact bytes, real weights ({model.num_params / 1e9:.2f}B params)",
                           {})):
        cap = kv_capacity(model, hw, tp, **kwargs)  # type: ignore[arg-type]
        row = {"variant": label, **cap.to_dict(), "context_len": context_len,
               "max_seqs": cap.max_seqs(context_len)}
        if kwargs.get("design_rounding"):
            row["design_seq_division"] = design_seq_division(cap, context_len)
        rows.append(row)
    return rows


def design_seq_division(cap: Capacity, context_len: int) -> float:
    """The design's "140 GB / 655 MB = ~218": the KV budget in GB times 1,024 MB/GB, over the
    per-sequence KV in (decimal) MB. Kept only to show where 218 comes from."""
    seq_mb = -(-context_len // cap.block_size) * cap.block_bytes / 1e6
    return cap.kv_budget_bytes / 1e9 * 1024 / seq_mb
