"""Every request value that reaches a tensor is checked at intake: a bad one is a 400 naming
its field, before the request can share a forward pass with anyone. The server here runs the
real sampler and logits controls on each pass, so a value that slipped through would fail the
pass (500) instead."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

from everystop.core.outputs import ModelOutput, SchedulerOutput
from everystop.engine.async_engine import AsyncEngine
from everystop.executor.sampler import Sampler
from everystop.sampling_params import SamplingParams, SamplingParamsError
from everystop.server.app import build_app
from tests.core.toy_executor import ToyExecutor
from tests.engine.toy_engine import make_toy_engine
from tests.server.fakes import ChatCharTokenizer

VOCAB = ChatCharTokenizer.vocab_size


class SamplingToyExecutor(ToyExecutor):
    """The toy model's KV checks, then the real sampler over logits that favour the toy's
    token: every row's controls (logit_bias, stop ids, penalties, ...) run as in a real pass."""

    def __init__(self, inner: ToyExecutor) -> None:
        self.__dict__.update(inner.__dict__)
        self.sampler = Sampler("cpu")

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        out = super().execute(sched)
        rows = [e for e in sched.scheduled if e.sample]
        if rows:
            logits = torch.zeros(len(rows), VOCAB)
            for i, e in enumerate(rows):
                logits[i, out.sampled_token_ids[e.request_id]] = 10.0
            sampled = self.sampler(logits, [e.sampling_params for e in rows],
                                   [e.output_index for e in rows], rows)
            for e, token in zip(rows, sampled.token_ids):
                out.sampled_token_ids[e.request_id] = token
        return out


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    engine = make_toy_engine(num_blocks=256, max_model_len=1024)
    engine.executor = SamplingToyExecutor(engine.executor)  # type: ignore[assignment]
    engine.tokenizer = ChatCharTokenizer()
    front = AsyncEngine(engine)
    yield TestClient(build_app(front, "toy"))
    front.shutdown()


BAD: list[tuple[dict[str, Any], str]] = [
    # (fields added to {"prompt": "x"}, the field the 400 names)
    ({"logit_bias": {"100000000000000000000": 5}}, "logit_bias"),  # overflowed in the pass
    ({"logit_bias": {str(2**31): 5}}, "logit_bias"),
    ({"logit_bias": {str(VOCAB): 5}}, "logit_bias"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {"12abc": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [2**62]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": [5, VOCAB]}, "prompt"),
    ({"prompt": [2**62]}, "prompt"),
    ({"prompt": [[5], [-3]]}, "prompt"),
    ({"temperature": 101}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2**40}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 1e-9}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),  # allowed only with echo (score the prompt)
    ({"allowed_token_ids": [5, VOCAB]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": "word"}, "bad_words"),
    ({"max_tokens": 2**40}, "max_tokens"),
    ({"max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ({"n": 0}, "n"),
    ({"n": 2**40}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"seed": "7"}, "seed"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[str(b[0])[:60] for b in BAD])
def test_a_bad_value_is_a_400_naming_its_field(client: TestClient, extra: dict[str, Any],
                                               param: str) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    # The server is unharmed: the next request is served.
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_chat_names_the_field_too(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "logit_bias": {str(VOCAB + 7): -100}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert f"0..{VOCAB - 1}" in r.json()["error"]["message"]


GOOD: list[dict[str, Any]] = [
    {"logit_bias": {str(VOCAB - 1): 100, "0": -100}},
    {"stop_token_ids": [0, VOCAB - 1]},
    {"prompt": [0, VOCAB - 1]},
    {"seed": -2**63},
    {"seed": 2**63 - 1, "temperature": 0.7},
    {"temperature": 1e-30},  # near zero: argmax, without dividing logits by it
    {"temperature": 100, "top_k": 2**31 - 1, "top_p": 1e-300},
    {"repetition_penalty": 100, "presence_penalty": -2, "frequency_penalty": 2},
    {"min_p": 1.0, "temperature": 1.0},
    {"logprobs": 20, "prompt_logprobs": 0},
]


@pytest.mark.parametrize("extra", GOOD, ids=[str(g)[:60] for g in GOOD])
def test_values_at_the_edges_of_their_ranges_are_served(client: TestClient,
                                                        extra: dict[str, Any]) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize(("kwargs", "param"), [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(presence_penalty=float("inf")), "presence_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={3: float("nan")}), "logit_bias"),
    (dict(logit_bias={10**30: 1.0}), "logit_bias"),
    (dict(logit_bias={10**5000: 1.0}), "logit_bias"),
    (dict(stop_token_ids=[2**31]), "stop_token_ids"),
    (dict(seed=2**63), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(top_k=2.0), "top_k"),
])
def test_sampling_params_refuse_values_no_tensor_can_take(kwargs: dict[str, Any],
                                                          param: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and len(str(info.value)) < 200


def test_check_vocab_names_ids_and_counts_past_the_vocabulary() -> None:
    SamplingParams(logit_bias={"9": 1}, stop_token_ids=[9], logprobs=10).check_vocab(10)
    for kwargs, param in ((dict(logit_bias={"10": 1}), "logit_bias"),
                          (dict(stop_token_ids=[10]), "stop_token_ids"),
                          (dict(logprobs=11), "logprobs"),
                          (dict(prompt_logprobs=11), "prompt_logprobs")):
        with pytest.raises(SamplingParamsError) as info:
            SamplingParams(**kwargs).check_vocab(10)  # type: ignore[arg-type]
        assert info.value.param == param
