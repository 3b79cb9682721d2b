"""Speculation through the engine loop with the toy model: a pass that accepts several tokens
ends at a stop string exactly where plain decoding ends, text and tokens alike."""

from __future__ import annotations

import pytest

from everystop.sampling_params import SamplingParams
from tests.core.test_speculation import OracleProposer
from tests.core.toy_executor import reference_output

from .toy_engine import make_toy_engine


def _run(speculate: bool, params: SamplingParams, prompt: str = "abc"):
    eng = make_toy_engine(**(dict(speculative="ngram", num_speculative_tokens=8)
                             if speculate else {}))
    if speculate:
        eng.scheduler.proposer = OracleProposer(wrong=0.0, seed=0, always_k=True)
    eng.add_request(prompt, params)
    deltas, final = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            deltas.append(out.new_text)
            final = out
            eng.scheduler.check_integrity()
    assert final is not None and "".join(deltas) == final.text
    assert eng.kv.pool.num_used_blocks == 0
    return final, eng.scheduler.stats()


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_inside_an_accepted_run_ends_the_output_there(include: bool) -> None:
    full = "".join(chr(t) for t in reference_output([ord(c) for c in "abc"], 40))
    stop = full[13:15]
    if stop in full[:13]:
        stop = full[13:17]
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=include)
    plain, _ = _run(False, params)
    spec, stats = _run(True, params)
    assert stats.spec_decode_num_accepted_tokens >= 8  # whole runs were accepted
    assert spec.finish_reason == plain.finish_reason == "stop"
    assert spec.text == plain.text and spec.token_ids == plain.token_ids
    assert spec.stop_reason == stop
    assert len(spec.token_ids) < 40


def test_max_tokens_and_min_tokens_end_as_without_speculation() -> None:
    params = SamplingParams(max_tokens=21, min_tokens=10, ignore_eos=True)
    plain, _ = _run(False, params)
    spec, stats = _run(True, params)
    assert stats.spec_decode_num_draft_tokens > 0
    assert spec.token_ids == plain.token_ids and len(spec.token_ids) == 21
    assert spec.finish_reason == plain.finish_reason == "length"
