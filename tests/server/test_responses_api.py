"""/v1/responses on the toy engine: the request becomes the chat turn it describes, the answer
comes back in the Responses API's shapes (whole and as its stream of events), and what a
stateless server cannot do is refused by name."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.core.toy_executor import reference_output

from .conftest import ServerProcess

pytestmark = pytest.mark.server


def _toy(prompt: str, n: int) -> str:
    return "".join(chr(t) for t in reference_output([ord(c) for c in prompt], n))


def _post(server: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json=body, timeout=60)


def test_text_input_answers_as_the_chat_turn(toy_server: ServerProcess) -> None:
    r = _post(toy_server, {"model": "toy", "input": "hello", "max_output_tokens": 5,
                           "instructions": "be brief"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    text = item["content"][0]["text"]
    # The toy template: "<system>be brief\n<user>hello\n<assistant>"
    assert text == _toy("<system>be brief\n<user>hello\n<assistant>", 5)
    assert body["usage"]["output_tokens"] == 5 and body["usage"]["input_tokens"] > 0


def test_items_with_function_calls_and_outputs(toy_server: ServerProcess) -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": "2+2?"}]},
             {"type": "function_call", "call_id": "c1", "name": "add",
              "arguments": "{\"a\": 2, \"b\": 2}"},
             {"type": "function_call_output", "call_id": "c1", "output": "4"}]
    r = _post(toy_server, {"model": "toy", "input": items, "max_output_tokens": 3})
    assert r.status_code == 200, r.text
    prompt = "<user>2+2?\n<assistant>\n<tool>4\n<assistant>"
    assert r.json()["output"][0]["content"][0]["text"] == _toy(prompt, 3)


def test_streamed_events_carry_the_same_text(toy_server: ServerProcess) -> None:
    body = {"model": "toy", "input": "hello", "max_output_tokens": 6, "stream": True}
    with httpx.stream("POST", toy_server.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == _toy("<user>hello\n<assistant>", 6)
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["text"] == deltas
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == deltas
    assert final["usage"]["output_tokens"] == 6


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"prompt_cache_key": "k"}, "prompt_cache_key"),
])
def test_what_a_stateless_server_cannot_do_is_refused(toy_server: ServerProcess,
                                                      extra: dict[str, Any], param: str) -> None:
    r = _post(toy_server, {"model": "toy", "input": "x", **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_non_text_input_is_refused(toy_server: ServerProcess) -> None:
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
    r = _post(toy_server, {"model": "toy", "input": [image]})
    assert r.status_code == 400 and "input_image" in r.json()["error"]["message"]


def test_a_client_leaving_a_streamed_response_frees_its_blocks(toy_server: ServerProcess) -> None:
    before = toy_server.metric("everystop:kv_cache_used_blocks")
    aborted = toy_server.num_aborted()
    body = {"model": "toy", "input": "walk away", "max_output_tokens": 200, "stream": True}
    with httpx.stream("POST", toy_server.url + "/v1/responses", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(18)]  # 4 opening events, then deltas
        assert any('"response.output_text.delta"' in g for g in got)
        assert toy_server.metric("everystop:kv_cache_used_blocks") > before
    # Ended by the leaving (aborted), not by its 200 tokens; waited for up to 5 s, as a loaded
    # host may take more than the 2 s this once allowed.
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if (toy_server.metric("everystop:kv_cache_used_blocks") == before
                and toy_server.num_aborted() > aborted):
            break
        time.sleep(0.02)
    assert toy_server.metric("everystop:kv_cache_used_blocks") == before
    assert toy_server.metric("everystop:num_requests_running") == 0
    assert toy_server.num_aborted() == aborted + 1
