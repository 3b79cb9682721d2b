"""Property: whatever a client sends, a request the intake accepts cannot make the sampling
step raise, and cannot change what the other rows of its pass sample.

Random request fields (huge and negative integers, NaN, infinities, ids past the vocabulary,
numbers as strings) go through the real intake (SamplingParams, then `new_request` against a
vocabulary); each accepted request is sampled by the real sampler and logits controls beside
an innocent greedy row, whose token must be the one it samples alone."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from everystop.core.outputs import ScheduledSequence
from everystop.engine.llm_engine import new_request
from everystop.executor.sampler import Sampler
from everystop.sampling_params import SamplingParams, SamplingParamsError

VOCAB = 50
EOS = 2


class Tokenizer:
    eos_token_id = EOS
    eos_token_ids = frozenset({EOS, 3})
    vocab_size = VOCAB

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % VOCAB for c in text]


EDGES = [0, 1, -1, VOCAB - 1, VOCAB, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -2**63]
INTS = st.one_of(st.integers(-3, VOCAB + 3), st.sampled_from(EDGES),
                 st.integers(-2**80, 2**80))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.floats(-3.0, 3.0), st.sampled_from([0.0, 1e-30, 1e-5, 1.0, 100.0, 1e30]))
NUMBERS = st.one_of(INTS, FLOATS)
IDS = st.one_of(st.sampled_from(EDGES), st.sampled_from(EDGES).map(str), INTS.map(str),
                st.sampled_from(["", "x", "1e3", " 7", "+7", "0x10", "٣"]))
# Per field: values in its range, then anything (each field is often valid, so that requests
# with one hostile value among valid ones are accepted or refused, not all refused at once).
IN_RANGE: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(1, 64), "min_tokens": st.integers(0, 2), "n": st.integers(1, 4),
    "seed": st.integers(-2**63, 2**63 - 1), "temperature": st.floats(0.0, 100.0),
    "top_p": st.floats(1e-9, 1.0), "top_k": st.integers(-1, VOCAB + 2),
    "min_p": st.floats(0.0, 1.0), "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0), "repetition_penalty": st.floats(0.01, 100.0),
    "logprobs": st.integers(0, 20), "prompt_logprobs": st.integers(0, 20),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100),
                                  max_size=3),
}
ANYTHING: dict[str, st.SearchStrategy[Any]] = {
    **{name: NUMBERS for name in IN_RANGE},
    "stop_token_ids": st.lists(IDS, min_size=1, max_size=2),
    "logit_bias": st.one_of(st.dictionaries(IDS, st.floats(-100, 100), min_size=1, max_size=2),
                            st.dictionaries(st.integers(0, 9).map(str), NUMBERS, min_size=1,
                                            max_size=2)),
}


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Fields in their ranges, then one or two of them replaced by anything."""
    body = draw(st.fixed_dictionaries({}, optional=IN_RANGE))  # type: ignore[arg-type]
    for name in draw(st.lists(st.sampled_from(sorted(ANYTHING)), min_size=1, max_size=2,
                                unique=True)):
        body[name] = draw(ANYTHING[name])
    body["ignore_eos"] = draw(st.booleans())
    return body


PROMPTS = st.one_of(st.text(min_size=1, max_size=6),
                    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
                    st.lists(INTS, min_size=1, max_size=3))
INNOCENT = SamplingParams(temperature=0.0, max_tokens=8)


def row(rid: str, prompt: list[int], output: list[int], params: SamplingParams
        ) -> ScheduledSequence:
    """A decode row as the pass builder makes it (tokens seen so far, EOS for min_tokens)."""
    seq = ScheduledSequence(rid, [prompt[-1]], len(prompt) - 1, [0], True, params,
                            output_index=len(output))
    seq.prompt_token_ids, seq.output_token_ids = prompt, output
    seq.eos_token_id = None if params.ignore_eos else EOS
    return seq


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies(), prompt=PROMPTS, output=st.lists(st.integers(0, VOCAB - 1), max_size=5),
       logits_seed=st.integers(0, 2**16))
def test_an_accepted_request_never_fails_the_sampling_step(
        body: dict[str, Any], prompt: str | list[int], output: list[int],
        logits_seed: int) -> None:
    try:
        params = SamplingParams(**body)
        req = new_request(Tokenizer(), 4096, prompt, params)  # type: ignore[arg-type]
    except SamplingParamsError as exc:
        assert exc.param in body  # refused by name
        return
    except ValueError as exc:
        assert isinstance(prompt, list) and "vocabulary" in str(exc)  # a prompt id
        return
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(logits_seed)) * 4
    innocent = row("innocent", [5, 6, 7], [8], INNOCENT)
    alone = Sampler("cpu")(logits[:1], [INNOCENT], [1], [innocent]).token_ids[0]
    params = req.sampling_params
    seqs = [innocent, row(req.request_id, req.prompt_token_ids, output, params)]
    out = Sampler("cpu")(logits, [INNOCENT, params], [1, len(output)], seqs)
    assert out.token_ids[0] == alone
    assert 0 <= out.token_ids[1] < VOCAB
    lp = out.logprobs[1]
    if params.logprobs is not None:
        assert lp is not None and all(0 <= t < VOCAB for t, _ in lp.top)
