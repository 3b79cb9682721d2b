"""Structured output: one grammar matcher per constrained request, and before each pass the
packed token bitmask of every constrained row that samples (vLLM v1's design: the masks are
computed beside the scheduler and travel with the plan; the sampler only applies them).

The grammar engine is xgrammar: on this model's 49k vocabulary it fills a row's mask in ~3 us
(0.4 ms for 128 rows, against 1-8 ms for llguidance), since
it precomputes which tokens each grammar position accepts. Nothing here is built until the first
constrained request arrives, so unconstrained serving pays neither the import nor the vocabulary
scan. Compiling (limits, cache, time limit) is GrammarCompiler's job.
"""

from __future__ import annotations

import logging
from typing import Any

from everystop.config import StructuredOutputConfig
from everystop.core.outputs import SchedulerOutput
from everystop.core.request import Request
from everystop.engine.grammar_compiler import GrammarCompiler
from everystop.sampling_params import StructuredOutput

logger = logging.getLogger("everystop.engine")


class StructuredOutputManager:
    def __init__(self, hf_tokenizer: Any, stop_token_ids: list[int],
                 config: StructuredOutputConfig | None = None) -> None:
        """`hf_tokenizer`: the transformers tokenizer (None: structured output unsupported);
        `stop_token_ids`: what ends a finished text (EOS and end-of-turn ids)."""
        self._hf = hf_tokenizer
        self.compiler = GrammarCompiler(hf_tokenizer, stop_token_ids, config)
        # request id -> [matcher, tokens consumed]
        self._matchers: dict[str, list[Any]] = {}
        # request id -> its compiled grammar, held from admission to finish, so that an LRU
        # eviction never makes the engine thread compile again.
        self._held: dict[str, Any] = {}

    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar (see GrammarCompiler.compile for what it raises)."""
        return self.compiler.compile(so)

    def hold(self, req: Request) -> None:
        """Keep `req`'s compiled grammar (compiled by make_request) until `free`."""
        so = req.sampling_params.structured_output
        if so is not None:
            compiled = self.compiler.cached(so)
            if compiled is not None:
                self._held[req.request_id] = compiled

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
                compiled = self._held.get(seq.request_id)
                if compiled is None:  # evicted before admission: compiled again here
                    compiled = self.compile(so)
                state = self._matchers[seq.request_id] = [xgrammar.GrammarMatcher(compiled), 0]
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
        self._held.pop(request_id, None)
