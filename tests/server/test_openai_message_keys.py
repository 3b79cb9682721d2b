"""Every row of the "Keys inside `messages`" table in docs/openai-fields.md: the key, sent back
in an earlier turn as clients send it, is accepted and dropped (the reply is the one without
it) and counted on /metrics; a key outside the table and the message's own fields is a 400."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from everystop.server.fields import CONTENT_PART_BOOKKEEPING, MESSAGE_BOOKKEEPING
from everystop.server.protocol import ChatMessage

from .conftest import ROOT, ServerProcess

CHAT = "/v1/chat/completions"
HEADING = "## Keys inside `messages`"


def key_rows() -> list[tuple[str, str, Any]]:
    """(key, where: "message" or "content part", example) per row of the table."""
    section = (ROOT / "docs" / "openai-fields.md").read_text().split(HEADING, 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[2].startswith("`"):
            rows.append((cells[0].strip("`"), cells[1], json.loads(cells[2].strip("`"))))
    return rows


ROWS = key_rows()


def test_the_table_is_the_list_the_server_drops() -> None:
    assert {k for k, where, _ in ROWS if where == "message"} == MESSAGE_BOOKKEEPING
    assert {k for k, where, _ in ROWS if where == "content part"} == CONTENT_PART_BOOKKEEPING
    assert not {k for k, _, _ in ROWS} & set(ChatMessage.model_fields)


def _reply(server: ServerProcess, earlier: dict[str, Any]) -> httpx.Response:
    messages = [{"role": "user", "content": "2+2?"}, earlier,
                {"role": "user", "content": "and 3+3?"}]
    body = {"model": "toy", "messages": messages, "max_tokens": 4}
    return httpx.post(server.url + CHAT, json=body, timeout=60)


def _dropped(server: ServerProcess, key: str) -> float:
    prefix = f'everystop:ignored_request_fields_total{{field="{key}",'
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.server
@pytest.mark.parametrize(("key", "where", "example"), ROWS, ids=[r[0] for r in ROWS])
def test_key_is_accepted_dropped_and_counted(toy_server: ServerProcess, key: str, where: str,
                                             example: Any) -> None:
    plain = {"role": "assistant", "content": [{"type": "text", "text": "4"}]}
    want = _reply(toy_server, plain)
    assert want.status_code == 200, want.text
    if where == "message":
        earlier: dict[str, Any] = {**plain, key: example}
    else:
        earlier = {**plain, "content": [{"type": "text", "text": "4", key: example}]}
    before = _dropped(toy_server, key)
    got = _reply(toy_server, earlier)
    assert got.status_code == 200, got.text
    assert got.json()["choices"] == want.json()["choices"]
    assert got.json()["usage"]["prompt_tokens"] == want.json()["usage"]["prompt_tokens"]
    assert _dropped(toy_server, key) == before + 1


@pytest.mark.server
@pytest.mark.parametrize("where", ["message", "content part"])
def test_a_key_outside_the_table_is_refused_by_name(toy_server: ServerProcess,
                                                    where: str) -> None:
    for key in ("colour", "refusals", "cache"):
        part: dict[str, Any] = {"type": "text", "text": "4"}
        earlier: dict[str, Any] = {"role": "assistant", "content": [part]}
        (earlier if where == "message" else part)[key] = "x"
        r = _reply(toy_server, earlier)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and key in err["message"], err
