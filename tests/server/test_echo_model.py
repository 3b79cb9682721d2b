"""lm-eval's loglikelihood request against the real server: `echo: true, logprobs: 1,
max_tokens: 1` on token ids, read as lm-eval reads it, checked against transformers'
log-softmax on the same weights (float32 weights and KV cache, as the model tests)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from .conftest import ServerProcess, start_model_server

pytestmark = [pytest.mark.model, pytest.mark.server]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_model_server(tmp_path_factory.mktemp("echo"), "--max-num-seqs", "4",
                              "--max-num-batched-tokens", "64", "--chunk-size", "16",
                              "--kv-cache-dtype", "float32", "--int8-decode-dot", "off")
    yield proc
    proc.stop()


def test_lm_eval_loglikelihood_matches_transformers(server: ServerProcess,
                                                    hf_float32_model: Any) -> None:

    tok = httpx.post(server.url + "/tokenize", timeout=30,
                     json={"prompt": "Question: What is the capital of France, the large country "
                           "in western Europe? Answer:"}).json()
    context = tok["tokens"]
    continuation = httpx.post(server.url + "/tokenize", json={"prompt": " Paris"},
                              timeout=30).json()["tokens"]
    prompt = context + continuation  # > one 16-token chunk: the scores are stitched
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "prompt": prompt, "echo": True, "logprobs": 1,
        "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    # lm-eval: the continuation's logprobs are token_logprobs[ctxlen:-1] (the last entry is
    # the one generated token).
    assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
    ours = torch.tensor(lp["token_logprobs"][1:len(prompt)])

    with torch.no_grad():
        logits = hf_float32_model(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (ours - ref).abs().max().item() < 2e-3
    loglik = sum(lp["token_logprobs"][len(context):-1])
    assert loglik == pytest.approx(ref[len(context) - 1:].sum().item(), abs=5e-3)
