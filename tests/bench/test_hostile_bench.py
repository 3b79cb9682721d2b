"""`everystop bench hostile`'s parts that need no server: the cases at the issue's sizes, the
pass rule, and the attribution of slow probes to the server's own loop lag."""

from __future__ import annotations

import json
from typing import Any

import pytest

from everystop.bench.hostile import P99_MS, WORST_MS, _judge, _loop_lags_over
from everystop.bench.hostile_cases import hostile_cases, names_its_limit


def test_the_cases_are_at_the_issues_sizes() -> None:
    cases = {c.name: c for c in hostile_cases()}
    body = {name: case.raw_body() for name, case in cases.items()}
    assert len(body["enum_100k"]) >= 1.9e6
    assert len(body["detokenize_10MB"]) >= 10e6
    assert len(body["tokenize_non_ascii"]) >= 15e6  # UTF-8, not \u escapes
    assert not body["tokenize_non_ascii"].isascii()
    assert len(json.loads(body["prompt_1.7M_ids"])["prompt"]) == 1_700_000
    assert len(json.loads(body["regex_200k_words"])["guided_regex"].split("|")) == 200_000
    assert len(json.loads(body["choice_20k"])["guided_choice"]) == 20_000
    assert json.loads(body["arrays_5k_deep"])["guided_json"].count('"array"') == 5000
    tool = json.loads(body["tool_80k_properties"])["tools"][0]["function"]["parameters"]
    assert len(tool["properties"]) == 80_000
    assert json.loads(body["logit_bias_overflow"])["logit_bias"] == {"1" + "0" * 20: 5}


def _result(p99: float, worst: float, **extra: Any) -> dict[str, Any]:
    return {"status": 400, "expected_status": 400, "innocent_failed": 0,
            "health": {"p99_ms": p99, "worst_ms": worst, "failed": 0}, **extra}


@pytest.mark.parametrize(("result", "passes"), [
    (_result(P99_MS - 1, WORST_MS - 1), True),
    (_result(P99_MS, WORST_MS - 1), False),
    (_result(P99_MS - 1, WORST_MS), False),
    (_result(1, 1, status=500), False),
    (_result(1, 1, innocent_failed=1), False),
    (_result(1, 1, error_names_the_limit=False), False),
    ({"connections": 200, "closed_by_server": 200, "innocent_failed": 0,
      "health": {"p99_ms": 1, "worst_ms": 1, "failed": 0}}, True),
    ({"connections": 200, "closed_by_server": 199, "innocent_failed": 0,
      "health": {"p99_ms": 1, "worst_ms": 1, "failed": 0}}, False),
])
def test_a_case_passes_only_within_both_latency_targets_and_with_its_answer(
        result: dict[str, Any], passes: bool) -> None:
    assert _judge(result) is passes


def test_loop_lag_samples_over_a_bound_are_counted_from_the_histograms_difference() -> None:
    before = {"lag_le_0.1": 10.0, "lag_le_0.25": 12.0, "lag_le_+Inf": 12.0}
    after = {"lag_le_0.1": 15.0, "lag_le_0.25": 19.0, "lag_le_+Inf": 20.0}
    assert _loop_lags_over(before, after) == {"over_0.1s": 3, "over_0.25s": 1}


def test_a_refusal_names_its_limit_in_the_message_and_the_code_or_param() -> None:
    assert names_its_limit({"message": "over max_choices (4096)", "code": "max_choices"},
                           "max_choices")
    assert names_its_limit({"message": "logit_bias: token id 7 is outside", "param":
                            "logit_bias", "code": "invalid_value"}, "logit_bias")
    assert names_its_limit({"message": "longer than max_model_len", "code":
                            "context_length_exceeded"}, "max_model_len")
    assert not names_its_limit({"message": "too big", "code": "max_choices"}, "max_choices")
