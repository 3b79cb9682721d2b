"""Each family served unchanged: `everystop serve --model FILE.gguf` on a tiny GGUF of the
family (its tokenizer and chat template in the file) answers the openai client's chat
completion with the greedy tokens the Python API (`everystop.LLM`) gives on the same file, and
the prompt it scored is transformers' `apply_chat_template` of the messages, token for token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from everystop import LLM, SamplingParams
from tests.server.conftest import ServerProcess, start_model_server

from .family_builders import tokenizer
from .family_ggufs import SERVED, family_spec, write_family_gguf

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What is 2+2?"}]
MAX_TOKENS = 8
# The limits start_model_server gives the server, for the Python API too.
LIMITS: dict[str, Any] = dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                              kv_cache_memory=128 << 20)

pytestmark = [pytest.mark.server, pytest.mark.slow]  # nine server starts


@pytest.fixture(scope="module", params=SERVED)
def served(request, tmp_path_factory) -> Iterator[tuple[str, Path, ServerProcess]]:
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    path = write_family_gguf(name, tmp)
    server = start_model_server(tmp, "--model", str(path), "--served-model-name", name)
    yield name, path, server
    server.stop()


def _template_ids(name: str) -> list[int]:
    """transformers' rendering of MESSAGES, tokenized as apply_chat_template does (the
    template writes its own BOS)."""
    hf = tokenizer(family_spec(name))
    text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return list(hf(text, add_special_tokens=False)["input_ids"])


def test_serve_answers_the_openai_client_as_the_python_api(served) -> None:
    name, path, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        extra_body={"return_tokens_as_token_ids": True, "prompt_logprobs": 0})
    assert raw.status_code == 200
    reply = raw.parse()
    served_tokens = [int(lp.token.removeprefix("token_id:"))
                     for lp in reply.choices[0].logprobs.content]
    # vLLM's prompt_logprobs: per prompt token after the first, a dict keyed by its id.
    scored = reply.model_extra["prompt_logprobs"]
    served_prompt = [int(next(iter(entry))) for entry in scored[1:]]

    llm = LLM(str(path), **LIMITS)
    [offline] = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                         use_tqdm=False)
    expected_prompt = _template_ids(name)
    assert offline.prompt_token_ids == expected_prompt
    assert reply.usage.prompt_tokens == len(expected_prompt)
    assert served_prompt == expected_prompt[1:]
    assert len(offline.token_ids) > 0
    assert served_tokens == offline.token_ids
