"""benchmarks/workloads/spec-grounded-32.json, speculative decoding's workload: 32 chat requests
whose answers copy their input, each prompt the default model's chat template over its
instruction and input, its token ids those of the prompt."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from everystop.bench.speculative import GROUNDED, WORKLOADS
from everystop.tokenizer import load_tokenizer
from everystop.workload import load_workload

PATH = WORKLOADS / GROUNDED


@pytest.fixture(scope="module")
def requests() -> list[dict[str, Any]]:
    return list(json.loads(Path(PATH).read_text())["requests"])


def copied_fraction(answer: list[int], source: list[int], n: int = 4) -> float:
    """The fraction of `answer`'s tokens inside a run of `n` tokens that `source` also holds:
    what prompt lookup can propose."""
    grams = {tuple(source[i:i + n]) for i in range(len(source) - n + 1)}
    hit = [False] * len(answer)
    for i in range(len(answer) - n + 1):
        if tuple(answer[i:i + n]) in grams:
            hit[i:i + n] = [True] * n
    return sum(hit) / len(answer)


def test_copied_fraction_counts_tokens_in_shared_runs() -> None:
    assert copied_fraction([1, 2, 3, 4, 9], [0, 1, 2, 3, 4]) == 0.8
    assert copied_fraction([1, 2, 3, 9, 9], [0, 1, 2, 3, 4]) == 0.0


def test_32_requests_eight_of_each_task(requests: list[dict[str, Any]]) -> None:
    assert len(requests) == 32 and len({r["id"] for r in requests}) == 32
    assert Counter(r["kind"] for r in requests) == {
        "fix-code": 8, "fix-grammar": 8, "extract": 8, "reformat": 8}
    assert len(load_workload(PATH).requests) == 32  # the benchmarks' reader takes it


def test_each_prompt_is_the_chat_template_over_its_instruction_and_input(
        requests: list[dict[str, Any]]) -> None:
    tok = load_tokenizer()
    for r in requests:
        user = f"{r['instruction']}\n\n{r['input']}"
        assert r["prompt"] == tok.render_chat([{"role": "user", "content": user}]), r["id"]
        assert r["prompt_token_ids"] == tok.encode(r["prompt"]), r["id"]
        assert r["prompt_len"] == len(r["prompt_token_ids"])
        # Room for the whole answer, within the benchmark's output lengths.
        assert len(tok.encode(r["reference"])) + 16 <= r["max_tokens"] <= 256


def test_answers_copy_long_runs_of_their_input(requests: list[dict[str, Any]]) -> None:
    tok = load_tokenizer()
    fractions = []
    for r in requests:
        assert r["input"] in r["prompt"]
        fractions.append(copied_fraction(tok.encode(r["reference"]), r["prompt_token_ids"]))
    # Extractions quote values between new JSON keys; the rest are their input, edited.
    assert min(fractions) >= 0.3 and sum(fractions) / len(fractions) >= 0.7, fractions


def test_fix_tasks_have_something_to_fix_and_extractions_quote_the_document(
        requests: list[dict[str, Any]]) -> None:
    for r in requests:
        if r["kind"].startswith("fix"):
            assert r["input"] != r["reference"], r["id"]
        if r["kind"] == "extract":
            values = json.loads(r["reference"]).values()
            quoted = [v for value in values for v in (value if isinstance(value, list)
                                                      else [value])]
            assert all(v in r["input"] for v in quoted), r["id"]
