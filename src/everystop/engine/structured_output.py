"""Structured output: one grammar matcher per constrained request, and before each pass the
packed token bitmask of every constrained row that samples (vLLM v1's design: the masks are
computed beside the scheduler and travel with the plan; the sampler only applies them).

The grammar engine is xgrammar: on this model's 49k vocabulary it fills a row's mask in ~3 us
(0.4 ms for 128 rows, against 1-8 ms for llguidance), since
it precomputes which tokens each grammar position accepts. Nothing here is built until the first
constrained request arrives, so unconstrained serving pays neither the import nor the vocabulary
scan.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from everystop.core.outputs import SchedulerOutput
from everystop.core.request import Request
from everystop.sampling_params import StructuredOutput, StructuredOutputError

logger = logging.getLogger("everystop.engine")


class StructuredOutputManager:
    def __init__(self, hf_tokenizer: Any, stop_token_ids: list[int]) -> None:
        """`hf_tokenizer`: the transformers tokenizer (None: structured output unsupported);
        `stop_token_ids`: what ends a finished text (EOS and end-of-turn ids)."""
        self._hf = hf_tokenizer
        self._stop_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()  # compile() runs on request threads
        # request id -> [matcher, tokens consumed]
        self._matchers: dict[str, list[Any]] = {}

    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar (cached by the compiler); raises StructuredOutputError."""
        compiler = self._get_compiler()
        try:
            if so.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if so.kind == "json_schema":
                # Fixed separators: a small model given free whitespace can emit newlines
                # forever without leaving the grammar.
                return compiler.compile_json_schema(so.spec, any_whitespace=False)
            if so.kind == "regex":
                return compiler.compile_regex(so.spec)
            if so.kind == "choice":
                choices = json.loads(so.spec)
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(str(c)) for c in choices))
            return compiler.compile_grammar(so.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            msg = " ".join(str(exc).split())[:300]
            raise StructuredOutputError(f"invalid {so.kind}: {msg}") from None

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                if self._hf is None:
                    raise StructuredOutputError("this model's tokenizer does not support "
                                                "structured output")
                try:
                    import xgrammar
                except ImportError:
                    raise StructuredOutputError("structured output needs xgrammar "
                                                "(pip install xgrammar)") from None
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._hf, vocab_size=len(self._hf), stop_token_ids=self._stop_ids)
                self._compiler = xgrammar.GrammarCompiler(info)
            return self._compiler

    def fill_bitmasks(self, sched: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Set `token_bitmask` on every sampled row with a grammar, first advancing its matcher
        over the tokens generated since the last pass."""
        rows = [s for s in sched.scheduled if s.sample
                and s.sampling_params.structured_output is not None]
        if not rows:
            return
        import xgrammar

        masks = xgrammar.allocate_token_bitmask(len(rows), len(self._hf))
        for i, seq in enumerate(rows):
            state = self._matchers.get(seq.request_id)
            if state is None:
                so = seq.sampling_params.structured_output
                assert so is not None
                state = self._matchers[seq.request_id] = [
                    xgrammar.GrammarMatcher(self.compile(so)), 0]
            matcher, consumed = state
            output = requests[seq.request_id].output_token_ids
            for token in output[consumed:]:
                if not matcher.accept_token(token):  # cannot happen while the mask is applied
                    logger.warning("request %s: token %d left its grammar", seq.request_id,
                                   token)
            state[1] = len(output)
            matcher.fill_next_token_bitmask(masks, i)
            seq.token_bitmask = masks[i]

    def free(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
