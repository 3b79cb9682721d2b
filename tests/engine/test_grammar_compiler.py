"""Structured-output specs: size limits checked before compiling, the compiled-grammar LRU, the
compile time limit (a late compile still fills the cache) and the bound on compiles at once."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from everystop.config import ConfigError, StructuredOutputConfig
from everystop.engine.grammar_compiler import GrammarCompiler, GrammarCompilerBusy
from everystop.engine.grammar_limits import SpecOverLimit, check_spec
from everystop.sampling_params import StructuredOutput, StructuredOutputError

LIMITS = StructuredOutputConfig()


def schema(value: Any) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(value))


def nested_arrays(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + "{}" + "}" * depth


@pytest.mark.parametrize("so,limit", [
    (schema({"enum": [f"w{i}" for i in range(LIMITS.max_enum_values + 1)]}), "max_enum_values"),
    (schema({"anyOf": [{"const": i} for i in range(LIMITS.max_enum_values + 1)]}),
     "max_enum_values"),
    (schema({"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                              for i in range(LIMITS.max_schema_properties + 1)}}),
     "max_schema_properties"),
    (StructuredOutput("json_schema", nested_arrays(LIMITS.max_schema_depth)),
     "max_schema_depth"),
    (StructuredOutput("json_schema", nested_arrays(5000)), "max_schema_depth"),
    (schema({"description": "x" * LIMITS.max_spec_bytes}), "max_spec_bytes"),
    (StructuredOutput("regex", "|".join(f"w{i}" for i in range(5000))), "max_regex_chars"),
    (StructuredOutput("choice", json.dumps([f"c{i}" for i in range(LIMITS.max_choices + 1)])),
     "max_choices"),
    (StructuredOutput("grammar", "root ::= " + " | ".join(['"a"'] * 60000)), "max_spec_bytes"),
])
def test_a_spec_over_a_limit_is_refused_naming_it(so: StructuredOutput, limit: str) -> None:
    with pytest.raises(SpecOverLimit) as info:
        check_spec(so, LIMITS)
    assert info.value.limit == limit
    assert limit in str(info.value)


@pytest.mark.parametrize("so", [
    schema({"enum": [f"w{i}" for i in range(LIMITS.max_enum_values)]}),
    StructuredOutput("json_schema", nested_arrays(LIMITS.max_schema_depth // 2 - 1)),
    StructuredOutput("regex", "[0-9]{3}-[0-9]{2}"),
    StructuredOutput("choice", json.dumps(["yes", "no"])),
    StructuredOutput("json_object"),
    StructuredOutput("json_schema", "{not json"),  # malformed: the compiler says what is wrong
])
def test_a_spec_within_the_limits_passes(so: StructuredOutput) -> None:
    check_spec(so, LIMITS)


def test_the_limits_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_choices"):
        StructuredOutputConfig(max_choices=0)


class GatedCompiler(GrammarCompiler):
    """Compiles to a token object, each compile waiting for `gate` (a slow compile on demand)."""

    def __init__(self, config: StructuredOutputConfig) -> None:
        super().__init__(None, [], config)
        self.gate = threading.Event()
        self.built: list[str] = []

    def _build(self, so: StructuredOutput) -> Any:
        assert self.gate.wait(10)
        self.built.append(so.spec)
        return object()


def test_compiled_grammars_are_cached_by_spec_in_a_bounded_lru() -> None:
    c = GatedCompiler(StructuredOutputConfig(grammar_cache_size=2))
    c.gate.set()
    a, b, d = (StructuredOutput("regex", r) for r in ("a+", "b+", "d+"))
    first = c.compile(a)
    assert c.compile(a) is first and c.num_compiles == 1 and c.num_cache_hits == 1
    c.compile(b)
    c.compile(a)  # a is now the most recently used
    c.compile(d)  # evicts b
    assert c.cached(b) is None and c.cached(a) is first and c.cached(d) is not None
    assert c.num_cached == 2


def test_a_slow_compile_is_refused_and_its_late_result_is_cached() -> None:
    c = GatedCompiler(StructuredOutputConfig(grammar_compile_timeout_s=0.05,
                                             max_concurrent_compiles=1))
    slow, other = StructuredOutput("regex", "slow"), StructuredOutput("regex", "other")
    with pytest.raises(SpecOverLimit) as info:
        c.compile(slow)
    assert info.value.limit == "grammar_compile_timeout_s"
    with pytest.raises(GrammarCompilerBusy, match="max_concurrent_compiles"):
        c.compile(other)  # the one slot is still compiling `slow`
    with pytest.raises(SpecOverLimit):
        c.compile(slow)  # waits on the compile in flight: no second one starts
    assert c.num_compiles == 1 and c.num_timeouts == 2
    c.gate.set()
    deadline = time.monotonic() + 10  # a hang guard: the released compile ends at once
    while c.cached(slow) is None and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    assert c.cached(slow) is not None and c.built == ["slow"]
    c.compile(other)  # the slot is free again


def test_an_invalid_spec_is_a_structured_output_error_and_is_not_cached() -> None:
    from everystop.tokenizer import load_tokenizer

    tok = load_tokenizer()
    c = GrammarCompiler(tok.hf_tokenizer, sorted(tok.eos_token_ids))
    bad = StructuredOutput("regex", "([a-z")
    with pytest.raises(StructuredOutputError, match="invalid regex"):
        c.compile(bad)
    assert c.cached(bad) is None
    good = StructuredOutput("regex", "[0-9]{3}")
    assert c.compile(good) is c.compile(good)
