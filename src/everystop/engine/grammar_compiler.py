"""Structured-output specs -> compiled xgrammar grammars: size limits first, then a bounded LRU
cache keyed by the spec's hash, then a compile on its own thread under a time limit.

A compile that runs past `grammar_compile_timeout_s` is refused (SpecOverLimit naming the
limit) while its thread finishes in the background; the cache then keeps the result, and a
request for the same spec meanwhile waits on that compile instead of starting another. At most
`max_concurrent_compiles` run at once: more is GrammarCompilerBusy (the server answers 503), so
hostile specs cannot pile up threads. The threads are daemons: a compile still running never
holds up the process's exit.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from everystop.config import StructuredOutputConfig
from everystop.engine.grammar_limits import SpecOverLimit, check_spec
from everystop.sampling_params import StructuredOutput, StructuredOutputError


def spec_key(so: StructuredOutput) -> str:
    """The cache key: a hash of the spec's kind and text."""
    return hashlib.sha256(f"{so.kind}\0{so.spec}".encode("utf-8", "surrogatepass")).hexdigest()


class GrammarCompilerBusy(RuntimeError):
    """Every compile slot is taken (by slow compiles); the request may be retried."""


class GrammarCompiler:
    def __init__(self, hf_tokenizer: Any, stop_token_ids: list[int],
                 config: StructuredOutputConfig | None = None) -> None:
        """`hf_tokenizer`: the transformers tokenizer (None: structured output unsupported);
        `stop_token_ids`: what ends a finished text (EOS and end-of-turn ids)."""
        self.config = config or StructuredOutputConfig()
        self._hf = hf_tokenizer
        self._stop_ids = sorted(stop_token_ids)
        self._xgr: Any = None
        self._xgr_lock = threading.Lock()
        self._lock = threading.Lock()  # the cache and the compiles in flight
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._compiling: dict[str, Future[Any]] = {}
        self.num_cache_hits = 0
        self.num_compiles = 0
        self.num_timeouts = 0

    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar of `so`. Raises SpecOverLimit (over a size limit, or the time
        limit), StructuredOutputError (a spec the compiler refuses) or GrammarCompilerBusy."""
        check_spec(so, self.config)
        key = spec_key(so)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return hit
            future = self._compiling.get(key)
            if future is None:
                if len(self._compiling) >= self.config.max_concurrent_compiles:
                    raise GrammarCompilerBusy(
                        f"{len(self._compiling)} grammars are compiling, the most "
                        f"max_concurrent_compiles ({self.config.max_concurrent_compiles}) allows")
                future = self._compiling[key] = Future()
                self.num_compiles += 1
                threading.Thread(target=self._run, args=(key, so, future), daemon=True,
                                 name="everystop-grammar").start()
        timeout = self.config.grammar_compile_timeout_s
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            with self._lock:
                self.num_timeouts += 1
            raise SpecOverLimit("grammar_compile_timeout_s", f"compiling the {so.kind} took "
                                f"longer than grammar_compile_timeout_s ({timeout:g} s)") from None

    def cached(self, so: StructuredOutput) -> Any | None:
        """The cached grammar of `so`, or None (never compiles)."""
        key = spec_key(so)
        with self._lock:
            return self._cache.get(key)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _run(self, key: str, so: StructuredOutput, future: Future[Any]) -> None:
        try:
            compiled = self._build(so)
        except BaseException as exc:
            with self._lock:
                self._compiling.pop(key, None)
            future.set_exception(exc)
            return
        with self._lock:
            self._compiling.pop(key, None)
            self._cache[key] = compiled
            while len(self._cache) > self.config.grammar_cache_size:
                self._cache.popitem(last=False)
        future.set_result(compiled)

    def _build(self, so: StructuredOutput) -> Any:
        compiler = self._compiler()
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
        except (RuntimeError, ValueError, TypeError, RecursionError) as exc:
            msg = " ".join(str(exc).split())[:300]
            raise StructuredOutputError(f"invalid {so.kind}: {msg}") from None

    def _compiler(self) -> Any:
        with self._xgr_lock:
            if self._xgr is None:
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
                # Our cache, bounded, replaces xgrammar's (unbounded by default).
                self._xgr = xgrammar.GrammarCompiler(info, cache_enabled=False)
            return self._xgr
