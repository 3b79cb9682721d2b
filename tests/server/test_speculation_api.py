"""Speculative decoding through the server (toy engine, `--speculative ngram`): the text is the
model's own, the vLLM-named metrics count proposals and acceptances (overall and by position),
and a request with `disable_spec_decode` proposes nothing."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.core.toy_executor import reference_output

from .conftest import ServerProcess, start_toy_server

pytestmark = pytest.mark.server

# The toy model's tokens look random (a hash of the context): a prompt of 200 distinct tokens
# (every third code point from 300) gives the n-gram proposer some 1-gram matches to propose
# from (7 passes of 39 with this prompt); the toy model seldom agrees with them.
PROMPT = "".join(chr(300 + 3 * i) for i in range(200))


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_toy_server(tmp_path_factory.mktemp("spec"), "--speculative", "ngram",
                              "--num-speculative-tokens", "3", "--ngram-min", "1")
    yield server
    server.stop()


def complete(server: ServerProcess, **extra: object) -> str:
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": "toy", "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def drafts(server: ServerProcess) -> float:
    return server.metric("everystop:spec_decode_num_draft_tokens_total")


def test_speculation_keeps_the_text_and_counts_in_vllm_named_metrics(
        spec_server: ServerProcess) -> None:
    expected = "".join(chr(t) for t in reference_output([ord(c) for c in PROMPT], 40))
    assert complete(spec_server) == expected
    text = httpx.get(spec_server.url + "/metrics", timeout=5).text
    proposed = drafts(spec_server)
    accepted = spec_server.metric("everystop:spec_decode_num_accepted_tokens_total")
    rows = spec_server.metric("everystop:spec_decode_num_drafts_total")
    assert proposed > 0 and rows > 0 and 0 <= accepted <= proposed
    assert spec_server.metric("everystop:spec_decode_draft_acceptance_rate") == \
        pytest.approx(accepted / proposed)
    per_pos = [line for line in text.splitlines()
               if line.startswith("everystop:spec_decode_num_accepted_tokens_per_pos_total{")]
    assert [f'position="{i}"' in line for i, line in enumerate(per_pos)] == [True] * 3
    assert sum(float(line.rsplit(" ", 1)[1]) for line in per_pos) == accepted
    # the sizing rule's choices (core/spec_sizing.py): the latest pass's mean k, within the cap
    assert 0 <= spec_server.metric("everystop:spec_decode_mean_k") <= 3
    assert spec_server.metric("everystop:spec_decode_num_sized_off_total") >= 0


def test_a_request_that_opts_out_proposes_nothing(spec_server: ServerProcess) -> None:
    before = drafts(spec_server)
    plain = complete(spec_server, disable_spec_decode=True)
    assert drafts(spec_server) == before
    assert complete(spec_server) == plain  # and speculating gives the same text
    assert drafts(spec_server) > before
    r = httpx.post(spec_server.url + "/v1/completions", timeout=30, json={
        "model": "toy", "prompt": "x", "disable_spec_decode": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "disable_spec_decode"


@pytest.mark.model
def test_streamed_logprobs_on_the_default_model_are_those_of_plain_decoding(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """One speculating server, one copying prompt streamed with logprobs twice: speculating
    (several tokens per frame) and opted out. Batch-invariant kernels: bit-equal rows."""
    import json

    from .conftest import start_model_server

    server = start_model_server(tmp_path_factory.mktemp("spec-model"), "--speculative",
                                "ngram", "--batch-invariant", "--dtype", "float32")
    prompt = ("Copy each line.\nInput: birds sing in the tall trees\nOutput: birds sing in the "
              "tall trees\nInput: the red balloon sleeps in the warm sun\nOutput:")
    try:
        def stream(**extra: object) -> tuple[str, list[float]]:
            body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 12,
                    "temperature": 0, "logprobs": 2, "stream": True, **extra}
            text, lps = "", []
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        text += choice["text"]
                        lps += (choice.get("logprobs") or {}).get("token_logprobs") or []
            return text, lps

        before = drafts(server)
        plain = stream(disable_spec_decode=True)
        assert drafts(server) == before
        spec = stream()
        assert server.metric("everystop:spec_decode_num_accepted_tokens_total") > 0
        assert spec[0] == plain[0] and len(spec[1]) == len(plain[1]) > 5  # ends at EOS
        assert spec[1] == pytest.approx(plain[1], abs=1e-5)
    finally:
        server.stop()
