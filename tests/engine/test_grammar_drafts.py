"""Structured output under speculative decoding, at the grammar: proposals are cut at the
first token the grammar rejects (and before one that would end it), each verified position of
a speculating row gets the mask of the grammar's state after the proposals before it, and the
request's matcher is left where its output leaves it. The real tokenizer and xgrammar, no
model."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import xgrammar

from everystop.core.outputs import ScheduledSequence, SchedulerOutput
from everystop.core.request import Request
from everystop.engine.structured_output import StructuredOutputManager
from everystop.executor.models.loader import default_model_path
from everystop.executor.verify_rows import per_position_rows
from everystop.sampling_params import SamplingParams, StructuredOutput
from everystop.tokenizer import load_tokenizer

SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"},
                                                      "age": {"type": "integer"}},
                     "required": ["name", "age"], "additionalProperties": False})

@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(default_model_path())

@pytest.fixture
def manager(tokenizer: Any) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer.hf_tokenizer, sorted(tokenizer.eos_token_ids))

def _request(output: list[int]) -> Request:
    params = SamplingParams(max_tokens=64, temperature=0.0,
                            structured_output=StructuredOutput("json_schema", SCHEMA))
    return Request("r", [1, 2, 3], params, output_token_ids=list(output))

def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.hf_tokenizer.encode(text, add_special_tokens=False)

def _mask_after(manager: StructuredOutputManager, tokens: list[int]) -> torch.Tensor:
    """The bitmask a fresh matcher of SCHEMA gives after `tokens` (the reference)."""
    compiled = manager.compile(StructuredOutput("json_schema", SCHEMA))
    matcher = xgrammar.GrammarMatcher(compiled)
    for token in tokens:
        assert matcher.accept_token(token)
    mask = xgrammar.allocate_token_bitmask(1, len(manager._hf))
    matcher.fill_next_token_bitmask(mask, 0)
    return mask[0]

def _row(output: list[int], drafts: list[int]) -> ScheduledSequence:
    req = _request(output)
    return ScheduledSequence("r", [output[-1], *drafts], 3 + len(output) - 1, [0], True,
                             req.sampling_params, output_index=len(output),
                             num_draft_tokens=len(drafts))

def test_a_proposal_the_grammar_rejects_is_cut_there(tokenizer, manager) -> None:
    output = _ids(tokenizer, '{"name": "Ann", ')
    good = _ids(tokenizer, '"age": 3')
    bad = _ids(tokenizer, "\nInput")  # no JSON object continues so
    req = _request(output)
    assert manager.valid_drafts(req, good + bad + good) == good
    assert manager.valid_drafts(req, bad + good) == []
    assert manager.valid_drafts(req, good) == good
    # The matcher is left where the output leaves it: the next mask is the output's.
    row = _row(output, [])
    manager.fill_bitmasks(SchedulerOutput(scheduled=[row]), {"r": req})
    assert torch.equal(row.token_bitmask, _mask_after(manager, output))

def test_a_proposal_that_would_end_the_grammar_is_left_to_the_model(tokenizer,
                                                                     manager) -> None:
    output = _ids(tokenizer, '{"name": "Ann", "age": 3')
    close = _ids(tokenizer, "}")
    eos = sorted(tokenizer.eos_token_ids)[0]
    req = _request(output)
    assert manager.valid_drafts(req, close + [eos] + close) == close
    # ...and the model's token there is sampled under the mask that allows the end.
    row = _row(output, close)
    manager.fill_bitmasks(SchedulerOutput(scheduled=[row]), {"r": req})
    last = row.token_bitmask[1]
    assert last[eos // 32] >> (eos % 32) & 1

def test_each_verified_position_gets_the_mask_after_the_proposals_before_it(
        tokenizer, manager) -> None:
    output = _ids(tokenizer, '{"name": ')
    drafts = _ids(tokenizer, '"Ann", "age": 31')
    req = _request(output)
    row = _row(output, drafts)
    manager.fill_bitmasks(SchedulerOutput(scheduled=[row]), {"r": req})
    assert row.token_bitmask.shape[0] == 1 + len(drafts)
    for j in range(1 + len(drafts)):
        assert torch.equal(row.token_bitmask[j], _mask_after(manager, output + drafts[:j])), j
    # The sampler sees position j's mask on position j's row.
    rows = per_position_rows([row] * (1 + len(drafts)))
    for j, seq in enumerate(rows):
        assert torch.equal(seq.token_bitmask, row.token_bitmask[j]) and seq.output_index == (
            len(output) + j)
    # The matcher went back: once the pass keeps d1, d2 and the model's token, it advances
    # over exactly those.
    req.output_token_ids.extend(drafts[:3])
    again = _row(req.output_token_ids, [])
    manager.fill_bitmasks(SchedulerOutput(scheduled=[again]), {"r": req})
    assert torch.equal(again.token_bitmask, _mask_after(manager, req.output_token_ids))

def test_positions_past_a_rejected_proposal_get_a_mask_that_allows_something(
        tokenizer, manager) -> None:
    """A proposal no draft check cut (a scheduler without one): the position before it
    forbids it, so nothing past it is kept; the later positions still sample finitely."""
    output = _ids(tokenizer, '{"name": ')
    good, bad = _ids(tokenizer, '"Ann"'), _ids(tokenizer, "\nInput")
    req = _request(output)
    row = _row(output, good + bad + good)
    manager.fill_bitmasks(SchedulerOutput(scheduled=[row]), {"r": req})
    masks, at = row.token_bitmask, len(good)  # position `at` samples where bad[0] would go
    assert not masks[at][bad[0] // 32] >> (bad[0] % 32) & 1
    for j in range(at + 1, masks.shape[0]):
        assert bool((masks[j] != 0).any()), j
    plain = _row(output, [])
    manager.fill_bitmasks(SchedulerOutput(scheduled=[plain]), {"r": req})
    assert torch.equal(plain.token_bitmask, _mask_after(manager, output))


def test_after_the_grammar_ends_only_stop_tokens_follow(tokenizer, manager) -> None:
    """A request that ignores EOS goes on past its grammar's end: it gets stop tokens only,
    and nothing is proposed for it."""
    eos_ids = sorted(tokenizer.eos_token_ids)
    output = _ids(tokenizer, '{"name": "Ann", "age": 3}') + [eos_ids[0]]
    req = _request(output)
    assert manager.valid_drafts(req, _ids(tokenizer, "}") + eos_ids) == []
    row = _row(output, [])
    manager.fill_bitmasks(SchedulerOutput(scheduled=[row]), {"r": req})
    bits = row.token_bitmask
    allowed = [t for t in range(len(manager._hf)) if bits[t // 32] >> (t % 32) & 1]
    assert allowed == eos_ids
