"""Read a LoRA adapter in llama.cpp's GGUF form (what its convert_lora_to_gguf.py writes) into
the same in-memory adapter as a PEFT directory.

The file says `general.type = "adapter"`, `adapter.type = "lora"` and `adapter.lora.alpha`;
each targeted weight `blk.{i}.{kind}.weight` has `.lora_a` ([r, in] outermost first, as PEFT's
A) and `.lora_b` ([out, r], as PEFT's B). llama.cpp scales the product by alpha / r, or by 1
when alpha is 0 (rsLoRA is not recorded in the file). Where llama.cpp interleaves a family's
Q/K rotary rows on export (models/family.py, `gguf_permuted_qk`), B's rows of attn_q and attn_k
are interleaved too and are put back in Hugging Face's order here.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from everystop.executor.lora.peft_adapter import (
    LoraAdapter,
    LoraLoadError,
    build_adapter,
    check_rank,
)
from everystop.executor.models.decoder import DecoderArgs
from everystop.executor.models.errors import ModelLoadError
from everystop.executor.models.family import GGUF_LAYER_NAMES

GGUF_MAGIC = b"GGUF"
TENSOR_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
# GGUF's per-layer kind -> PEFT's projection name (q_proj, ...), for the kinds a LoRA may target.
KINDS = {kind: hf.split(".")[-1] for kind, hf in GGUF_LAYER_NAMES.items()
         if not kind.endswith("_norm")}
# Keys that change which tokens the adapter applies to: refused, not ignored.
REFUSED_KEYS = ("adapter.alora.invocation_tokens",)


def is_gguf_file(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:  # a directory, or unreadable: not a GGUF adapter
        return False


def load_gguf_adapter(path: str, args: DecoderArgs, dtype: torch.dtype,
                      max_rank: int) -> LoraAdapter:
    """Read and check the GGUF LoRA adapter at `path` against a base model with `args`."""
    from everystop.executor.models.gguf_file import GGUFFile
    from everystop.executor.models.registry import family_for_gguf

    try:
        reader = GGUFFile(path)
    except Exception as e:  # numpy/struct errors on a truncated or foreign file
        raise LoraLoadError(f"{path}: unreadable GGUF: {type(e).__name__}: {e}") from None
    fields = reader.fields
    for key, want in (("general.type", "adapter"), ("adapter.type", "lora")):
        if fields.get(key) != want:
            raise LoraLoadError(f"{path}: {key} is {fields.get(key)!r}, not {want!r}: not a "
                                "llama.cpp LoRA adapter")
    refused = [key for key in REFUSED_KEYS if key in fields]
    if refused:
        raise LoraLoadError(f"{path}: unsupported LoRA options {', '.join(refused)}")
    try:
        family = family_for_gguf(fields.get("general.architecture"), path, fields)
    except ModelLoadError as e:
        raise LoraLoadError(str(e)) from None
    alpha = float(fields.get("adapter.lora.alpha") or 0.0)
    named: list[tuple[str, int, str, str, torch.Tensor]] = []
    for tensor in reader.tensors:
        m = TENSOR_NAME.match(tensor.name)
        if m is None or m.group(2) not in KINDS:
            raise LoraLoadError(f"{path}: tensor {tensor.name!r} is not a LoRA weight of a "
                                f"decoder layer's {', '.join(KINDS)}")
        layer, proj, which = int(m.group(1)), KINDS[m.group(2)], m.group(3).upper()
        w = torch.from_numpy(_as_float32(tensor))
        heads = {"q_proj": args.num_heads, "k_proj": args.num_kv_heads}.get(proj, 0)
        if which == "B" and family.gguf_permuted_qk and heads and w.shape[0] % (2 * heads) == 0:
            w = _unpermute_rows(w, heads)
        named.append((tensor.name, layer, proj, which, w))
    if not named:
        raise LoraLoadError(f"{path}: the file holds no LoRA weights")
    # llama.cpp takes each pair's rank from its B; one scale per adapter needs one rank.
    ranks = sorted({int(w.shape[1]) for _, _, _, which, w in named if which == "B"})
    if len(ranks) != 1:
        raise LoraLoadError(f"{path}: its pairs have ranks {ranks}; one rank per adapter is "
                            "served")
    rank = ranks[0]
    check_rank(path, rank, max_rank)
    scale = alpha / rank if alpha else 1.0
    return build_adapter(path, named, rank, scale, args, dtype)


def _as_float32(tensor: Any) -> np.ndarray:
    """The tensor as fp32, outermost dimension first (GGUF lists dims innermost first)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = [int(d) for d in reversed(tensor.shape)]
    data = np.asarray(tensor.data)
    if tensor.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data = dequantize(data, tensor.tensor_type)
    return np.array(data, dtype=np.float32).reshape(shape)


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # Export put each head's rows (2, d/2) in the order (d/2, 2); swap them back.
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
