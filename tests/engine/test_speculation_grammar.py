"""Structured output with speculative decoding on the real default model: greedy JSON-schema,
regex and choice output with prompt lookup or a draft model is token for token what plain
greedy decoding gives, alone and in a 16-sequence batch, and always in its language; the
proposals did run, and some were cut at their grammar (the prompts go on past what the
grammar allows, so prompt lookup proposes tokens it rejects)."""

from __future__ import annotations

import json
import re

import pytest

from everystop import LLM, SamplingParams
from everystop.core.request import Request
from everystop.executor.models.loader import default_model_path
from everystop.sampling_params import StructuredOutput

from .free_draft import free_draft
from .test_speculation_model import every_proposal

pytestmark = pytest.mark.model

PEOPLE = [("Ann", 31, "Oslo"), ("Bob", 45, "Lima"), ("Chen", 27, "Paris"), ("Dara", 52, "Cairo"),
          ("Eve", 38, "Quito"), ("Femi", 29, "Lagos"), ("Gus", 61, "Perth"), ("Hana", 44, "Kyoto")]
CITIES = [city for *_, city in PEOPLE]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]+ is [0-9]+ and lives in [A-Z][a-z]+\."


def _json_prompt(name: str, age: int, city: str) -> str:
    return (f'Copy the record as JSON.\nInput: name Zed, age 40, city Rome\n'
            f'Output: {{"name": "Zed", "age": 40, "city": "Rome"}}\n'
            f'Input: name {name}, age {age}, city {city}\nOutput:')


def _regex_prompt(name: str, age: int, city: str) -> str:
    return (f"Zed is 40 and lives in Rome. Input: Zed, 40, Rome\n"
            f"{name} is {age} and lives in {city}. Input: {name}, {age}, {city}\nSay it again:")


def _choice_prompt(name: str, age: int, city: str) -> str:
    return f"{name} is {age} and lives in {city}. Where does {name} live? {name} lives in"


def _greedy(kind: str, spec: str) -> SamplingParams:
    return SamplingParams(max_tokens=48, temperature=0.0,
                          structured_output=StructuredOutput(kind, spec))  # type: ignore[arg-type]


CASES = ([(_json_prompt(*p), _greedy("json_schema", json.dumps(SCHEMA))) for p in PEOPLE]
         + [(_regex_prompt(*p), _greedy("regex", REGEX)) for p in PEOPLE]
         + [(_choice_prompt(*p), _greedy("choice", json.dumps(CITIES))) for p in PEOPLE])
OPTIONS = dict(dtype="float32", max_num_batched_tokens=512)


def _in_its_language(text: str, params: SamplingParams) -> bool:
    so = params.structured_output
    assert so is not None
    if so.kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if so.kind == "choice":
        return text in CITIES
    value = json.loads(text)
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"])
            and isinstance(value["name"], str) and isinstance(value["city"], str)
            and isinstance(value["age"], int) and not isinstance(value["age"], bool))


def _generate(llm: LLM, cases: list[tuple[str, SamplingParams]]
              ) -> list[tuple[list[int], str, str | None]]:
    outs = llm.generate([p for p, _ in cases], [s for _, s in cases], use_tqdm=False)
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


@pytest.fixture(scope="module")
def plain() -> list[tuple[list[int], str, str | None]]:
    return _generate(LLM(**OPTIONS, max_num_seqs=24), CASES)


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("max_num_seqs", [1, 16])
def test_structured_output_with_speculation_gives_the_plain_greedy_tokens(
        plain, method: str, max_num_seqs: int) -> None:
    # Alone: three prompts of each kind, one sequence at a time; batched: all 24 together.
    picked = [i for i in range(len(CASES)) if max_num_seqs > 1 or i % len(PEOPLE) < 3]
    speculative = "ngram" if method == "ngram" else f"draft:{default_model_path()}"
    llm = LLM(**OPTIONS, max_num_seqs=max_num_seqs, speculative=speculative,
              num_speculative_tokens=4)
    if method == "draft":
        free_draft(llm)
    else:
        every_proposal(llm)
    sched = llm.engine.scheduler
    check = sched.draft_check
    assert check is not None
    cuts: list[tuple[int, int]] = []  # (proposed, kept) per structured-output proposal

    def counted(req: Request, drafts: list[int]) -> list[int]:
        kept = check(req, drafts)
        cuts.append((len(drafts), len(kept)))
        return kept

    sched.draft_check = counted
    outs = _generate(llm, [CASES[i] for i in picked])
    assert outs == [plain[i] for i in picked]
    for (_, text, finish), i in zip(outs, picked):
        assert finish == "stop" and _in_its_language(text, CASES[i][1]), text
    stats = llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert any(kept < proposed for proposed, kept in cuts)  # the grammar cut some
    assert any(kept > 0 for _, kept in cuts)
    assert llm.engine.kv.pool.num_used_blocks == 0
    sched.check_integrity()
