"""Per-request generation parameters, validated (the server maps OpenAI fields onto these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


class SamplingParamsError(ValueError):
    """An out-of-range or inconsistent sampling parameter (the server answers 400)."""


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingParamsError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingParamsError(f"top_k must be >= 0 (or -1 for none), got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise SamplingParamsError(
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise SamplingParamsError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if not isinstance(self.n, int) or self.n < 1:
            raise SamplingParamsError(f"n must be an integer >= 1, got {self.n!r}")
        # A new dict: the caller's is never changed, and JSON's string keys become ids.
        self.logit_bias = {_token_id(t): max(-100.0, min(100.0, float(b)))
                           for t, b in dict(self.logit_bias or {}).items()}

    @property
    def penalizes(self) -> bool:
        """Whether sampling needs the tokens seen so far (prompt and output)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _token_id(key: object) -> int:
    try:
        tid = int(str(key))
    except ValueError:
        raise SamplingParamsError(f"logit_bias keys must be token ids, got {key!r}") from None
    if tid < 0:
        raise SamplingParamsError(f"logit_bias keys must be token ids >= 0, got {tid}")
    return tid
