"""Text <-> token ids for the engine and the server: a thin wrapper over a Hugging Face
tokenizer (read from GGUF metadata or an HF directory), plus incremental detokenization.

NOTE: no torch here, and transformers is imported lazily: importing this module stays cheap.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Sequence, Set
from typing import Any, Protocol

from everystop.config import cache_dir

# End-of-turn markers of common chat templates: generation should stop at these too.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>",
                       "<|end|>", "<end_of_turn>")


class EngineTokenizer(Protocol):
    """What the engine needs of a tokenizer (`Tokenizer` below, or a test double). A tokenizer
    may also offer `make_detokenizer(params)` and `apply_chat_template(...)`."""

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> Set[int]:
        """Every id that ends generation (EOS and end-of-turn markers)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class TokenizerLoadError(Exception):
    """The tokenizer could not be loaded (one-line message)."""


class Tokenizer:
    """What the engine needs from a tokenizer, independent of where it came from."""

    def __init__(self, hf_tokenizer: Any, extra_eos_ids: Iterable[int] = ()) -> None:
        self._tok = hf_tokenizer
        eos = hf_tokenizer.eos_token_id
        self._eos_id: int | None = eos
        vocab = hf_tokenizer.get_vocab()
        ids = {vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab}
        ids.update(extra_eos_ids)
        if eos is not None:
            ids.add(eos)
        self._eos_ids = frozenset(ids)
        # Computed here, from the vocabulary already at hand: the server reads it on its event
        # loop, where a first lazy scan of 100k+ tokens would stall every client.
        self.max_token_chars = max((len(t) for t in vocab), default=1) or 1
        self._pieces_ok: bool | None = None  # long texts in pieces (_encode_long): decided once
        self._special_wrap: tuple[list[int], list[int]] = ([], [])  # what add_special_tokens adds

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """EOS plus any end-of-turn token in the vocabulary (e.g. <|im_end|>, <|eot_id|>)."""
        return self._eos_ids

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer underneath (the grammar engine reads its vocabulary)."""
        return self._tok

    @property
    def special_token_ids(self) -> frozenset[int]:
        """The special tokens' ids (BOS, EOS, chat markers such as <|im_end|>)."""
        return frozenset(self._tok.all_special_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    # NOTE: max_token_chars (set in __init__) is the longest token's text, in characters (at
    # least 1): a text of C characters is at least C / max_token_chars tokens, so a server can
    # refuse an absurdly long prompt without tokenizing it. Byte-level tokens spell one byte
    # per character, and no UTF-8 character is shorter than its one byte, so the bound holds
    # for any text (it would not for a normalizer that deletes characters; ours, byte-level
    # BPE and SentencePiece, do not).

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > LONG_TEXT_CHARS and self._can_split():
            ids = self._encode_long(text)
            if add_special_tokens:
                before, after = self._special_wrap
                ids = [*before, *ids, *after]
            return ids
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def _encode_long(self, text: str) -> list[int]:
        """`text`'s ids, encoded as pieces cut where the pre-tokenizer cuts anyway
        (split_points): the Rust tokenizer works on all of them in one call that releases
        the GIL, and each piece's ids come back to Python in a conversion of milliseconds.
        One 10 MB encode() instead holds the GIL for its whole result (2M ids, then offsets
        and masks nobody asked for): a stall of every other thread, /health included."""
        cuts = [0, *split_points(text, PIECE_CHARS), len(text)]
        pieces = [text[a:b] for a, b in zip(cuts, cuts[1:])]
        ids: list[int] = []
        for encoding in self._tok.backend_tokenizer.encode_batch(pieces,
                                                                 add_special_tokens=False):
            ids.extend(encoding.ids)  # NOTE: one piece per call: threads may run in between
        return ids

    def _can_split(self) -> bool:
        """Whether encoding in pieces gives exactly the ids of one encode(): a Rust-backed
        byte-level BPE with no normalizer (or NFC, which never reaches across a space or a
        newline), no prefix space, no added token that a cut could fall inside, and the same
        ids, whole and cut at every split point, on a probe text. Decided once."""
        if self._pieces_ok is None:
            self._pieces_ok = self._check_split()
        return self._pieces_ok

    def _check_split(self) -> bool:
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            return False
        spec = json.loads(backend.to_str())
        pre, norm = spec.get("pre_tokenizer") or {}, spec.get("normalizer")
        steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        if not any(p.get("type") == "ByteLevel" for p in steps) or any(
                p.get("type") not in ("ByteLevel", "Split") or p.get("add_prefix_space")
                for p in steps):
            return False
        if norm is not None and norm.get("type") != "NFC":
            return False
        if any(_SPLIT_POINT.search(t.get("content", "")) for t in spec.get("added_tokens", [])):
            return False
        cuts = [0, *split_points(_PROBE, 1), len(_PROBE)]
        whole = list(self._tok.encode(_PROBE, add_special_tokens=False))
        pieces = [_PROBE[a:b] for a, b in zip(cuts, cuts[1:])]
        if len(pieces) <= 10 or whole != [
                i for e in backend.encode_batch(pieces, add_special_tokens=False) for i in e.ids]:
            return False
        # The special tokens a single sequence gets (BOS, EOS), found around the probe's ids.
        wrapped = list(self._tok.encode(_PROBE, add_special_tokens=True))
        for k in range(len(wrapped) - len(whole) + 1):
            if wrapped[k:k + len(whole)] == whole:
                self._special_wrap = (wrapped[:k], wrapped[k + len(whole):])
                return True
        return False

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def info(self) -> dict[str, Any]:
        """What remote-tokenizer clients read (vLLM's /tokenizer_info; lm-eval uses it)."""
        t = self._tok
        return {"tokenizer_class": type(t).__name__, "eos_token": t.eos_token,
                "bos_token": t.bos_token, "pad_token": t.pad_token, "unk_token": t.unk_token,
                "chat_template": getattr(t, "chat_template", None), "vocab_size": len(t)}

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return list(self._tok.convert_ids_to_tokens(list(ids)))

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    continue_final_message: bool = False, **template_kwargs: Any) -> str:
        """The chat template applied to `messages` (and `tools`, OpenAI-shaped), as text.
        `continue_final_message`: the last (assistant) turn is left open for the model to go
        on with; `template_kwargs` reach the template as variables (e.g. enable_thinking)."""
        template = getattr(self._tok, "chat_template", None)
        if tools and not (isinstance(template, str) and "tools" in template):
            # The template has no place for tools: they go into the system turn, and earlier
            # calls into the assistant turns' text, in the shape the server parses back.
            messages = _tools_in_text(messages, tools)
            tools = None
        if not template:
            # No template shipped: a plain transcript the model can at least continue.
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            if continue_final_message:
                return text.removesuffix("\n")
            return text + ("assistant:" if add_generation_prompt else "")
        return str(self._tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **template_kwargs))

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            continue_final_message: bool = False,
                            **template_kwargs: Any) -> list[int]:
        """Token ids of the rendered chat. NOTE: templates write their own BOS, so no special
        tokens are added on top."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools,
                                            continue_final_message, **template_kwargs))


# Longer texts are encoded in pieces of about PIECE_CHARS (Tokenizer._encode_long).
LONG_TEXT_CHARS = 1 << 16
PIECE_CHARS = 1 << 15

# Where byte-level BPE pre-tokenizers (the GPT-2, Llama 3 and Qwen regexes) always start a new
# pre-token, whatever came before: at a space that follows a non-space and precedes a letter
# (" word" is one pre-token, and nothing before it can take the space), and after a lone
# newline between non-spaces. BPE never merges across pre-tokens, so the ids of the pieces,
# joined, are the ids of the text. NOTE: a longer whitespace run is no split point: GPT-2's
# `\s+(?!\S)` splits "\r\n" before a word but not at the end of a piece.
_SPLIT_POINT = re.compile(r"(?<=\S)(?= [^\W\d_])|(?<=\S\n)(?=\S)")
_PROBE = ("Hello world, it's 2024: naïve café déjà vu; x=3.14*r**2 (e.g.) don't \n"
          "\tindented\n\n  two spaces then words ½ ² 中文 字符 emoji 🙂 done.\r\nOK  <|im_end|>"
          " <|endoftext|> trailing   \n\nword's 'quoted' ABC123 abc_def ... !!! ?\n") * 3


def split_points(text: str, every: int) -> list[int]:
    """Offsets, about `every` characters apart, where `text` may be cut (_SPLIT_POINT): the
    first one at or after each target; a stretch with none makes a longer piece. NOTE: each
    search looks at one window of `every` characters at most, so no single call holds the GIL
    for long even on a text with no split point at all."""
    points: list[int] = []
    pos, window = every, max(every, 256)
    while pos < len(text):
        found = _SPLIT_POINT.search(text, pos, pos + window)
        if found is None:
            pos += window
            continue
        points.append(found.start())
        pos = found.start() + every
    return points


_TOOLS_PROMPT = ("You can call these functions:\n{functions}\nTo call one, answer with only "
                 'a JSON object: {{"name": <function name>, "arguments": <its arguments>}}; '
                 "to call several at once, a JSON array of such objects.")


def _tools_in_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]]
                   ) -> list[dict[str, Any]]:
    functions = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    prompt = _TOOLS_PROMPT.format(functions=functions)
    out = [dict(m) for m in messages]
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:  # in the shape the prompt asks for: one object, or an array of several
            objs = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                    for c in calls]
            m["content"] = json.dumps(objs[0] if len(objs) == 1 else objs)
        m.pop("tool_call_id", None)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def load_tokenizer(model_path: str | None = None) -> Tokenizer:
    """Tokenizer for a GGUF file or HF directory (None: the default model). Cached per path."""
    if model_path is None:
        # Lazy import: the loader pulls in torch, which this module must not.
        from everystop.executor.models.loader import default_model_path
        model_path = default_model_path()
    return _load_cached(os.path.abspath(os.path.expanduser(model_path)))


@functools.lru_cache(maxsize=8)
def _load_cached(path: str) -> Tokenizer:
    if not os.path.exists(path):
        raise TokenizerLoadError(f"tokenizer path does not exist: {path}")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "tokenizer.json")) \
            and not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            path = os.path.join(path, ggufs[0])
    try:
        if os.path.isfile(path):
            hf = _from_gguf(path)
        else:
            from transformers import AutoTokenizer  # slow import: only when needed
            hf = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        msg = " ".join(f"cannot load tokenizer from {path}: {type(e).__name__}: {e}".split())
        raise TokenizerLoadError(msg) from None
    return Tokenizer(hf, _generation_eos_ids(path))


def _from_gguf(path: str) -> Any:
    """The tokenizer of a GGUF file, through a converted copy cached on disk.

    Building it from GGUF metadata means parsing the whole vocabulary out of the file (seconds);
    the converted files load in a fraction of that. The cache key is the file's path, size and
    mtime (and the layout's version), so a replaced file is converted again. A cache that
    cannot be written is skipped.
    """
    import hashlib

    st = os.stat(path)
    key = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}:{_CACHE_LAYOUT}".encode()
                         ).hexdigest()[:16]
    cache = os.path.join(cache_dir(), "tokenizers", key)
    if os.path.isfile(os.path.join(cache, "tokenizer.json")):
        try:
            return _fast_tokenizer_class().from_pretrained(cache)
        except Exception:  # a damaged cache entry: rebuild it below
            pass
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    if not getattr(hf, "chat_template", None):
        # transformers' GGUF conversion keeps the file's template for some architectures only
        # (Qwen's, not Gemma's or Phi-3's): the file's own is the model's.
        from everystop.executor.models.gguf_file import GGUFFile  # numpy only, no torch

        template = GGUFFile(path).fields.get("tokenizer.chat_template")
        if isinstance(template, str) and template:
            hf.chat_template = template
    try:
        tmp = f"{cache}.{os.getpid()}.tmp"
        hf.save_pretrained(tmp)
        _record_added_tokens(tmp, hf)
        os.replace(tmp, cache)  # atomic: readers see a complete entry or none
    except OSError:
        pass
    return hf


# Version of what a converted copy holds (2: the added tokens in tokenizer_config.json).
_CACHE_LAYOUT = 2


def _record_added_tokens(directory: str, hf: Any) -> None:
    """Write the added tokens into the saved tokenizer_config.json, where transformers reads
    them first. NOTE: transformers 5 saves them in tokenizer.json only, and loading a config
    without them parses the whole tokenizer.json in Python to find them: the vocabulary and
    merges as Python objects, ~20 MiB and ~0.3 s of start-up for a 49k vocabulary, thrown away
    at once (the Rust tokenizer parses the file again for itself)."""
    file = os.path.join(directory, "tokenizer_config.json")
    with open(file) as f:
        config = json.load(f)
    if "added_tokens_decoder" in config:
        return
    config["added_tokens_decoder"] = {str(i): t.__getstate__()
                                      for i, t in sorted(hf.added_tokens_decoder.items())}
    with open(file, "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def _fast_tokenizer_class() -> Any:
    """The class of a converted (tokenizer.json) tokenizer, imported by its own module.

    NOTE: `from transformers import AutoTokenizer` first indexes every model package
    transformers ships (~1.5 s here); the class itself imports in a third of that. The
    converted copy is always a tokenizers-backed one, so nothing needs AutoTokenizer's lookup.
    """
    try:  # transformers 5
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
        return TokenizersBackend
    except ImportError:  # transformers 4
        from transformers.tokenization_utils_fast import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast


def _generation_eos_ids(path: str) -> list[int]:
    # HF checkpoints may list several stop ids (e.g. Llama 3 instruct) in generation_config.json.
    import json

    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return []
    try:
        with open(file) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


class IncrementalDetokenizer:
    """Turns a growing stream of token ids into text deltas.

    Each `push` returns only text that is complete: a token that ends mid UTF-8 character
    decodes to U+FFFD, so that text is held back until the character's remaining bytes arrive.
    The window decoded each time starts a few tokens back (`prefix`) because tokenizers decode a
    token differently at the start of a string (e.g. SentencePiece's leading space)::

        ids: |... prefix_offset | already returned | read_offset | new (not yet returned) |
    """

    def __init__(self, tokenizer: EngineTokenizer, prompt_ids_tail: Sequence[int] = (),
                 skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # vLLM's spaces_between_special_tokens: special tokens kept in the text stand apart
        # from their neighbours by a space.
        special = getattr(tokenizer, "special_token_ids", frozenset())
        self._special: frozenset[int] = frozenset() if skip_special_tokens or \
            not spaces_between_special_tokens else frozenset(special)
        self._ids: list[int] = list(prompt_ids_tail)[-6:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # everything returned so far

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return newly completed text (possibly "")."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Text still held back at the end of the stream (e.g. a truly invalid byte sequence)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        delta = full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        ids = self._ids[start:end]
        if not self._special.intersection(ids):
            return self._tok.decode(ids, skip_special_tokens=self._skip)
        parts: list[list[int]] = []
        for t in ids:  # runs of ordinary tokens, and each special token alone
            if t in self._special or not parts or parts[-1][-1] in self._special:
                parts.append([t])
            else:
                parts[-1].append(t)
        return " ".join(self._tok.decode(p, skip_special_tokens=False) for p in parts)
