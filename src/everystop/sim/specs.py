"""Hardware and model specifications, loaded from the JSON data files in specs/.

Every figure in those files is `{"value": ..., "source": "..."}` so a reader can check where a
number came from; `load_*` keep the sources alongside the values. Parameter counts are derived
from the architecture here, never typed in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path

SPEC_DIR = Path(__file__).with_name("specs")


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (per-GPU figures) plus the efficiency assumptions used with it."""

    key: str
    name: str
    peak_flops: float  # dense BF16 FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    link_bandwidth: float  # NVLink bytes/s per direction
    pcie_bandwidth: float  # host<->device bytes/s
    eff_compute: float
    eff_memory: float
    eff_link: float
    allreduce_latency_s: float
    iteration_overhead_s: float
    overhead_per_seq_s: float
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # An efficiency above 1 or a non-positive rate would let the model predict passes faster
        # than the physical roofline it prints beside them: refuse, by name.
        for name in ("peak_flops", "hbm_bytes", "hbm_bandwidth", "link_bandwidth",
                     "pcie_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{self.key}: {name} must be > 0, not {getattr(self, name)}")
        for name in ("eff_compute", "eff_memory", "eff_link"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{self.key}: {name} is the achieved fraction of peak and must "
                                 f"be in (0, 1], not {getattr(self, name)}")
        for name in ("allreduce_latency_s", "iteration_overhead_s", "overhead_per_seq_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{self.key}: {name} must be >= 0, not {getattr(self, name)}")

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which a kernel is compute-bound (roofline ridge)."""
        return self.peak_flops / self.hbm_bandwidth


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder: the shapes that set FLOPs, weight bytes and KV bytes."""

    key: str
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    dtype_bytes: int
    max_model_len: int
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @cached_property  # a frozen spec: the cost model reads it on every pass
    def params_per_layer(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * self.num_heads * self.head_dim * 2 + h * kv * 2  # q, o; k, v
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        return attn + mlp + 2 * h  # + two RMSNorm weights

    @cached_property  # a frozen spec: the cost model reads it on every pass
    def layer_params(self) -> int:
        """Parameters every token multiplies through (all decoder layers + final norm)."""
        return self.num_layers * self.params_per_layer + self.hidden_size

    @cached_property  # a frozen spec: the cost model reads it on every pass
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        tied = 0 if self.tied_embeddings else self.embedding_params
        return self.layer_params + self.lm_head_params + tied

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @cached_property  # a frozen spec: the cost model reads it on every pass
    def pass_weight_bytes(self) -> int:
        """Weights every forward pass streams from HBM: all layers and the LM head (the
        embedding table is only gathered row by row)."""
        return (self.layer_params + self.lm_head_params) * self.dtype_bytes

    @cached_property  # a frozen spec: the cost model reads it on every pass
    def kv_bytes_per_token(self) -> int:
        """K and V for one token across all layers and all KV heads (whole model, all GPUs)."""
        return 2 * self.num_kv_heads * self.head_dim * self.num_layers * self.dtype_bytes


def _values(entry: dict) -> tuple[dict, dict[str, str]]:
    values, sources = {}, {}
    for name, fig in entry.items():
        if isinstance(fig, dict):
            values[name], sources[name] = fig["value"], fig["source"]
        else:
            values[name] = fig
    return values, sources


@cache
def _load(name: str) -> dict:
    return json.loads((SPEC_DIR / name).read_text())


def hardware_keys() -> list[str]:
    return [k for k in _load("hardware.json") if not k.startswith("_") and k != "efficiency"]


def model_keys() -> list[str]:
    return [k for k in _load("models.json") if not k.startswith("_")]


def load_hardware(key: str, **overrides: float) -> HardwareSpec:
    """The accelerator `key` (e.g. 'a100-80gb'); keyword overrides replace any figure."""
    data = _load("hardware.json")
    if key not in hardware_keys():
        raise KeyError(f"unknown hardware {key!r}; known: {', '.join(hardware_keys())}")
    hw, sources = _values(data[key])
    eff, eff_sources = _values(data["efficiency"])
    values = dict(hw, eff_compute=eff["compute"], eff_memory=eff["memory"], eff_link=eff["link"],
                  allreduce_latency_s=eff["allreduce_latency_s"],
                  iteration_overhead_s=eff["iteration_overhead_s"],
                  overhead_per_seq_s=eff["overhead_per_seq_s"])
    values.update(overrides)
    sources.update({f"eff_{k}" if k in ("compute", "memory", "link") else k: v
                    for k, v in eff_sources.items()})
    return HardwareSpec(key=key, sources=sources, **values)


def load_model(key: str) -> ModelSpec:
    """The model `key` (e.g. 'llama-3-70b')."""
    if key not in model_keys():
        raise KeyError(f"unknown model {key!r}; known: {', '.join(model_keys())}")
    values, sources = _values(_load("models.json")[key])
    return ModelSpec(key=key, sources=sources, **values)
