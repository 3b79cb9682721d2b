"""Read a LoRA adapter in PEFT's format (a directory with `adapter_config.json` and
`adapter_model.safetensors`) and shape it for the decoder's fused projections.

PEFT's tensors are named `base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight`
([r, in]) and `...lora_B.weight` ([out, r]); the delta of a projection is
scale * x @ A^T @ B^T with scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).
Every option that would change that arithmetic is refused by name rather than ignored.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file

from everystop.executor.layers.lora import LoraPair
from everystop.executor.models.decoder import DecoderArgs

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_MAX_LORA_RANK = 64

# PEFT's projection name -> (our fused projection, its part)
PARTS: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "o_proj": ("o_proj", "o"), "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"), "down_proj": ("down_proj", "down"),
}
# Config keys read here, and keys that only describe training or provenance (no effect on the
# adapter's output). Any other key set to something other than an off value is refused.
READ_KEYS = {"r", "lora_alpha", "use_rslora", "peft_type", "target_modules", "task_type"}
INERT_KEYS = {"auto_mapping", "base_model_name_or_path", "revision", "peft_version",
              "inference_mode", "init_lora_weights", "lora_dropout", "megatron_core",
              "qalora_group_size", "loftq_config", "layers_to_transform", "layers_pattern",
              "exclude_modules", "ensure_weight_tying"}
OFF_VALUES: tuple[Any, ...] = (None, False, "none", {}, [])
TENSOR_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
                         r"(\w+)\.lora_([AB])\.weight$")


class LoraLoadError(ValueError):
    """An adapter that cannot be served on this base model, with the reason by name."""


def peft_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling of the low-rank product."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter, shaped for the decoder: a pair per targeted projection, named as the
    model's LoRA bank names them (`{layer}.{projection}`)."""

    path: str
    rank: int
    scale: float
    pairs: dict[str, LoraPair]

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.pairs.values())


def check_rank(path: str, rank: int, max_rank: int) -> None:
    if rank > max_rank:
        raise LoraLoadError(f"{path}: rank {rank} is above the maximum LoRA rank {max_rank} "
                            "(--max-lora-rank)")


def load_peft_adapter(path: str, args: DecoderArgs, dtype: torch.dtype,
                      max_rank: int = DEFAULT_MAX_LORA_RANK) -> LoraAdapter:
    """Read and check the adapter at `path` against a base model with `args`."""
    config = _read_config(path)
    rank, alpha = config["r"], config["lora_alpha"]
    if not isinstance(rank, int) or rank <= 0:
        raise LoraLoadError(f"{path}: r must be a positive integer, not {rank!r}")
    check_rank(path, rank, max_rank)
    scale = peft_scale(float(alpha), rank, bool(config.get("use_rslora")))
    tensors = _read_tensors(path)
    named: list[tuple[str, int, str, str, torch.Tensor]] = []
    for name, tensor in tensors.items():
        m = TENSOR_NAME.match(name)
        if m is None:
            raise LoraLoadError(f"{path}: tensor {name!r} is not a LoRA weight of a decoder "
                                f"layer's {', '.join(PARTS)}")
        named.append((name, int(m.group(1)), m.group(3), m.group(4), tensor))
    if not named:
        raise LoraLoadError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")
    return build_adapter(path, named, rank, scale, args, dtype)


def build_adapter(path: str, named: list[tuple[str, int, str, str, torch.Tensor]], rank: int,
                  scale: float, args: DecoderArgs, dtype: torch.dtype) -> LoraAdapter:
    """Check an adapter's tensors against the base and fuse them. `named`: (the tensor's name
    in its file, layer, PEFT projection name, "A" or "B", tensor as PEFT orients it: A [r, in],
    B [out, r])."""
    shapes = _projection_shapes(args)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, layer, proj, which, tensor in named:
        if proj not in PARTS:
            raise LoraLoadError(f"{path}: tensor {name!r} targets {proj!r}; supported target "
                                f"modules: {', '.join(PARTS)}")
        if layer >= args.num_layers:
            raise LoraLoadError(f"{path}: tensor {name!r} is for layer {layer}, but the base "
                                f"model has {args.num_layers} layers")
        out_size, in_size = shapes[proj]
        want = (rank, in_size) if which == "A" else (out_size, rank)
        if tuple(tensor.shape) != want:
            raise LoraLoadError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, but "
                                f"this base model needs {want} (an adapter of another base "
                                "model?)")
        parts.setdefault((layer, proj), {})[which] = tensor
    for (layer, proj), pair in parts.items():
        if len(pair) != 2:
            raise LoraLoadError(f"{path}: layer {layer} {proj} has lora_{next(iter(pair))} "
                                "but not its other half")
    return LoraAdapter(path, rank, scale, _fuse(parts, shapes, scale, dtype))


def _read_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file) as f:
            config = json.load(f)
    except OSError as e:
        raise LoraLoadError(f"{path}: cannot read {CONFIG_FILE}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise LoraLoadError(f"{file}: not JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoraLoadError(f"{file}: not a JSON object")
    if config.get("peft_type") != "LORA":
        raise LoraLoadError(f"{file}: peft_type {config.get('peft_type')!r} is not 'LORA'")
    for key in ("r", "lora_alpha"):
        if key not in config:
            raise LoraLoadError(f"{file}: {key!r} is missing")
    unsupported = sorted(key for key, value in config.items()
                         if key not in READ_KEYS | INERT_KEYS
                         and not any(value == off for off in OFF_VALUES))
    if unsupported:
        raise LoraLoadError(f"{file}: unsupported LoRA options "
                            + ", ".join(f"{k}={config[k]!r}" for k in unsupported))
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise LoraLoadError(f"{path}: no {WEIGHTS_FILE}")
    try:
        return load_file(file)
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise LoraLoadError(f"{file}: unreadable: {e}") from None


def _projection_shapes(args: DecoderArgs) -> dict[str, tuple[int, int]]:
    """(out, in) of each PEFT projection on this base."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    h, i = args.hidden_size, args.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def _fuse(parts: dict[tuple[int, str], dict[str, torch.Tensor]],
          shapes: dict[str, tuple[int, int]], scale: float,
          dtype: torch.dtype) -> dict[str, LoraPair]:
    """One pair per fused projection: A stacks the parts' A; B is block diagonal, each part's
    B (times the scale) in its output rows and its own rank columns; parts the adapter does not
    target are absent (no rows of B, no columns)."""
    by_fused: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, proj), pair in parts.items():
        fused, _ = PARTS[proj]
        siblings = [p for p, (f, _) in PARTS.items() if f == fused]
        row = sum(shapes[p][0] for p in siblings[:siblings.index(proj)])
        by_fused.setdefault((layer, fused), []).append((row, pair["A"], pair["B"]))
    out: dict[str, LoraPair] = {}
    for (layer, fused), members in by_fused.items():
        out_size = sum(shapes[p][0] for p, (f, _) in PARTS.items() if f == fused)
        a = torch.cat([m[1] for m in members]).to(torch.float32)
        b = torch.zeros(out_size, a.shape[0])
        col = 0
        for row, _, part_b in members:
            b[row:row + part_b.shape[0], col:col + part_b.shape[1]] = part_b.float() * scale
            col += part_b.shape[1]
        out[f"{layer}.{fused}"] = LoraPair(a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return out
