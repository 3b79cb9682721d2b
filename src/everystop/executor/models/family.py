"""What makes a model family: the checkpoint names it answers to, how its hyper-parameters are
read (config.json or GGUF metadata) into the shared decoder's `DecoderArgs`, and how its
checkpoint tensors map onto the decoder's parameters.

The hyper-parameters every decoder shares are read here once (`hf_common_args`,
`gguf_common_args`); a family file adds only what differs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from everystop.executor.models.decoder import DecoderArgs, DecoderForCausalLM, hf_sources
from everystop.executor.models.errors import ModelLoadError

# GGUF per-layer tensor kinds (blk.{i}.{kind}.weight|bias) -> Hugging Face module names, shared
# by every family; a family adds its own in `Family.gguf_layer_names`.
GGUF_LAYER_NAMES: Mapping[str, str] = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_TOP_NAMES: Mapping[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight"}
# The rope scalings our rope (layers/rotary.py) computes.
ROPE_SCALINGS = ("default", "linear", "llama3", "longrope", "su")


class GGUFMeta:
    """A GGUF file's metadata as one architecture's keys (`{arch}.name`), with its tensors'
    names for checks; a missing required key is a ModelLoadError naming it."""

    def __init__(self, fields: Mapping[str, Any], arch: str, tensors: Mapping[str, Any],
                 path: str) -> None:
        self.fields, self.arch, self.tensors, self.path = fields, arch, tensors, path

    def key(self, name: str, default: Any = None) -> Any:
        value = self.fields.get(f"{self.arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {self.arch}.{name}")
        return value

    def get(self, name: str) -> Any:
        """A key outside the architecture's namespace (e.g. tokenizer.*), or None."""
        return self.fields.get(name)


@dataclass(frozen=True)
class Family:
    """One architecture family, as the loader and `everystop models` see it.

    `hf_args` / `gguf_args` build the decoder's arguments from a parsed config.json or a GGUF
    header; `gguf_layer_names` extends GGUF_LAYER_NAMES; `hf_sources` lists, per decoder
    parameter, the checkpoint tensors (Hugging Face names) stacked into it."""

    name: str
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    hf_args: Callable[[dict[str, Any]], DecoderArgs]
    gguf_args: Callable[[GGUFMeta], DecoderArgs]
    hf_model_types: tuple[str, ...] = ()
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    hf_sources: Callable[[DecoderArgs], dict[str, list[str]]] = hf_sources
    model_class: type[DecoderForCausalLM] = DecoderForCausalLM
    # llama.cpp interleaves each Q/K head's rotary pairs on export for "llama" (its rope is
    # the interleaved kind there); families exported with NeoX-style rope keep HF's rows.
    gguf_permuted_qk: bool = False
    # Added to every RMSNorm weight read from a Hugging Face checkpoint: Gemma's norms scale by
    # (1 + w), which llama.cpp's export already folds into the GGUF's weights.
    hf_norm_offset: float = 0.0
    # What the family adds to the shared decoder, as `everystop models` lists it.
    notes: str = ""
    # Where families share a GGUF architecture: whether a file's metadata is this family's.
    gguf_accepts: Callable[[Mapping[str, Any]], bool] | None = None

    def gguf_hf_name(self, name: str) -> str | None:
        """The Hugging Face name of a GGUF tensor, or None for one the model does not use."""
        if name in GGUF_TOP_NAMES:
            return GGUF_TOP_NAMES[name]
        parts = name.split(".")  # blk.{i}.{kind}.weight|bias
        if len(parts) == 4 and parts[0] == "blk":
            kind = self.gguf_layer_names.get(parts[2]) or GGUF_LAYER_NAMES.get(parts[2])
            if kind is not None:
                return f"model.layers.{parts[1]}.{kind}.{parts[3]}"
        return None


def rope_scaling_from_hf(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, rope scaling or None) from a config.json; an unsupported scaling kind is a
    ModelLoadError naming it."""
    # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_scaling`.
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_SCALINGS:
        raise ModelLoadError(f"unsupported rope_scaling type {kind!r} (supported: "
                             f"{', '.join(ROPE_SCALINGS)})")
    if kind in ("longrope", "su"):  # Phi-3 keeps its pretraining length beside the factors
        original = (rope.get("original_max_position_embeddings")
                    or config.get("original_max_position_embeddings"))
        if not original or "long_factor" not in rope or "short_factor" not in rope:
            raise ModelLoadError("longrope rope_scaling needs long_factor, short_factor and "
                                 "original_max_position_embeddings")
        rope["original_max_position_embeddings"] = int(original)
    return theta, None if kind == "default" else rope


def hf_common_args(config: dict[str, Any]) -> dict[str, Any]:
    """DecoderArgs fields every family reads the same way from config.json."""
    try:
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        theta, scaling = rope_scaling_from_hf(config)
        eos = config.get("eos_token_id")
        return dict(
            vocab_size=config["vocab_size"], hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"], num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)), rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos)
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks {e.args[0]}") from None


def gguf_common_args(meta: GGUFMeta) -> dict[str, Any]:
    """DecoderArgs fields every family reads the same way from a GGUF header."""
    hidden, heads = int(meta.key("embedding_length")), int(meta.key("attention.head_count"))
    if "token_embd.weight" not in meta.tensors:
        raise ModelLoadError(f"{meta.path}: missing tensor token_embd.weight")
    vocab = int(meta.key("vocab_size", int(meta.tensors["token_embd.weight"].shape[-1])))
    scaling = None
    kind = meta.fields.get(f"{meta.arch}.rope.scaling.type")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta.key("rope.scaling.factor"))}
    elif kind not in (None, "none"):
        raise ModelLoadError(f"{meta.path}: unsupported rope scaling type {kind!r} "
                             "(supported: none, linear, or llama3 as rope_freqs)")
    return dict(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(meta.key("feed_forward_length")),
        num_layers=int(meta.key("block_count")), num_heads=heads,
        num_kv_heads=int(meta.key("attention.head_count_kv", heads)),
        head_dim=int(meta.key("attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta.key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.key("rope.freq_base", 10000.0)), rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in meta.tensors,
        max_position_embeddings=int(meta.key("context_length", 4096)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"))


def gguf_layer_windows(meta: GGUFMeta, num_layers: int) -> tuple[int, ...]:
    """`{arch}.attention.sliding_window` on every layer where the file records one (a Mistral
    exported as "llama"), else none."""
    window = int(meta.key("attention.sliding_window", 0))
    return (window,) * num_layers if window else ()


def hf_layer_windows(config: dict[str, Any], num_layers: int,
                     default_all: bool = False) -> tuple[int, ...]:
    """Per-layer sliding windows from config.json: `layer_types` where it is written
    ("sliding_attention" layers get `sliding_window`), else every layer's `sliding_window`
    where `default_all`, else none."""
    window = int(config.get("sliding_window") or 0)
    types = config.get("layer_types")
    if window and types:
        if len(types) != num_layers:
            raise ModelLoadError(f"config.json: {len(types)} layer_types for {num_layers} layers")
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return (window,) * num_layers if window and default_all else ()
