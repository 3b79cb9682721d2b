"""Per-request generation parameters, validated (the server maps OpenAI fields onto these)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

INT32_MAX = 2**31 - 1
MAX_TEMPERATURE = 100.0
# Below this (and above 0) a temperature is argmax in all but name, and dividing logits by it
# could overflow float32: such rows are sampled greedily.
GREEDY_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """An out-of-range or inconsistent sampling parameter (the server answers 400 naming
    `param`, the request field it came from)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StructuredOutputError(SamplingParamsError):
    """A structured-output spec the grammar engine cannot compile (the server answers 400)."""


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the generated text to a language: `json_object` (any JSON object; `spec`
    unused), `json_schema` (spec: the schema as JSON text), `regex`, `choice` (spec: a JSON
    list of the allowed strings) or `grammar` (spec: EBNF in xgrammar's GBNF dialect)."""

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar"]
    spec: str = ""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Number of top log-probabilities to return per sampled token (None: no logprobs).
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # OpenAI: subtract presence_penalty once from every token already generated, and
    # frequency_penalty once per time it was generated ([-2, 2]).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF/vLLM: a token seen in the prompt or the output has its logit divided by this when
    # positive, multiplied when negative (> 0; 1 = off).
    repetition_penalty: float = 1.0
    # Drop tokens whose probability is below min_p times the most likely token's ([0, 1]).
    min_p: float = 0.0
    # EOS and the stop token ids cannot be sampled before this many tokens.
    min_tokens: int = 0
    # token id -> added to its logit, clamped to [-100, 100] (OpenAI's range).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Completions per prompt (the offline API; the server fans `n` out itself).
    n: int = 1
    # Logprob of every prompt token given its prefix, with this many top alternatives (None:
    # not computed; a request asking for it is not served from the prefix cache).
    prompt_logprobs: int | None = None
    # Only tokens that keep the text inside this language can be sampled (a token mask).
    structured_output: StructuredOutput | None = None
    # Only these token ids can be sampled (None: any).
    allowed_token_ids: list[int] | None = None
    # Words never to generate. The engine tokenizes them into bad_words_token_ids: a one-token
    # word is banned outright, a longer one bans its last token right after its other tokens.
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Detokenizer options: drop special tokens from the text; put spaces between them.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Decode this request one token per pass even when the engine speculates (--speculative).
    disable_spec_decode: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = [_token_id("stop_token_ids", t) for t in self.stop_token_ids]
        if self.top_k == -1:
            self.top_k = 0
        # NOTE: every value that reaches a tensor is range-checked here (and token ids against
        # the vocabulary in check_vocab): a bad value must fail its own request at intake, not
        # the forward pass it would share with other requests.
        _check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        _check_int("top_k", self.top_k, 0, INT32_MAX, "(or -1 for none)")
        if self.seed is not None:
            _check_int("seed", self.seed, -2**63, 2**63 - 1)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY,
                     MAX_REPETITION_PENALTY)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        _check_int("n", self.n, 1, INT32_MAX)
        if not isinstance(self.disable_spec_decode, bool):
            raise SamplingParamsError(f"disable_spec_decode must be a boolean, got "
                                      f"{_short(self.disable_spec_decode)}",
                                      "disable_spec_decode")
        # A new dict: the caller's is never changed, and JSON's string keys become ids.
        self.logit_bias = {_token_id("logit_bias", t): _bias(b)
                           for t, b in dict(self.logit_bias or {}).items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [_token_id("allowed_token_ids", t)
                                      for t in self.allowed_token_ids]
            if not self.allowed_token_ids:
                raise SamplingParamsError("allowed_token_ids must not be empty",
                                          "allowed_token_ids")
        self.bad_words = [w for w in self.bad_words if w]
        self.bad_words_token_ids = [[_token_id("bad_words", t) for t in ids]
                                    for ids in self.bad_words_token_ids if ids]

    def tokenize_bad_words(self, encode: Callable[[str], list[int]]) -> None:
        """Fill bad_words_token_ids from bad_words, each word as written and with a leading
        space (how it appears mid-sentence), as vLLM does."""
        seen = {tuple(ids) for ids in self.bad_words_token_ids}
        for word in self.bad_words:
            for form in (word, " " + word.lstrip(" ")):
                ids = tuple(encode(form))
                if ids and ids not in seen:
                    seen.add(ids)
                    self.bad_words_token_ids.append(list(ids))

    def check_vocab(self, vocab_size: int) -> None:
        """Raise SamplingParamsError if a token id or count here does not fit a vocabulary of
        `vocab_size` tokens (what the engine calls when it makes a request for its model)."""
        bad_word_ids = [t for ids in self.bad_words_token_ids for t in ids]
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", self.logit_bias),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("bad_words", bad_word_ids)):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise SamplingParamsError(f"{name}: token id {bad} is outside the vocabulary "
                                          f"(0..{vocab_size - 1})", name)
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            if count is not None and count > vocab_size:
                raise SamplingParamsError(f"{name} must be <= the vocabulary size "
                                          f"({vocab_size}), got {count}", name)

    @property
    def penalizes(self) -> bool:
        """Whether sampling needs the tokens seen so far (prompt and output)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _check_int(name: str, value: object, lo: int, hi: int, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SamplingParamsError(
            f"{name} must be an integer in [{lo}, {hi}]{' ' + note if note else ''}, "
            f"got {_short(value)}", name)


def _check_float(name: str, value: object, lo: float, hi: float) -> None:
    # NaN fails both comparisons; a bool is not a number here.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise SamplingParamsError(
            f"{name} must be a number in [{lo:g}, {hi:g}], got {_short(value)}", name)


def _bias(value: object) -> float:
    """A logit_bias value, clamped to OpenAI's [-100, 100]; NaN or a non-number is refused."""
    try:
        bias = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        bias = math.nan
    if math.isnan(bias) or isinstance(value, bool):
        raise SamplingParamsError(f"logit_bias values must be numbers, got {_short(value)}",
                                  "logit_bias")
    return max(-100.0, min(100.0, bias))


def _token_id(name: str, key: object) -> int:
    """A token id from an int or (logit_bias's JSON keys) a decimal string, in [0, INT32_MAX]:
    ids become int32/int64 tensor indices, and no vocabulary is that large."""
    if isinstance(key, bool):
        tid = -1
    else:
        try:
            tid = int(key) if isinstance(key, int) else int(str(key), 10)
        except ValueError:
            tid = -1
    if not 0 <= tid <= INT32_MAX:
        raise SamplingParamsError(f"{name}: token ids must be integers in [0, {INT32_MAX}], "
                                  f"got {_short(key)}", name)
    return tid


def _short(value: object) -> str:
    """A value for an error message: at most 40 characters (an int too long to print, too)."""
    try:
        text = repr(value)
    except ValueError:  # Python will not print an int of over 4300 digits
        return "an integer too large to print"
    return text if len(text) <= 40 else text[:37] + "..."
